// The weight gradient of a convolution with few input channels (MobileNetV1's stem: 3 -> 32 channels, 3x3, stride
// 2), channels_last: grad_w[k, c, kh, kw] = sum over (n, oh, ow) of grad_out[n, oh, ow, k] * x[n, ih, iw, c] with
// ih = oh * stride - pad + kh, iw = ow * stride - pad + kw.
//
// cuDNN runs this pass at several times its memory floor (3 channels give its implicit GEMMs a reduction of only
// 27 values per output pixel to tile). Here it is a reduction over output pixels of a (K x 9C) outer product:
//   - a block stages a tile of whole output rows in shared memory as fp32: grad_out's rows (its K channels, padded
//     so that LDS.128 is free of bank conflicts) and the input rows under them, zero-filled outside the image and
//     split by column parity at stride 2 (consecutive output columns then read consecutive words);
//   - warp (kg, c) owns 8 output channels and one input channel: 72 fp32 accumulators per lane, one pixel per lane
//     per step, 8 + 9 shared-memory loads for 72 FMAs;
//   - the next tile's global loads are issued into registers before the current tile is computed;
//   - blocks stride over the tiles in a fixed order, each lane's sums are added over the warp by a fixed xor tree,
//     and a second kernel adds the blocks' partials in block order: the result depends on the shape alone.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "depthwise.h"  // DType

namespace mstem {

using mdw::DType;  // F32, F16 or BF16 here

struct StemShape {
  int N, C, H, W;  // input (channels_last)
  int K, Ho, Wo;   // output channels and size
  int stride, pad;
};

constexpr int kTaps = 9;            // 3 x 3
constexpr int kChannelsPerWarp = 8; // output channels per warp
constexpr int kMaxChannelGroups = 4;  // warps along K per block: a block covers up to 32 output channels
constexpr int kInputChannels = 3;   // RGB: the one count the kernel is instantiated for

struct StemPlan {
  int rows;        // output rows per tile
  int tiles;       // N * ceil(Ho / rows)
  int blocks;      // grid.x: blocks striding over the tiles
  int k_blocks;    // grid.y: slices of 32 output channels
  int threads;     // 32 * channel groups of a block * C
  size_t smem;     // dynamic shared memory per block, bytes
  bool prefetch;   // a tile's loads fit the registers set aside for them (else loaded after the compute)
};

// The launch plan (C == 3, stride 1 or 2, K * element size a multiple of 16 bytes: the op checks these first), or
// plan.blocks == 0 when a tile of one output row needs more shared memory than `max_smem`.
StemPlan make_stem_plan(const StemShape& s, DType dt, int num_sms, size_t max_smem);
// Floats of the partials workspace: blocks * K * C * 9.
size_t stem_partial_floats(const StemShape& s, const StemPlan& p);

// grad_w: fp32 [K, C, 3, 3] contiguous; partial: stem_partial_floats() floats.
void launch_stem_weight_grad(const StemShape& s, const StemPlan& p, DType dt, const void* grad_out, const void* x,
                             float* partial, float* grad_w, cudaStream_t stream);

}  // namespace mstem
