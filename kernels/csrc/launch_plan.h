// Host-side launch planning shared by the pass files (depthwise_*.cu) and the dispatch (depthwise_dispatch.cpp):
// how a block's lanes cover a tile, the measured launch-shape knobs, the SM count and the per-dtype vector widths.
// No device code; device_common.h decodes the Tiling on the device side.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "depthwise.h"

namespace mdw {

// How a block's lanes cover an output (or input, for dgrad) tile.
//   NHWC: lane = cv + lanes_c * (sx + sx_n * sy); cv picks a vector of V channels, so a warp reads
//         lanes_c*V contiguous channels of a few neighbouring pixels.
//   NCHW: lane = sx + sx_n * (sy + sy_n * q); sx runs along the row for coalescing, q picks the plane.
// Each (sx, sy) lane computes `tw` consecutive columns of one row.
struct Tiling {
  int lanes_c;   // NHWC: channel vectors per block; NCHW: planes per block
  int sx_n;      // strips per tile row
  int sy_n;      // rows per tile
  int tiles_h;   // tiles along the rows
  int tiles_w;   // tiles along the strips
  int groups;    // NHWC: channel groups; NCHW: plane groups
  int strip0;    // first strip index (dgrad starts its strips at padding/tw)
  int threads;   // lanes_c * sx_n * sy_n
  int block;     // threads rounded up to whole warps
  int images;    // NHWC forward/dgrad: images each block loops over (amortises its weight staging)
  int group_fastest;     // NHWC forward/dgrad: channel group is the fastest-varying block index
  int blocks_per_group;  // NHWC forward/dgrad: blocks of one channel group
  int reverse;           // column walks: bands of rows from the last image to the first (COLUMN_REVERSE)
};

inline int ceil_div(long long a, long long b) { return static_cast<int>((a + b - 1) / b); }

inline int floor_pow2(int v) {
  int p = 1;
  while (p * 2 <= v) p *= 2;
  return p;
}

// rows x strips to cover; `units` = channel vectors (NHWC) or planes (NCHW). NHWC: at most max_strips_c
// strips per tile row (0: as many as the block's spatial lanes take, i.e. whole rows of strips).
inline Tiling make_tiling(bool channels_last, int rows, int strip0, int strips, int units, int max_lanes_c = 8,
                          int max_strips_c = 4) {
  Tiling t{};
  t.strip0 = strip0;
  if (channels_last) {
    // max_lanes_c vectors = one 128-byte line of channels per pixel; the other lanes take a 2-D
    // patch of pixels so that neighbouring lanes share input rows and columns through L1.
    t.lanes_c = floor_pow2(units < max_lanes_c ? units : max_lanes_c);
    const int spatial = 256 / t.lanes_c;
    const int max_sx = max_strips_c > 0 ? max_strips_c : spatial;
    t.sx_n = strips < max_sx ? strips : max_sx;
    t.sy_n = spatial / t.sx_n;
    if (t.sy_n > rows) t.sy_n = rows;
    t.groups = ceil_div(units, t.lanes_c);
  } else {
    t.sx_n = strips < 32 ? strips : 32;
    t.sy_n = 256 / t.sx_n;
    if (t.sy_n > rows) t.sy_n = rows;
    t.lanes_c = 256 / (t.sx_n * t.sy_n);
    if (t.lanes_c > units) t.lanes_c = units;
    if (t.lanes_c < 1) t.lanes_c = 1;
    t.groups = ceil_div(units, t.lanes_c);
  }
  t.tiles_h = ceil_div(rows, t.sy_n);
  t.tiles_w = ceil_div(strips, t.sx_n);
  // Same number of tiles, no more idle lanes than needed (14 rows: 2 tiles of 7, not 8 + 6).
  t.sy_n = ceil_div(rows, t.tiles_h);
  t.sx_n = ceil_div(strips, t.tiles_w);
  if (!channels_last) {
    t.lanes_c = 256 / (t.sx_n * t.sy_n);
    if (t.lanes_c > units) t.lanes_c = units;
    if (t.lanes_c < 1) t.lanes_c = 1;
    t.groups = ceil_div(units, t.lanes_c);
  }
  t.threads = t.lanes_c * t.sx_n * t.sy_n;
  t.block = ceil_div(t.threads, 32) * 32;
  t.images = 1;
  t.group_fastest = 1;
  t.blocks_per_group = 0;
  return t;
}

int num_sms();  // of the current device, cached
int max_smem_per_block_optin();  // bytes of shared memory a block may opt in to on the current device, cached
int compute_capability_major();  // of the current device, cached

// The work per grid unit, 1..max_work, whose grid takes least time in whole waves of `resident` units: ceil(units(work)
// / resident) * (work + fixed), `fixed` a unit's cost besides its work (its start and drain) in the same measure; the
// smallest such work on ties. units(work): the grid's units (warps, blocks) at that work per unit.
template <class Units>
int work_by_waves(int max_work, long long resident, float fixed, Units units) {
  int best = 1;
  float best_t = 0.f;
  for (int work = 1; work <= max_work; ++work) {
    const long long waves = (units(work) + resident - 1) / resident;
    const float t = static_cast<float>(waves) * (static_cast<float>(work) + fixed);
    if (work == 1 || t < best_t) best = work, best_t = t;
  }
  return best;
}

// Above 48 KB of dynamic shared memory a kernel must opt in, once per kernel and device: to `bytes`, the most any
// launch of it asks for. `opted` (a static of the caller, one per kernel instantiation) remembers the devices done.
template <class Kernel>
void opt_in_shared_memory(Kernel kernel, int bytes, std::atomic<uint64_t>& opted) {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = uint64_t(1) << (dev % 64);
  if (!(opted.load() & bit)) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    opted.fetch_or(bit);
  }
}

// Lanes per block of the ring kernels (depthwise_ring.cu): one per channel word and row group, 2 blocks per SM; the
// dispatch's rule for the ring counts the lanes a layer's channel words leave idle.
constexpr int kRingLanes = 256;

// Blocks of the generic kernels' grid-stride loops: one element per thread, at most 32 blocks per SM.
inline int grid_for(long long total, int block) {
  const long long want = (total + block - 1) / block;
  const long long cap = static_cast<long long>(num_sms()) * 32;
  return static_cast<int>(want < cap ? (want > 0 ? want : 1) : cap);
}

// Compile-time strip width (outputs per lane along a row) for the tiled kernels.
template <int K, int S>
struct StripWidth {
  static constexpr int value = K <= 3 ? 4 : (K == 5 && S == 1 ? 4 : 2);
};

// Channels per lane in the NHWC forward/dgrad kernels: one 16-byte vector (4 fp32, 8 fp16/bf16).
// 8-byte vectors of 16-bit data (more lanes, fewer registers) measured slower (docs/kernel_notes.md).
template <typename S>
struct NhwcVec {
  static constexpr int value = 16 / sizeof(S);
};
inline int nhwc_vec(DType dt) { return dt == DType::F32 ? 4 : 8; }

// Channels per lane in the tiled NHWC weight-gradient kernel: K*K*V fp32 accumulators must fit in registers
// next to the loads.
template <int K>
struct WgradVec {
  static constexpr int value = K == 3 ? 4 : (K == 5 ? 2 : 1);
};
inline int wgrad_vec(int k) { return k == 3 ? 4 : (k == 5 ? 2 : 1); }

// Launch-shape knobs, per dtype, with measured defaults; MDW_<NAME>_<F32|F16|BF16> or MDW_<NAME>
// override them (used by the benchmark sweeps that picked the defaults).
enum class Knob {
  kGroupFastest, kImages, kWgradBlocksPerSm, kNchwRows,
  kWgradColumn,  // NHWC 3x3 weight gradient through the column-walking kernel
  kFwdColumn,    // NHWC 3x3 column-walking forward (1), and the stride-1 input gradient too (2)
  kFwdColumnRows,  // column-walking forward: output rows per lane (1 or 2; 0: by shape, see depthwise_forward.cu)
  kColumnReverse,  // column-walking forward/input gradient: blocks walk the images last to first (1) or first to last (0)
  kFwdColumnDeep,  // 16-bit stride-1 column walks: twice the steps in flight at 3 blocks per SM (1) or not (0)
  kFwdColumnK57,   // NHWC 5x5/7x7 column-walking forward (1), and the stride-1 input gradient too (2); 0: tiled;
                   // -1: by shape (depthwise_dispatch.cpp)
  kNchwColumnK57,  // NCHW 5x5/7x7 forward walking down the columns (1), and the stride-1 input gradient too (2);
                   // 0: tiled; -1: both by shape
  kWgradColumnK57,       // 5x5/7x7 weight gradient with a kernel row per lane (bit 0: NHWC column walk, bit 1: NCHW
                         // strips) or tiled (bit clear); -1: NHWC, and NCHW by shape
  kWgradK57BlocksPerSm,  // that walk's blocks per SM (its grid; each block a contiguous run of rows)
  kFwdSmem,  // NHWC 3x3/5x5/7x7 shared-memory tile (depthwise_smem.cu): forward (1), and the stride-1 input gradient
             // too (2); 0: off; -1: by shape (depthwise_dispatch.cpp)
  kColumnSectors,   // column walks: channel groups of whole 32-byte sectors where they split evenly (1) or balanced
                    // groups (0) (column_tiling)
  kDgradColumnRows, // NHWC 3x3 stride-1 input gradient's walk: one row x 4 steps per lane (1) or the forward's choice
                    // of rows and steps (0: FWD_COLUMN_ROWS, FWD_COLUMN_DEEP; see input_grad_nhwc_column)
  kNchwColumnK57Prefetch,  // NCHW 5x5/7x7 stride-1 forward walk: the next step's loads issued before this step's
                           // FMAs (1) or after them (0) (depthwise_k57.cu)
  kFwdColumnK57Prefetch,   // NHWC 5x5/7x7 column walk (forward and input gradient): the next steps' loads issued
                           // before these steps' FMAs (1) or after them (0) (stencil_column_k57.cuh)
  kFwdColumnPrefetch,      // NHWC 3x3 stride-1 column walks: the next steps' loads issued first, at 3 blocks per SM,
                           // in place of FWD_COLUMN_DEEP (1) or not (0) (column_walk, stencil_3x3.cuh)
  kS2WalkPairs,  // the stride-2 normalizing backward walk: column pairs whose loads are issued together (2 or 4;
                 // 4 for 16-bit, 2 for fp32, where 4 was not measured)
  kFwdMma,  // NHWC 16-bit 3x3/5x5/7x7 stride-1 tensor-core tile (depthwise_mma.cu): forward (1), and the stride-1
            // input gradient too (2); 0: off; -1: by shape (depthwise_dispatch.cpp)
  kBwdWalk,  // NHWC 3x3 padding-1 backward: both gradients in one input-row walk at stride 1 (1), at strides 1 and 2
             // (2), or the input gradient's and weight gradient's kernels one after the other (0)
             // (depthwise_dispatch.cpp)
  kFwdRing,       // NHWC 3x3 forward fed by bulk copies into a ring of input rows (depthwise_ring.cu): 1 on where it
                  // fits, 0 off, -1 by shape (depthwise_dispatch.cpp)
  kRingRows,      // that kernel's output rows per lane (1 or 2)
  kRingBlockRows, // that kernel's output rows per block (rounded to whole bands; 0: the whole image; -1: bands per
                  // block by whole waves, ring_bands in depthwise_ring.cu), and the backward ring's input rows
  kBwdRing,       // NHWC 3x3 stride-1 padding-1 backward from rings of grad_out and x rows (depthwise_ring.cu) in
                  // place of the input-row walk: 1 where it fits, 0 never, -1 by shape (depthwise_dispatch.cpp)
  kFwdRingNorm,   // norm.apply_in_depthwise's forward from the ring where FWD_RING takes the plain forward (1) or
                  // the normalizing column walk (0)
  kFwdMmaWalk,    // NHWC 16-bit forward on the tensor cores walking down the rows (depthwise_mma_walk.cu): forward
                  // (1), and the stride-1 input gradient too (2); 0: off; -1: by shape (depthwise_dispatch.cpp)
  kMmaWalkRows,   // that walk's output rows per product: 1 (16 columns) or 2 (8 columns); 0: 2 on rows of <= 8 columns
  kMmaWalkCh,     // that walk's channels per warp: 1 (8) or 2 (16, two products per pixel); 0: 16 where C and
                  // K <= 5 allow
  kMmaWalkImages, // that walk's images per warp on rows of <= 8 columns (the weights loaded once for them); 0: by
                  // whole waves of resident warps (walk_images, depthwise_mma_walk.cu)
  kBwdRingNorm,   // norm.apply_in_depthwise's stride-1 backward with the BatchNorm's sums from the backward's rings
                  // (depthwise_ring.cu) where BWD_RING takes the plain backward (1), or the input-row walk (0)
  kCount
};
int knob(Knob k, DType dt);
// Makes knob() read the environment again at its next call (the benchmark's in-process A/B of a knob).
void reload_knobs();
// Images each NHWC forward/dgrad block loops over (amortises its weight staging).
int images_per_block(DType dt, int blocks_per_image, int N);
// Lanes along the channels: one 128-byte line per pixel.
inline int nhwc_lanes_c(int vec, int elem_bytes) { return 128 / (vec * elem_bytes); }

inline int elem_size(DType dt) {
  return dt == DType::F64 ? 8 : (dt == DType::F32 ? 4 : 2);
}

inline bool aligned(const void* p, size_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

// The stride-1 input gradient as a forward convolution: grad_input = conv(grad_out, rot180(w), stride 1,
// padding K - 1 - P), i.e. the shape whose input is grad_out (OH x OW) and whose output is grad_input (H x W).
inline ConvShape input_grad_as_forward(const ConvShape& s) {
  ConvShape f = s;
  f.H = s.OH;
  f.W = s.OW;
  f.OH = s.H;
  f.OW = s.W;
  f.PH = s.KH - 1 - s.PH;
  f.PW = s.KW - 1 - s.PW;
  return f;
}

// The generic kernels' host-side switch over every dtype, fp64 included.
#define MDW_DISPATCH(dt, FN, ...)                               \
  switch (dt) {                                                 \
    case DType::F32: return FN<F32T>(__VA_ARGS__);              \
    case DType::F16: return FN<F16T>(__VA_ARGS__);              \
    case DType::BF16: return FN<BF16T>(__VA_ARGS__);            \
    case DType::F64: return FN<F64T>(__VA_ARGS__);              \
  }

}  // namespace mdw
