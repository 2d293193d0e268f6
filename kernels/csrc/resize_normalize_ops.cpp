// Op schema of the loader's fused resize + mirror + normalise (namespace mobilenet_data) and its CUDA implementation:
// argument checks, allocation. The kernel lives in resize_normalize.cu;
// kernels/resize_ops.py checks the arguments with messages that name the crop first (these checks are the last line)
// and holds the fake kernel.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "resize_normalize.h"

namespace mdata {
namespace {

// The batch (N, 3, size[0], size[1]) in `dtype` from the N crops that `table` (CUDA int64, N x kDescWords,
// contiguous) lists as address, height, width and mirror flag: each a contiguous uint8 HWC RGB image on the table's
// device, alive until the kernel has run. channels_last memory if asked, else contiguous. The addresses cannot be
// checked here: kernels/resize_ops.py builds tables from tensors, or from a DALI batch it keeps alive.
at::Tensor resize_normalize(const at::Tensor& table, at::IntArrayRef size, at::ArrayRef<double> mean,
                            at::ArrayRef<double> std, at::ScalarType dtype, bool channels_last) {
  TORCH_CHECK(table.is_cuda() && table.scalar_type() == at::kLong && table.dim() == 2 &&
                  table.size(1) == kDescWords && table.is_contiguous(),
              "resize_normalize: the crop table must be a contiguous CUDA int64 tensor of shape (N, 4)");
  const int64_t n = table.size(0);
  TORCH_CHECK(n >= 1 && n <= 65535, "resize_normalize: 1 to 65535 crops per call");
  TORCH_CHECK(size.size() == 2 && size[0] >= 1 && size[1] >= 1 && size[0] <= 65535 * 8 && size[1] <= (1 << 20),
              "resize_normalize: size must be two positive numbers (height, width)");
  TORCH_CHECK(mean.size() == 3 && std.size() == 3, "resize_normalize: mean and std take 3 values (R, G, B)");
  for (double s : std) TORCH_CHECK(s > 0, "resize_normalize: std must be positive");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "resize_normalize: the output dtype must be float32, float16 or bfloat16");

  c10::cuda::CUDAGuard guard(table.device());
  const auto opts = at::TensorOptions().dtype(dtype).device(table.device());
  at::Tensor out = channels_last
                       ? at::empty({n, 3, size[0], size[1]}, opts.memory_format(c10::MemoryFormat::ChannelsLast))
                       : at::empty({n, 3, size[0], size[1]}, opts);
  ResizeNormalizeArgs a{};
  a.desc = table.const_data_ptr<int64_t>();
  a.out = out.data_ptr();
  a.n = static_cast<int>(n);
  a.out_h = static_cast<int>(size[0]);
  a.out_w = static_cast<int>(size[1]);
  a.nhwc = channels_last;
  for (int c = 0; c < 3; ++c) {
    a.scale[c] = static_cast<float>(1.0 / (255.0 * std[c]));
    a.shift[c] = static_cast<float>(-mean[c] / std[c]);
  }
  const DType dt = dtype == at::kFloat ? DType::F32 : dtype == at::kHalf ? DType::F16 : DType::BF16;
  launch_resize_normalize(a, dt, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace mdata

TORCH_LIBRARY(mobilenet_data, m) {
  m.def("resize_normalize(Tensor table, int[2] size, float[3] mean, float[3] std, ScalarType dtype, "
        "bool channels_last) -> Tensor");
}

TORCH_LIBRARY_IMPL(mobilenet_data, CUDA, m) { m.impl("resize_normalize", &mdata::resize_normalize); }
