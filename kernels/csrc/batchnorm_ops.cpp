// Op schemas of the fused BatchNorm + ReLU (namespace mobilenet_bn) and their CUDA implementations: argument
// checks, layout handling, allocation. The kernels live in batchnorm_relu.cu.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <cstdint>
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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bn_relu_fwd(const at::Tensor& x_in, const at::Tensor& weight,
                                                                       const at::Tensor& bias, double eps) {
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
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(fmt));
  const auto stat = x.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({s.C}, stat), invstd = at::empty({s.C}, stat), var = at::empty({s.C}, stat);
  const BnPlan p = make_plan(s, dt, address(x) | address(y), num_sms(), BnPass::kForward);
  at::Tensor workspace = at::empty({static_cast<int64_t>(workspace_floats(s, p))}, stat);
  launch_forward(s, p, dt, x.const_data_ptr(), w.const_data_ptr<float>(), b.const_data_ptr<float>(),
                 static_cast<float>(eps), y.mutable_data_ptr(), mean.mutable_data_ptr<float>(),
                 invstd.mutable_data_ptr<float>(), var.mutable_data_ptr<float>(), workspace.mutable_data_ptr<float>(),
                 c10::cuda::getCurrentCUDAStream());
  return {y, mean, invstd, var};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_relu_bwd(const at::Tensor& grad_y_in, const at::Tensor& x_in,
                                                           const at::Tensor& weight, const at::Tensor& bias,
                                                           const at::Tensor& mean, const at::Tensor& invstd) {
  check_input(x_in);
  TORCH_CHECK(grad_y_in.sizes() == x_in.sizes(), "batch_norm_relu backward: grad_y ", grad_y_in.sizes(),
              " must have the input's shape ", x_in.sizes());
  TORCH_CHECK(grad_y_in.scalar_type() == x_in.scalar_type(), "batch_norm_relu backward: grad_y (",
              grad_y_in.scalar_type(), ") must have the input's dtype ", x_in.scalar_type());
  TORCH_CHECK(grad_y_in.device() == x_in.device(), "batch_norm_relu backward: grad_y must be on the input's device ",
              x_in.device());
  check_channel_vector(weight, x_in, "weight");
  check_channel_vector(bias, x_in, "bias");
  check_channel_vector(mean, x_in, "mean");
  check_channel_vector(invstd, x_in, "invstd");
  c10::cuda::CUDAGuard guard(x_in.device());
  const c10::MemoryFormat fmt = layout_of(x_in);
  const at::Tensor x = in_layout(x_in, fmt), grad_y = in_layout(grad_y_in, fmt);
  const at::Tensor w = weight.contiguous(), b = bias.contiguous(), m = mean.contiguous(), is = invstd.contiguous();
  const BnShape s = shape_of(x, fmt);
  const DType dt = to_dtype(x.scalar_type());
  at::Tensor grad_x = at::empty(x.sizes(), x.options().memory_format(fmt));
  const auto stat = x.options().dtype(at::kFloat);
  at::Tensor grad_weight = at::empty({s.C}, stat), grad_bias = at::empty({s.C}, stat);
  const BnPlan p = make_plan(s, dt, address(x) | address(grad_y) | address(grad_x), num_sms(), BnPass::kBackward);
  at::Tensor workspace = at::empty({static_cast<int64_t>(workspace_floats(s, p))}, stat);
  launch_backward(s, p, dt, grad_y.const_data_ptr(), x.const_data_ptr(), w.const_data_ptr<float>(),
                  b.const_data_ptr<float>(), m.const_data_ptr<float>(), is.const_data_ptr<float>(),
                  grad_x.mutable_data_ptr(), grad_weight.mutable_data_ptr<float>(),
                  grad_bias.mutable_data_ptr<float>(), workspace.mutable_data_ptr<float>(),
                  c10::cuda::getCurrentCUDAStream());
  return {grad_x, grad_weight, grad_bias};
}


void bn_update_running_stats(at::Tensor& running_mean, at::Tensor& running_var, at::Tensor& num_batches_tracked,
                             const at::Tensor& mean, const at::Tensor& var, double momentum, int64_t count) {
  TORCH_CHECK(mean.is_cuda() && mean.dim() == 1, "batch_norm_relu running statistics: mean must be a 1-D CUDA tensor");
  const std::pair<const at::Tensor*, const char*> vectors[] = {
      {&running_mean, "running_mean"}, {&running_var, "running_var"}, {&mean, "mean"}, {&var, "var"}};
  for (const auto& [t, name] : vectors) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == mean.size(0) && t->scalar_type() == at::kFloat &&
                    t->device() == mean.device() && t->is_contiguous(),
                "batch_norm_relu running statistics: ", name, " must be a contiguous float32 (", mean.size(0),
                ",) tensor on ", mean.device(), ", got ", t->scalar_type(), " ", t->sizes(), " on ", t->device());
  }
  TORCH_CHECK(num_batches_tracked.numel() == 1 && num_batches_tracked.scalar_type() == at::kLong &&
                  num_batches_tracked.device() == mean.device(),
              "batch_norm_relu running statistics: num_batches_tracked must be one int64 on ", mean.device());
  TORCH_CHECK(count > 1, "batch_norm_relu running statistics: the unbiased variance needs more than 1 value per "
              "channel, got ", count);
  TORCH_CHECK(momentum <= 1, "batch_norm_relu running statistics: momentum must be in [0, 1] (or negative for a "
              "cumulative average), got ", momentum);
  c10::cuda::CUDAGuard guard(mean.device());
  launch_update_running_stats(static_cast<int>(mean.size(0)), mean.const_data_ptr<float>(), var.const_data_ptr<float>(),
                              count, momentum, running_mean.mutable_data_ptr<float>(),
                              running_var.mutable_data_ptr<float>(), num_batches_tracked.mutable_data_ptr<int64_t>(),
                              c10::cuda::getCurrentCUDAStream());
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
}

TORCH_LIBRARY_IMPL(mobilenet_bn, CUDA, m) {
  m.impl("bn_relu_fwd", &mbn::bn_relu_fwd);
  m.impl("bn_relu_bwd", &mbn::bn_relu_bwd);
  m.impl("bn_update_running_stats", &mbn::bn_update_running_stats);
}
