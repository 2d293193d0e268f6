// Fused BatchNorm + ReLU in training mode: host-side launch plans and launchers (batchnorm_relu.cu).
//
// Both directions are two-stage, fixed-order reductions, so the results are bitwise repeatable:
//   1. reduce:   every block sums its chunk of each channel into partial[chunk][2][C] (fp32);
//   2. finalize: per channel, the chunks are summed in fp64 in a fixed order, deriving the per-channel
//                constants (statistics, gradients of weight and bias, and the coefficients of step 3);
//   3. apply:    an elementwise pass: y = relu((x - mean) * scale + bias), or the input gradient.
// The backward reads grad_y and x only: the ReLU's mask is y > 0, recomputed from x.
// The forward statistics are sums of x - pivot (the channel's first element), so the variance of data with a
// large mean does not cancel away in fp32.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "depthwise.h"  // mdw::DType

namespace mbn {

using mdw::DType;

// x of logical shape (N, C, H, W) with HW = H * W, stored (N, H, W, C) when nhwc, else (N, C, H, W).
struct BnShape {
  int N, C, HW;
  bool nhwc;
};

// Which direction a plan is for: the passes differ in registers (so in blocks per SM) and in unrolling.
enum class BnPass { kForward, kBackward };

// A pass's split of each channel group's rows (NHWC) or vector units (NCHW) into gridDim.y chunks.
struct Chunking {
  int chunks;     // gridDim.y
  int per_chunk;  // rows or units per chunk
};

// How the reduce and apply kernels of one direction cover a tensor (computed once per call).
struct BnPlan {
  int vec;        // elements per thread access: 16 bytes where channels (NHWC) or plane length (NCHW) allow
  int lanes;      // NHWC: threads along the channel vectors (blockDim.x); NCHW: threads per block
  int rows;       // NHWC: rows (pixels) per block pass (blockDim.y); NCHW: 1
  int groups;     // gridDim.x: NHWC channel groups of lanes * vec channels; NCHW: channels
  Chunking reduce, apply;
};

// `address_bits`: the OR of every tensor pointer the kernels access, to choose an aligned vector width.
BnPlan make_plan(const BnShape& s, DType dt, uintptr_t address_bits, int num_sms, BnPass pass);

// fp32 elements of workspace the forward and backward launchers need.
size_t workspace_floats(const BnShape& s, const BnPlan& p);

// The running statistics a forward updates as it finalizes the batch statistics (no kernel of its own), with
// launch_update_running_stats' arithmetic for momentum in [0, 1]; running_mean == nullptr: no update.
struct RunningUpdate {
  float* running_mean = nullptr;
  float* running_var = nullptr;
  int64_t* num_batches_tracked = nullptr;
  double momentum = 0.0;
  int64_t count = 0;  // values per channel, for the unbiased variance
};

// y = relu(batch_norm(x)); mean, invstd (1 / sqrt(var + eps)) and biased var per channel, all fp32; and the running
// statistics where `update` names them. y == nullptr: the statistics only (no apply pass), for a consumer that
// normalizes x itself as it loads it (norm.apply_in_depthwise).
void launch_forward(const BnShape& s, const BnPlan& p, DType dt, const void* x, const float* weight, const float* bias,
                    float eps, void* y, float* mean, float* invstd, float* var, float* workspace,
                    const RunningUpdate& update, cudaStream_t stream);

// launch_forward with the statistics of x given as partial [bands][3][C] fp64 = (count, mean, M2) per block and
// channel (the depthwise forward's, depthwise_fwd_stats) instead of computed by a pass over x: the bands merged in
// fp64 with Chan's formula in a fixed order, then the same normalize. workspace: C floats.
void launch_forward_from_partials(const BnShape& s, const BnPlan& p, DType dt, const void* x, const double* partial,
                                  int bands, const float* weight, const float* bias, float eps, void* y, float* mean,
                                  float* invstd, float* var, float* workspace, cudaStream_t stream);

// The three gradients of y = relu(batch_norm(x)), the ReLU's backward (grad_y where y > 0) folded in. The mask is
// recomputed from x, weight, bias and the saved statistics exactly as the forward computed y, so y is not read.
void launch_backward(const BnShape& s, const BnPlan& p, DType dt, const void* grad_y, const void* x, const float* weight,
                     const float* bias, const float* mean, const float* invstd, void* grad_x, float* grad_weight,
                     float* grad_bias, float* workspace, cudaStream_t stream);

// launch_backward with the gradient sums given instead of its reduce pass: sums [chunks][2][C] fp32 partials of
// sum(g) and sum(g * (x - mean)) (g = grad_y where the ReLU passed), as the depthwise backward walk that wrote grad_y
// returns them (mdw::launch_bwd_normed); finalized in fp64 in a fixed order, as the reduce's own partials are.
void launch_backward_from_sums(const BnShape& s, const BnPlan& p, DType dt, const void* grad_y, const void* x,
                               const float* weight, const float* bias, const float* mean, const float* invstd,
                               const float* sums, int chunks, void* grad_x, float* grad_weight, float* grad_bias,
                               float* workspace, cudaStream_t stream);

// launch_backward's reduce and finalize without its apply pass: grad_weight, grad_bias, and consts [6][C] fp32, the
// input gradient's per-channel constants in mdw::OutputGradNorm's order (mean, c_g, c_x, c_0, scale, bias), for a
// depthwise backward walk that applies that input gradient as it loads its grad_out (mdw::launch_bwd_normed).
void launch_backward_consts(const BnShape& s, const BnPlan& p, DType dt, const void* grad_y, const void* x,
                            const float* weight, const float* bias, const float* mean, const float* invstd,
                            float* consts, float* grad_weight, float* grad_bias, float* workspace,
                            cudaStream_t stream);

// launch_backward_consts with the gradient sums given (launch_backward_from_sums' sums): the finalize alone, whose
// consts the depthwise input-gradient kernel applies to the gradient it computes (mdw::launch_dgrad_normed).
void launch_backward_consts_from_sums(const BnShape& s, const BnPlan& p, DType dt, const void* x,
                                      const float* weight, const float* bias, const float* mean, const float* invstd,
                                      const float* sums, int chunks, float* consts, float* grad_weight,
                                      float* grad_bias, float* workspace, cudaStream_t stream);

// nn.BatchNorm2d's running-statistics update from this batch's mean and biased variance over `count` values per
// channel: num_batches_tracked += 1, then running = (1 - f) * running + f * batch (var made unbiased), where
// f = momentum, or 1 / num_batches_tracked when momentum < 0 (nn.BatchNorm2d's momentum=None).
void launch_update_running_stats(int C, const float* mean, const float* var, int64_t count, double momentum,
                                 float* running_mean, float* running_var, int64_t* num_batches_tracked,
                                 cudaStream_t stream);

// --- sync_bn (SyncBatchNorm with the fused ReLU): the passes above, split where the ranks combine their sums -----
// Plans as above: kForward for the statistics and the normalize, kBackward for the gradient sums and input gradient.

// fp32 elements of workspace each of the sync launchers below needs.
size_t sync_workspace_floats(const BnShape& s, const BnPlan& p);

// This batch's mean and biased variance per channel, in fp64 (the reduce of launch_forward).
void launch_local_stats(const BnShape& s, const BnPlan& p, DType dt, const void* x, double* mean, double* var,
                        float* workspace, cudaStream_t stream);

// y = relu((x - mean) * weight * invstd + bias) for given statistics, in launch_forward's arithmetic.
void launch_normalize(const BnShape& s, const BnPlan& p, DType dt, const void* x, const float* weight,
                      const float* bias, const float* mean, const float* invstd, void* y, float* workspace,
                      cudaStream_t stream);

// sums[0][c] = sum(g), sums[1][c] = sum(g * (x - mean)) in fp64, g = grad_y where y > 0 (the mask from x, as in
// launch_backward).
void launch_grad_sums(const BnShape& s, const BnPlan& p, DType dt, const void* grad_y, const void* x,
                      const float* weight, const float* bias, const float* mean, const float* invstd, double* sums,
                      float* workspace, cudaStream_t stream);

// grad_x from grad_means [2][C] = (mean(g), mean(g * (x - mean))) over the whole (all ranks') batch.
void launch_input_grad(const BnShape& s, const BnPlan& p, DType dt, const void* grad_y, const void* x,
                       const float* weight, const float* bias, const float* mean, const float* invstd,
                       const float* grad_means, void* grad_x, float* workspace, cudaStream_t stream);

// launch_update_running_stats with the variance already unbiased (over a count held on the device).
void launch_update_running_stats_unbiased(int C, const float* mean, const float* unbiased_var, double momentum,
                                          float* running_mean, float* running_var, int64_t* num_batches_tracked,
                                          cudaStream_t stream);

// norm.apply_in_pointwise (kernels/norm_pointwise.py): out [2][C] in dt = (weight * invstd, bias - mean * scale), the
// operands of a cuDNN convolution that normalizes its input as it loads it; and the batch statistics (fp32 mean,
// invstd, biased var) from [2][C] fp32 sums and sums of squares of `count` values per channel, with the running
// statistics updated as the forward's finalize updates them (momentum in [0, 1]).
void launch_scale_shift(int C, DType dt, const float* mean, const float* invstd, const float* weight,
                        const float* bias, void* out, cudaStream_t stream);
void launch_stats_from_sums(int C, const float* sums, int64_t count, float eps, float* mean, float* invstd,
                            float* var, const RunningUpdate& update, cudaStream_t stream);

}  // namespace mbn
