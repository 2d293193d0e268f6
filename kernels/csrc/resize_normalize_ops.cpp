// Op schema of the loader's fused resize + mirror + normalise (namespace mobilenet_data) and its CUDA implementation:
// argument checks, the per-crop descriptor table, allocation. The kernel lives in resize_normalize.cu;
// kernels/resize_ops.py checks the arguments with messages that name the crop first (these checks are the last line)
// and holds the fake kernel.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "resize_normalize.h"

namespace mdata {
namespace {

// out[n] = normalise(mirror[n] ? flip(resize(crops[n])) : resize(crops[n])), N x 3 x size[0] x size[1] in `dtype`,
// channels_last memory if asked, else contiguous. crops: CUDA uint8 tensors (H, W, 3), contiguous, each its own size;
// mirror: N values on the CPU (nonzero: mirror), or none.
at::Tensor resize_normalize(const std::vector<at::Tensor>& crops, const std::optional<at::Tensor>& mirror,
                            at::IntArrayRef size, at::ArrayRef<double> mean, at::ArrayRef<double> std,
                            at::ScalarType dtype, bool channels_last) {
  TORCH_CHECK(!crops.empty(), "resize_normalize: no crops");
  TORCH_CHECK(crops.size() <= 65535, "resize_normalize: at most 65535 crops per call");
  TORCH_CHECK(size.size() == 2 && size[0] >= 1 && size[1] >= 1 && size[0] <= 65535 * 8 && size[1] <= (1 << 20),
              "resize_normalize: size must be two positive numbers (height, width)");
  TORCH_CHECK(mean.size() == 3 && std.size() == 3, "resize_normalize: mean and std take 3 values (R, G, B)");
  for (double s : std) TORCH_CHECK(s > 0, "resize_normalize: std must be positive");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "resize_normalize: the output dtype must be float32, float16 or bfloat16");
  const int64_t n = static_cast<int64_t>(crops.size());
  const c10::Device device = crops[0].device();
  TORCH_CHECK(device.is_cuda(), "resize_normalize: the crops must be CUDA tensors");
  at::Tensor flags;
  if (mirror.has_value()) {
    TORCH_CHECK(!mirror->is_cuda() && mirror->numel() == n,
                "resize_normalize: mirror must hold one value per crop, on the CPU");
    flags = mirror->to(at::kLong).contiguous();
  }

  at::Tensor host = at::empty({n, kDescWords}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = host.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& c = crops[i];
    TORCH_CHECK(c.device() == device, "resize_normalize: every crop must be on one CUDA device");
    TORCH_CHECK(c.scalar_type() == at::kByte && c.dim() == 3 && c.size(2) == 3 && c.is_contiguous(),
                "resize_normalize: each crop must be a contiguous uint8 (H, W, 3) tensor");
    TORCH_CHECK(c.size(0) >= 1 && c.size(1) >= 1 && c.numel() < (int64_t(1) << 31),
                "resize_normalize: each crop must have 1 to 2^31 - 1 values");
    h[i * kDescWords + 0] = reinterpret_cast<int64_t>(c.const_data_ptr());
    h[i * kDescWords + 1] = c.size(0);
    h[i * kDescWords + 2] = c.size(1);
    h[i * kDescWords + 3] = flags.defined() ? (flags.const_data_ptr<int64_t>()[i] != 0) : 0;
  }

  c10::cuda::CUDAGuard guard(device);
  // From pinned memory the copy is asynchronous; the caching host allocator keeps `host` until it has run.
  const at::Tensor desc = host.to(device, at::kLong, /*non_blocking=*/true);
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  at::Tensor out = channels_last
                       ? at::empty({n, 3, size[0], size[1]}, opts.memory_format(c10::MemoryFormat::ChannelsLast))
                       : at::empty({n, 3, size[0], size[1]}, opts);
  ResizeNormalizeArgs a{};
  a.desc = desc.const_data_ptr<int64_t>();
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
  m.def("resize_normalize(Tensor[] crops, Tensor? mirror, int[2] size, float[3] mean, float[3] std, "
        "ScalarType dtype, bool channels_last) -> Tensor");
}

// The crops' CUDA key decides the dispatch; mirror, on the CPU, does not change it.
TORCH_LIBRARY_IMPL(mobilenet_data, CUDA, m) { m.impl("resize_normalize", &mdata::resize_normalize); }
