// One launcher per (pass, technique): defined in the pass's file (depthwise_forward.cu, depthwise_input_grad.cu,
// depthwise_weight_grad.cu; the 5x5/7x7 walks' in depthwise_k57.cu), picked by the tables in depthwise_dispatch.cpp.
// A launcher runs the case it is given; the dispatch has checked that the case is its own (the NCHW 3x3 vector
// launchers check the alignment themselves and return false when it does not allow their vectors).
#pragma once

#include <cuda_runtime_api.h>

#include "depthwise.h"

namespace mdw {

// Forward: y = act(conv(x, w) + bias), bias may be null.
// NHWC 3x3, stride 1 or 2, whole 32-bit words of channels: a lane walks one output row (column walk).
void forward_nhwc_column(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                         cudaStream_t stream);
// The same walk without bias or activation that also writes, per band of rows (one block per band and channel group),
// the statistics of y as stored: partial[band][3][C] fp64 = (count, mean, M2) per channel, for the BatchNorm that
// reads y (mobilenet_bn::bn_relu_fwd_from_partials). forward_nhwc_column_stats_bands: the number of bands.
int forward_nhwc_column_stats_bands(const ConvShape& s, DType dt);
void forward_nhwc_column_stats(const ConvShape& s, DType dt, const void* x, const void* w, void* y, double* partial,
                               cudaStream_t stream);
// The same walk without bias or activation on relu(batch_norm(x)), applied to x's words as they are loaded.
void forward_nhwc_column_normed(const ConvShape& s, DType dt, const void* x, const void* w, const InputNorm& norm,
                                void* y, cudaStream_t stream);
// NHWC 3x3, stride 1 or 2, channels in whole 16-byte units, x 16-byte aligned, compute capability 9.0 or later: the
// column walk's arithmetic on input rows that bulk copies stream into a shared-memory ring (depthwise_ring.cu).
// False, having launched nothing, where the case does not fit (the launcher checks).
bool forward_nhwc_ring(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                       cudaStream_t stream);
// The same without bias or activation on relu(batch_norm(x)), the rows normalized in shared memory as they land.
bool forward_nhwc_ring_normed(const ConvShape& s, DType dt, const void* x, const void* w, const InputNorm& norm,
                              void* y, cudaStream_t stream);
// NHWC 5x5 or 7x7, stride 1 or 2, whole 32-bit words of channels: a lane walks one output row carrying partial sums.
void forward_nhwc_column_k57(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                             cudaStream_t stream);
// NHWC 3x3, 5x5 or 7x7, stride 1 or 2, whole 32-bit words of channels: each block copies its input tile into shared
// memory once (depthwise_smem.cu).
void forward_nhwc_smem(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                       cudaStream_t stream);
// NHWC 3x3, 5x5 or 7x7, stride 1, 16-bit, C a multiple of 8, 16-byte aligned: tensor-core products on a
// shared-memory tile (depthwise_mma.cu).
void forward_nhwc_mma(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                      cudaStream_t stream);
// NHWC 3x3, 5x5 or 7x7, stride 1 or 2, 16-bit, C a multiple of 8, 16-byte aligned: tensor-core products of 16
// pixels x 8 channels, each warp walking down the rows (depthwise_mma_walk.cu).
void forward_nhwc_mma_walk(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                           cudaStream_t stream);
// NCHW 5x5 or 7x7, stride 1 or 2, 16/32-bit: a lane walks down TW columns carrying partial sums.
void forward_nchw_column_k57(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                             cudaStream_t stream);
// NCHW 3x3, stride 1, padding 1, 16-bit: 16-byte vector loads along the rows, halo by shuffles.
bool forward_nchw_vec3x3(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                         cudaStream_t stream);
// 3/5/7 square, stride 1 or 2, dilation 1, 16/32-bit, either layout: register tiles of a few columns per lane.
void forward_tiled(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                   cudaStream_t stream);
// Any shape, dtype and layout the op accepts (any kernel, stride, padding, dilation, depth multiplier, 64-bit
// sizes): one output element per thread, 32-bit index math where the case fits it.
void forward_generic(const DepthwiseShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                     cudaStream_t stream);

// Input gradient.
// NHWC 3x3, stride 1: the forward column walk with the kernel rotated, on input_grad_as_forward(s).
void input_grad_nhwc_column(const ConvShape& s, DType dt, const void* grad_out, const void* w, void* grad_input,
                            cudaStream_t stream);
// NHWC 5x5 or 7x7, stride 1: the forward 5x5/7x7 column walk with the kernel rotated, on input_grad_as_forward(s).
void input_grad_nhwc_column_k57(const ConvShape& s, DType dt, const void* grad_out, const void* w, void* grad_input,
                                cudaStream_t stream);
// NCHW 5x5 or 7x7, stride 1: the NCHW forward walk with the kernel rotated, on input_grad_as_forward(s).
void input_grad_nchw_column_k57(const ConvShape& s, DType dt, const void* grad_out, const void* w, void* grad_input,
                                cudaStream_t stream);
// NHWC 3x3, 5x5 or 7x7, stride 1: the shared-memory tile with the kernel rotated, on input_grad_as_forward(s).
void input_grad_nhwc_smem(const ConvShape& s, DType dt, const void* grad_out, const void* w, void* grad_input,
                          cudaStream_t stream);
// NHWC 3x3, 5x5 or 7x7, stride 1, 16-bit: the tensor-core tile with the kernel rotated, on input_grad_as_forward(s).
void input_grad_nhwc_mma(const ConvShape& s, DType dt, const void* grad_out, const void* w, void* grad_input,
                         cudaStream_t stream);
// NHWC 3x3, 5x5 or 7x7, stride 1, 16-bit: the tensor-core walk with the kernel rotated, on input_grad_as_forward(s).
void input_grad_nhwc_mma_walk(const ConvShape& s, DType dt, const void* grad_out, const void* w, void* grad_input,
                              cudaStream_t stream);
// NCHW 3x3, stride 1, padding 1, 16-bit: the forward's vector stencil with the kernel rotated.
bool input_grad_nchw_vec3x3(const ConvShape& s, DType dt, const void* grad_out, const void* w, void* grad_input,
                            cudaStream_t stream);
// 3/5/7 square, stride 1 or 2, dilation 1, 16/32-bit, either layout: register tiles of a few columns per lane.
void input_grad_tiled(const ConvShape& s, DType dt, const void* grad_out, const void* w, void* grad_input,
                      cudaStream_t stream);
// The tiled NHWC 3x3 kernel at stride 1 or 2 with the BatchNorm's input gradient as its epilogue
// (launch_dgrad_normed, depthwise.h).
void input_grad_tiled_normed(const ConvShape& s, DType dt, const void* grad_out, const void* w,
                             const InputGradNorm& bn, void* grad_y, cudaStream_t stream);
// Any shape, dtype and layout the op accepts: one input element per thread, summing over its M filters.
void input_grad_generic(const DepthwiseShape& s, DType dt, const void* grad_out, const void* w, void* grad_input,
                        cudaStream_t stream);

// Weight and bias gradients, stage 1: a technique writes partial sums ws[chunk][C][KH*KW+1] (last slot: bias) for
// the number of chunks its *_chunks() gives and returns that number. It depends only on the shape and the GPU, so
// reruns are bitwise identical.
// NHWC 3x3, stride 1 or 2, whole 32-bit words of channels: a lane walks one output row (column walk).
int weight_grad_column_chunks(const ConvShape& s, DType dt);
int weight_grad_column(const ConvShape& s, DType dt, const void* grad_out, const void* x, void* ws,
                       cudaStream_t stream);
// The same walk with x = relu(batch_norm(y)) applied to y's words as they are loaded.
int weight_grad_column_normed_chunks(const ConvShape& s, DType dt);
int weight_grad_column_normed(const ConvShape& s, DType dt, const void* grad_out, const void* y, const InputNorm& norm,
                              void* ws, cudaStream_t stream);
// Stride 1, padding 1: the normalizing input-row walk that also writes the input gradient (of relu(batch_norm(y)))
// from the grad_out words it holds; stage 1 of the weight gradient as above. sums (may be null): the BatchNorm +
// ReLU backward's per-channel sums of that gradient, [chunks][2][C] fp32. Stride 2, padding 1: the stride-2 walk
// (a lane per input row), which always gives the sums (not null). out_norm (may be null; with sums): grad_out is the
// gradient of that BatchNorm + ReLU after the convolution, whose input gradient the walk applies as it loads it.
int backward_input_row_normed_chunks(const ConvShape& s, DType dt);
int backward_input_row_normed(const ConvShape& s, DType dt, const void* grad_out, const void* y, const void* w,
                              const InputNorm& norm, void* grad_input, void* ws, float* sums,
                              const OutputGradNorm* out_norm, cudaStream_t stream);
// The same stride-1 walk on the convolution's own input (no BatchNorm): both gradients of the plain op from one read
// of grad_out, the bias gradient in stage 1's bias slot; chunks as backward_input_row_normed_chunks.
int backward_input_row(const ConvShape& s, DType dt, const void* grad_out, const void* x, const void* w,
                       void* grad_input, void* ws, cudaStream_t stream);
// NHWC 3x3, stride 1, padding 1, channels in whole 16-byte units, grad_out and x 16-byte aligned, compute capability
// 9.0 or later: both gradients of the plain op from rings of grad_out and x rows that bulk copies fill
// (depthwise_ring.cu, BWD_RING); stage 1 of the weight gradient as above, one chunk per block.
// backward_nhwc_ring_chunks: its chunks (norm: the normalizing ring's), 0 where the shape does not fit;
// backward_nhwc_ring returns them, or 0 having launched nothing where the case does not fit.
int backward_nhwc_ring_chunks(const ConvShape& s, DType dt, bool norm = false);
int backward_nhwc_ring(const ConvShape& s, DType dt, const void* grad_out, const void* x, const void* w,
                       void* grad_input, void* ws, cudaStream_t stream);
// The same rings for norm.apply_in_depthwise's backward with the BatchNorm's sums (BWD_RING_NORM): as
// backward_input_row_normed at stride 1 with sums, one chunk of partials and one row of sums per block; out_norm: the
// BatchNorm after the convolution, applied to the grad_out rows in shared memory. Returns the chunks, or 0 having
// launched nothing.
int backward_nhwc_ring_normed(const ConvShape& s, DType dt, const void* grad_out, const void* y, const void* w,
                              const InputNorm& norm, void* grad_input, void* ws, float* sums,
                              const OutputGradNorm* out_norm, cudaStream_t stream);
// 5x5 or 7x7, stride 1 or 2, 16/32-bit, one kernel row per lane. NHWC (whole 32-bit words of channels): a lane walks
// one output row; NCHW (16-bit: W and OW even): a lane takes 4 columns of one output row.
int weight_grad_column_k57_chunks(const ConvShape& s, DType dt);
int weight_grad_column_k57(const ConvShape& s, DType dt, const void* grad_out, const void* x, void* ws,
                           cudaStream_t stream);
// 3/5/7 square, stride 1 or 2, dilation 1, 16/32-bit, either layout: register tiles of a few columns per lane.
int weight_grad_tiled_chunks(const ConvShape& s, DType dt);
int weight_grad_tiled(const ConvShape& s, DType dt, const void* grad_out, const void* x, void* ws,
                      cudaStream_t stream);
// Any shape, dtype and layout the op accepts; partials ws[chunk][C * M][KH*KW+1], and it runs its own stage 2.
int weight_grad_generic_chunks(const DepthwiseShape& s);
void weight_grad_generic(const DepthwiseShape& s, DType dt, const void* grad_out, const void* x, void* ws,
                         void* grad_weight, void* grad_bias, cudaStream_t stream);
// Stage 2: grad_weight[c][k] = sum over chunks of ws (fixed order), grad_bias[c] likewise from slot KH*KW.
void weight_grad_finalize(const ConvShape& s, DType dt, const void* ws, int chunks, void* grad_weight,
                          void* grad_bias, cudaStream_t stream);

}  // namespace mdw
