// The training loader's last step on the GPU, in one pass: every decoded random crop (uint8 HWC RGB, its own size)
// resized to the batch's size with an antialiased bilinear (triangle) filter, mirrored where asked, normalised
// ((v / 255 - mean) / std) and written in the run's dtype and memory format.
//
// The filter is PyTorch's (F.interpolate(mode="bilinear", antialias=True, align_corners=False)): output pixel i of an
// axis scaled by s = in / out is centred at s * (i + 0.5) and weighs the inputs j within max(s, 1) of it by
// 1 - |(j + 0.5 - centre) / max(s, 1)|, normalised over the window, which is clipped to the image.
//
// One pass: the crop is read once and nothing in between is written to global memory, where a separable resize
// writes and reads an intermediate image and a separate normalisation reads the resized batch again
// (resize_normalize.cu says how a block computes its tile).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "depthwise.h"  // DType

namespace mdata {

using mdw::DType;  // F32, F16 or BF16 here

constexpr int kDescWords = 4;  // per crop in the crop table (int64): address, height, width, mirror (0 or 1)

struct ResizeNormalizeArgs {
  const int64_t* desc;  // the crop table, on the device: kDescWords per crop
  void* out;            // N x 3 x out_h x out_w, NCHW or NHWC memory
  int n, out_h, out_w;
  bool nhwc;
  float scale[3];  // 1 / (255 * std[c])
  float shift[3];  // -mean[c] / std[c]
};

void launch_resize_normalize(const ResizeNormalizeArgs& a, DType dt, cudaStream_t stream);

}  // namespace mdata
