// The launch-shape knobs (MDW_* environment overrides of measured per-dtype defaults), the SM count and the
// images-per-block rule that launch_plan.h declares.
#include "launch_plan.h"

#include <c10/cuda/CUDAException.h>

#include <atomic>
#include <cstdlib>
#include <string>

namespace mdw {

// An attribute of the current device, cached per device in `cached` (one array per attribute).
static int device_attribute(cudaDeviceAttr attr, std::atomic<int> (&cached)[64]) {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 64 && cached[dev].load() > 0) return cached[dev].load();
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, attr, dev));
  if (dev < 64) cached[dev].store(n);
  return n;
}

int num_sms() {
  static std::atomic<int> cached[64] = {};
  return device_attribute(cudaDevAttrMultiProcessorCount, cached);
}

int max_smem_per_block_optin() {
  static std::atomic<int> cached[64] = {};
  return device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, cached);
}

int compute_capability_major() {
  static std::atomic<int> cached[64] = {};
  return device_attribute(cudaDevAttrComputeCapabilityMajor, cached);
}

static int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

namespace {
constexpr int kKnobs = static_cast<int>(Knob::kCount);
bool knob_ready[kKnobs][4];  // read from the environment since the last reload_knobs()
}  // namespace

void reload_knobs() {
  for (auto& per_dtype : knob_ready)
    for (bool& ready : per_dtype) ready = false;
}

int knob(Knob k, DType dt) {
  // Unsized, so that the static_asserts below catch a knob added to the enum without its name or default.
  static const char* names[] = {"GROUP_FASTEST", "IMAGES", "WGRAD_BLOCKS_PER_SM", "NCHW_ROWS", "WGRAD_COLUMN",
                                "FWD_COLUMN",    "FWD_COLUMN_ROWS", "COLUMN_REVERSE", "FWD_COLUMN_DEEP",
                                "FWD_COLUMN_K57", "NCHW_COLUMN_K57", "WGRAD_COLUMN_K57",
                                "WGRAD_K57_BLOCKS_PER_SM", "FWD_SMEM", "COLUMN_SECTORS", "DGRAD_COLUMN_ROWS",
                                "NCHW_COLUMN_K57_PREFETCH", "FWD_COLUMN_K57_PREFETCH", "FWD_COLUMN_PREFETCH",
                                "S2_WALK_PAIRS", "FWD_MMA", "BWD_WALK", "FWD_RING", "RING_ROWS",
                                "RING_BLOCK_ROWS", "BWD_RING", "FWD_RING_NORM", "FWD_MMA_WALK",
                                "MMA_WALK_ROWS", "MMA_WALK_CH", "MMA_WALK_IMAGES", "BWD_RING_NORM"};
  static_assert(sizeof(names) / sizeof(names[0]) == kKnobs, "one MDW_ name per launch knob (launch_plan.h)");
  static const char* suffix[] = {"F32", "F16", "BF16", "F64"};
  static int cache[kKnobs][4];
  const int ki = static_cast<int>(k), di = static_cast<int>(dt);
  if (!knob_ready[ki][di]) {
    // Defaults picked by the H200 sweeps of docs/kernel_notes.md, per dtype {F32, F16, BF16, F64}.
    static const int defaults[][4] = {
        {1, 1, 1, 1},     // GROUP_FASTEST
        {0, -6, -6, 0},   // IMAGES (0: auto, 16 blocks/SM; -6: auto, 6 blocks/SM)
        {8, 4, 4, 8},     // WGRAD_BLOCKS_PER_SM (NHWC)
        {2, 2, 2, 2},     // NCHW_ROWS (NCHW 3x3 stride 1 forward)
        {1, 1, 1, 0},     // WGRAD_COLUMN (NHWC 3x3 weight gradient: column-walking kernel)
        {2, 2, 2, 0},     // FWD_COLUMN (NHWC 3x3 column-walking forward; 2: also the stride-1 input gradient)
        {2, 0, 0, 1},     // FWD_COLUMN_ROWS (column-walking forward: output rows per lane; 0: auto, see depthwise_forward.cu)
        {1, 1, 1, 1},     // COLUMN_REVERSE (column walks: images last to first, see stencil_3x3.cuh)
        {0, 1, 1, 0},     // FWD_COLUMN_DEEP (16-bit stride-1 column walks: more steps in flight, see stencil_3x3.cuh)
        {-1, -1, -1, 0},  // FWD_COLUMN_K57 (NHWC 5x5/7x7 column walk; 2: also the stride-1 input gradient; -1: by shape)
        {-1, -1, -1, 0},  // NCHW_COLUMN_K57 (NCHW 5x5/7x7 forward down the columns; 2: also the stride-1 input
                          // gradient; -1: both by shape; fp64 not measured)
        {-1, -1, -1, 0},  // WGRAD_COLUMN_K57 (5x5/7x7 weight gradient, a kernel row per lane; bit 0 NHWC, bit 1 NCHW;
                          // -1: NHWC, and NCHW by shape, see depthwise_dispatch.cpp)
        {4, 4, 4, 4},     // WGRAD_K57_BLOCKS_PER_SM (that walk's grid)
        {-1, -1, -1, 0},  // FWD_SMEM (NHWC shared-memory tile; 2: also the stride-1 input gradient; -1: by shape)
        {1, 1, 1, 0},     // COLUMN_SECTORS (column walks' channel groups: whole 32-byte sectors where they split evenly)
        {0, 0, 0, 0},     // DGRAD_COLUMN_ROWS (stride-1 input gradient walk: 1 row x 4 steps; 0: as the forward)
        {1, 1, 1, 1},     // NCHW_COLUMN_K57_PREFETCH (NCHW 5x5/7x7 forward walk: the next step's loads first)
        {1, 1, 1, 1},     // FWD_COLUMN_K57_PREFETCH (NHWC 5x5/7x7 column walk: the next steps' loads first)
        {0, 0, 0, 0},     // FWD_COLUMN_PREFETCH (NHWC 3x3 stride-1 walks: the next steps' loads first; measured
                          // slower on MobileNetV1's layers, docs/kernels.md)
        {2, 4, 4, 2},     // S2_WALK_PAIRS (stride-2 backward walk: 2 or 4 column pairs' loads in flight; 4 measured
                          // in fp16 only, docs/kernels.md)
        {-1, -1, -1, 0},  // FWD_MMA (NHWC 16-bit stride-1 tensor-core tile; 2: also the stride-1 input gradient;
                          // -1: by shape, see depthwise_dispatch.cpp; fp32 and fp64 it never takes)
        {1, 1, 1, 0},     // BWD_WALK (NHWC 3x3 padding-1 backward: both gradients in one walk, 1 at stride 1, 2 at
                          // strides 1 and 2; the stride-2 walk, faster in fp16 only, gives an input gradient whose
                          // bits differ from norm.apply_in_depthwise's pair, so it is opt-in, docs/kernels.md; fp64
                          // has no walk)
        {-1, -1, -1, 0},  // FWD_RING (NHWC 3x3 forward from a ring of input rows filled by bulk copies; -1: by shape,
                          // see depthwise_dispatch.cpp)
        {2, 2, 2, 2},     // RING_ROWS (that kernel's output rows per lane)
        {-1, -1, -1, -1}, // RING_BLOCK_ROWS (the rings' rows per block; -1: bands per block by whole waves)
        {-1, -1, -1, -1}, // BWD_RING (the backward from rings of rows in place of the input-row walk: -1 by shape,
                          // see depthwise_dispatch.cpp)
        {0, 1, 1, 0},     // FWD_RING_NORM (the normalizing forward from the ring: +1.5% fp16 training on the H200;
                          // fp32 not measured)
        {-1, -1, -1, 0},  // FWD_MMA_WALK (NHWC 16-bit tensor-core walk down the rows; 2: also the stride-1 input
                          // gradient; -1: by shape, see depthwise_dispatch.cpp; fp32 and fp64 it never takes)
        {0, 0, 0, 0},     // MMA_WALK_ROWS (that walk's output rows per product; 0: by the row's width)
        {0, 0, 0, 0},     // MMA_WALK_CH (that walk's 8-channel products per warp; 0: 2 where possible)
        {0, 0, 0, 0},     // MMA_WALK_IMAGES (that walk's images per warp on rows of <= 8 columns; 0: by whole
                          // waves, walk_images)
        {0, 1, 1, 0},     // BWD_RING_NORM (the normalizing backward with the sums from the rings: +0.4% fp16 training
                          // on the H200, +1.4% with MBN_DEPTHWISE_BACKWARD=next_norm_ring; fp32 not measured)
    };
    static_assert(sizeof(defaults) / sizeof(defaults[0]) == kKnobs,
                  "one row of defaults per launch knob (launch_plan.h)");
    const std::string base = std::string("MDW_") + names[ki];
    int v = env_int(base.c_str(), defaults[ki][di]);
    v = env_int((base + "_" + suffix[di]).c_str(), v);
    cache[ki][di] = v;
    knob_ready[ki][di] = true;
  }
  return cache[ki][di];
}

int images_per_block(DType dt, int blocks_per_image, int N) {
  // > 0: that many; 0: auto with ~16 blocks per SM; < 0: auto with -value blocks per SM.
  const int setting = knob(Knob::kImages, dt);
  int images = setting;
  if (images <= 0) {
    const long long target = static_cast<long long>(num_sms()) * (setting < 0 ? -setting : 16);
    images = static_cast<int>((static_cast<long long>(blocks_per_image) * N + target - 1) / target);
  }
  return images < 1 ? 1 : (images > N ? N : images);
}

}  // namespace mdw
