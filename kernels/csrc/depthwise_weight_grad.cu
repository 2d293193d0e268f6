// Weight and bias gradients of the depthwise convolution, deterministic and without atomics:
//   stage 1: block (chunk g, channel group) sums grad_out * x over a fixed set of tiles of
//            (n, oh, ow) into registers, reduces its lanes in a fixed order (warp butterfly, then
//            warps in index order) and writes fp32 partials ws[g][c][K*K + 1] (last slot: bias);
//   stage 2: one thread per (c, tap) adds the partials over g in index order.
// The chunk count depends only on the shape and the GPU, so reruns are bitwise identical.
//
// Every kernel of both stages, one section per technique of stage 1. Which one runs a case is decided by the
// weight-gradient table in depthwise_dispatch.cpp.
//   tiled:      NHWC and NCHW, 3/5/7 square, stride 1/2, dilation 1, 16/32-bit (register tiles of a few columns)
//   column:     NHWC 3x3, stride 1/2, whole 32-bit words of channels (column walk)
//   generic:    everything else
//   finalize:   stage 2, for all of them
#include <c10/cuda/CUDAException.h>

#include "depthwise_launchers.h"
#include "device_common.h"

namespace mdw {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

// Output columns per lane: 2 keeps the accumulators, the grad_out strip and one input row segment
// within 80 registers (3 blocks per SM); neighbouring lanes share the rest through L1.
constexpr int kWgradStrip = 2;

// ---- shared by the NHWC kernels (tiled and column) ----

// Sum the lanes' accumulators of one channel vector in a fixed order (butterfly inside each warp,
// then warps in index order) and write the block's partials ws[chunk][c][tap].
// Lanes with the same cv sit lanes_c apart in a warp (lanes_c is a power of two <= 16).
// kSlotMajor: ws[chunk][tap][c] instead (the BatchNorm backward's partial layout, batchnorm_relu.cu).
// `red`: shared memory of partials_smem_bytes(t, KK, V).
template <int KK, int V, bool kSlotMajor = false>
__device__ __forceinline__ void reduce_nhwc_partials(float (&acc)[KK + 1][V], float* red, float* __restrict__ ws,
                                                     const ConvShape& s, const Tiling& t, int group, int chunk) {
  constexpr int E = (KK + 1) * V;
  const int lane = threadIdx.x;
  for (int off = t.lanes_c; off < 32; off <<= 1)
#pragma unroll
    for (int k = 0; k <= KK; ++k)
#pragma unroll
      for (int v = 0; v < V; ++v) acc[k][v] += __shfl_xor_sync(kFullMask, acc[k][v], off);
  const int warp = lane / 32, wl = lane % 32;
  if (wl < t.lanes_c) {
    float* dst = red + (warp * t.lanes_c + wl) * E;
#pragma unroll
    for (int k = 0; k <= KK; ++k)
#pragma unroll
      for (int v = 0; v < V; ++v) dst[k * V + v] = acc[k][v];
  }
  __syncthreads();
  const int warps = blockDim.x / 32;
  for (int idx = lane; idx < t.lanes_c * E; idx += blockDim.x) {
    const int cl = idx / E, e = idx - cl * E;
    float sum = 0.f;
    for (int wi = 0; wi < warps; ++wi) sum += red[(wi * t.lanes_c + cl) * E + e];
    const int c = (group * t.lanes_c + cl) * V + e % V;
    const int k = e / V;
    if (c < s.C) {
      if constexpr (kSlotMajor) {
        ws[(static_cast<size_t>(chunk) * (KK + 1) + k) * s.C + c] = sum;
      } else {
        ws[(static_cast<size_t>(chunk) * s.C + c) * (KK + 1) + k] = sum;
      }
    }
  }
}

// The shared memory reduce_nhwc_partials reduces KK + 1 slots of V channels through: [warps][lanes_c][(KK + 1) * V].
inline size_t partials_smem_bytes(const Tiling& t, int KK, int V) {
  return sizeof(float) * (t.block / 32) * t.lanes_c * (KK + 1) * V;
}

// An NHWC wgrad block: channel groups vary fastest across blocks so the blocks sharing a pixel's
// cache lines run together; the block's chunk takes every chunks-th tile.
struct WgradNhwcBlock {
  int group, chunk, chunks;
};
__device__ __forceinline__ WgradNhwcBlock wgrad_nhwc_block(const Tiling& t) {
  WgradNhwcBlock r;
  r.group = blockIdx.x % t.groups;
  r.chunk = blockIdx.x / t.groups;
  r.chunks = gridDim.x / t.groups;
  return r;
}

// ---- tiled ----

// Input column i of kernel row kh against the lane's TW grad_out columns: acc[kh*K + kw] += g[j] * x
// for each kw = i - j*S in [0, K). Per column rather than per row: a whole-row helper (widening
// included) changed the 16-bit kernels' machine code.
template <int K, int S, int TW, int V>
__device__ __forceinline__ void accumulate_wgrad_column(int kh, int i, const float (&xv)[V], const float (&g)[TW][V],
                                                        float (&acc)[K * K + 1][V]) {
#pragma unroll
  for (int j = 0; j < TW; ++j) {
    const int kw = i - j * S;
    if (kw >= 0 && kw < K) {
#pragma unroll
      for (int v = 0; v < V; ++v) acc[kh * K + kw][v] = fmaf(g[j][v], xv[v], acc[kh * K + kw][v]);
    }
  }
}

// 3 blocks of 256 per SM: caps registers at 80 (uncapped it took ~110 and ran 2 blocks per SM).
template <class TT, int K, int S, int TW, int V>
__global__ void __launch_bounds__(256, 3)
    wgrad_nhwc_kernel(const typename TT::S* __restrict__ go, const typename TT::S* __restrict__ x,
                      float* __restrict__ ws, ConvShape s, Tiling t, int num_tiles) {
  using Sx = typename TT::S;
  constexpr int L = (TW - 1) * S + K;
  constexpr int KK = K * K;
  extern __shared__ float red[];  // [warps][lanes_c][(KK + 1) * V]

  const int lane = threadIdx.x;
  const NhwcLane ln = nhwc_lane(lane, t);
  const WgradNhwcBlock blk = wgrad_nhwc_block(t);
  const int c0 = (blk.group * t.lanes_c + ln.cv) * V;
  const bool active = lane < t.threads && c0 < s.C;
  float acc[KK + 1][V];
  fill(acc, 0.f);

  if (active) {
    for (int tile_index = blk.chunk; tile_index < num_tiles; tile_index += blk.chunks) {
      const TileIndex tile = split_tile_index(tile_index, t);
      const int n = tile.outer;
      const int oh = tile.tile_h * t.sy_n + ln.sy;
      const int ow0 = (tile.tile_w * t.sx_n + ln.sx) * TW;
      if (oh >= s.OH || ow0 >= s.OW) continue;
      float g[TW][V];
      const Sx* gp = go + ((static_cast<size_t>(n) * s.OH + oh) * s.OW + ow0) * s.C + c0;
#pragma unroll
      for (int j = 0; j < TW; ++j) {
        if (ow0 + j < s.OW) {
          load_vec<TT, V>(gp + static_cast<size_t>(j) * s.C, g[j]);
        } else {
#pragma unroll
          for (int v = 0; v < V; ++v) g[j][v] = 0.f;
        }
#pragma unroll
        for (int v = 0; v < V; ++v) acc[KK][v] += g[j][v];
      }
      const Sx* xn = x + static_cast<size_t>(n) * s.H * s.W * s.C + c0;
      const int iw0 = ow0 * S - s.PW;
#pragma unroll
      for (int kh = 0; kh < K; ++kh) {
        const int ih = oh * S - s.PH + kh;
        if (ih < 0 || ih >= s.H) continue;
        Pack<Sx, V> raw[L];
        load_row_packs(xn + static_cast<size_t>(ih) * s.W * s.C, iw0, s.W, s.C, raw);
#pragma unroll
        for (int i = 0; i < L; ++i) {
          float xv[V];
          widen<TT, V>(raw[i], xv);
          accumulate_wgrad_column<K, S>(kh, i, xv, g, acc);
        }
      }
    }
  }

  reduce_nhwc_partials<KK, V>(acc, red, ws, s, t, blk.group, blk.chunk);
}

// NCHW: block (chunk, channel c); lanes cover a tile of rows x strips of lanes_c images.
template <class TT, int K, int S, int TW>
__global__ void __launch_bounds__(256)
    wgrad_nchw_kernel(const typename TT::S* __restrict__ go, const typename TT::S* __restrict__ x,
                      float* __restrict__ ws, ConvShape s, Tiling t, int num_tiles) {
  using Sx = typename TT::S;
  constexpr int L = (TW - 1) * S + K;
  constexpr int KK = K * K;
  __shared__ float red[8][KK + 1];
  const int c = blockIdx.y;
  const int lane = threadIdx.x;
  const NchwLane ln = nchw_lane(lane, t);
  const bool active = lane < t.threads;

  float acc[KK + 1];
#pragma unroll
  for (int k = 0; k <= KK; ++k) acc[k] = 0.f;

  if (active) {
    for (int tile_index = blockIdx.x; tile_index < num_tiles; tile_index += gridDim.x) {
      const TileIndex tile = split_tile_index(tile_index, t);
      const int n = tile.outer * t.lanes_c + ln.q;
      const int oh = tile.tile_h * t.sy_n + ln.sy;
      const int ow0 = (tile.tile_w * t.sx_n + ln.sx) * TW;
      if (n >= s.N || oh >= s.OH || ow0 >= s.OW) continue;
      const size_t plane = static_cast<size_t>(n) * s.C + c;
      const Sx* gp = go + (plane * s.OH + oh) * s.OW + ow0;
      float g[TW];
#pragma unroll
      for (int j = 0; j < TW; ++j) {
        g[j] = ow0 + j < s.OW ? TT::to_acc(gp[j]) : 0.f;
        acc[KK] += g[j];
      }
      const Sx* xp = x + plane * s.H * s.W;
      const int iw0 = ow0 * S - s.PW;
#pragma unroll
      for (int kh = 0; kh < K; ++kh) {
        const int ih = oh * S - s.PH + kh;
        if (ih < 0 || ih >= s.H) continue;
        Sx raw[L];
        load_row_scalars(xp + static_cast<size_t>(ih) * s.W, iw0, s.W, raw);
#pragma unroll
        for (int i = 0; i < L; ++i) {
          const float xv = TT::to_acc(raw[i]);
#pragma unroll
          for (int j = 0; j < TW; ++j) {
            const int kw = i - j * S;
            if (kw >= 0 && kw < K) acc[kh * K + kw] = fmaf(g[j], xv, acc[kh * K + kw]);
          }
        }
      }
    }
  }

  for (int off = 1; off < 32; off <<= 1)
#pragma unroll
    for (int k = 0; k <= KK; ++k) acc[k] += __shfl_xor_sync(kFullMask, acc[k], off);
  const int warp = lane / 32;
  if (lane % 32 == 0) {
#pragma unroll
    for (int k = 0; k <= KK; ++k) red[warp][k] = acc[k];
  }
  __syncthreads();
  const int warps = blockDim.x / 32;
  for (int k = lane; k <= KK; k += blockDim.x) {
    float sum = 0.f;
    for (int wi = 0; wi < warps; ++wi) sum += red[wi][k];
    ws[(static_cast<size_t>(blockIdx.x) * s.C + c) * (KK + 1) + k] = sum;
  }
}

// Tiled launch shape: the tiling of (n, oh, ow), how many tiles it has, and the chunks of tiles (blocks along
// grid.x; partial sums per (c, tap)).
struct WgradPlan {
  Tiling tiling;
  int num_tiles;
  int chunks;
};

template <int K, int S>
WgradPlan plan_tiled_t(const ConvShape& s, DType dt) {
  const int elem_bytes = elem_size(dt);
  constexpr int TW = kWgradStrip;
  WgradPlan p{};
  const int strips = ceil_div(s.OW, TW);
  const int target_blocks = num_sms() * (s.channels_last ? knob(Knob::kWgradBlocksPerSm, dt) : 8);
  if (s.channels_last) {
    constexpr int V = WgradVec<K>::value;
    // <= 16 lanes: the block reduction's shared memory stays under 48 KB for every K.
    const int lanes = nhwc_lanes_c(V, elem_bytes) < 16 ? nhwc_lanes_c(V, elem_bytes) : 16;
    p.tiling = make_tiling(true, s.OH, 0, strips, s.C / V, lanes);
    p.num_tiles = s.N * p.tiling.tiles_h * p.tiling.tiles_w;
    p.chunks = ceil_div(target_blocks, p.tiling.groups);
  } else {
    p.tiling = make_tiling(false, s.OH, 0, strips, s.N);
    p.num_tiles = p.tiling.groups * p.tiling.tiles_h * p.tiling.tiles_w;
    p.chunks = ceil_div(target_blocks, s.C);
  }
  if (p.chunks > p.num_tiles) p.chunks = p.num_tiles;
  if (p.chunks < 1) p.chunks = 1;
  return p;
}

WgradPlan plan_tiled(const ConvShape& s, DType dt) {
  const int k = s.KH, str = s.SH;
  if (k == 3) return str == 1 ? plan_tiled_t<3, 1>(s, dt) : plan_tiled_t<3, 2>(s, dt);
  if (k == 5) return str == 1 ? plan_tiled_t<5, 1>(s, dt) : plan_tiled_t<5, 2>(s, dt);
  return str == 1 ? plan_tiled_t<7, 1>(s, dt) : plan_tiled_t<7, 2>(s, dt);
}

template <class TT, int K, int S>
void run_wgrad_tiled(const ConvShape& s, const WgradPlan& p, const void* go, const void* x, float* ws,
                     cudaStream_t stream) {
  using Sx = typename TT::S;
  constexpr int TW = kWgradStrip;
  const Tiling& t = p.tiling;
  if (s.channels_last) {
    constexpr int V = WgradVec<K>::value;
    const size_t smem = partials_smem_bytes(t, K * K, V);
    const dim3 grid(t.groups * p.chunks);
    wgrad_nhwc_kernel<TT, K, S, TW, V><<<grid, t.block, smem, stream>>>(
        static_cast<const Sx*>(go), static_cast<const Sx*>(x), ws, s, t, p.num_tiles);
  } else {
    const dim3 grid(p.chunks, s.C);
    wgrad_nchw_kernel<TT, K, S, TW><<<grid, t.block, 0, stream>>>(
        static_cast<const Sx*>(go), static_cast<const Sx*>(x), ws, s, t, p.num_tiles);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT>
void wgrad_tiled_t(const ConvShape& s, const WgradPlan& p, const void* go, const void* x, float* ws, cudaStream_t st) {
  const int k = s.KH, str = s.SH;
  if (k == 3) (str == 1 ? run_wgrad_tiled<TT, 3, 1> : run_wgrad_tiled<TT, 3, 2>)(s, p, go, x, ws, st);
  else if (k == 5) (str == 1 ? run_wgrad_tiled<TT, 5, 1> : run_wgrad_tiled<TT, 5, 2>)(s, p, go, x, ws, st);
  else (str == 1 ? run_wgrad_tiled<TT, 7, 1> : run_wgrad_tiled<TT, 7, 2>)(s, p, go, x, ws, st);
}

// ---- column ----

// Column-walking variant (NHWC, K=3, low registers): a lane owns one 32-bit word of channels (a pair
// of 16-bit channels, or one fp32 channel) of one output row and walks along it. Step t loads
// grad_out column t and the S input columns (3 rows each) whose last user is output column t, and
// adds each input column into the taps of the <= 3 output columns that use it; the grad_out columns
// of the previous steps stay widened in registers. So every word is loaded and widened once, and a
// lane holds 10 x V accumulators plus a few words instead of the 80 of the kernels above; the loads
// of U steps are issued before their FMAs.
// Lanes: Tiling with one strip per row, lane = cv + lanes_c * row: a warp reads lanes_c * 4
// contiguous bytes of one pixel per load, the block's warps take consecutive rows of the flattened
// (n, oh) index, and tile b is the band of rows [b * sy_n, (b + 1) * sy_n).
template <int S, int V>
struct ColumnWalk {
  static constexpr int kHeld = 2 / S;  // earlier grad_out columns that the 3 taps reach back to
  // Steps whose loads are issued together: at stride 2 a step loads 7 words, and 4 such steps spill at
  // 64 registers (16-bit: 3 spill too).
  static constexpr int kMaxUnroll = S == 2 ? (V == 2 ? 2 : 3) : 4;
};

// Blocks per SM the walk's registers must allow: 4 (64 registers); the NORM walk with 16-bit data (V = 2) holds 6
// per-channel constants more, which spill 40-48 bytes at 64 registers, so it is given up to 85 (3 blocks).
template <bool NORM, int V>
constexpr int kWgradColumnMinBlocks = NORM && V == 2 ? 3 : 4;

// The words of U steps starting at step t0: grad_out column t0 + u and input columns
// (t0 + u) * S - PW + d of the lane's 3 input rows. Checked: zeros (and no load) for grad_out columns
// >= OW and input columns outside [0, col_end[kh]) (col_end is 0 for rows outside the image, and
// stops at the last step); unchecked: the caller has seen that every word is inside.
// Input words are addressed as one image pointer plus int offsets (row_off: the row's first word): one
// 64-bit pointer instead of three keeps the kernel within 64 registers. Each input word goes through `norm`
// (WordNorm: the identity, or the BatchNorm + ReLU of the layer before).
template <bool kChecked, int S, int U, class Norm>
__device__ __forceinline__ void load_column_steps(const uint32_t* gp, const uint32_t* xn, const int (&row_off)[3],
                                                  const int (&col_end)[3], int words, int OW, int PW, int t0,
                                                  const Norm& norm, uint32_t (&graw)[U], uint32_t (&xraw)[U][3][S]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int step = t0 + u;
    if (!kChecked || step < OW) {
      graw[u] = __ldg(gp + step * words);
    } else {
      graw[u] = 0u;
    }
#pragma unroll
    for (int d = 0; d < S; ++d) {
      const int iw = step * S - PW + d;
      const int offset = iw * words;
#pragma unroll
      for (int kh = 0; kh < 3; ++kh) {
        if (!kChecked || static_cast<unsigned>(iw) < static_cast<unsigned>(col_end[kh])) {
          xraw[u][kh][d] = norm(__ldg(xn + (row_off[kh] + offset)));
        } else {
          xraw[u][kh][d] = 0u;
        }
      }
    }
  }
}

// 4 blocks of 256 per SM: a 64-register cap, which no variant reaches. NORM: x = relu(batch_norm(y)) from the
// words of y (norm.apply_in_depthwise), at MINB blocks per SM.
template <class TT, int S, int U, int V, bool NORM = false, int MINB = 4>
__global__ void __launch_bounds__(256, MINB)
    wgrad_nhwc_column_kernel(const uint32_t* __restrict__ go, const uint32_t* __restrict__ x, float* __restrict__ ws,
                             ConvShape s, Tiling t, InputNorm input_norm) {
  constexpr int K = 3, KK = K * K;
  constexpr int F = ColumnWalk<S, V>::kHeld;
  extern __shared__ float red[];  // [warps][lanes_c][(KK + 1) * V]

  const int lane = threadIdx.x;
  const NhwcLane ln = nhwc_lane(lane, t);
  const WgradNhwcBlock blk = wgrad_nhwc_block(t);
  const int words = s.C / V;  // 32-bit words per pixel
  const int cw = blk.group * t.lanes_c + ln.cv;
  const bool active = lane < t.threads && cw < words;
  const int rows = s.N * s.OH;
  // Steps [t_first, t_last]: the steps whose input columns all lie in the padding are skipped, but
  // every grad_out column is loaded, in a step or among those held before the first (for the bias).
  const int t_first = s.PW / S < F ? s.PW / S : F;
  const int t_image = (s.W - 1 + s.PW) / S;  // last step with an input column inside the image
  const int t_used = t_image < s.OW - 1 + F ? t_image : s.OW - 1 + F;
  const int t_last = t_used > s.OW - 1 ? t_used : s.OW - 1;
  // Input columns past the last step's are not loaded: a step beyond it only pads a group of U.
  const int col_stop = (t_last + 1) * S - s.PW < s.W ? (t_last + 1) * S - s.PW : s.W;
  float acc[KK + 1][V];
  fill(acc, 0.f);
  WordNorm<TT, V, NORM> norm;
  if (active) norm.setup(input_norm, cw * V);

  if (active) {
    for (int tile = blk.chunk; tile < t.tiles_h; tile += blk.chunks) {
      const int r = tile * t.sy_n + ln.sy;
      if (r >= rows) continue;
      const int n = r / s.OH, oh = r - n * s.OH;
      const uint32_t* gp = go + static_cast<size_t>(r) * s.OW * words + cw;
      const uint32_t* xn = x + static_cast<size_t>(n) * s.H * s.W * words + cw;
      // Opaque to the compiler: otherwise it rebuilds these addresses from the kernel arguments at every load.
      asm("" : "+l"(gp));
      asm("" : "+l"(xn));
      int row_off[K], col_end[K];
      bool rows_inside = true;
#pragma unroll
      for (int kh = 0; kh < K; ++kh) {
        const int ih = oh * S - s.PH + kh;
        const bool inside = ih >= 0 && ih < s.H;
        rows_inside = rows_inside && inside;
        col_end[kh] = inside ? col_stop : 0;
        row_off[kh] = (inside ? ih : 0) * s.W * words;
      }
      // held[j] = grad_out column t - 1 - j before step t; zero outside the row.
      float held[F][V];
#pragma unroll
      for (int j = 0; j < F; ++j) {
        const int ow = t_first - 1 - j;
        if (ow >= 0 && ow < s.OW) {
          widen_word<TT, V>(__ldg(gp + ow * words), held[j]);
        } else {
#pragma unroll
          for (int v = 0; v < V; ++v) held[j][v] = 0.f;
        }
#pragma unroll
        for (int v = 0; v < V; ++v) acc[KK][v] += held[j][v];
      }
      for (int t0 = t_first; t0 <= t_last; t0 += U) {
        // Most groups lie inside the image and the row: no bounds tests there. Steps past t_last (a
        // partial last group) and columns outside load zeros, which add exact zeros.
        uint32_t graw[U], xraw[U][K][S];
        const bool inside = rows_inside && t0 * S - s.PW >= 0 && (t0 + U) * S - s.PW <= col_stop && t0 + U <= s.OW;
        if (inside) {
          load_column_steps<false, S, U>(gp, xn, row_off, col_end, words, s.OW, s.PW, t0, norm, graw, xraw);
        } else {
          load_column_steps<true, S, U>(gp, xn, row_off, col_end, words, s.OW, s.PW, t0, norm, graw, xraw);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          float g[V];
          widen_word<TT, V>(graw[u], g);
#pragma unroll
          for (int v = 0; v < V; ++v) acc[KK][v] += g[v];
          // Input column step * S - PW + d is tap kw = d + j * S of output column step - j.
#pragma unroll
          for (int kh = 0; kh < K; ++kh)
#pragma unroll
            for (int d = 0; d < S; ++d) {
              float xv[V];
              widen_word<TT, V>(xraw[u][kh][d], xv);
#pragma unroll
              for (int j = 0; j <= F; ++j) {
                const int kw = d + j * S;
                if (kw < K) {
#pragma unroll
                  for (int v = 0; v < V; ++v)
                    acc[kh * K + kw][v] = fmaf(j == 0 ? g[v] : held[j > 0 ? j - 1 : 0][v], xv[v], acc[kh * K + kw][v]);
                }
              }
            }
#pragma unroll
          for (int j = F - 1; j > 0; --j)
#pragma unroll
            for (int v = 0; v < V; ++v) held[j][v] = held[j - 1][v];
#pragma unroll
          for (int v = 0; v < V; ++v) held[0][v] = g[v];
        }
      }
    }
  }
  reduce_nhwc_partials<KK, V>(acc, red, ws, s, t, blk.group, blk.chunk);
}

// An input-row walk's lane: its block, its place in the block, and the 32-bit word of channels it owns (cw, of
// words); active when it owns one.
template <int V>
struct InputRowLane {
  WgradNhwcBlock blk;
  NhwcLane ln;
  int words, cw;
  bool active;
  __device__ __forceinline__ InputRowLane(const ConvShape& s, const Tiling& t)
      : blk(wgrad_nhwc_block(t)), ln(nhwc_lane(threadIdx.x, t)), words(s.C / V) {
    cw = blk.group * t.lanes_c + ln.cv;
    active = static_cast<int>(threadIdx.x) < t.threads && cw < words;
  }
};

// The NORM weight gradient at stride 1, padding 1, walked per input row: a lane owns one input row (n, ih) and walks
// iw = 0..W-1 along it, so each input word is loaded and normalized by one lane (the column walk above, a lane per
// output row, normalizes each by the 3 lanes whose rows read it). Input column iw is tap (kh, kw) of grad_out
// (ih + 1 - kh, iw + 1 - kw): step iw loads the new grad_out column iw + 1 of the <= 3 output rows ih + 1 - kh and
// holds the two before it, widened. No bias slot (the normalizing op has no bias gradient): it is written as 0.
// Lanes and blocks as the column walk's (rows of the flattened (n, ih) index; H == OH here).
// DGRAD: those 3 x 3 grad_out words are exactly the taps of the input gradient at (ih, iw), so the lane also writes
// grad_input there, summed in the order of the rotated-kernel column walk (stencil_3x3.cuh, FLIP), hence the same
// bits as depthwise_bwd's input gradient, and grad_out is read once for both gradients instead of twice.
// DGRAD holds the lane's 9 x V fp32 weights more: 16-bit at 2 blocks per SM (128 registers; ptxas of nvcc 13.0 for
// sm_90 reports 112-115, 120-121 with SUMS, 128 with GNORM, no spills), fp32 at 3 (85; 77-80 used).
// SUMS (with DGRAD): the lane also has y's word at (ih, iw), so it sums the BatchNorm + ReLU backward's per-channel
// sums there, sum(g) and sum(g * (y - mean)) with g = grad_input as stored where the ReLU passed (the normalized
// word > 0 is the mask bn_relu_bwd recomputes), into sums[chunk][2][C] (batchnorm_relu.cu's partial layout), so that
// the BatchNorm's backward skips its reduce pass over grad_input and y.
// GNORM (with SUMS): go is the gradient of the BatchNorm + ReLU after the convolution (out_norm), and each grad_out
// word is computed from it and that BatchNorm's input as it is loaded (WordGradNorm): the same grad_out bits as that
// BatchNorm's input-gradient pass, which then does not run.
// NORM false (with DGRAD, without SUMS): x is the convolution's own input, loaded as it is, and the bias slot sums
// grad_out (the word of output row ih at column iw, held[1][0] at step iw: each word once): the plain op's backward
// (backward_input_row), both gradients from one read of grad_out.
template <bool DGRAD, int V>
constexpr int kInputRowMinBlocks = DGRAD ? (V == 1 ? 3 : 2) : kWgradColumnMinBlocks<true, V>;

template <class TT, int U, int V, bool DGRAD = false, bool SUMS = false, bool GNORM = false, bool NORM = true>
__global__ void __launch_bounds__(256, kInputRowMinBlocks<DGRAD, V>)
    wgrad_nhwc_input_row_kernel(const uint32_t* __restrict__ go, const uint32_t* __restrict__ x,
                                float* __restrict__ ws, ConvShape s, Tiling t, InputNorm input_norm,
                                const typename TT::S* __restrict__ w, uint32_t* __restrict__ gx,
                                float* __restrict__ sums, OutputGradNorm out_norm) {
  static_assert(DGRAD || !SUMS, "the sums are of the input gradient the walk writes");
  static_assert(SUMS || !GNORM, "the walk that applies the BatchNorm after the convolution is the sums walk");
  static_assert(NORM || !SUMS, "the sums are the BatchNorm's, which the plain walk has not");
  constexpr int K = 3, KK = K * K;
  extern __shared__ float red[];  // [warps][lanes_c][(KK + 1) * V]

  const InputRowLane<V> lr(s, t);
  const NhwcLane& ln = lr.ln;
  const WgradNhwcBlock& blk = lr.blk;
  const int words = lr.words, cw = lr.cw, rows = s.N * s.H;
  const bool active = lr.active;
  const bool store_gx = gx != nullptr;  // null: the sums and the weight gradient only (the gradient is recomputed)
  float acc[KK + 1][V];
  fill(acc, 0.f);
  float bn_sums[2][V];  // SUMS: sum(g), sum(g * (y - mean))
  fill(bn_sums, 0.f);
  WordNorm<TT, V, NORM> norm;
  WordGradNorm<TT, V, GNORM> gnorm;
  float wr[DGRAD ? KK : 1][V];  // DGRAD: the lane's weights, fp32
  if (active) {
    norm.setup(input_norm, cw * V);
    gnorm.setup(out_norm, cw * V);
    if constexpr (DGRAD) {
#pragma unroll
      for (int v = 0; v < V; ++v)
#pragma unroll
        for (int k = 0; k < KK; ++k) wr[k][v] = TT::to_acc(__ldg(w + (cw * V + v) * KK + k));
    }
  }

  if (active) {
    for (int tile = blk.chunk; tile < t.tiles_h; tile += blk.chunks) {
      const int r = tile * t.sy_n + ln.sy;
      if (r >= rows) continue;
      const int n = r / s.H, ih = r - n * s.H;
      const uint32_t* xp = x + static_cast<size_t>(r) * s.W * words + cw;
      const size_t g_base = static_cast<size_t>(n) * s.OH * s.OW * words + cw;
      const uint32_t* gn = go + g_base;
      const uint32_t* zn = GNORM ? static_cast<const uint32_t*>(out_norm.x) + g_base : nullptr;
      uint32_t* gxp = DGRAD ? gx + static_cast<size_t>(r) * s.W * words + cw : nullptr;
      asm("" : "+l"(xp));
      asm("" : "+l"(gn));
      if constexpr (GNORM) asm("" : "+l"(zn));
      if constexpr (DGRAD) asm("" : "+l"(gxp));
      // Output row ih + 1 - kh of kernel row kh: its first word from gn, or -1 outside the output.
      int g_off[K];
      bool rows_inside = true;
#pragma unroll
      for (int kh = 0; kh < K; ++kh) {
        const int oh = ih + 1 - kh;
        const bool inside = oh >= 0 && oh < s.OH;
        rows_inside = rows_inside && inside;
        g_off[kh] = inside ? oh * s.OW * words : -1;
      }
      // held[kh][j] = grad_out column iw - j of row kh before step iw (column -1: zero).
      float held[K][2][V];
#pragma unroll
      for (int kh = 0; kh < K; ++kh) {
        uint32_t w0 = 0u;
        if (g_off[kh] >= 0) w0 = gnorm.load(gn, zn, g_off[kh]);
        widen_word<TT, V>(w0, held[kh][0]);
#pragma unroll
        for (int v = 0; v < V; ++v) held[kh][1][v] = 0.f;
      }
      for (int t0 = 0; t0 < s.W; t0 += U) {
        uint32_t xraw[U], graw[U][K];
        uint32_t zraw[GNORM ? U : 1][K];  // GNORM: the next BatchNorm's input words beside graw's
        unsigned gvalid = 0u;             // GNORM: bit u * K + kh, graw[u][kh] lies inside grad_out
        // Inside: every row exists and every step's input column and new grad_out column lie inside.
        const bool inside = rows_inside && t0 + U < s.W;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int iw = t0 + u;
          if constexpr (SUMS) {  // y's word itself, normalized below (the sums need both)
            xraw[u] = (inside || iw < s.W) ? __ldg(xp + iw * words) : 0u;
          } else {
            xraw[u] = (inside || iw < s.W) ? norm(__ldg(xp + iw * words)) : 0u;
          }
          // All loads first, as predicated loads; GNORM's arithmetic waits for the second loop.
#pragma unroll
          for (int kh = 0; kh < K; ++kh) {
            const bool ok = inside || (g_off[kh] >= 0 && iw + 1 < s.OW);
            const int off = g_off[kh] + (iw + 1) * words;
            graw[u][kh] = ok ? __ldg(gn + off) : 0u;
            if constexpr (GNORM) {
              zraw[u][kh] = ok ? __ldg(zn + off) : 0u;
              gvalid |= static_cast<unsigned>(ok) << (u * K + kh);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          float xv[V], fresh[K][V];
          if constexpr (SUMS) {
            widen_word<TT, V>((inside || t0 + u < s.W) ? norm(xraw[u]) : 0u, xv);
          } else {
            widen_word<TT, V>(xraw[u], xv);
          }
#pragma unroll
          for (int kh = 0; kh < K; ++kh) {
            uint32_t word = graw[u][kh];
            if constexpr (GNORM) word = (gvalid >> (u * K + kh) & 1u) ? gnorm.apply(word, zraw[u][kh]) : 0u;
            widen_word<TT, V>(word, fresh[kh]);
          }
          if constexpr (DGRAD) {
            float d[V];
            input_row_grad<V>(wr, held, fresh, d);  // grad_input(ih, iw)
            const int iw = t0 + u;
            const bool in_row = inside || iw < s.W;
            const uint32_t stored = narrow_word<TT, V>(d);
            if (in_row && store_gx) asm volatile("st.global.b32 [%0], %1;" ::"l"(gxp + iw * words), "r"(stored));
            if constexpr (SUMS) add_grad_sums<TT, V>(stored, xraw[u], xv, in_row, norm.mean, bn_sums);
          }
          if constexpr (!NORM) {  // the bias gradient: grad_out(ih, iw), zero past the row's end
#pragma unroll
            for (int v = 0; v < V; ++v) acc[KK][v] += held[1][0][v];
          }
#pragma unroll
          for (int kh = 0; kh < K; ++kh) {
#pragma unroll
            for (int v = 0; v < V; ++v) {
              acc[kh * K + 0][v] = fmaf(fresh[kh][v], xv[v], acc[kh * K + 0][v]);
              acc[kh * K + 1][v] = fmaf(held[kh][0][v], xv[v], acc[kh * K + 1][v]);
              acc[kh * K + 2][v] = fmaf(held[kh][1][v], xv[v], acc[kh * K + 2][v]);
              held[kh][1][v] = held[kh][0][v];
              held[kh][0][v] = fresh[kh][v];
            }
          }
        }
      }
    }
  }
  reduce_nhwc_partials<KK, V>(acc, red, ws, s, t, blk.group, blk.chunk);
  if constexpr (SUMS) {
    __syncthreads();  // red is reused
    reduce_nhwc_partials<1, V, true>(bn_sums, red, sums, s, t, blk.group, blk.chunk);
  }
}

template <class TT, bool DGRAD = false, bool SUMS = false, bool GNORM = false, bool NORM = true>
void run_wgrad_input_row(const ConvShape& s, const WgradPlan& p, const void* go, const void* y, float* ws,
                         cudaStream_t stream, const InputNorm& norm, const void* w = nullptr, void* gx = nullptr,
                         float* sums = nullptr, const OutputGradNorm& out_norm = {}) {
  constexpr int K = 3;
  constexpr int VW = 4 / sizeof(typename TT::S);
  const Tiling& t = p.tiling;
  const size_t smem = partials_smem_bytes(t, K * K, VW);
  const dim3 grid(t.groups * p.chunks);
  wgrad_nhwc_input_row_kernel<TT, GNORM ? 2 : 4, VW, DGRAD, SUMS, GNORM, NORM><<<grid, t.block, smem, stream>>>(
      static_cast<const uint32_t*>(go), static_cast<const uint32_t*>(y), ws, s, t, norm,
      static_cast<const typename TT::S*>(w), static_cast<uint32_t*>(gx), sums, out_norm);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The NORM backward at stride 2, padding 1, with the BatchNorm backward's sums (SUMS above), walked per input row: a
// lane owns input row (n, ih) and walks its columns in pairs (2q, 2q + 1). Padding 1 puts input row ih under kernel
// rows kh = (ih + 1) % 2 and kh + 2 (when < 3) of output rows (ih + 1 - kh) / 2, and input column 2q under tap kw = 1
// of output column q, column 2q + 1 under kw = 0 of column q + 1 and kw = 2 of column q; so each step loads two words
// of y and the new grad_out column q + 1 of the lane's one or two output rows, and takes from them the input gradient,
// the weight gradient's products and the sums. grad_out is read once and y once, where the kernels this replaces (the
// tiled input gradient, the normalizing column walk, the BatchNorm's reduce pass) read grad_out twice, y twice and the
// input gradient again. NS: the row's kernel rows, 2 (kh 0 and 2: ih odd) or 1 (kh 1: ih even), a branch that is
// uniform in a warp whenever a warp is one row (32 words of channels or more: every MobileNetV1 layer). U: the column
// pairs whose loads are issued together (S2_WALK_PAIRS).
// NORM false: x is the convolution's own input, there are no sums, and the bias slot sums grad_out: output row oh is
// kernel row 1 of input row 2 oh alone (NS = 1), whose held column q is grad_out(oh, q) at step q (zero past OW).
template <class TT, int V, int NS, int U, bool GNORM, bool NORM>
__device__ __forceinline__ void walk_row_s2(const uint32_t* xp, const uint32_t* gn, const uint32_t* zn, uint32_t* gxp,
                                            const int (&g_off)[2], int words, const ConvShape& s,
                                            const WordNorm<TT, V, NORM>& norm, const WordGradNorm<TT, V, GNORM>& gnorm,
                                            const float (&wr)[9][V], float (&acc)[10][V], float (&bn_sums)[2][V]) {
  constexpr int K = 3;
  auto kernel_row = [](int slot) { return NS == 2 ? 2 * slot : 1; };
  float held[NS][V];  // grad_out column q of each output row
#pragma unroll
  for (int sl = 0; sl < NS; ++sl) widen_word<TT, V>(g_off[sl] >= 0 ? gnorm.load(gn, zn, g_off[sl]) : 0u, held[sl]);
  for (int q0 = 0; 2 * q0 < s.W; q0 += U) {
    uint32_t yraw[U][2], graw[U][NS];
    uint32_t zraw[GNORM ? U : 1][NS];  // GNORM: the next BatchNorm's input words beside graw's
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int q = q0 + u;
#pragma unroll
      for (int i = 0; i < 2; ++i) yraw[u][i] = 2 * q + i < s.W ? __ldg(xp + (2 * q + i) * words) : 0u;
#pragma unroll
      for (int sl = 0; sl < NS; ++sl) {
        const bool ok = g_off[sl] >= 0 && q + 1 < s.OW;
        graw[u][sl] = ok ? __ldg(gn + g_off[sl] + (q + 1) * words) : 0u;
        if constexpr (GNORM) zraw[u][sl] = ok ? __ldg(zn + g_off[sl] + (q + 1) * words) : 0u;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int q = q0 + u;
      float fresh[NS][V];
#pragma unroll
      for (int sl = 0; sl < NS; ++sl) {
        uint32_t word = graw[u][sl];
        if constexpr (GNORM) word = g_off[sl] >= 0 && q + 1 < s.OW ? gnorm.apply(word, zraw[u][sl]) : 0u;
        widen_word<TT, V>(word, fresh[sl]);
      }
      float d[2][V];  // grad_input at 2q and 2q + 1
#pragma unroll
      for (int v = 0; v < V; ++v) d[0][v] = d[1][v] = 0.f;
#pragma unroll
      for (int sl = 0; sl < NS; ++sl) {
        const int kh = kernel_row(sl);
#pragma unroll
        for (int v = 0; v < V; ++v) {
          d[0][v] = fmaf(wr[kh * K + 1][v], held[sl][v], d[0][v]);
          d[1][v] = fmaf(wr[kh * K + 0][v], fresh[sl][v], d[1][v]);
          d[1][v] = fmaf(wr[kh * K + 2][v], held[sl][v], d[1][v]);
        }
      }
      float xv[2][V];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int iw = 2 * q + i;
        if (iw >= s.W) {  // an odd width's last pair: no column 2q + 1
#pragma unroll
          for (int v = 0; v < V; ++v) xv[i][v] = 0.f;
          continue;
        }
        const uint32_t stored = narrow_word<TT, V>(d[i]);
        if (gxp != nullptr) gxp[iw * words] = stored;
        widen_word<TT, V>(norm(yraw[u][i]), xv[i]);
        if constexpr (NORM) add_grad_sums<TT, V>(stored, yraw[u][i], xv[i], true, norm.mean, bn_sums);
      }
      if constexpr (!NORM && NS == 1) {
#pragma unroll
        for (int v = 0; v < V; ++v) acc[9][v] += held[0][v];
      }
#pragma unroll
      for (int sl = 0; sl < NS; ++sl) {
        const int kh = kernel_row(sl);
#pragma unroll
        for (int v = 0; v < V; ++v) {
          acc[kh * K + 1][v] = fmaf(held[sl][v], xv[0][v], acc[kh * K + 1][v]);
          acc[kh * K + 0][v] = fmaf(fresh[sl][v], xv[1][v], acc[kh * K + 0][v]);
          acc[kh * K + 2][v] = fmaf(held[sl][v], xv[1][v], acc[kh * K + 2][v]);
          held[sl][v] = fresh[sl][v];
        }
      }
    }
  }
}

// Blocks of 256 per SM: 16-bit at 2 (95 registers with 2 pairs in flight, 102-104 with 4; at 3 blocks, ptxas of nvcc
// 13.0 for sm_90 spills under the 80-register cap), fp32 at 3 (64). GNORM adds 6 x V constants and a second load per
// grad_out word: 16-bit 116 registers at 2 pairs and 128 at 4 (its default), fp32 79 at 2 (its default), no spills
// (fp32 at 4 pairs spills 8 bytes).
template <int V>
constexpr int kInputRowS2MinBlocks = V == 1 ? 3 : 2;

// GNORM: go is the gradient of the BatchNorm + ReLU after the convolution, as in the stride-1 walk. NORM false: the
// plain op's backward (walk_row_s2), sums unused.
template <class TT, int V, int U, bool GNORM = false, bool NORM = true>
__global__ void __launch_bounds__(256, kInputRowS2MinBlocks<V>)
    bwd_nhwc_input_row_s2_kernel(const uint32_t* __restrict__ go, const uint32_t* __restrict__ x,
                                 float* __restrict__ ws, ConvShape s, Tiling t, InputNorm input_norm,
                                 const typename TT::S* __restrict__ w, uint32_t* __restrict__ gx,
                                 float* __restrict__ sums, OutputGradNorm out_norm) {
  constexpr int KK = 9;
  extern __shared__ float red[];  // [warps][lanes_c][(KK + 1) * V]
  const InputRowLane<V> lane(s, t);
  const int words = lane.words, cw = lane.cw;
  float acc[KK + 1][V], bn_sums[2][V], wr[KK][V];  // weight gradient, BatchNorm sums, the lane's fp32 weights
  static_assert(NORM || !GNORM, "the plain walk applies no BatchNorm");
  fill(acc, 0.f);
  fill(bn_sums, 0.f);
  WordNorm<TT, V, NORM> norm;
  WordGradNorm<TT, V, GNORM> gnorm;
  if (lane.active) {
    norm.setup(input_norm, cw * V);
    gnorm.setup(out_norm, cw * V);
#pragma unroll
    for (int v = 0; v < V; ++v)
#pragma unroll
      for (int k = 0; k < KK; ++k) wr[k][v] = TT::to_acc(__ldg(w + (cw * V + v) * KK + k));
    for (int tile = lane.blk.chunk; tile < t.tiles_h; tile += lane.blk.chunks) {
      const int r = tile * t.sy_n + lane.ln.sy;
      if (r >= s.N * s.H) continue;
      const int n = r / s.H, ih = r - n * s.H;
      const uint32_t* xp = x + static_cast<size_t>(r) * s.W * words + cw;
      const size_t g_base = static_cast<size_t>(n) * s.OH * s.OW * words + cw;
      const uint32_t* gn = go + g_base;
      const uint32_t* zn = GNORM ? static_cast<const uint32_t*>(out_norm.x) + g_base : nullptr;
      // gx null: the sums and the weight gradient only (the input gradient is recomputed with the BatchNorm's).
      uint32_t* gxp = gx != nullptr ? gx + static_cast<size_t>(r) * s.W * words + cw : nullptr;
      const int kh0 = (ih + 1) & 1;
      int g_off[2];  // the first word of output row (ih + 1 - kh) / 2 for kh = kh0, kh0 + 2; -1 outside
#pragma unroll
      for (int sl = 0; sl < 2; ++sl) {
        const int kh = kh0 + 2 * sl, oh = (ih + 1 - kh) / 2;
        g_off[sl] = kh < 3 && ih + 1 - kh >= 0 && oh < s.OH ? oh * s.OW * words : -1;
      }
      if (kh0 == 0) {
        walk_row_s2<TT, V, 2, U, GNORM, NORM>(xp, gn, zn, gxp, g_off, words, s, norm, gnorm, wr, acc, bn_sums);
      } else {
        walk_row_s2<TT, V, 1, U, GNORM, NORM>(xp, gn, zn, gxp, g_off, words, s, norm, gnorm, wr, acc, bn_sums);
      }
    }
  }
  reduce_nhwc_partials<KK, V>(acc, red, ws, s, t, lane.blk.group, lane.blk.chunk);
  if constexpr (NORM) {
    __syncthreads();  // red is reused
    reduce_nhwc_partials<1, V, true>(bn_sums, red, sums, s, t, lane.blk.group, lane.blk.chunk);
  }
}

// Column walk: one 32-bit word per lane (2 channels of 16-bit data, 1 of fp32). Tiling with one strip per
// row: lanes_c <= 32 words of one pixel, 256 / lanes_c rows of the flattened (n, oh) index per block
// (fewer when there are fewer rows), one tile per band of rows.
// resident: the blocks per SM the kernel's registers allow (its MINB). WGRAD_BLOCKS_PER_SM was measured at 4; a
// kernel with fewer can get proportionally fewer blocks, so that its grid keeps the same number of waves.
// rows: the rows of the flattened (n, row) index the lanes walk (output rows; input rows for the input-row walks).
WgradPlan plan_rows(const ConvShape& s, DType dt, int rows, int resident) {
  WgradPlan p{};
  const int words = s.C * elem_size(dt) / 4;
  p.tiling = make_tiling(true, rows, 0, 1, words, 32, 1);
  p.num_tiles = p.tiling.tiles_h;
  const int target_blocks = num_sms() * knob(Knob::kWgradBlocksPerSm, dt) * resident / 4;
  p.chunks = ceil_div(target_blocks, p.tiling.groups);
  if (p.chunks > p.num_tiles) p.chunks = p.num_tiles;
  if (p.chunks < 1) p.chunks = 1;
  return p;
}

WgradPlan plan_column(const ConvShape& s, DType dt, int resident = 4) { return plan_rows(s, dt, s.N * s.OH, resident); }

template <class TT, int S, bool NORM = false>
void run_wgrad_column(const ConvShape& s, const WgradPlan& p, const void* go, const void* x, float* ws,
                      cudaStream_t stream, const InputNorm& norm) {
  constexpr int K = 3;
  constexpr int VW = 4 / sizeof(typename TT::S);  // channels per 32-bit word
  constexpr int kMaxUnroll = ColumnWalk<S, VW>::kMaxUnroll;
  const Tiling& t = p.tiling;
  const size_t smem = partials_smem_bytes(t, K * K, VW);
  const dim3 grid(t.groups * p.chunks);
  wgrad_nhwc_column_kernel<TT, S, kMaxUnroll, VW, NORM, kWgradColumnMinBlocks<NORM, VW>><<<grid, t.block, smem, stream>>>(
      static_cast<const uint32_t*>(go), static_cast<const uint32_t*>(x), ws, s, t, norm);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT>
void wgrad_column_t(const ConvShape& s, const WgradPlan& p, const void* go, const void* x, float* ws,
                    cudaStream_t st) {
  (s.SH == 1 ? run_wgrad_column<TT, 1> : run_wgrad_column<TT, 2>)(s, p, go, x, ws, st, InputNorm{});
}

// Stride 1, padding 1 (MobileNet's stride-1 layers): the input-row walk; otherwise the column walk with NORM.
template <class TT>
void wgrad_column_normed_t(const ConvShape& s, const WgradPlan& p, const void* go, const void* y, float* ws,
                           cudaStream_t st, const InputNorm& norm) {
  if (s.SH == 1 && s.PH == 1 && s.PW == 1) return run_wgrad_input_row<TT>(s, p, go, y, ws, st, norm);
  (s.SH == 1 ? run_wgrad_column<TT, 1, true> : run_wgrad_column<TT, 2, true>)(s, p, go, y, ws, st, norm);
}

// Stage 1 of the 16/32-bit techniques (tiled or column) with plan p; returns the chunks written. The dispatch's
// tiled and column tests exclude fp64.
int run_planned(const ConvShape& s, DType dt, const WgradPlan& p, bool column, const void* go, const void* x,
                void* ws, cudaStream_t stream) {
  float* wsf = static_cast<float*>(ws);
  switch (dt) {
    case DType::F32: (column ? wgrad_column_t<F32T> : wgrad_tiled_t<F32T>)(s, p, go, x, wsf, stream); break;
    case DType::F16: (column ? wgrad_column_t<F16T> : wgrad_tiled_t<F16T>)(s, p, go, x, wsf, stream); break;
    case DType::BF16: (column ? wgrad_column_t<BF16T> : wgrad_tiled_t<BF16T>)(s, p, go, x, wsf, stream); break;
    default: break;
  }
  return p.chunks;
}

// ---- generic ----

// Taps per side of the register tile a generic block accumulates: a kernel larger than 7x7 is cut into
// 7x7 tiles of taps, one tile per block along the grid's z (grid-stride), each rereading its elements.
constexpr int kTapTile = 7;

// Lanes of a generic wgrad block: channels x elements of (n, oh, ow). NHWC puts 32 channels side by
// side (coalesced); NCHW gives the whole block to one channel and runs along its plane.
inline int generic_channel_lanes(const DepthwiseShape& s) { return s.channels_last ? 32 : 1; }

inline long long ceil_div64(long long a, long long b) { return (a + b - 1) / b; }

inline long long generic_tap_tiles_w(const DepthwiseShape& s) { return ceil_div64(s.KW, kTapTile); }
inline long long generic_tap_tiles(const DepthwiseShape& s) {
  return ceil_div64(s.KH, kTapTile) * generic_tap_tiles_w(s);
}

// Any kernel size, stride, padding, dilation and depth multiplier: the partials of output channel oc (its own
// filter) from input channel oc / M. Channel groups (grid y) and tap tiles (grid z) are grid-stride loops, so
// any channel count and kernel size fit the grid; every (chunk, oc, tap) partial is written by one block.
template <class TT, class I>
__global__ void __launch_bounds__(256)
    wgrad_generic_kernel(const typename TT::S* __restrict__ go, const typename TT::S* __restrict__ x,
                         typename TT::Acc* __restrict__ ws, GenericShape<I> s, int channel_lanes, I tiles_w,
                         I tiles) {
  using Acc = typename TT::Acc;
  __shared__ Acc buf[256];
  const int elem_lanes = blockDim.x / channel_lanes;
  const int tx = threadIdx.x % channel_lanes, ty = threadIdx.x / channel_lanes;
  const I OC = s.OC(), KK = s.KH * s.KW;
  const I total = s.N * s.OH * s.OW;
  const I groups = (OC + channel_lanes - 1) / channel_lanes;
  for (I group = blockIdx.y; group < groups; group += gridDim.y) {
    const I oc = group * channel_lanes + tx;
    const I c = oc / s.M;
    for (I tile = blockIdx.z; tile < tiles; tile += gridDim.z) {
      const I kh0 = tile / tiles_w * kTapTile, kw0 = tile % tiles_w * kTapTile;
      Acc acc[kTapTile][kTapTile];
      Acc acc_b = Acc(0);
#pragma unroll
      for (int kh = 0; kh < kTapTile; ++kh)
#pragma unroll
        for (int kw = 0; kw < kTapTile; ++kw) acc[kh][kw] = Acc(0);
      if (oc < OC) {
        for (I m = static_cast<I>(blockIdx.x) * elem_lanes + ty; m < total;
             m += static_cast<I>(gridDim.x) * elem_lanes) {
          const I ow = m % s.OW;
          const I oh = m / s.OW % s.OH;
          const I n = m / (s.OW * s.OH);
          const Acc g = TT::to_acc(go[offset<I>(n, oc, oh, ow, OC, s.OH, s.OW, s.channels_last)]);
          acc_b += g;
#pragma unroll
          for (int kh = 0; kh < kTapTile; ++kh) {
            const I ih = oh * s.SH - s.PH + (kh0 + kh) * s.DH;
            if (kh0 + kh >= s.KH || ih < 0 || ih >= s.H) continue;
#pragma unroll
            for (int kw = 0; kw < kTapTile; ++kw) {
              const I iw = ow * s.SW - s.PW + (kw0 + kw) * s.DW;
              if (kw0 + kw >= s.KW || iw < 0 || iw >= s.W) continue;
              acc[kh][kw] += g * TT::to_acc(x[offset<I>(n, c, ih, iw, s.C, s.H, s.W, s.channels_last)]);
            }
          }
        }
      }
      // Fixed-order reduction over the element lanes, one tap at a time.
      auto reduce_slot = [&](Acc v, I slot) {
        buf[threadIdx.x] = v;
        __syncthreads();
        if (ty == 0 && oc < OC) {
          Acc sum = Acc(0);
          for (int e = 0; e < elem_lanes; ++e) sum += buf[e * channel_lanes + tx];
          ws[(static_cast<I>(blockIdx.x) * OC + oc) * (KK + 1) + slot] = sum;
        }
        __syncthreads();
      };
#pragma unroll
      for (int kh = 0; kh < kTapTile; ++kh)
#pragma unroll
        for (int kw = 0; kw < kTapTile; ++kw)
          if (kh0 + kh < s.KH && kw0 + kw < s.KW) reduce_slot(acc[kh][kw], (kh0 + kh) * s.KW + kw0 + kw);
      if (tile == 0) reduce_slot(acc_b, KK);
    }
  }
}

// Stage 2 of the generic path where a 32-bit index does not reach every weight: grid-stride over (oc, slot).
template <class TT>
__global__ void wgrad_finalize_wide_kernel(const typename TT::Acc* __restrict__ ws, int chunks, long long OC,
                                           long long KK, typename TT::S* __restrict__ gw,
                                           typename TT::S* __restrict__ gb) {
  using Acc = typename TT::Acc;
  const long long slots = KK + 1;
  for (long long idx = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; idx < OC * slots;
       idx += static_cast<long long>(gridDim.x) * blockDim.x) {
    Acc sum = Acc(0);
    for (int g = 0; g < chunks; ++g) sum += ws[g * OC * slots + idx];
    const long long oc = idx / slots, k = idx - oc * slots;
    if (k < KK) {
      if (gw) gw[oc * KK + k] = TT::from_acc(sum);
    } else if (gb) {
      gb[oc] = TT::from_acc(sum);
    }
  }
}

template <class TT, class I>
void wgrad_generic_i(const DepthwiseShape& d, const void* go, const void* x, void* ws, int chunks, cudaStream_t st) {
  using Sx = typename TT::S;
  const int lanes = generic_channel_lanes(d);
  const long long groups = ceil_div64(d.C * d.M, lanes), tiles = generic_tap_tiles(d);
  const dim3 grid(chunks, static_cast<unsigned>(groups < 65535 ? groups : 65535),
                  static_cast<unsigned>(tiles < 65535 ? tiles : 65535));
  wgrad_generic_kernel<TT, I><<<grid, 256, 0, st>>>(static_cast<const Sx*>(go), static_cast<const Sx*>(x),
                                                    static_cast<typename TT::Acc*>(ws), generic_shape<I>(d), lanes,
                                                    static_cast<I>(generic_tap_tiles_w(d)), static_cast<I>(tiles));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT>
void wgrad_finalize_wide_t(const DepthwiseShape& d, const void* ws, int chunks, void* gw, void* gb, cudaStream_t st) {
  using Sx = typename TT::S;
  const long long OC = d.C * d.M, KK = d.KH * d.KW;
  wgrad_finalize_wide_kernel<TT><<<grid_for(OC * (KK + 1), 256), 256, 0, st>>>(
      static_cast<const typename TT::Acc*>(ws), chunks, OC, KK, static_cast<Sx*>(gw), static_cast<Sx*>(gb));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT>
void wgrad_generic_t(const DepthwiseShape& d, const void* go, const void* x, void* ws, int chunks, cudaStream_t st) {
  const bool narrow = generic_fits_int(d, static_cast<long long>(chunks) * d.C * d.M * (d.KH * d.KW + 1));
  (narrow ? wgrad_generic_i<TT, int> : wgrad_generic_i<TT, long long>)(d, go, x, ws, chunks, st);
}

void generic_partials(const DepthwiseShape& s, DType dt, const void* go, const void* x, void* ws, int chunks,
                      cudaStream_t stream) {
  MDW_DISPATCH(dt, wgrad_generic_t, s, go, x, ws, chunks, stream)
}

void generic_finalize_wide(const DepthwiseShape& s, DType dt, const void* ws, int chunks, void* gw, void* gb,
                           cudaStream_t stream) {
  MDW_DISPATCH(dt, wgrad_finalize_wide_t, s, ws, chunks, gw, gb, stream)
}

// ---- finalize ----

template <class TT>
__global__ void wgrad_finalize_kernel(const typename TT::Acc* __restrict__ ws, int chunks, int C, int KK,
                                      typename TT::S* __restrict__ gw, typename TT::S* __restrict__ gb) {
  using Acc = typename TT::Acc;
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  const int slots = KK + 1;
  if (idx >= C * slots) return;
  Acc sum = Acc(0);
  for (int g = 0; g < chunks; ++g) sum += ws[static_cast<size_t>(g) * C * slots + idx];
  const int c = idx / slots, k = idx - c * slots;
  if (k < KK) {
    if (gw) gw[c * KK + k] = TT::from_acc(sum);
  } else if (gb) {
    gb[c] = TT::from_acc(sum);
  }
}

template <class TT>
void finalize_t(const ConvShape& s, const void* ws, int chunks, void* gw, void* gb, cudaStream_t st) {
  using Sx = typename TT::S;
  const int KK = s.KH * s.KW;
  const int total = s.C * (KK + 1);
  wgrad_finalize_kernel<TT><<<ceil_div(total, 256), 256, 0, st>>>(
      static_cast<const typename TT::Acc*>(ws), chunks, s.C, KK, static_cast<Sx*>(gw), static_cast<Sx*>(gb));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

int weight_grad_tiled_chunks(const ConvShape& s, DType dt) { return plan_tiled(s, dt).chunks; }

int weight_grad_tiled(const ConvShape& s, DType dt, const void* go, const void* x, void* ws, cudaStream_t stream) {
  return run_planned(s, dt, plan_tiled(s, dt), /*column=*/false, go, x, ws, stream);
}

int weight_grad_column_chunks(const ConvShape& s, DType dt) { return plan_column(s, dt).chunks; }

// The NORM walk's plan. Measured on the H200 (scripts/experiments/norm_in_depthwise_layers.py, fp16, batch 256): with
// the grid cut to its 3 resident blocks per SM the layers of 28 columns or more took 11-24% less time than with
// WGRAD_BLOCKS_PER_SM's full grid, the 14- and 7-wide ones 10-13% more, so those keep the full grid.
static WgradPlan plan_column_normed(const ConvShape& s, DType dt) {
  const int resident = dt == DType::F32 ? kWgradColumnMinBlocks<true, 1> : kWgradColumnMinBlocks<true, 2>;
  return plan_column(s, dt, s.OW >= 28 ? resident : 4);
}

int weight_grad_column_normed_chunks(const ConvShape& s, DType dt) { return plan_column_normed(s, dt).chunks; }

int weight_grad_column_normed(const ConvShape& s, DType dt, const void* go, const void* y, const InputNorm& norm,
                              void* ws, cudaStream_t stream) {
  const WgradPlan p = plan_column_normed(s, dt);
  float* wsf = static_cast<float*>(ws);
  switch (dt) {
    case DType::F32: wgrad_column_normed_t<F32T>(s, p, go, y, wsf, stream, norm); break;
    case DType::F16: wgrad_column_normed_t<F16T>(s, p, go, y, wsf, stream, norm); break;
    case DType::BF16: wgrad_column_normed_t<BF16T>(s, p, go, y, wsf, stream, norm); break;
    default: break;  // normed_fits excludes fp64
  }
  return p.chunks;
}

// The walks' plans: the weight gradient's, over output rows at stride 1 and input rows at stride 2, with the grid cut
// to the blocks their registers allow on the layers of 28 output columns or more, as plan_column_normed does.
static WgradPlan plan_input_row_backward(const ConvShape& s, DType dt) {
  const bool f32 = dt == DType::F32;
  if (s.SH == 2) {
    const int resident = f32 ? kInputRowS2MinBlocks<1> : kInputRowS2MinBlocks<2>;
    return plan_rows(s, dt, s.N * s.H, s.OW >= 28 ? resident : 4);
  }
  const int resident = f32 ? kInputRowMinBlocks<true, 1> : kInputRowMinBlocks<true, 2>;
  return plan_column(s, dt, s.OW >= 28 ? resident : 4);
}

int backward_input_row_normed_chunks(const ConvShape& s, DType dt) { return plan_input_row_backward(s, dt).chunks; }

template <class TT, bool GNORM, bool NORM = true>
void run_bwd_input_row_s2(const ConvShape& s, DType dt, const WgradPlan& p, const void* go, const void* y,
                          const void* w, const InputNorm& norm, void* gx, float* ws, float* sums,
                          const OutputGradNorm& out_norm, cudaStream_t stream) {
  constexpr int VW = 4 / sizeof(typename TT::S);
  const Tiling& t = p.tiling;
  const size_t smem = partials_smem_bytes(t, 9, VW);
  auto kernel = knob(Knob::kS2WalkPairs, dt) == 4 ? bwd_nhwc_input_row_s2_kernel<TT, VW, 4, GNORM, NORM>
                                                        : bwd_nhwc_input_row_s2_kernel<TT, VW, 2, GNORM, NORM>;
  kernel<<<dim3(t.groups * p.chunks), t.block, smem, stream>>>(
      static_cast<const uint32_t*>(go), static_cast<const uint32_t*>(y), ws, s, t, norm,
      static_cast<const typename TT::S*>(w), static_cast<uint32_t*>(gx), sums, out_norm);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// norm null: the plain op's walks (NORM false, no sums); else the normalizing ones, with the sums and the BatchNorm
// after the convolution where asked.
template <class TT>
void backward_input_row_t(const ConvShape& s, DType dt, const WgradPlan& p, const void* go, const void* y,
                          const void* w, const InputNorm* norm, void* gx, float* ws, float* sums,
                          const OutputGradNorm* out_norm, cudaStream_t st) {
  if (norm == nullptr && s.SH == 2) {
    run_bwd_input_row_s2<TT, false, false>(s, dt, p, go, y, w, InputNorm{}, gx, ws, nullptr, {}, st);
  } else if (norm == nullptr) {
    run_wgrad_input_row<TT, true, false, false, false>(s, p, go, y, ws, st, InputNorm{}, w, gx);
  } else if (s.SH == 2 && out_norm != nullptr) {
    run_bwd_input_row_s2<TT, true>(s, dt, p, go, y, w, *norm, gx, ws, sums, *out_norm, st);
  } else if (s.SH == 2) {
    run_bwd_input_row_s2<TT, false>(s, dt, p, go, y, w, *norm, gx, ws, sums, {}, st);
  } else if (out_norm != nullptr) {
    run_wgrad_input_row<TT, true, true, true>(s, p, go, y, ws, st, *norm, w, gx, sums, *out_norm);
  } else if (sums != nullptr) {
    run_wgrad_input_row<TT, true, true>(s, p, go, y, ws, st, *norm, w, gx, sums);
  } else {
    run_wgrad_input_row<TT, true>(s, p, go, y, ws, st, *norm, w, gx);
  }
}

static int run_backward_input_row(const ConvShape& s, DType dt, const void* go, const void* y, const void* w,
                                  const InputNorm* norm, void* gx, void* ws, float* sums,
                                  const OutputGradNorm* out_norm, cudaStream_t stream) {
  const WgradPlan p = plan_input_row_backward(s, dt);
  float* wsf = static_cast<float*>(ws);
  switch (dt) {
    case DType::F32: backward_input_row_t<F32T>(s, dt, p, go, y, w, norm, gx, wsf, sums, out_norm, stream); break;
    case DType::F16: backward_input_row_t<F16T>(s, dt, p, go, y, w, norm, gx, wsf, sums, out_norm, stream); break;
    case DType::BF16: backward_input_row_t<BF16T>(s, dt, p, go, y, w, norm, gx, wsf, sums, out_norm, stream); break;
    default: break;  // normed_fits and bwd_walk_fits exclude fp64
  }
  return p.chunks;
}

int backward_input_row_normed(const ConvShape& s, DType dt, const void* go, const void* y, const void* w,
                              const InputNorm& norm, void* gx, void* ws, float* sums, const OutputGradNorm* out_norm,
                              cudaStream_t stream) {
  return run_backward_input_row(s, dt, go, y, w, &norm, gx, ws, sums, out_norm, stream);
}

int backward_input_row(const ConvShape& s, DType dt, const void* go, const void* x, const void* w, void* gx, void* ws,
                       cudaStream_t stream) {
  return run_backward_input_row(s, dt, go, x, w, nullptr, gx, ws, nullptr, nullptr, stream);
}

int weight_grad_column(const ConvShape& s, DType dt, const void* go, const void* x, void* ws, cudaStream_t stream) {
  return run_planned(s, dt, plan_column(s, dt), /*column=*/true, go, x, ws, stream);
}

int weight_grad_generic_chunks(const DepthwiseShape& s) {
  const int lanes = generic_channel_lanes(s);
  const int elem_lanes = 256 / lanes;
  const long long total = s.N * s.OH * s.OW;
  const long long max_chunks = ceil_div64(total, elem_lanes);
  long long chunks = ceil_div64(static_cast<long long>(num_sms()) * 8, ceil_div64(s.C * s.M, lanes));
  if (chunks > max_chunks) chunks = max_chunks;
  return chunks < 1 ? 1 : static_cast<int>(chunks);
}

void weight_grad_generic(const DepthwiseShape& s, DType dt, const void* go, const void* x, void* ws, void* gw,
                         void* gb, cudaStream_t stream) {
  const int chunks = weight_grad_generic_chunks(s);
  generic_partials(s, dt, go, x, ws, chunks, stream);
  const long long oc = s.C * s.M, slots = s.KH * s.KW + 1;
  if (oc * slots < (1LL << 31) - (1LL << 26)) {
    // the finalize every technique runs, on the shape with OC channels
    ConvShape f{};
    f.C = static_cast<int>(oc);
    f.KH = static_cast<int>(s.KH);
    f.KW = static_cast<int>(s.KW);
    weight_grad_finalize(f, dt, ws, chunks, gw, gb, stream);
  } else {
    generic_finalize_wide(s, dt, ws, chunks, gw, gb, stream);
  }
}

void weight_grad_finalize(const ConvShape& s, DType dt, const void* ws, int chunks, void* gw, void* gb,
                          cudaStream_t stream) {
  MDW_DISPATCH(dt, finalize_t, s, ws, chunks, gw, gb, stream)
}

}  // namespace mdw
