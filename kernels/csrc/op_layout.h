// The memory layout both op families (depthwise conv, BatchNorm+ReLU) compute in and return, shared by their op
// files. Host-side ATen code: the .cu kernel files do not include it.
#pragma once

#include <ATen/core/Tensor.h>

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

}  // namespace mdw
