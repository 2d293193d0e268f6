// What both op families (depthwise conv, BatchNorm+ReLU) share in their op files: the memory layout they compute in
// and return, and the check of per-channel vectors. Host-side ATen code: the .cu kernel files do not include it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <initializer_list>
#include <utility>

namespace mdw {

// The two standard layouts are used as they are; a tensor that is neither (a slice, a permutation) is copied once
// into its suggested layout. The same rule as kernels.kernel_layout(), which the fake kernels use.
inline c10::MemoryFormat layout_of(const at::Tensor& x) {
  if (x.is_contiguous(c10::MemoryFormat::ChannelsLast) && !x.is_contiguous()) return c10::MemoryFormat::ChannelsLast;
  if (x.is_contiguous()) return c10::MemoryFormat::Contiguous;
  return x.suggest_memory_format();
}

// t in layout fmt: t itself when it already is, else one copy.
inline at::Tensor in_layout(const at::Tensor& t, c10::MemoryFormat fmt) {
  return t.is_contiguous(fmt) ? t : t.contiguous(fmt);
}

// Per-channel vectors (a BatchNorm's mean, invstd, weight, ...): each a contiguous float32 (channels,) tensor on
// `device`, else an error that starts with `what` and names the vector.
inline void check_fp32_vectors(const char* what, int64_t channels, const c10::Device& device,
                                  std::initializer_list<std::pair<const at::Tensor*, const char*>> vectors) {
  for (const auto& [t, name] : vectors) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == channels && t->scalar_type() == at::kFloat && t->device() == device &&
                    t->is_contiguous(),
                what, ": ", name, " must be a contiguous float32 (", channels, ",) tensor on ", device, ", got ",
                t->scalar_type(), " ", t->sizes(), " on ", t->device());
  }
}

}  // namespace mdw
