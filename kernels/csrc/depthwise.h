// Host-side interface between the op layer (depthwise_ops.cpp) and the kernels: the dispatch in
// depthwise_dispatch.cpp picks a kernel per case. Kept free of ATen so the .cu files compile quickly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime_api.h>

namespace mdw {

enum class DType { F32, F16, BF16, F64 };

// One depthwise convolution; every tensor is contiguous in the layout named by channels_last. The shape the
// specialised kernels take (32-bit sizes, one filter per channel); the op describes a call by DepthwiseShape.
struct ConvShape {
  int N, C, H, W;    // input
  int OH, OW;        // output
  int KH, KW;        // kernel
  int SH, SW;        // stride
  int PH, PW;        // padding
  int DH, DW;        // dilation
  bool channels_last;
  int act;           // forward epilogue, after the bias: Act below (the gradients always run with kNone)
};

// Any depthwise convolution F.conv2d(groups=C) runs: 64-bit sizes and a depth multiplier M, with C * M output
// channels (output channel oc reads input channel oc / M; weight (C * M, 1, KH, KW)). The dispatch narrows it to a
// ConvShape for the specialised kernels where it fits them (depthwise_dispatch.cpp), else runs the generic ones.
struct DepthwiseShape {
  int64_t N, C, M;     // input (N, C, H, W); output channels C * M
  int64_t H, W;        // input
  int64_t OH, OW;      // output
  int64_t KH, KW;      // kernel
  int64_t SH, SW;      // stride
  int64_t PH, PW;      // padding (top and left; the output size says how much the bottom and right have)
  int64_t DH, DW;      // dilation
  bool channels_last;
  int act;
};

// The BatchNorm (batch statistics, fp32 per channel) + ReLU of the layer before a depthwise convolution, which the
// NHWC 3x3 walks apply to every input word as they load it (norm.apply_in_depthwise): the convolution of
// relu(batch_norm(y)) computed from y, without x = relu(batch_norm(y)) ever being written (WordNorm, device_common.h).
struct InputNorm {
  const float* mean = nullptr;
  const float* invstd = nullptr;
  const float* weight = nullptr;
  const float* bias = nullptr;
};

// The BatchNorm + ReLU of the layer after a depthwise convolution, whose backward the NHWC 3x3 backward walks apply
// as they load grad_out: given the gradient of that BatchNorm's output in place of grad_out, they compute each
// grad_out word from it and from x, the BatchNorm's input (the convolution's output), with the per-channel constants
// of the BatchNorm's backward, so that its input gradient (grad_out) is never written (WordGradNorm,
// device_common.h). consts: [6][C] fp32, rows mean, c_g, c_x, c_0, scale, bias (mobilenet_bn::bn_relu_bwd_consts).
struct OutputGradNorm {
  const void* x = nullptr;
  const float* consts = nullptr;
  int C = 0;
};

// The BatchNorm + ReLU before a depthwise convolution, whose input gradient the tiled NHWC input-gradient kernel
// applies to each grad_input value it computes (launch_dgrad_normed): y, that BatchNorm's input (the shape and
// layout of grad_input), and consts, its backward's per-channel constants from its gradient sums, laid out as
// OutputGradNorm's (mobilenet_bn::bn_relu_bwd_consts_from_sums).
struct InputGradNorm {
  const void* y = nullptr;
  const float* consts = nullptr;
};

// The activations the forward epilogue can apply; values match the op schema's `activation` argument.
enum Act : int { kActNone = 0, kActReLU = 1, kActReLU6 = 2 };

// y = act(conv(x, w) + bias); bias may be null, act is s.act.
void launch_forward(const DepthwiseShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                    cudaStream_t stream);

// The forward with the statistics of y per block (no bias, no activation): whether the case is the statistics walk's
// (NHWC 3x3, equal strides 1 or 2, dilation 1, whole 32-bit words of channels, 4-byte pointers, in the specialised
// kernels' domain), the bands of its partial[bands][3][C] fp64 (0 when it is not), and the launch.
bool forward_stats_fits(const DepthwiseShape& s, DType dt, const void* x, const void* y);
int forward_stats_bands(const DepthwiseShape& s, DType dt);
void launch_forward_stats(const DepthwiseShape& s, DType dt, const void* x, const void* w, void* y, double* partial,
                          cudaStream_t stream);

// The convolution of relu(batch_norm(y)) from y (InputNorm): whether the case is the column walk's (NHWC 3x3, equal
// strides 1 or 2, dilation 1, whole 32-bit words of channels, 4-byte pointers, in the specialised kernels' domain, no
// depth multiplier), the forward (no bias, no activation), and the weight gradient's workspace and launch (no bias
// gradient). Only these walks apply an InputNorm, so there is no other kernel to run these cases.
bool normed_fits(const DepthwiseShape& s, DType dt, const void* y, const void* out);
void launch_forward_normed(const DepthwiseShape& s, DType dt, const void* y, const void* w, const InputNorm& norm,
                           void* out, cudaStream_t stream);
size_t wgrad_normed_workspace_elems(const DepthwiseShape& s, DType dt);
void launch_wgrad_normed(const DepthwiseShape& s, DType dt, const void* grad_out, const void* y, const InputNorm& norm,
                         void* workspace, void* grad_weight, cudaStream_t stream);

// The backward of norm.apply_in_depthwise's convolution: grad_input (the gradient of relu(batch_norm(y)), which the
// BatchNorm's own backward then takes) and grad_weight, in one walk over y and grad_out at stride 1 and padding 1
// (bwd_normed_one_walk), and at stride 2 and padding 1 where the sums are asked for; else the input gradient's and
// weight gradient's kernels one after the other. `workspace`: bwd_normed_workspace_elems floats (`sums`: whether the
// launch will ask for them). sums (the walks only; may be null): that BatchNorm backward's per-channel sums of
// grad_input where the ReLU passed, sum(g) and sum(g * (y - mean)), as partials [bwd_normed_sums_chunks][2][C] fp32
// (mobilenet_bn::bn_relu_bwd_from_sums takes them instead of its reduce pass); bwd_normed_sums_chunks is 0 where no
// walk gives them. out_norm (may be null; only where the walks give the sums, with sums): grad_out is the gradient of
// the BatchNorm + ReLU after the convolution, whose input gradient the walks apply to it as they load it.
bool bwd_normed_one_walk(const DepthwiseShape& s);
size_t bwd_normed_workspace_elems(const DepthwiseShape& s, DType dt, bool sums);
int bwd_normed_sums_chunks(const DepthwiseShape& s, DType dt);
// Whether launch_bwd_normed with the sums runs the backward's rings for this shape on the current device
// (BWD_RING_NORM; the pointers permitting, which the launch checks).
bool bwd_normed_ring_runs(const DepthwiseShape& s, DType dt);
void launch_bwd_normed(const DepthwiseShape& s, DType dt, const void* grad_out, const void* y, const void* w,
                       const InputNorm& norm, void* grad_input, void* workspace, void* grad_weight, float* sums,
                       const OutputGradNorm* out_norm, cudaStream_t stream);

// Both gradients in one walk where bwd_walk_fits (NHWC 3x3, stride 1, padding 1, dilation 1, whole 32-bit words of
// channels, 4-byte pointers, no depth multiplier, BWD_WALK on): grad_input, and grad_weight and/or grad_bias (either
// may be null) through a workspace of bwd_walk_workspace_elems floats.
bool bwd_walk_fits(const DepthwiseShape& s, DType dt, const void* grad_out, const void* x, const void* grad_input);
size_t bwd_walk_workspace_elems(const DepthwiseShape& s, DType dt);
void launch_bwd_walk(const DepthwiseShape& s, DType dt, const void* grad_out, const void* x, const void* w,
                     void* grad_input, void* workspace, void* grad_weight, void* grad_bias, cudaStream_t stream);

// grad_input from grad_out (gather over the taps that touch each input pixel).
void launch_dgrad(const DepthwiseShape& s, DType dt, const void* grad_out, const void* w, void* grad_input,
                  cudaStream_t stream);

// The gradient of y, the input of the BatchNorm + ReLU before the convolution (bn), from grad_out in one pass: the
// tiled NHWC kernel's input gradient with that BatchNorm's input-gradient arithmetic applied to each value
// (InputGradNorm). dgrad_normed_fits: NHWC 3x3, stride 1 or 2, padding 1, dilation 1, no depth multiplier, 16/32-bit,
// channels in whole vectors of the tiled kernel with aligned pointers; it never runs another way.
bool dgrad_normed_fits(const DepthwiseShape& s, DType dt, const void* grad_out, const void* y, const void* grad_y);
void launch_dgrad_normed(const DepthwiseShape& s, DType dt, const void* grad_out, const void* w,
                         const InputGradNorm& bn, void* grad_y, cudaStream_t stream);

// Weight/bias gradients are reduced in two fixed-order stages through a workspace of partial sums
// (fp32, or fp64 for double inputs); this says how many elements of that type the workspace needs.
size_t wgrad_workspace_elems(const DepthwiseShape& s, DType dt, const void* grad_out, const void* x);

// grad_weight and/or grad_bias (either may be null). `workspace` has wgrad_workspace_elems() elements.
void launch_wgrad(const DepthwiseShape& s, DType dt, const void* grad_out, const void* x, void* workspace,
                  void* grad_weight, void* grad_bias, cudaStream_t stream);

}  // namespace mdw
