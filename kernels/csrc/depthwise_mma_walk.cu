// The NHWC 16-bit forward (and stride-1 input gradient) on the tensor cores, walking down the output rows
// (FWD_MMA_WALK).
//
// A depthwise convolution sums over no channel, yet one tensor-core product can carry it when the channels are its
// N dimension and the taps part of its K dimension. With M = 16 output pixels, N = 8 channels and K = two taps x the
// same 8 channels, B holds the two taps' weights on its two diagonals and zeros elsewhere:
//   out[m][c] += sum_{j < 2, c' < 8} x[pixel(m) + tap_j][c'] * B[8 j + c'][c],  B[8 j + c'][c] = w[c][tap_j] if c' == c
// so one m16n8k16 mma.sync does 256 useful multiply-adds (an eighth of its lanes' work) where an FFMA instruction
// does 32, and takes the 16-bit inputs as they are, with no widening. A kernel row of K taps is (K - 1) / 2 such
// products and one m16n8k8 for the odd tap. An A row is 8 channels of one NHWC pixel, 16 contiguous bytes: one
// ldmatrix row, so the input needs no transposition (the tensor-core tile of depthwise_mma.cu, which transposed its
// tile into per-channel planes, spent more issue slots on the copies than the products saved).
//
// A warp owns 16 output pixels (P = 1: 16 columns of one row; P = 2, for rows of at most 8 columns: 8 columns of
// two rows) x 8 * CH channels of one image, and walks down the rows. It copies each input row its pixels read (with
// the halo) once, by cp.async, into a ring of its own in shared memory, two steps before the products use it (no
// block barrier: cp.async.wait_group and __syncwarp); the row's A fragments, read by ldmatrix, enter the products of
// every open output row they reach, kernel row kh = the row's offset in that output's window, the fp32 sums of the
// (K - 1) / (P * S) + 1 open rows held in C fragments (the column walk of stencil_column_k57.cuh turned by 90
// degrees). CH = 2: two products per pixel, channels 0-7 and 8-15 of a 16-channel group, so that a row's copy moves
// whole 32-byte sectors. Copy, read and store offsets are running sums: recomputing 64-bit addresses each step cost
// more issue slots than the products (docs/kernels.md, "The tensor-core walk").
//
// Zero weights multiply the other channels of a group: a NaN or an infinity in the input makes NaN in the outputs of
// the other channels of its group that it reaches (0 x inf), where F.conv2d keeps it to its own channel. Finite
// inputs give the exact products summed in fp32 (in the tensor core's order); deterministic.
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <type_traits>

#include "depthwise_launchers.h"
#include "device_common.h"
#include "launch_plan.h"
#include "mma_sync.cuh"

namespace mdw {
namespace {

constexpr int kWalkThreads = 128;  // 4 warps: consecutive channel groups of the same pixels

struct MmaWalkPlan {
  int groups;       // channel groups of 8 * CH channels
  int colsegs;      // segments of 16 / P output columns
  int tiles;        // row tiles: OH (P = 1) or ceil(OH / 2) (P = 2)
  int seg_tiles;    // row tiles per warp
  int segs;         // ceil(tiles / seg_tiles)
  int images;       // images per warp, walked one after the other with the same weights in registers
  long long warps;  // ceil(N / images) * colsegs * segs * groups
};

// What a warp keeps in shared memory: a ring of input rows, each the span of input pixels its 16 / P output columns
// read (with the halo), as CH planes of 16-byte pixels (8 channels each: one ldmatrix row), filled by cp.async
// kAhead steps before the products read them. P = 2 also keeps the S rows before a step's (its products' rows m < 8).
template <int K, int S, int P, int CH>
struct WalkRing {
  static constexpr int kSS = P * S;                // input rows one step brings
  static constexpr int kOpen = (K - 1) / kSS + 1;  // output row tiles open at once (NO)
  static constexpr int kLead = P == 2 ? S : 0;     // rows an image's first step brings before its kSS
  static constexpr int kPixels = (16 / P - 1) * S + K;
  static constexpr int kPlaneBytes = kPixels * 16;
  static constexpr int kRowBytes = kPlaneBytes * CH;
  static constexpr int kAhead = 2;
  // A step reads its kSS rows (P = 2: and the S before them) while the next kAhead steps' copies are in flight; the
  // copies run on into the next image, whose first step also brings its kLead rows. Two image starts are never in
  // flight at once: every walk of several images per warp has at least two steps per image (kOpen >= 2).
  static constexpr int kNeed = (kAhead + 1) * kSS + 2 * kLead;
  static constexpr int kSlots = kNeed <= 4 ? 4 : (kNeed <= 8 ? 8 : 16);
  static constexpr int kWarpBytes = kSlots * kRowBytes;
  static constexpr int kChunks = kPixels * CH;  // 16-byte copies per row
  static constexpr int kChunksPerLane = (kChunks + 31) / 32;
};

// FLIP: the kernel rotated 180 degrees, no bias and no activation (the stride-1 input gradient on
// input_grad_as_forward's shape, grad_out as the input). ACT: s.act is not kActNone (without it, no instruction of
// the activation is issued).
template <class TT, int K, int S, int P, int CH, bool FLIP, bool ACT>
__global__ void __launch_bounds__(kWalkThreads)
    fwd_nhwc_mma_walk_kernel(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                             const uint16_t* __restrict__ bias, uint32_t* __restrict__ y, ConvShape s,
                             MmaWalkPlan p) {
  using Ring = WalkRing<K, S, P, CH>;
  constexpr int KK = K * K;
  constexpr int SS = Ring::kSS;
  constexpr int NO = Ring::kOpen;
  extern __shared__ __align__(16) unsigned char walk_smem[];
  const int lane = threadIdx.x & 31;
  const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (warp >= p.warps) return;
  long long rest = warp;
  const int group = static_cast<int>(rest % p.groups);
  rest /= p.groups;
  const int seg = static_cast<int>(rest % p.segs);
  rest /= p.segs;
  const int colseg = static_cast<int>(rest % p.colsegs);
  const int n_first = static_cast<int>(rest / p.colsegs) * p.images;  // the warp's images: n_first, + 1, ...
  const int g = lane >> 2, t = lane & 3;
  const int cb = group * 8 * CH;  // the group's first channel

  // B: the lane holds column n = g of each product's B, rows k = 2t, 2t + 1 (and + 8); channel(k) == channel(g) only
  // on the lanes with t == g / 2, in the low half for even g.
  uint32_t b[CH][KK];
  float bias_v[CH][2];
  {
    const bool diag = t == (g >> 1);
    const int shift = (g & 1) * 16;
#pragma unroll
    for (int h = 0; h < CH; ++h) {
      const int cn = cb + 8 * h + g;
#pragma unroll
      for (int k = 0; k < KK; ++k)
        b[h][k] = diag ? static_cast<uint32_t>(__ldg(w + cn * KK + (FLIP ? KK - 1 - k : k))) << shift : 0u;
#pragma unroll
      for (int e = 0; e < 2; ++e)
        bias_v[h][e] = !FLIP && bias != nullptr ? TT::to_acc(__ldg(bias + cb + 8 * h + 2 * t + e)) : 0.f;
    }
  }

  // The weights above serve p.images images (P = 2, whose walks are short), walked one after the other. The copies
  // run on across them: the next image's first rows are in flight while this one's last steps compute, so a short
  // walk does not wait a whole memory latency at each image's start.
  const int n_end = P == 2 ? min(s.N, n_first + p.images) : n_first + 1;

  // Tile tt's output rows: tt (P = 1) or 2 tt and 2 tt + 1 (P = 2). Its window of input rows, as the rows of the A
  // rows m >= 8: base(tt) .. base(tt) + K - 1. Step tt brings rows base(tt) + K - SS + d, d < SS; row d enters tile
  // tt + j through kernel row K - SS + d - j * SS. An image's rows are copied in order from ih_start on (P = 2: the S
  // rows before step t_first's first, with that step), one ring slot after the other, image after image.
  const int t_begin = seg * p.seg_tiles;
  const int t_end = min(p.tiles, t_begin + p.seg_tiles);
  const int t_first = t_begin - (NO - 1);  // the first NO - 1 steps only open sums
  constexpr int kLead = Ring::kLead;
  const int step_ih0 = t_first * SS + (P - 1) * S - s.PH + K - SS;  // step t_first's first row
  const int ih_start = step_ih0 - kLead;
  const int image_rows = kLead + (t_end - t_first) * SS;  // rows copied per image

  // The lane's copies: chunk c of a row is pixel c / CH's plane c % CH (lanes side by side read a pixel's bytes);
  // each keeps its element offset in x, advanced by a row per copy and to the next image's first row after the last.
  const int ow0 = colseg * (16 / P);
  const int ic0 = ow0 * S - s.PW;  // the ring's first input column
  const unsigned ring = static_cast<unsigned>(__cvta_generic_to_shared(walk_smem)) +
                        static_cast<unsigned>((threadIdx.x >> 5) * Ring::kWarpBytes);
  const long long row_elems = static_cast<long long>(s.W) * s.C;
  const long long next_image_elems = (static_cast<long long>(s.H) - image_rows) * row_elems;
  long long cp_off[Ring::kChunksPerLane];
  unsigned chunk_dst[Ring::kChunksPerLane];
  unsigned chunk_in = 0;  // bit i: chunk i is a copy (inside the row's columns); else zeros
#pragma unroll
  for (int i = 0; i < Ring::kChunksPerLane; ++i) {
    const int c = lane + 32 * i;
    const int px = c / CH, h = c % CH;
    const int ic = ic0 + px;
    cp_off[i] = (static_cast<long long>(n_first) * s.H + ih_start) * row_elems + ic * s.C + cb + 8 * h;
    chunk_dst[i] = static_cast<unsigned>(h * Ring::kPlaneBytes + px * 16);
    if (c < Ring::kChunks && ic >= 0 && ic < s.W) chunk_in |= 1u << i;
  }
  int cp_ih = ih_start, cp_slot = 0, cp_tt = t_first, cp_n = n_first;
  auto copy_next_row = [&]() {
    const bool row_in = static_cast<unsigned>(cp_ih) < static_cast<unsigned>(s.H);
    const unsigned dst = ring + static_cast<unsigned>(cp_slot * Ring::kRowBytes);
#pragma unroll
    for (int i = 0; i < Ring::kChunksPerLane; ++i) {
      if (Ring::kChunks % 32 == 0 || i + 1 < Ring::kChunksPerLane || lane + 32 * i < Ring::kChunks) {
        const bool in = row_in && (chunk_in >> i & 1u);
        cp_async16(dst + chunk_dst[i], in ? x + cp_off[i] : x, in);
      }
      cp_off[i] += row_elems;
    }
    ++cp_ih;
    cp_slot = (cp_slot + 1) & (Ring::kSlots - 1);
  };
  // The next step's rows in the copy order (an image's first step also brings its kLead rows); one commit group each.
  auto copy_step = [&]() {
    if (cp_n < n_end) {
      if (cp_tt == t_first) {
#pragma unroll
        for (int d = 0; d < kLead; ++d) copy_next_row();
      }
#pragma unroll
      for (int d = 0; d < SS; ++d) copy_next_row();
      if (++cp_tt == t_end) {
        cp_tt = t_first;
        cp_ih = ih_start;
        ++cp_n;
#pragma unroll
        for (int i = 0; i < Ring::kChunksPerLane; ++i) cp_off[i] += next_image_elems;
      }
    }
    cp_async_commit();
  };

  // ldmatrix rows: lane = 8 q + i gives row i of matrix q. P = 1: matrices (m < 8, tap kw), (m >= 8, kw), (m < 8,
  // kw + 1), (m >= 8, kw + 1), pixel m * S + tap; P = 2: m = i in both halves, whose rows are S apart (the lanes of
  // the halves m < 8 read the row S slots back).
  const int q = lane >> 3, i8 = lane & 7;
  const unsigned lane_px_off =
      static_cast<unsigned>(((P == 1 ? (i8 + 8 * (q & 1)) : i8) * S + (q >> 1)) * 16);
  const int lane_back = P == 2 && (q & 1) == 0 ? S : 0;

  float acc[NO][CH][4];
  auto reset = [&](float (&a)[CH][4]) {
#pragma unroll
    for (int h = 0; h < CH; ++h) {
      a[h][0] = a[h][2] = bias_v[h][0];
      a[h][1] = a[h][3] = bias_v[h][1];
    }
  };

  // One kernel row's products for one open output row, the A fragments at lane address `at` (plane 0, tap 0).
  auto kernel_row = [&](float (&a)[CH][4], unsigned at, int kh) {
#pragma unroll
    for (int h = 0; h < CH; ++h) {
      const unsigned ph = at + h * Ring::kPlaneBytes;
#pragma unroll
      for (int kw = 0; kw + 1 < K; kw += 2) {
        uint32_t fa[4];
        ldmatrix_x4(fa, ph + kw * 16);
        mma_16816<TT>(a[h], fa, b[h][kh * K + kw], b[h][kh * K + kw + 1]);
      }
      uint32_t fa[2];
      ldmatrix_x2(fa, ph + (K - 1) * 16);
      mma_1688<TT>(a[h], fa, b[h][kh * K + K - 1]);
    }
  };

  // The lane's outputs: pixel g (C rows c0, c1) and pixel g + 8 (c2, c3) of tile tt, channels cb + 8 h + 2t, + 1;
  // offsets in words, advanced by a tile per step.
  const int words = s.C / 2;
  const long long tile_words = static_cast<long long>(P) * s.OW * words;
  const long long half_words = P == 1 ? 8LL * words : static_cast<long long>(s.OW) * words;
  const bool col_ok0 = ow0 + g < s.OW;
  const bool col_ok1 = P == 1 ? ow0 + g + 8 < s.OW : col_ok0;

#pragma unroll
  for (int a = 0; a < Ring::kAhead; ++a) copy_step();

  int rd_slot = 0;  // the ring slot of this step's first row
  for (int n = n_first; n < n_end; ++n) {
    uint32_t* yn = y + static_cast<size_t>(n) * s.OH * s.OW * words;
    long long st_off = t_first * tile_words + static_cast<long long>(ow0 + g) * words + cb / 2 + t;
    auto store = [&](int tt, const float (&a)[CH][4]) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const bool ok = half == 0 ? col_ok0 : (col_ok1 && (P == 1 || 2 * tt + 1 < s.OH));
        if (!ok) continue;
        uint32_t* yp = yn + st_off + (half ? half_words : 0);
#pragma unroll
        for (int h = 0; h < CH; ++h) {
          float v[2] = {a[h][2 * half], a[h][2 * half + 1]};
          if constexpr (ACT) {
            v[0] = activate(v[0], s.act);
            v[1] = activate(v[1], s.act);
          }
          store_global(yp + 4 * h, narrow_word<TT, 2>(v));
        }
      }
    };
#pragma unroll
    for (int j = 0; j < NO; ++j) reset(acc[j]);

    rd_slot = (rd_slot + kLead) & (Ring::kSlots - 1);  // past the image's lead rows
    int rd_ih = step_ih0;                              // the row of rd_slot
    for (int t0 = t_first; t0 < t_end; t0 += NO) {
#pragma unroll
      for (int u = 0; u < NO; ++u) {
        const int tt = t0 + u;
        if (tt < t_end) {
          __syncwarp();  // every lane is done with the slots the next copies overwrite
          copy_step();
          cp_async_wait<Ring::kAhead>();
          __syncwarp();  // and every lane's copies of this step's rows have landed
#pragma unroll
          for (int d = 0; d < SS; ++d) {
            const int ih = rd_ih + d;
            // A row of zeros adds nothing: skip the products (uniform across the warp).
            const bool any = static_cast<unsigned>(ih) < static_cast<unsigned>(s.H) ||
                             (P == 2 && static_cast<unsigned>(ih - S) < static_cast<unsigned>(s.H));
            if (!any) continue;
            const int slot = (rd_slot + d - lane_back) & (Ring::kSlots - 1);
            const unsigned at = ring + static_cast<unsigned>(slot * Ring::kRowBytes) + lane_px_off;
#pragma unroll
            for (int j = 0; j < NO; ++j) {
              const int kh = K - SS + d - j * SS;
              if (kh < 0 || kh >= K) continue;
              kernel_row(acc[(u + j) % NO], at, kh);
            }
          }
          if (tt >= t_begin) store(tt, acc[u]);
          reset(acc[u]);
          rd_slot = (rd_slot + SS) & (Ring::kSlots - 1);
          rd_ih += SS;
          st_off += tile_words;
        }
      }
    }
  }
  cp_async_wait<0>();
}

// Images per warp for P = 2, whose walks are short: the count whose grid, in whole waves of the SMs' resident warps,
// takes the least time, a warp's time taken as images + kImageWalkFixed (its weights, its first copies). Measured on
// the H200 (docs/kernels.md, "The tensor-core walk"): 4 images per warp left a second wave a quarter full on
// 672x14x14 5x5 s2 (0.073 ms; 1 image 0.059, 8 images 0.059), and 1152x7x7 took 0.052, 0.055, 0.062 ms at 4, 1, 8,
// as the wave count predicts with a fixed cost of about 0.4 image.
constexpr float kImageWalkFixed = 0.4f;

int walk_images(int n, long long warps_per_image, long long resident_warps) {
  return work_by_waves(std::min(n, 16), resident_warps, kImageWalkFixed,
                       [&](int i) { return static_cast<long long>(ceil_div(n, i)) * warps_per_image; });
}

// P: two rows of 8 columns per product where a row has at most 8 output columns (MMA_WALK_ROWS = 1 or 2 forces it).
// CH: 16-channel groups (two products per pixel, whole sectors per copy) where C allows and the weights fit in
// registers (K <= 5), MMA_WALK_CH = 1 or 2 forces it (2 only where it is possible). Images per warp (P = 2):
// walk_images, or MMA_WALK_IMAGES. Row segments: as few as give every SM 32 warps, each at least 4 tiles past the
// NO - 1 steps it repeats.
template <class TT, int K, int S, int P, int CH, bool FLIP>
void launch_mma_walk_shape(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                           cudaStream_t stream) {
  using Ring = WalkRing<K, S, P, CH>;
  constexpr int NO = Ring::kOpen;
  constexpr size_t smem = static_cast<size_t>(kWalkThreads / 32) * Ring::kWarpBytes;
  static_assert(smem <= 48 * 1024, "the walk's ring fits the default shared memory of a block");
  auto kernel = fwd_nhwc_mma_walk_kernel<TT, K, S, P, CH, FLIP, false>;
  if constexpr (!FLIP) {
    if (s.act != kActNone) kernel = fwd_nhwc_mma_walk_kernel<TT, K, S, P, CH, FLIP, true>;
  }
  MmaWalkPlan p;
  p.groups = s.C / (8 * CH);
  p.colsegs = ceil_div(s.OW, 16 / P);
  p.tiles = P == 1 ? s.OH : ceil_div(s.OH, 2);
  // One image per warp where NO == 1 (3x3 at stride 2): an image's walk may then be a single step, and the ring
  // (Ring::kNeed) holds one image start in flight, not two.
  p.images = 1;
  if (P == 2 && NO >= 2) {
    const int images_knob = knob(Knob::kMmaWalkImages, dt);
    if (images_knob >= 1) {
      p.images = std::min(images_knob, s.N);
    } else {
      // Resident blocks per SM of this kernel (with or without the activation): a query of its attributes, cached
      // (it does not synchronise, so a capture may launch it).
      static int blocks_per_sm[2] = {0, 0};
      int& b = blocks_per_sm[s.act != kActNone];
      if (b == 0) {
        int q = 0;
        C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&q, kernel, kWalkThreads, smem));
        b = std::max(q, 1);
      }
      const long long resident = static_cast<long long>(num_sms()) * b * (kWalkThreads / 32);
      p.images = walk_images(s.N, static_cast<long long>(p.colsegs) * p.groups, resident);
    }
  }
  const long long base_warps = static_cast<long long>(ceil_div(s.N, p.images)) * p.colsegs * p.groups;
  const long long want = static_cast<long long>(num_sms()) * 32;
  int segs = static_cast<int>((want + base_warps - 1) / base_warps);
  const int max_segs = std::max(1, p.tiles / (NO - 1 + 4));
  segs = std::min(std::max(segs, 1), max_segs);
  p.seg_tiles = ceil_div(p.tiles, segs);
  p.segs = ceil_div(p.tiles, p.seg_tiles);
  p.warps = base_warps * p.segs;
  const long long blocks = (p.warps * 32 + kWalkThreads - 1) / kWalkThreads;
  kernel<<<static_cast<unsigned>(blocks), kWalkThreads, smem, stream>>>(
      static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(bias),
      static_cast<uint32_t*>(y), s, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

int mma_walk_rows(const ConvShape& s, DType dt) {
  const int v = knob(Knob::kMmaWalkRows, dt);
  return v == 1 || v == 2 ? v : (s.OW <= 8 ? 2 : 1);
}

bool mma_walk_wide(const ConvShape& s, DType dt) {
  const int v = knob(Knob::kMmaWalkCh, dt);
  const bool possible = s.C % 16 == 0 && s.KH <= 5;
  return possible && v != 1;
}

template <class TT, int K, int S, bool FLIP>
void launch_mma_walk_k(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                       cudaStream_t stream) {
  const bool two_rows = mma_walk_rows(s, dt) == 2;
  if constexpr (K <= 5) {
    if (mma_walk_wide(s, dt)) {
      return two_rows ? launch_mma_walk_shape<TT, K, S, 2, 2, FLIP>(s, dt, x, w, bias, y, stream)
                      : launch_mma_walk_shape<TT, K, S, 1, 2, FLIP>(s, dt, x, w, bias, y, stream);
    }
  }
  two_rows ? launch_mma_walk_shape<TT, K, S, 2, 1, FLIP>(s, dt, x, w, bias, y, stream)
           : launch_mma_walk_shape<TT, K, S, 1, 1, FLIP>(s, dt, x, w, bias, y, stream);
}

template <class TT, bool FLIP>
void launch_mma_walk_tt(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                        cudaStream_t stream) {
  auto by_stride = [&](auto k) {
    constexpr int K = decltype(k)::value;
    if (s.SH == 1) return launch_mma_walk_k<TT, K, 1, FLIP>(s, dt, x, w, bias, y, stream);
    if constexpr (!FLIP) launch_mma_walk_k<TT, K, 2, FLIP>(s, dt, x, w, bias, y, stream);
  };
  if (s.KH == 3) by_stride(std::integral_constant<int, 3>{});
  else if (s.KH == 5) by_stride(std::integral_constant<int, 5>{});
  else by_stride(std::integral_constant<int, 7>{});
}

template <bool FLIP>
void launch_mma_walk(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                     cudaStream_t stream) {
  if (dt == DType::F16) launch_mma_walk_tt<F16T, FLIP>(s, dt, x, w, bias, y, stream);
  else launch_mma_walk_tt<BF16T, FLIP>(s, dt, x, w, bias, y, stream);  // tensor_core_fits admits only 16-bit types
}

}  // namespace

void forward_nhwc_mma_walk(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                           cudaStream_t stream) {
  launch_mma_walk<false>(s, dt, x, w, bias, y, stream);
}

// The forward walk on input_grad_as_forward(s), whose input is grad_out; stride 1 only.
void input_grad_nhwc_mma_walk(const ConvShape& s, DType dt, const void* go, const void* w, void* gx,
                              cudaStream_t stream) {
  launch_mma_walk<true>(input_grad_as_forward(s), dt, go, w, nullptr, gx, stream);
}

}  // namespace mdw
