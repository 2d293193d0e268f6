// Op schema of the stem convolution's weight gradient (namespace mobilenet_stem) and its CUDA implementation:
// argument checks, allocation. The kernels live in stem_weight_grad.cu; kernels/stem_ops.py checks the arguments
// with messages that name the shapes first (these checks are the last line), and holds the fake kernel and autograd.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "launch_plan.h"
#include "stem_weight_grad.h"

namespace mstem {
namespace {

bool channels_last(const at::Tensor& t) { return t.is_contiguous(c10::MemoryFormat::ChannelsLast); }

// grad_w[k, c, kh, kw] (fp32, contiguous) of y = conv2d(x, w, stride, padding), 3x3 kernel, dilation 1, groups 1,
// from grad_out = dL/dy. x and grad_out channels_last, of one dtype.
at::Tensor conv3x3_weight_grad(const at::Tensor& grad_out, const at::Tensor& x, at::IntArrayRef stride,
                               at::IntArrayRef padding) {
  TORCH_CHECK(x.dim() == 4 && grad_out.dim() == 4, "conv3x3_weight_grad: x and grad_out must be 4-D");
  TORCH_CHECK(x.is_cuda() && grad_out.is_cuda() && x.device() == grad_out.device(),
              "conv3x3_weight_grad: x and grad_out must be CUDA tensors on one device");
  TORCH_CHECK(x.scalar_type() == grad_out.scalar_type(), "conv3x3_weight_grad: x and grad_out must share a dtype");
  const c10::ScalarType t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16,
              "conv3x3_weight_grad: float32, float16 or bfloat16 tensors only");
  const DType dt = t == at::kFloat ? DType::F32 : t == at::kHalf ? DType::F16 : DType::BF16;
  TORCH_CHECK(channels_last(x) && channels_last(grad_out),
              "conv3x3_weight_grad: x and grad_out must be channels_last");
  TORCH_CHECK(x.size(1) == kInputChannels, "conv3x3_weight_grad: x must have 3 channels");
  TORCH_CHECK(stride.size() == 2 && padding.size() == 2 && stride[0] == stride[1] && padding[0] == padding[1],
              "conv3x3_weight_grad: stride and padding must be equal pairs");
  TORCH_CHECK(stride[0] == 1 || stride[0] == 2, "conv3x3_weight_grad: stride must be 1 or 2");
  TORCH_CHECK(padding[0] >= 0 && padding[0] <= 2, "conv3x3_weight_grad: padding must be 0, 1 or 2");
  StemShape s{};
  s.N = static_cast<int>(x.size(0));
  s.C = static_cast<int>(x.size(1));
  s.H = static_cast<int>(x.size(2));
  s.W = static_cast<int>(x.size(3));
  s.K = static_cast<int>(grad_out.size(1));
  s.stride = static_cast<int>(stride[0]);
  s.pad = static_cast<int>(padding[0]);
  s.Ho = (s.H + 2 * s.pad - 3) / s.stride + 1;
  s.Wo = (s.W + 2 * s.pad - 3) / s.stride + 1;
  TORCH_CHECK(s.H + 2 * s.pad >= 3 && s.W + 2 * s.pad >= 3 && grad_out.size(0) == s.N && grad_out.size(2) == s.Ho &&
                  grad_out.size(3) == s.Wo,
              "conv3x3_weight_grad: grad_out's shape is not the convolution's output shape");
  const int elem = dt == DType::F32 ? 4 : 2;
  TORCH_CHECK(s.K >= 1 && (s.K * elem) % 16 == 0,
              "conv3x3_weight_grad: grad_out's channels must fill whole 16-byte vectors");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(grad_out.const_data_ptr()) % 16 == 0,
              "conv3x3_weight_grad: grad_out must be 16-byte aligned");
  TORCH_CHECK(x.numel() < (int64_t(1) << 31) && grad_out.numel() < (int64_t(1) << 31),
              "conv3x3_weight_grad: tensors of 2^31 or more elements are not supported");

  c10::cuda::CUDAGuard guard(x.device());
  const StemPlan p = make_stem_plan(s, dt, mdw::num_sms(), static_cast<size_t>(mdw::max_smem_per_block_optin()));
  TORCH_CHECK(p.blocks > 0, "conv3x3_weight_grad: one output row of this width needs more shared memory than the "
              "GPU has per block");
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor grad_w = at::empty({s.K, s.C, 3, 3}, f32);
  at::Tensor partial = at::empty({static_cast<int64_t>(stem_partial_floats(s, p))}, f32);
  launch_stem_weight_grad(s, p, dt, grad_out.const_data_ptr(), x.const_data_ptr(), partial.data_ptr<float>(),
                          grad_w.data_ptr<float>(), c10::cuda::getCurrentCUDAStream());
  return grad_w;
}

}  // namespace
}  // namespace mstem

TORCH_LIBRARY(mobilenet_stem, m) {
  m.def("conv3x3_weight_grad(Tensor grad_out, Tensor x, int[2] stride, int[2] padding) -> Tensor");
}

TORCH_LIBRARY_IMPL(mobilenet_stem, CUDA, m) { m.impl("conv3x3_weight_grad", &mstem::conv3x3_weight_grad); }
