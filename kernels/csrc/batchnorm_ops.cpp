// Op schemas of the fused BatchNorm + ReLU (namespace mobilenet_bn) and their CUDA implementations: argument
// checks, layout handling, allocation. The kernels live in batchnorm_relu.cu.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>

#include "batchnorm_relu.h"
#include "launch_plan.h"
#include "op_layout.h"

namespace mbn {
namespace {

DType to_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return DType::F32;
    case c10::ScalarType::Half: return DType::F16;
    case c10::ScalarType::BFloat16: return DType::BF16;
    default:
      TORCH_CHECK(false, "batch_norm_relu: dtype ", t, " is not supported (float32, float16, bfloat16)");
  }
  return DType::F32;  // not reached
}

using mdw::check_fp32_vectors;
using mdw::in_layout;
using mdw::layout_of;

void check_input(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 4, "batch_norm_relu: input must be 4-D (N, C, H, W), got ", x.dim(), "-D");
  TORCH_CHECK(x.is_cuda(), "batch_norm_relu: input must be a CUDA tensor, got one on ", x.device());
  to_dtype(x.scalar_type());
  TORCH_CHECK(x.size(1) >= 1 && x.size(0) * x.size(2) * x.size(3) >= 1,
              "batch_norm_relu: input ", x.sizes(), " has no values per channel");
  TORCH_CHECK(x.numel() < (int64_t(1) << 31), "batch_norm_relu: tensors of 2^31 or more elements are not supported");
}

// weight, bias, mean, invstd: fp32 per-channel vectors on x's device (fp32 whatever x's dtype, as cuDNN's BN).
void check_channel_vector(const at::Tensor& v, const at::Tensor& x, const char* name) {
  TORCH_CHECK(v.dim() == 1 && v.size(0) == x.size(1), "batch_norm_relu: ", name, " must have shape (", x.size(1),
              ",), got ", v.sizes());
  TORCH_CHECK(v.device() == x.device(), "batch_norm_relu: ", name, " is on ", v.device(), " but the input is on ",
              x.device());
  TORCH_CHECK(v.scalar_type() == at::kFloat, "batch_norm_relu: ", name, " must be float32 (statistics and affine "
              "parameters stay fp32 for every input dtype), got ", v.scalar_type());
}

BnShape shape_of(const at::Tensor& x, c10::MemoryFormat fmt) {
  BnShape s{};
  s.N = static_cast<int>(x.size(0));
  s.C = static_cast<int>(x.size(1));
  s.HW = static_cast<int>(x.size(2) * x.size(3));
  // With one pixel per image both layouts are the same memory, and the channel-vector kernels read it best.
  s.nhwc = fmt == c10::MemoryFormat::ChannelsLast || s.HW == 1;
  return s;
}

uintptr_t address(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()); }

using mdw::num_sms;  // cached per device (launch_plan.cpp): no query, so no synchronisation, in a capture

// with_y = false: the statistics only, y is returned undefined.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_with(const at::Tensor& x_in, const at::Tensor& weight,
                                                                        const at::Tensor& bias, double eps,
                                                                        RunningUpdate update, bool with_y = true) {
  check_input(x_in);
  check_channel_vector(weight, x_in, "weight");
  check_channel_vector(bias, x_in, "bias");
  TORCH_CHECK(eps >= 0, "batch_norm_relu: eps must be >= 0, got ", eps);
  c10::cuda::CUDAGuard guard(x_in.device());
  const c10::MemoryFormat fmt = layout_of(x_in);
  const at::Tensor x = in_layout(x_in, fmt);
  const at::Tensor w = weight.contiguous(), b = bias.contiguous();
  const BnShape s = shape_of(x, fmt);
  const DType dt = to_dtype(x.scalar_type());
  at::Tensor y = with_y ? at::empty(x.sizes(), x.options().memory_format(fmt)) : at::Tensor();
  const auto stat = x.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({s.C}, stat), invstd = at::empty({s.C}, stat), var = at::empty({s.C}, stat);
  const BnPlan p = make_plan(s, dt, address(x) | (with_y ? address(y) : 0), num_sms(), BnPass::kForward);
  at::Tensor workspace = at::empty({static_cast<int64_t>(workspace_floats(s, p))}, stat);
  launch_forward(s, p, dt, x.const_data_ptr(), w.const_data_ptr<float>(), b.const_data_ptr<float>(),
                 static_cast<float>(eps), with_y ? y.mutable_data_ptr() : nullptr, mean.mutable_data_ptr<float>(),
                 invstd.mutable_data_ptr<float>(), var.mutable_data_ptr<float>(), workspace.mutable_data_ptr<float>(),
                 update, c10::cuda::getCurrentCUDAStream());
  return {y, mean, invstd, var};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bn_relu_fwd(const at::Tensor& x, const at::Tensor& weight,
                                                                       const at::Tensor& bias, double eps) {
  return forward_with(x, weight, bias, eps, RunningUpdate{});
}

// The four per-channel vectors every pass after the statistics takes.
void check_channel_vectors(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                           const at::Tensor& mean, const at::Tensor& invstd) {
  check_channel_vector(weight, x, "weight");
  check_channel_vector(bias, x, "bias");
  check_channel_vector(mean, x, "mean");
  check_channel_vector(invstd, x, "invstd");
}

// bn_relu_fwd with x's statistics from partial [bands, 3, C] fp64 (count, mean, M2 per band and channel), as
// mobilenet_dw::depthwise_fwd_stats returns them with x: the same outputs without the statistics pass over x.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bn_relu_fwd_from_partials(
    const at::Tensor& x_in, const at::Tensor& partial, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  check_input(x_in);
  check_channel_vector(weight, x_in, "weight");
  check_channel_vector(bias, x_in, "bias");
  TORCH_CHECK(eps >= 0, "batch_norm_relu: eps must be >= 0, got ", eps);
  TORCH_CHECK(partial.dim() == 3 && partial.size(0) >= 1 && partial.size(0) < (1 << 30) && partial.size(1) == 3 &&
                  partial.size(2) == x_in.size(1) && partial.scalar_type() == at::kDouble &&
                  partial.device() == x_in.device(),
              "batch_norm_relu: partials must be a float64 (bands, 3, ", x_in.size(1), ") tensor on ", x_in.device(),
              ", got ", partial.scalar_type(), " ", partial.sizes());
  c10::cuda::CUDAGuard guard(x_in.device());
  const c10::MemoryFormat fmt = layout_of(x_in);
  const at::Tensor x = in_layout(x_in, fmt);
  const at::Tensor part = partial.contiguous(), w = weight.contiguous(), b = bias.contiguous();
  const BnShape s = shape_of(x, fmt);
  const DType dt = to_dtype(x.scalar_type());
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(fmt));
  const auto stat = x.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({s.C}, stat), invstd = at::empty({s.C}, stat), var = at::empty({s.C}, stat);
  at::Tensor scale = at::empty({s.C}, stat);
  const BnPlan p = make_plan(s, dt, address(x) | address(y), num_sms(), BnPass::kForward);
  launch_forward_from_partials(s, p, dt, x.const_data_ptr(), part.const_data_ptr<double>(),
                               static_cast<int>(part.size(0)), w.const_data_ptr<float>(), b.const_data_ptr<float>(),
                               static_cast<float>(eps), y.mutable_data_ptr(), mean.mutable_data_ptr<float>(),
                               invstd.mutable_data_ptr<float>(), var.mutable_data_ptr<float>(),
                               scale.mutable_data_ptr<float>(), c10::cuda::getCurrentCUDAStream());
  return {y, mean, invstd, var};
}

// The backward's inputs: grad_y like x, and the forward's fp32 per-channel vectors.
void check_backward_inputs(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& bias, const at::Tensor& mean, const at::Tensor& invstd) {
  check_input(x);
  TORCH_CHECK(grad_y.sizes() == x.sizes(), "batch_norm_relu backward: grad_y ", grad_y.sizes(),
              " must have the input's shape ", x.sizes());
  TORCH_CHECK(grad_y.scalar_type() == x.scalar_type(), "batch_norm_relu backward: grad_y (", grad_y.scalar_type(),
              ") must have the input's dtype ", x.scalar_type());
  TORCH_CHECK(grad_y.device() == x.device(), "batch_norm_relu backward: grad_y must be on the input's device ",
              x.device());
  check_channel_vectors(x, weight, bias, mean, invstd);
}

// The backward's inputs checked (check_backward_inputs), then in the layout and form its kernels read; x's device is
// current while this lives.
struct BackwardInputs {
  BackwardInputs(const at::Tensor& grad_y_in, const at::Tensor& x_in, const at::Tensor& weight,
                 const at::Tensor& bias, const at::Tensor& mean, const at::Tensor& invstd) {
    check_backward_inputs(grad_y_in, x_in, weight, bias, mean, invstd);
    guard.set_device(x_in.device());
    fmt = layout_of(x_in);
    x = in_layout(x_in, fmt);
    grad_y = in_layout(grad_y_in, fmt);
    w = weight.contiguous(), b = bias.contiguous(), m = mean.contiguous(), is = invstd.contiguous();
    s = shape_of(x, fmt);
    dt = to_dtype(x.scalar_type());
  }
  c10::cuda::OptionalCUDAGuard guard;
  c10::MemoryFormat fmt;
  at::Tensor x, grad_y, w, b, m, is;
  BnShape s;
  DType dt;
};

// bn_relu_bwd, with its gradient sums given as partials (sums, may be null) or from its own reduce pass.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_with(const at::Tensor& grad_y_in, const at::Tensor& x_in,
                                                             const at::Tensor& weight, const at::Tensor& bias,
                                                             const at::Tensor& mean, const at::Tensor& invstd,
                                                             const at::Tensor* sums) {
  const BackwardInputs in(grad_y_in, x_in, weight, bias, mean, invstd);
  const at::Tensor &x = in.x, &grad_y = in.grad_y, &w = in.w, &b = in.b, &m = in.m, &is = in.is;
  const BnShape& s = in.s;
  const DType dt = in.dt;
  at::Tensor grad_x = at::empty(x.sizes(), x.options().memory_format(in.fmt));
  const auto stat = x.options().dtype(at::kFloat);
  at::Tensor grad_weight = at::empty({s.C}, stat), grad_bias = at::empty({s.C}, stat);
  const BnPlan p = make_plan(s, dt, address(x) | address(grad_y) | address(grad_x), num_sms(), BnPass::kBackward);
  at::Tensor workspace = at::empty({static_cast<int64_t>(workspace_floats(s, p))}, stat);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (sums == nullptr) {
    launch_backward(s, p, dt, grad_y.const_data_ptr(), x.const_data_ptr(), w.const_data_ptr<float>(),
                    b.const_data_ptr<float>(), m.const_data_ptr<float>(), is.const_data_ptr<float>(),
                    grad_x.mutable_data_ptr(), grad_weight.mutable_data_ptr<float>(),
                    grad_bias.mutable_data_ptr<float>(), workspace.mutable_data_ptr<float>(), stream);
  } else {
    const at::Tensor part = sums->contiguous();
    launch_backward_from_sums(s, p, dt, grad_y.const_data_ptr(), x.const_data_ptr(), w.const_data_ptr<float>(),
                              b.const_data_ptr<float>(), m.const_data_ptr<float>(), is.const_data_ptr<float>(),
                              part.const_data_ptr<float>(), static_cast<int>(part.size(0)), grad_x.mutable_data_ptr(),
                              grad_weight.mutable_data_ptr<float>(), grad_bias.mutable_data_ptr<float>(),
                              workspace.mutable_data_ptr<float>(), stream);
  }
  return {grad_x, grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_relu_bwd(const at::Tensor& grad_y, const at::Tensor& x,
                                                           const at::Tensor& weight, const at::Tensor& bias,
                                                           const at::Tensor& mean, const at::Tensor& invstd) {
  return backward_with(grad_y, x, weight, bias, mean, invstd, nullptr);
}

// bn_relu_bwd with its gradient sums given as partials [chunks, 2, C] fp32 (mobilenet_dw::depthwise_bwd_normed's
// sums for this very grad_y and x): the same outputs to the sums' summation order, without the reduce pass.
std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_relu_bwd_from_sums(const at::Tensor& grad_y, const at::Tensor& x,
                                                                     const at::Tensor& weight, const at::Tensor& bias,
                                                                     const at::Tensor& mean, const at::Tensor& invstd,
                                                                     const at::Tensor& sums) {
  TORCH_CHECK(sums.dim() == 3 && sums.size(0) >= 1 && sums.size(0) < (1 << 30) && sums.size(1) == 2 &&
                  x.dim() == 4 && sums.size(2) == x.size(1) && sums.scalar_type() == at::kFloat &&
                  sums.device() == x.device(),
              "batch_norm_relu backward: sums must be a float32 (chunks, 2, C) tensor on the input's device, got ",
              sums.scalar_type(), " ", sums.sizes());
  return backward_with(grad_y, x, weight, bias, mean, invstd, &sums);
}

// bn_relu_bwd's reduce and finalize without its input-gradient pass: (consts [6, C] fp32, grad_weight, grad_bias),
// consts the input gradient's per-channel constants (mean, c_g, c_x, c_0, scale, bias) for
// mobilenet_dw::depthwise_bwd_normed, which applies that input gradient as it loads its grad_out.
std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_relu_bwd_consts(const at::Tensor& grad_y_in, const at::Tensor& x_in,
                                                                  const at::Tensor& weight, const at::Tensor& bias,
                                                                  const at::Tensor& mean, const at::Tensor& invstd) {
  const BackwardInputs in(grad_y_in, x_in, weight, bias, mean, invstd);
  const at::Tensor &x = in.x, &grad_y = in.grad_y, &w = in.w, &b = in.b, &m = in.m, &is = in.is;
  const BnShape& s = in.s;
  const DType dt = in.dt;
  const auto stat = x.options().dtype(at::kFloat);
  at::Tensor consts = at::empty({6, s.C}, stat);
  at::Tensor grad_weight = at::empty({s.C}, stat), grad_bias = at::empty({s.C}, stat);
  const BnPlan p = make_plan(s, dt, address(x) | address(grad_y), num_sms(), BnPass::kBackward);
  at::Tensor workspace = at::empty({static_cast<int64_t>(workspace_floats(s, p))}, stat);
  launch_backward_consts(s, p, dt, grad_y.const_data_ptr(), x.const_data_ptr(), w.const_data_ptr<float>(),
                         b.const_data_ptr<float>(), m.const_data_ptr<float>(), is.const_data_ptr<float>(),
                         consts.mutable_data_ptr<float>(), grad_weight.mutable_data_ptr<float>(),
                         grad_bias.mutable_data_ptr<float>(), workspace.mutable_data_ptr<float>(),
                         c10::cuda::getCurrentCUDAStream());
  return {consts, grad_weight, grad_bias};
}

// bn_relu_bwd_consts with its gradient sums given as partials [chunks, 2, C] fp32 (mobilenet_dw's
// depthwise_bwd_normed_sums): (consts [6, C] fp32, grad_weight, grad_bias) from the finalize alone, for
// mobilenet_dw::depthwise_dgrad_normed, which applies that input gradient to the gradient it computes. x: the
// BatchNorm's input (its shape and dtype set the count and the plan).
std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_relu_bwd_consts_from_sums(
    const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& mean,
    const at::Tensor& invstd, const at::Tensor& sums) {
  TORCH_CHECK(sums.dim() == 3 && sums.size(0) >= 1 && sums.size(0) < (1 << 30) && sums.size(1) == 2 &&
                  x_in.dim() == 4 && sums.size(2) == x_in.size(1) && sums.scalar_type() == at::kFloat &&
                  sums.device() == x_in.device(),
              "batch_norm_relu backward: sums must be a float32 (chunks, 2, C) tensor on the input's device, got ",
              sums.scalar_type(), " ", sums.sizes());
  const BackwardInputs in(x_in, x_in, weight, bias, mean, invstd);
  const BnShape& s = in.s;
  const auto stat = in.x.options().dtype(at::kFloat);
  at::Tensor consts = at::empty({6, s.C}, stat);
  at::Tensor grad_weight = at::empty({s.C}, stat), grad_bias = at::empty({s.C}, stat);
  const BnPlan p = make_plan(s, in.dt, address(in.x), num_sms(), BnPass::kBackward);
  at::Tensor workspace = at::empty({static_cast<int64_t>(workspace_floats(s, p))}, stat);
  const at::Tensor part = sums.contiguous();
  launch_backward_consts_from_sums(s, p, in.dt, in.x.const_data_ptr(), in.w.const_data_ptr<float>(),
                                   in.b.const_data_ptr<float>(), in.m.const_data_ptr<float>(),
                                   in.is.const_data_ptr<float>(), part.const_data_ptr<float>(),
                                   static_cast<int>(part.size(0)), consts.mutable_data_ptr<float>(),
                                   grad_weight.mutable_data_ptr<float>(), grad_bias.mutable_data_ptr<float>(),
                                   workspace.mutable_data_ptr<float>(), c10::cuda::getCurrentCUDAStream());
  return {consts, grad_weight, grad_bias};
}

// running_mean, running_var and the batch's mean and var: contiguous fp32 (C,) vectors on one device.
void check_running_stats(const at::Tensor& running_mean, const at::Tensor& running_var,
                         const at::Tensor& num_batches_tracked, const at::Tensor& mean, const at::Tensor& var,
                         double momentum) {
  TORCH_CHECK(mean.is_cuda() && mean.dim() == 1, "batch_norm_relu running statistics: mean must be a 1-D CUDA tensor");
  check_fp32_vectors("batch_norm_relu running statistics", mean.size(0), mean.device(),
                        {{&running_mean, "running_mean"}, {&running_var, "running_var"}, {&mean, "mean"}, {&var, "var"}});
  TORCH_CHECK(num_batches_tracked.numel() == 1 && num_batches_tracked.scalar_type() == at::kLong &&
                  num_batches_tracked.device() == mean.device(),
              "batch_norm_relu running statistics: num_batches_tracked must be one int64 on ", mean.device());
  TORCH_CHECK(momentum <= 1, "batch_norm_relu running statistics: momentum must be in [0, 1] (or negative for a "
              "cumulative average), got ", momentum);
}

void bn_update_running_stats(at::Tensor& running_mean, at::Tensor& running_var, at::Tensor& num_batches_tracked,
                             const at::Tensor& mean, const at::Tensor& var, double momentum, int64_t count) {
  check_running_stats(running_mean, running_var, num_batches_tracked, mean, var, momentum);
  TORCH_CHECK(count > 1, "batch_norm_relu running statistics: the unbiased variance needs more than 1 value per "
              "channel, got ", count);
  c10::cuda::CUDAGuard guard(mean.device());
  launch_update_running_stats(static_cast<int>(mean.size(0)), mean.const_data_ptr<float>(), var.const_data_ptr<float>(),
                              count, momentum, running_mean.mutable_data_ptr<float>(),
                              running_var.mutable_data_ptr<float>(), num_batches_tracked.mutable_data_ptr<int64_t>(),
                              c10::cuda::getCurrentCUDAStream());
}

// bn_relu_fwd, and the running statistics updated as bn_update_running_stats does, by the forward's finalize kernel.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_update_with(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, at::Tensor& running_mean,
    at::Tensor& running_var, at::Tensor& num_batches_tracked, double eps, double momentum, bool with_y) {
  check_input(x);
  TORCH_CHECK(momentum >= 0, "batch_norm_relu: the forward's running-statistics update needs momentum in [0, 1], got ",
              momentum, " (the cumulative average, momentum=None, is bn_update_running_stats')");
  check_running_stats(running_mean, running_var, num_batches_tracked, running_mean, running_var, momentum);
  TORCH_CHECK(running_mean.size(0) == x.size(1) && running_mean.device() == x.device(),
              "batch_norm_relu running statistics: running_mean must be a (", x.size(1), ",) tensor on ", x.device());
  const int64_t count = x.numel() / x.size(1);
  TORCH_CHECK(count > 1, "batch_norm_relu running statistics: the unbiased variance needs more than 1 value per "
              "channel, got ", count);
  RunningUpdate update;
  update.running_mean = running_mean.mutable_data_ptr<float>();
  update.running_var = running_var.mutable_data_ptr<float>();
  update.num_batches_tracked = num_batches_tracked.mutable_data_ptr<int64_t>();
  update.momentum = momentum;
  update.count = count;
  return forward_with(x, weight, bias, eps, update, with_y);
}

// The batch statistics of bn_relu_fwd without y (norm.apply_in_depthwise: the depthwise kernel after it normalizes
// x as it loads it): (mean, invstd, var).
std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_stats(const at::Tensor& x, const at::Tensor& weight,
                                                        const at::Tensor& bias, double eps) {
  auto [y, mean, invstd, var] = forward_with(x, weight, bias, eps, RunningUpdate{}, /*with_y=*/false);
  return {mean, invstd, var};
}

// bn_stats with the running statistics updated in its finalize kernel, as bn_relu_fwd_update does.
std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_stats_update(const at::Tensor& x, const at::Tensor& weight,
                                                               const at::Tensor& bias, at::Tensor& running_mean,
                                                               at::Tensor& running_var, at::Tensor& num_batches_tracked,
                                                               double eps, double momentum) {
  auto [y, mean, invstd, var] =
      forward_update_with(x, weight, bias, running_mean, running_var, num_batches_tracked, eps, momentum, false);
  return {mean, invstd, var};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bn_relu_fwd_update(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, at::Tensor& running_mean,
    at::Tensor& running_var, at::Tensor& num_batches_tracked, double eps, double momentum) {
  return forward_update_with(x, weight, bias, running_mean, running_var, num_batches_tracked, eps, momentum, true);
}

// --- sync_bn: the fused passes split where the ranks combine their statistics and gradient sums ------------------

// What every sync op sets up: x (and grad_y) in x's layout, the shape, dtype and plan, and the workspace. `out`:
// the op's output like x (allocated first, since its address takes part in the vector width).
struct Prepared {
  at::Tensor x, grad_y, out;
  BnShape s;
  DType dt;
  BnPlan p;
  at::Tensor workspace;
  const void* grad_y_ptr() const { return grad_y.defined() ? grad_y.const_data_ptr() : nullptr; }
};

Prepared prepare(const at::Tensor& x_in, const at::Tensor* grad_y_in, bool with_out, BnPass pass) {
  Prepared r;
  const c10::MemoryFormat fmt = layout_of(x_in);
  r.x = in_layout(x_in, fmt);
  uintptr_t bits = address(r.x);
  if (grad_y_in != nullptr) {
    r.grad_y = in_layout(*grad_y_in, fmt);
    bits |= address(r.grad_y);
  }
  if (with_out) {
    r.out = at::empty(r.x.sizes(), r.x.options().memory_format(fmt));
    bits |= address(r.out);
  }
  r.s = shape_of(r.x, fmt);
  r.dt = to_dtype(r.x.scalar_type());
  r.p = make_plan(r.s, r.dt, bits, num_sms(), pass);
  r.workspace = at::empty({static_cast<int64_t>(sync_workspace_floats(r.s, r.p))}, r.x.options().dtype(at::kFloat));
  return r;
}

// (mean, biased var) of x per channel, fp64.
std::tuple<at::Tensor, at::Tensor> bn_local_stats(const at::Tensor& x_in) {
  check_input(x_in);
  c10::cuda::CUDAGuard guard(x_in.device());
  Prepared r = prepare(x_in, nullptr, false, BnPass::kForward);
  const auto f64 = r.x.options().dtype(at::kDouble);
  at::Tensor mean = at::empty({r.s.C}, f64), var = at::empty({r.s.C}, f64);
  launch_local_stats(r.s, r.p, r.dt, r.x.const_data_ptr(), mean.mutable_data_ptr<double>(),
                     var.mutable_data_ptr<double>(), r.workspace.mutable_data_ptr<float>(),
                     c10::cuda::getCurrentCUDAStream());
  return {mean, var};
}

at::Tensor bn_relu_normalize(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& bias,
                             const at::Tensor& mean, const at::Tensor& invstd) {
  check_input(x_in);
  check_channel_vectors(x_in, weight, bias, mean, invstd);
  c10::cuda::CUDAGuard guard(x_in.device());
  Prepared r = prepare(x_in, nullptr, true, BnPass::kForward);
  launch_normalize(r.s, r.p, r.dt, r.x.const_data_ptr(), weight.contiguous().const_data_ptr<float>(),
                   bias.contiguous().const_data_ptr<float>(), mean.contiguous().const_data_ptr<float>(),
                   invstd.contiguous().const_data_ptr<float>(), r.out.mutable_data_ptr(),
                   r.workspace.mutable_data_ptr<float>(), c10::cuda::getCurrentCUDAStream());
  return r.out;
}

// [2, C] fp64: sum(g) and sum(g * (x - mean)) per channel, g = grad_y where relu let it through.
at::Tensor bn_relu_grad_sums(const at::Tensor& grad_y_in, const at::Tensor& x_in, const at::Tensor& weight,
                             const at::Tensor& bias, const at::Tensor& mean, const at::Tensor& invstd) {
  check_backward_inputs(grad_y_in, x_in, weight, bias, mean, invstd);
  c10::cuda::CUDAGuard guard(x_in.device());
  Prepared r = prepare(x_in, &grad_y_in, false, BnPass::kBackward);
  at::Tensor sums = at::empty({2, r.s.C}, r.x.options().dtype(at::kDouble));
  launch_grad_sums(r.s, r.p, r.dt, r.grad_y_ptr(), r.x.const_data_ptr(), weight.contiguous().const_data_ptr<float>(),
                   bias.contiguous().const_data_ptr<float>(), mean.contiguous().const_data_ptr<float>(),
                   invstd.contiguous().const_data_ptr<float>(), sums.mutable_data_ptr<double>(),
                   r.workspace.mutable_data_ptr<float>(), c10::cuda::getCurrentCUDAStream());
  return sums;
}

// grad_x from grad_means, the [2, C] fp32 means of g and g * (x - mean) over every rank's batch.
at::Tensor bn_relu_input_grad(const at::Tensor& grad_y_in, const at::Tensor& x_in, const at::Tensor& weight,
                              const at::Tensor& bias, const at::Tensor& mean, const at::Tensor& invstd,
                              const at::Tensor& grad_means) {
  check_backward_inputs(grad_y_in, x_in, weight, bias, mean, invstd);
  TORCH_CHECK(grad_means.dim() == 2 && grad_means.size(0) == 2 && grad_means.size(1) == x_in.size(1) &&
                  grad_means.scalar_type() == at::kFloat && grad_means.device() == x_in.device(),
              "batch_norm_relu backward: grad_means must be a float32 (2, ", x_in.size(1), ") tensor on ",
              x_in.device(), ", got ", grad_means.scalar_type(), " ", grad_means.sizes());
  c10::cuda::CUDAGuard guard(x_in.device());
  Prepared r = prepare(x_in, &grad_y_in, true, BnPass::kBackward);
  launch_input_grad(r.s, r.p, r.dt, r.grad_y_ptr(), r.x.const_data_ptr(), weight.contiguous().const_data_ptr<float>(),
                    bias.contiguous().const_data_ptr<float>(), mean.contiguous().const_data_ptr<float>(),
                    invstd.contiguous().const_data_ptr<float>(), grad_means.contiguous().const_data_ptr<float>(),
                    r.out.mutable_data_ptr(), r.workspace.mutable_data_ptr<float>(),
                    c10::cuda::getCurrentCUDAStream());
  return r.out;
}

void bn_update_running_stats_unbiased(at::Tensor& running_mean, at::Tensor& running_var,
                                      at::Tensor& num_batches_tracked, const at::Tensor& mean,
                                      const at::Tensor& unbiased_var, double momentum) {
  check_running_stats(running_mean, running_var, num_batches_tracked, mean, unbiased_var, momentum);
  c10::cuda::CUDAGuard guard(mean.device());
  launch_update_running_stats_unbiased(static_cast<int>(mean.size(0)), mean.const_data_ptr<float>(),
                                       unbiased_var.const_data_ptr<float>(), momentum,
                                       running_mean.mutable_data_ptr<float>(), running_var.mutable_data_ptr<float>(),
                                       num_batches_tracked.mutable_data_ptr<int64_t>(),
                                       c10::cuda::getCurrentCUDAStream());
}

// --- norm.apply_in_pointwise: around cuDNN's fused convolutions (kernels/norm_pointwise.py) ------------------------

// [2, C] in `dtype`: scale = weight * invstd and shift = bias - mean * scale.
at::Tensor bn_scale_shift(const at::Tensor& mean, const at::Tensor& invstd, const at::Tensor& weight,
                          const at::Tensor& bias, c10::ScalarType dtype) {
  TORCH_CHECK(mean.is_cuda() && mean.dim() == 1, "bn_scale_shift: mean must be a 1-D CUDA tensor");
  check_fp32_vectors("bn_scale_shift", mean.size(0), mean.device(),
                        {{&mean, "mean"}, {&invstd, "invstd"}, {&weight, "weight"}, {&bias, "bias"}});
  const DType dt = to_dtype(dtype);
  c10::cuda::CUDAGuard guard(mean.device());
  at::Tensor out = at::empty({2, mean.size(0)}, mean.options().dtype(dtype));
  launch_scale_shift(static_cast<int>(mean.size(0)), dt, mean.const_data_ptr<float>(), invstd.const_data_ptr<float>(),
                     weight.const_data_ptr<float>(), bias.const_data_ptr<float>(), out.mutable_data_ptr(),
                     c10::cuda::getCurrentCUDAStream());
  return out;
}

// (mean, invstd, biased var) from sums [2, C] fp32 of `count` values per channel; with running_mean, running_var and
// num_batches_tracked, the running statistics updated (momentum in [0, 1]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_stats_from_sums(
    const at::Tensor& sums, int64_t count, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, const std::optional<at::Tensor>& num_batches_tracked, double eps,
    double momentum) {
  TORCH_CHECK(sums.is_cuda() && sums.dim() == 2 && sums.size(0) == 2 && sums.scalar_type() == at::kFloat &&
                  sums.is_contiguous(),
              "bn_stats_from_sums: sums must be a contiguous float32 (2, C) CUDA tensor, got ", sums.scalar_type(),
              " ", sums.sizes(), " on ", sums.device());
  TORCH_CHECK(count > 1, "bn_stats_from_sums: the unbiased variance needs more than 1 value per channel, got ", count);
  const int64_t C = sums.size(1);
  c10::cuda::CUDAGuard guard(sums.device());
  at::Tensor mean = at::empty({C}, sums.options()), invstd = at::empty({C}, sums.options()),
             var = at::empty({C}, sums.options());
  RunningUpdate update;
  const bool updating = running_mean.has_value();
  TORCH_CHECK(updating == running_var.has_value() && updating == num_batches_tracked.has_value(),
              "bn_stats_from_sums: give running_mean, running_var and num_batches_tracked together, or none");
  if (updating) {
    TORCH_CHECK(momentum >= 0, "bn_stats_from_sums: the running-statistics update needs momentum in [0, 1], got ",
                momentum);
    check_running_stats(*running_mean, *running_var, *num_batches_tracked, mean, var, momentum);
    update.running_mean = running_mean->mutable_data_ptr<float>();
    update.running_var = running_var->mutable_data_ptr<float>();
    update.num_batches_tracked = num_batches_tracked->mutable_data_ptr<int64_t>();
    update.momentum = momentum;
    update.count = count;
  }
  launch_stats_from_sums(static_cast<int>(C), sums.const_data_ptr<float>(), count, static_cast<float>(eps),
                         mean.mutable_data_ptr<float>(), invstd.mutable_data_ptr<float>(),
                         var.mutable_data_ptr<float>(), update, c10::cuda::getCurrentCUDAStream());
  return {mean, invstd, var};
}

}  // namespace
}  // namespace mbn

// x: fp32/fp16/bf16; weight, bias and the returned statistics: fp32. Returns y = relu(batch_norm(x)) in x's dtype
// and layout, the batch mean, invstd = 1 / sqrt(var + eps) and the biased variance var.
TORCH_LIBRARY(mobilenet_bn, m) {
  m.def("bn_relu_fwd(Tensor x, Tensor weight, Tensor bias, float eps) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "bn_relu_bwd(Tensor grad_y, Tensor x, Tensor weight, Tensor bias, Tensor mean, Tensor invstd) "
      "-> (Tensor, Tensor, Tensor)");
  // nn.BatchNorm2d's running-statistics update in one kernel (as torch ops it is eight small kernels per layer);
  // momentum < 0 means nn.BatchNorm2d's momentum=None (a cumulative average).
  m.def(
      "bn_update_running_stats(Tensor(a!) running_mean, Tensor(b!) running_var, Tensor(c!) num_batches_tracked, "
      "Tensor mean, Tensor var, float momentum, int count) -> ()");
  // The sync_bn building blocks (SyncCustomBatchNormReLU in mobilenet/norm.py): the fused forward split at its
  // batch statistics and the fused backward at its gradient sums, so that the ranks can combine them in between.
  // Statistics and sums are fp64 (inputs of the cross-rank combine); the per-channel inputs are fp32 as above.
  // bn_relu_bwd with its gradient sums given as partials (mobilenet_dw::depthwise_bwd_normed's sums).
  m.def(
      "bn_relu_bwd_from_sums(Tensor grad_y, Tensor x, Tensor weight, Tensor bias, Tensor mean, Tensor invstd, "
      "Tensor sums) -> (Tensor, Tensor, Tensor)");
  // bn_relu_bwd without its input-gradient pass: that pass's per-channel constants [6, C] instead, for
  // mobilenet_dw::depthwise_bwd_normed, which applies it as it loads its grad_out.
  m.def(
      "bn_relu_bwd_consts(Tensor grad_y, Tensor x, Tensor weight, Tensor bias, Tensor mean, Tensor invstd) "
      "-> (Tensor, Tensor, Tensor)");
  // bn_relu_bwd_consts with the sums given (mobilenet_dw::depthwise_bwd_normed_sums'), for
  // mobilenet_dw::depthwise_dgrad_normed.
  m.def(
      "bn_relu_bwd_consts_from_sums(Tensor x, Tensor weight, Tensor bias, Tensor mean, Tensor invstd, Tensor sums) "
      "-> (Tensor, Tensor, Tensor)");
  m.def("bn_local_stats(Tensor x) -> (Tensor, Tensor)");
  m.def("bn_relu_normalize(Tensor x, Tensor weight, Tensor bias, Tensor mean, Tensor invstd) -> Tensor");
  m.def("bn_relu_grad_sums(Tensor grad_y, Tensor x, Tensor weight, Tensor bias, Tensor mean, Tensor invstd) -> Tensor");
  m.def(
      "bn_relu_input_grad(Tensor grad_y, Tensor x, Tensor weight, Tensor bias, Tensor mean, Tensor invstd, "
      "Tensor grad_means) -> Tensor");
  m.def(
      "bn_update_running_stats_unbiased(Tensor(a!) running_mean, Tensor(b!) running_var, "
      "Tensor(c!) num_batches_tracked, Tensor mean, Tensor unbiased_var, float momentum) -> ()");
  // bn_relu_fwd that also updates the running statistics (momentum in [0, 1]) in its finalize kernel: one kernel
  // per layer less than bn_relu_fwd followed by bn_update_running_stats, with the same results bit for bit.
  m.def(
      "bn_relu_fwd_update(Tensor x, Tensor weight, Tensor bias, Tensor(a!) running_mean, Tensor(b!) running_var, "
      "Tensor(c!) num_batches_tracked, float eps, float momentum) -> (Tensor, Tensor, Tensor, Tensor)");
  // The forward with x's statistics given as per-block partials (mobilenet_dw::depthwise_fwd_stats' second
  // output): no statistics pass over x. The backward is bn_relu_bwd's.
  m.def(
      "bn_relu_fwd_from_partials(Tensor x, Tensor partials, Tensor weight, Tensor bias, float eps) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  // The forward's statistics (mean, invstd, var) without y, for norm.apply_in_depthwise: the depthwise kernel after
  // the BatchNorm normalizes x as it loads it (mobilenet_dw::depthwise_fwd_normed). The backward is bn_relu_bwd's.
  m.def("bn_stats(Tensor x, Tensor weight, Tensor bias, float eps) -> (Tensor, Tensor, Tensor)");
  m.def(
      "bn_stats_update(Tensor x, Tensor weight, Tensor bias, Tensor(a!) running_mean, Tensor(b!) running_var, "
      "Tensor(c!) num_batches_tracked, float eps, float momentum) -> (Tensor, Tensor, Tensor)");
  // norm.apply_in_pointwise (kernels/norm_pointwise.py): the per-channel operands of cuDNN's fused convolutions,
  // scale and shift in their dtype as [2, C]; and the statistics from cuDNN's genstats sums [2, C] fp32 (sum and
  // sum of squares of `count` values per channel), with the running statistics updated when given.
  m.def("bn_scale_shift(Tensor mean, Tensor invstd, Tensor weight, Tensor bias, ScalarType dtype) -> Tensor");
  m.def(
      "bn_stats_from_sums(Tensor sums, int count, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
      "Tensor(c!)? num_batches_tracked, float eps, float momentum) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mobilenet_bn, CUDA, m) {
  m.impl("bn_relu_fwd", &mbn::bn_relu_fwd);
  m.impl("bn_relu_fwd_update", &mbn::bn_relu_fwd_update);
  m.impl("bn_stats", &mbn::bn_stats);
  m.impl("bn_stats_update", &mbn::bn_stats_update);
  m.impl("bn_relu_fwd_from_partials", &mbn::bn_relu_fwd_from_partials);
  m.impl("bn_relu_bwd", &mbn::bn_relu_bwd);
  m.impl("bn_relu_bwd_consts", &mbn::bn_relu_bwd_consts);
  m.impl("bn_relu_bwd_from_sums", &mbn::bn_relu_bwd_from_sums);
  m.impl("bn_relu_bwd_consts_from_sums", &mbn::bn_relu_bwd_consts_from_sums);
  m.impl("bn_update_running_stats", &mbn::bn_update_running_stats);
  m.impl("bn_local_stats", &mbn::bn_local_stats);
  m.impl("bn_relu_normalize", &mbn::bn_relu_normalize);
  m.impl("bn_relu_grad_sums", &mbn::bn_relu_grad_sums);
  m.impl("bn_relu_input_grad", &mbn::bn_relu_input_grad);
  m.impl("bn_update_running_stats_unbiased", &mbn::bn_update_running_stats_unbiased);
  m.impl("bn_scale_shift", &mbn::bn_scale_shift);
  m.impl("bn_stats_from_sums", &mbn::bn_stats_from_sums);
}
