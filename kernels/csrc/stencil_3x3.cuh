// The 3x3 stencils that run both as the forward and, with the kernel rotated 180 degrees (FLIP), as the stride-1
// input gradient: grad_input = conv(grad_out, rot180(w), stride 1, padding K - 1 - P). depthwise_forward.cu
// instantiates them with FLIP = false, depthwise_input_grad.cu with FLIP = true.
#pragma once

#include <c10/cuda/CUDAException.h>

#include "device_common.h"

namespace mdw {
namespace {

// NCHW, 3x3, stride 1, padding 1 (MobileNet's stride-1 layers) with vector loads: a lane owns TW
// aligned columns, loads them as one vector per input row and gets the one-column halo on each side
// from its neighbour lanes by shuffles (a scalar load only at warp/tile edges). 2-byte scalar loads
// made the generic NCHW kernel slower in fp16 than in fp32. FLIP runs the same stencil with the
// kernel rotated by 180 degrees, which is the input gradient of this convolution.
template <class TT, int TW, bool FLIP>
__global__ void __launch_bounds__(256)
    conv3x3_nchw_vec_kernel(const typename TT::S* __restrict__ x, const typename TT::S* __restrict__ w,
                            const typename TT::S* __restrict__ bias, typename TT::S* __restrict__ y, ConvShape s,
                            Tiling t) {
  using Sx = typename TT::S;
  const int lane = threadIdx.x;
  const NchwLane ln = nchw_lane(lane, t);
  const TileIndex tile = split_tile_index(blockIdx.x, t);
  const long long plane = static_cast<long long>(tile.outer) * t.lanes_c + ln.q;
  const int oh = tile.tile_h * t.sy_n + ln.sy;
  const int ow0 = (tile.tile_w * t.sx_n + ln.sx) * TW;
  // Every lane takes part in the shuffles; only valid lanes load and store.
  const bool valid = lane < t.threads && plane < static_cast<long long>(s.N) * s.C && oh < s.H && ow0 < s.W;
  const bool left_from_lane = ln.sx > 0 && (lane & 31) != 0;
  const bool right_from_lane = ln.sx + 1 < t.sx_n && (lane & 31) != 31 && lane + 1 < t.threads;
  const int c = valid ? static_cast<int>(plane % s.C) : 0;
  const Sx* xp = x + (valid ? plane : 0) * s.H * s.W;

  float acc[TW];
  const float bv = (bias && valid) ? TT::to_acc(bias[c]) : 0.f;
#pragma unroll
  for (int j = 0; j < TW; ++j) acc[j] = bv;
#pragma unroll
  for (int kh = 0; kh < 3; ++kh) {
    const int ih = oh - 1 + kh;
    const bool row_ok = valid && ih >= 0 && ih < s.H;
    const Sx* row = xp + static_cast<size_t>(row_ok ? ih : 0) * s.W;
    float v[TW + 2];
    if (row_ok) {
      float center[TW];
      load_vec<TT, TW>(row + ow0, center);
#pragma unroll
      for (int j = 0; j < TW; ++j) v[j + 1] = center[j];
    } else {
#pragma unroll
      for (int j = 0; j < TW; ++j) v[j + 1] = 0.f;
    }
    const float from_left = __shfl_up_sync(0xffffffffu, v[TW], 1);
    const float from_right = __shfl_down_sync(0xffffffffu, v[1], 1);
    v[0] = left_from_lane ? from_left : (row_ok && ow0 > 0 ? TT::to_acc(row[ow0 - 1]) : 0.f);
    v[TW + 1] = right_from_lane ? from_right : (row_ok && ow0 + TW < s.W ? TT::to_acc(row[ow0 + TW]) : 0.f);
    float wk[3];
#pragma unroll
    for (int kw = 0; kw < 3; ++kw) wk[kw] = TT::to_acc(w[c * 9 + (FLIP ? 8 - (kh * 3 + kw) : kh * 3 + kw)]);
#pragma unroll
    for (int j = 0; j < TW; ++j)
#pragma unroll
      for (int kw = 0; kw < 3; ++kw) acc[j] = fmaf(wk[kw], v[j + kw], acc[j]);
  }
  if constexpr (!FLIP) activate(acc, s.act);
  if (valid) store_vec<TT, TW>(y + (plane * s.H + oh) * s.W + ow0, acc);
}

template <class TT, int TW, bool FLIP>
void run_conv3x3_nchw_vec(const ConvShape& s, const void* x, const void* w, const void* bias, void* y,
                          cudaStream_t stream) {
  using Sx = typename TT::S;
  const Tiling t = make_tiling(false, s.H, 0, s.W / TW, s.N * s.C);
  const dim3 grid(t.groups * t.tiles_h * t.tiles_w);
  conv3x3_nchw_vec_kernel<TT, TW, FLIP><<<grid, t.block, 0, stream>>>(
      static_cast<const Sx*>(x), static_cast<const Sx*>(w), static_cast<const Sx*>(bias), static_cast<Sx*>(y), s, t);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT, bool FLIP>
bool conv3x3_nchw_vec_t(const ConvShape& s, const void* x, const void* w, const void* bias, void* y,
                        cudaStream_t st) {
  constexpr int kMaxTW = 16 / sizeof(typename TT::S);
  const int eb = sizeof(typename TT::S);
  // Measured on the H200 (docs/kernel_notes.md): a win only with 16-byte vectors of 16-bit data; with
  // fp32, or narrower vectors, the scalar-load kernel is as fast or faster.
  for (int tw = kMaxTW; tw >= 8; tw /= 2) {
    if (s.W % tw != 0 || !aligned(x, tw * eb) || !aligned(y, tw * eb)) continue;
    if (tw == 8) run_conv3x3_nchw_vec<TT, (kMaxTW >= 8 ? 8 : 4), FLIP>(s, x, w, bias, y, st);
    else if (tw == 4) run_conv3x3_nchw_vec<TT, 4, FLIP>(s, x, w, bias, y, st);
    else run_conv3x3_nchw_vec<TT, 2, FLIP>(s, x, w, bias, y, st);
    return true;
  }
  return false;
}

// The dtype switch; false when the case is not the vector kernel's: NCHW 3x3, stride 1, padding 1, dilation 1,
// 16/32-bit, and (conv3x3_nchw_vec_t) rows that split into aligned vectors.
template <bool FLIP>
bool conv3x3_nchw_vec(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                      cudaStream_t stream) {
  if (s.channels_last || dt == DType::F64 || s.KH != 3 || s.KW != 3 || s.SH != 1 || s.SW != 1 || s.PH != 1 ||
      s.PW != 1 || s.DH != 1 || s.DW != 1 || s.OH != s.H || s.OW != s.W)
    return false;
  switch (dt) {
    case DType::F32: return conv3x3_nchw_vec_t<F32T, FLIP>(s, x, w, bias, y, stream);
    case DType::F16: return conv3x3_nchw_vec_t<F16T, FLIP>(s, x, w, bias, y, stream);
    case DType::BF16: return conv3x3_nchw_vec_t<BF16T, FLIP>(s, x, w, bias, y, stream);
    default: return false;
  }
}

// NHWC 3x3 column-walking forward (and, with the kernel rotated, the stride-1 input gradient): the
// design of depthwise_weight_grad.cu's wgrad_nhwc_column_kernel applied to the stencil. A lane owns one
// 32-bit word of channels (a pair of 16-bit channels, or one fp32 channel) of one output row (n, oh) and
// walks ow = 0..OW-1 along it. It holds the 3 x 3 input window widened to fp32 in registers; step ow loads
// the S new input columns of the 3 rows (3 * S words, each loaded and widened once), does 9 x V FMAs
// with the lane's fp32 weights (fixed channels: loaded once from global memory, no shared memory) and
// stores one word. A warp reads lanes_c * 4 contiguous bytes of one pixel per load; the loads of U
// steps are issued before their FMAs. The tiled forward kernels (depthwise_forward.cu) instead hold
// 16-byte vectors x several columns per lane (~120 registers, latency-bound).

constexpr int kK = 3;

// Steps whose loads are in flight together: 4 at 64 registers. The tightest variant is 16-bit stride 2 with one row
// per lane (24 words in flight next to the 18 fp32 weights and the 6-float carried window, with the output pointer
// kept opaque as the kernel does; without that it spilled 36 bytes). ptxas of nvcc 13.0 (sm_90) against torch 2.14's
// headers reports 28 bytes of spill stores there, and 100 for fp32 stride 2 with one row per lane (not a default:
// fp32 takes two rows); the other variants do not spill.
constexpr int kColumnUnroll = 4;

// Where a lane's row walk reads: its input rows as word offsets from the image (row0: first input
// row, which may lie above the image; pitch: words per input row).
struct FwdColumnRow {
  const uint32_t* xn;
  int row0, pitch, words;
  int rows_in;  // bit kh: input row kh is inside the image (and needed)
};

// The new words of U steps starting at step t0: input columns (t0 + u) * S - PW + (K - S) + d of the
// KR input rows, each through `norm` (WordNorm). Checked: zeros (and no load) for steps >= OW, columns outside
// [0, W) and rows not in rows_in; unchecked: the caller has seen that every word is inside.
template <bool kChecked, int S, int U, int KR, class Norm>
__device__ __forceinline__ void load_fwd_steps(const FwdColumnRow& row, int W, int OW, int PW, int t0,
                                               const Norm& norm, uint32_t (&raw)[U][KR][S]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int step = t0 + u;
#pragma unroll
    for (int d = 0; d < S; ++d) {
      const int iw = step * S - PW + (kK - S) + d;
      const int offset = row.row0 + iw * row.words;
      const bool col_in = step < OW && static_cast<unsigned>(iw) < static_cast<unsigned>(W);
#pragma unroll
      for (int kh = 0; kh < KR; ++kh) {
        if (!kChecked || (col_in && (row.rows_in >> kh & 1))) {
          raw[u][kh][d] = norm(__ldg(row.xn + (offset + kh * row.pitch)));
        } else {
          raw[u][kh][d] = 0u;
        }
      }
    }
  }
}

// A prefetching walk's words of the next steps, handed to these steps (register moves once unrolled).
template <int U, int KR, int S>
__device__ __forceinline__ void take_words(const uint32_t (&from)[U][KR][S], uint32_t (&to)[U][KR][S]) {
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int kh = 0; kh < KR; ++kh)
#pragma unroll
      for (int d = 0; d < S; ++d) to[u][kh][d] = from[u][kh][d];
}

// STATS: per-lane statistics of the outputs as stored (rounded to TT, so exactly the values a BatchNorm of y reads),
// shifted by the lane's own first output per channel (the pivot) so that a large mean does not cancel the variance
// away in fp32. No bias or activation changes this: the values are whatever the epilogue stores.
template <class TT, int V>
struct ColumnStats {
  float pivot[V], s1[V], s2[V];
  __device__ __forceinline__ void add(const float (&a)[V], bool first) {
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const float y = TT::to_acc(TT::from_acc(a[v]));
      if (first) pivot[v] = y;
      const float d = y - pivot[v];
      s1[v] += d;
      s2[v] = fmaf(d, d, s2[v]);
    }
  }
};

// The block's statistics per channel into partial[band][3][C] (fp64: count, mean, M2 = sum of squared deviations):
// every lane's (count, pivot, s1, s2) goes through shared memory, then lane cv (the band's first row of lanes) adds
// rows sy = 0 .. sy_n - 1 of its channels in that order, in fp64, as sums shifted by row 0's pivot (ref): with
// delta = pivot - ref, a row adds s1 + n * delta and s2 + delta * (2 * s1 + n * delta), the sums of y - ref. ref is
// a value of the block, so these do not cancel the block's M2 away (in fp64 even less than the lanes' fp32 sums),
// and no division is on the chain. Each (band, channel) has exactly one block, so the result depends on the shape
// alone: bitwise repeatable, no atomics.
template <class TT, int V>
__device__ __forceinline__ void write_column_stats(const ColumnStats<TT, V>& st, float count, const Tiling& t, int cv,
                                                   int cw, int words, int band, double* __restrict__ partial) {
  __shared__ float red[1 + 3 * V][256];  // blocks have at most 256 lanes (column_tiling)
  const int lane = threadIdx.x;
  red[0][lane] = count;
#pragma unroll
  for (int v = 0; v < V; ++v) {
    red[1 + v][lane] = st.pivot[v];
    red[1 + V + v][lane] = st.s1[v];
    red[1 + 2 * V + v][lane] = st.s2[v];
  }
  __syncthreads();
  if (lane >= t.lanes_c || cw >= words) return;  // lane < lanes_c: the row sy = 0 (always active), cv = lane
  const int C = words * V;
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const double ref = red[1 + v][cv];
    double n = 0.0, a = 0.0, b = 0.0;
    for (int sy = 0; sy < t.sy_n; ++sy) {
      const int l = cv + t.lanes_c * sy;
      const double nl = red[0][l], s1 = red[1 + V + v][l], s2 = red[1 + 2 * V + v][l];
      const double delta = nl > 0.0 ? static_cast<double>(red[1 + v][l]) - ref : 0.0;
      n += nl;
      a += fma(nl, delta, s1);
      b += fma(delta, fma(nl, delta, 2.0 * s1), s2);
    }
    const double shifted_mean = a / n;
    double* out = partial + static_cast<size_t>(band) * 3 * C + cw * V + v;
    out[0] = n;
    out[C] = ref + shifted_mean;
    out[2 * C] = fmax(b - a * shifted_mean, 0.0);
  }
}

// Lanes: lane = cv + lanes_c * row, the block's rows are a band of consecutive rows of the flattened
// (n, oh / R) index (bands span images, so the 7- and 14-row layers still fill a block), and block b is
// channel group b % groups of band b / groups. R = 2: a lane row is a pair of output rows oh = 2p,
// 2p + 1 of one image (pairs never straddle images; with odd OH the last pair of an image has only
// its first row, whose extra input rows are then neither loaded nor stored); the walk holds the
// K + S input rows of both (stride 1: 4 rows for 2 outputs, stride 2: 5). Every (row, word) has
// exactly one lane, which writes all OW output words of its row(s). With t.reverse the bands run from
// the last image to the first: blocks start roughly in blockIdx order, so the first to run read the end
// of the input, the part its producer wrote last and most likely still in L2, and the last to run write
// the start of the output, which the next layer's kernel reads first. FLIP: the kernel rotated 180
// degrees, no bias and no activation (the input gradient of a stride-1 convolution, run on the flipped shape).
// NORM: the input words go through the BatchNorm + ReLU of `norm` as they are loaded (WordNorm; padding stays zero).
// 4 blocks of 256 per SM (64 registers), as the wgrad column kernel; MINB = 3 (up to 85 registers) for the
// deeper unrolls of FWD_COLUMN_DEEP. STATS: also the statistics of the stored outputs per (band, channel) into
// partial (write_column_stats); then no lane returns early (the block meets at a barrier): lanes without a row or
// word of their own set up a real one, walk none of it and count nothing.
// PREFETCH (FWD_COLUMN_PREFETCH): the next U steps' words are loaded before these U steps' FMAs, as the 5x5/7x7 walks
// do (stencil_column_k57.cuh); not with STATS.
template <class TT, int S, int U, bool FLIP, int R, int MINB, bool STATS = false, bool NORM = false,
          bool PREFETCH = false>
__global__ void __launch_bounds__(256, MINB)
    fwd_nhwc_column_kernel(const uint32_t* __restrict__ x, const typename TT::S* __restrict__ w,
                           const typename TT::S* __restrict__ bias, uint32_t* __restrict__ y, ConvShape s, Tiling t,
                           double* __restrict__ partial, InputNorm input_norm) {
  static_assert(R == 1 || R == 2, "R: output rows per lane");
  constexpr int K = kK, KK = K * K;
  constexpr int KR = K + S * (R - 1);            // input rows held
  constexpr int V = 4 / sizeof(typename TT::S);  // channels per 32-bit word
  constexpr int KH = K - S;                      // window columns carried from one step to the next
  const int lane = threadIdx.x;
  if (!STATS && lane >= t.threads) return;
  const NhwcLane ln = nhwc_lane(lane, t);
  const int words = s.C / V;
  const int cw_own = (blockIdx.x % t.groups) * t.lanes_c + ln.cv;
  const int OHR = R == 1 ? s.OH : (s.OH + 1) >> 1;  // lane rows per image
  const int bands = gridDim.x / t.groups;
  const int band = t.reverse ? bands - 1 - static_cast<int>(blockIdx.x) / t.groups : blockIdx.x / t.groups;
  const int r_own = band * t.sy_n + ln.sy;
  if (!STATS && (cw_own >= words || r_own >= s.N * OHR)) return;
  const bool active = !STATS || (lane < t.threads && cw_own < words && r_own < s.N * OHR);
  const int cw = STATS ? min(cw_own, words - 1) : cw_own;
  const int r = STATS ? min(r_own, s.N * OHR - 1) : r_own;
  const int n = r / OHR, oh = (r - n * OHR) * R;
  const bool second = R == 2 && oh + 1 < s.OH;  // the lane's second output row exists

  // The lane's channels are fixed: its weights (and bias) live in registers for the whole row.
  float wr[KK][V], b[V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const int c = cw * V + v;
#pragma unroll
    for (int k = 0; k < KK; ++k) wr[k][v] = TT::to_acc(__ldg(w + c * KK + (FLIP ? KK - 1 - k : k)));
    b[v] = !FLIP && bias != nullptr ? TT::to_acc(__ldg(bias + c)) : 0.f;
  }
  WordNorm<TT, V, NORM> norm;
  norm.setup(input_norm, cw * V);

  FwdColumnRow row;
  row.xn = x + static_cast<size_t>(n) * s.H * s.W * words + cw;
  uint32_t* yp = y + (static_cast<size_t>(n) * s.OH + oh) * s.OW * words + cw;
  // Opaque to the compiler: it keeps the pointers in registers (one IMAD.WIDE per access) instead of
  // rebuilding them from the kernel arguments at every access; yp's stores go through store_global.
  // Without it 16-bit stride 2 spills at U = 4.
  asm("" : "+l"(row.xn));
  asm("" : "+l"(yp));
  row.pitch = s.W * words;
  row.words = words;
  row.row0 = (oh * S - s.PH) * row.pitch;
  row.rows_in = 0;
#pragma unroll
  for (int kh = 0; kh < KR; ++kh) {
    const int ih = oh * S - s.PH + kh;
    row.rows_in |= (ih >= 0 && ih < s.H && (kh < K || second)) << kh;
  }
  const int ystep2 = s.OW * words;  // the second output row, from the first

  // held[kh][j] = input column step * S - PW + j (j < K - S) before step `step`, widened; zero outside.
  float held[KR][KH][V];
#pragma unroll
  for (int j = 0; j < KH; ++j) {
    const int iw = j - s.PW;
#pragma unroll
    for (int kh = 0; kh < KR; ++kh) {
      uint32_t word = 0u;
      if (static_cast<unsigned>(iw) < static_cast<unsigned>(s.W) && (row.rows_in >> kh & 1))
        word = norm(__ldg(row.xn + (row.row0 + kh * row.pitch + iw * words)));
      widen_word<TT, V>(word, held[kh][j]);
    }
  }

  ColumnStats<TT, V> st;
  if constexpr (STATS) {
#pragma unroll
    for (int v = 0; v < V; ++v) st.pivot[v] = st.s1[v] = st.s2[v] = 0.f;
  }
  const int walk_end = STATS && !active ? 0 : s.OW;
  static_assert(!(PREFETCH && STATS), "the statistics walk keeps the plain order");
  // PREFETCH's words of the next U steps (unused without it).
  uint32_t next[PREFETCH ? U : 1][KR][S];
  if constexpr (PREFETCH) load_fwd_steps<true, S, U, KR>(row, s.W, s.OW, s.PW, 0, norm, next);
  for (int t0 = 0; t0 < walk_end; t0 += U) {
    // Most groups lie inside the image and the row: no bounds tests there. Columns outside load
    // zeros (the padding); steps past OW (a partial last group) neither load nor store.
    uint32_t raw[U][KR][S];
    // The two branches spell out the same group test: a shared helper changed the register allocation of the
    // default (non-prefetching) stride-2 walks, which are the measured ones.
    if constexpr (PREFETCH) {
      take_words(next, raw);
      const int t1 = t0 + U;
      if (t1 < s.OW) {
        const bool inside = row.rows_in == (1 << KR) - 1 && t1 * S - s.PW + KH >= 0 &&
                            (t1 + U - 1) * S - s.PW + K - 1 < s.W && t1 + U <= s.OW;
        if (inside) {
          load_fwd_steps<false, S, U, KR>(row, s.W, s.OW, s.PW, t1, norm, next);
        } else {
          load_fwd_steps<true, S, U, KR>(row, s.W, s.OW, s.PW, t1, norm, next);
        }
      }
    } else {
      const bool inside = row.rows_in == (1 << KR) - 1 && t0 * S - s.PW + KH >= 0 &&
                          (t0 + U - 1) * S - s.PW + K - 1 < s.W && t0 + U <= s.OW;
      if (inside) {
        load_fwd_steps<false, S, U, KR>(row, s.W, s.OW, s.PW, t0, norm, raw);
      } else {
        load_fwd_steps<true, S, U, KR>(row, s.W, s.OW, s.PW, t0, norm, raw);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float acc[R][V];
      column_window_step<TT, S, R, V>(wr, b, held, raw[u], acc);
      if constexpr (!FLIP) {
#pragma unroll
        for (int q = 0; q < R; ++q) activate(acc[q], s.act);
      }
      if (t0 + u < s.OW) {
        store_global(yp + (t0 + u) * words, narrow_word<TT, V>(acc[0]));
        if (R == 2 && second) store_global(yp + (ystep2 + (t0 + u) * words), narrow_word<TT, V>(acc[R - 1]));
        if constexpr (STATS) {
          st.add(acc[0], u == 0 && t0 == 0);
          if (R == 2 && second) st.add(acc[R - 1], false);
        }
      }
    }
  }
  if constexpr (STATS) {
    const float count = active ? static_cast<float>(s.OW) * (second ? 2.f : 1.f) : 0.f;
    write_column_stats<TT, V>(st, count, t, ln.cv, cw_own, words, band, partial);
  }
}

// Column-walk launch shape: lanes_c words of one pixel per row, 256 / lanes_c rows of the flattened (n, oh) index
// per block (max_threads / lanes_c: the 5x5/7x7 walk of stencil_column_k57.cuh takes smaller blocks), fewer when
// there are fewer rows, in equal bands. Channel groups: all C / V words when there are at most 32; with
// COLUMN_SECTORS (sectors), the widest of 32, 24 or 16 words that splits them with no idle lane, so that every group
// starts on a 32-byte sector; else groups of at most 32 words, balanced so the last group is not mostly idle lanes.
// Balanced groups of 29 words (144 fp32 channels) start mid-sector, and that layer's forward took 0.517 ms against
// 0.315 with 24-word groups; groups of 8 words, or a half-idle last group, measured slower than balanced ones
// (docs/kernels.md, "The column walks' defaults").
Tiling column_tiling(int rows, int words, int max_threads = 256, bool sectors = false) {
  Tiling t{};
  t.groups = ceil_div(words, 32);
  t.lanes_c = ceil_div(words, t.groups);
  if (sectors && words > 32) {
    for (int lanes_c = 32; lanes_c >= 16; lanes_c -= 8) {
      if (words % lanes_c == 0) {
        t.lanes_c = lanes_c;
        t.groups = words / lanes_c;
        break;
      }
    }
  }
  t.sx_n = 1;
  t.sy_n = max_threads / t.lanes_c < rows ? max_threads / t.lanes_c : rows;
  t.tiles_h = ceil_div(rows, t.sy_n);
  t.sy_n = ceil_div(rows, t.tiles_h);
  t.tiles_w = 1;
  t.threads = t.lanes_c * t.sy_n;
  t.block = ceil_div(t.threads, 32) * 32;
  t.images = 1;
  t.group_fastest = 1;
  return t;
}

// column_tiling's `sectors` for dtype dt (COLUMN_SECTORS).
inline bool column_sectors(DType dt) { return knob(Knob::kColumnSectors, dt) == 1; }

// Steps whose loads are in flight together for R = 2 (4 input rows at stride 1, 5 at stride 2).
template <class TT, int S>
constexpr int column_unroll_r2() {
  return sizeof(typename TT::S) == 4 ? (S == 1 ? kColumnUnroll : 2) : (S == 1 ? 2 : 1);
}

// DEEP: the 16-bit stride-1 walk with twice the steps in flight (8 with one row per lane, 4 with two) at 3 blocks
// per SM instead of 4 (80 and 72 registers, no spills). On by default (FWD_COLUMN_DEEP, see column_walk).
// NORM: the walk that applies `norm` to its input (norm.apply_in_depthwise); with 16-bit data its 6 per-channel
// constants spill 12-56 bytes at the 64 registers of 4 blocks per SM, so it runs at 3 (up to 85 registers).
// PREFETCH: the plain walk's steps, with the next ones' loads issued first, at 3 blocks per SM (FWD_COLUMN_PREFETCH).
template <class TT, int S, bool FLIP, int R, bool DEEP = false, bool NORM = false, bool PREFETCH = false>
void launch_column(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                   cudaStream_t stream, const InputNorm& norm = InputNorm{}) {
  using Sx = typename TT::S;
  constexpr int V = 4 / sizeof(Sx);
  constexpr int U = DEEP ? (R == 1 ? 2 * kColumnUnroll : 4) : (R == 1 ? kColumnUnroll : column_unroll_r2<TT, S>());
  constexpr int kMinBlocks = DEEP || PREFETCH || (NORM && V == 2) ? 3 : 4;
  Tiling t = column_tiling(s.N * (R == 1 ? s.OH : (s.OH + 1) / 2), s.C / V, 256, column_sectors(dt));
  t.reverse = knob(Knob::kColumnReverse, dt);
  const dim3 grid(t.groups * t.tiles_h);
  fwd_nhwc_column_kernel<TT, S, U, FLIP, R, kMinBlocks, false, NORM, PREFETCH><<<grid, t.block, 0, stream>>>(
      static_cast<const uint32_t*>(x), static_cast<const Sx*>(w), static_cast<const Sx*>(bias),
      static_cast<uint32_t*>(y), s, t, nullptr, norm);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Output rows per lane of the walk at its plain unroll (not FWD_COLUMN_DEEP's): FWD_COLUMN_ROWS, or at 0 by shape.
// Two output rows per lane load 4 input rows for 2 outputs instead of 3 for 1, at 2 steps in flight instead
// of 4 (16-bit registers). Auto (0) takes it where the rows are short: at stride 1 with OW <= 28 the per-row
// start (weights, first window) weighs most, and there it measured 5-17% faster per layer in the L2-warm
// benchmark (fp16: 512x14 0.048 -> 0.040 ms), while the 112- and 56-wide layers and every stride-2 layer
// were as fast or faster with one row (docs/kernel_notes.md, v9).
inline int column_plain_rows(const ConvShape& s, DType dt) {
  const int rows = knob(Knob::kFwdColumnRows, dt);
  return rows == 2 || (rows == 0 && s.SH == 1 && s.OW <= 28) ? 2 : 1;
}

// Which column walk runs a forward (or, FLIP, the stride-1 input gradient as one): output rows per lane
// (FWD_COLUMN_ROWS) and steps in flight (FWD_COLUMN_DEEP, FWD_COLUMN_PREFETCH).
template <class TT, bool FLIP, bool NORM = false>
void column_walk(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                 cudaStream_t stream, const InputNorm& norm = InputNorm{}) {
  static_assert(!FLIP || !NORM, "the input gradient's input (grad_out) is never normalized");
  const bool two_rows = column_plain_rows(s, dt) == 2;
  // FWD_COLUMN_PREFETCH (stride 1, opt-in; slower on MobileNetV1's layers on an H200, docs/kernels.md): the plain
  // walk's rows and steps with the next steps' loads issued first, in place of FWD_COLUMN_DEEP's deeper unroll.
  if (s.SH == 1 && knob(Knob::kFwdColumnPrefetch, dt) == 1) {
    (two_rows ? launch_column<TT, 1, FLIP, 2, false, NORM, true> : launch_column<TT, 1, FLIP, 1, false, NORM, true>)(
        s, dt, x, w, bias, y, stream, norm);
    return;
  }
  if constexpr (sizeof(typename TT::S) == 2) {
    // FWD_COLUMN_DEEP (16-bit, stride 1): in the 2026-11-30 sweep (docs/kernel_notes.md, commit ede22fc) it was 7-9% faster on
    // the 112-, 56- and 28-wide layers and as fast on the 14- and 7-wide ones; two rows then win up to 56 wide.
    // Over MobileNetV1's 13 layers, fp16 NHWC forward, 0.904 ms against 0.929 without (docs/kernels.md).
    if (s.SH == 1 && knob(Knob::kFwdColumnDeep, dt) == 1) {
      const int rows = knob(Knob::kFwdColumnRows, dt);
      if (rows == 2 || (rows == 0 && s.OW <= 56)) {
        launch_column<TT, 1, FLIP, 2, true, NORM>(s, dt, x, w, bias, y, stream, norm);
      } else {
        launch_column<TT, 1, FLIP, 1, true, NORM>(s, dt, x, w, bias, y, stream, norm);
      }
      return;
    }
  }
  if constexpr (FLIP) {  // the input gradient runs as a stride-1 forward only
    (two_rows ? launch_column<TT, 1, true, 2> : launch_column<TT, 1, true, 1>)(s, dt, x, w, bias, y, stream, norm);
  } else if (two_rows) {
    (s.SH == 1 ? launch_column<TT, 1, false, 2, false, NORM> : launch_column<TT, 2, false, 2, false, NORM>)(
        s, dt, x, w, bias, y, stream, norm);
  } else {
    (s.SH == 1 ? launch_column<TT, 1, false, 1, false, NORM> : launch_column<TT, 2, false, 1, false, NORM>)(
        s, dt, x, w, bias, y, stream, norm);
  }
}

// The statistics walk (STATS): one row per lane or two as the plain walk picks them (column_plain_rows), the plain
// walk's unroll; no bias, no activation. 16-bit at 3 blocks per SM (up to 85 registers): its 6 more
// floats per lane (pivot and sums of 2 channels) spilled 36-96 bytes at 4 (64 registers); fp32 fits 4. The same
// FMAs in the same order as the plain forward, so y is bitwise its y. partial: [bands][3][C] fp64, bands =
// column_stats_tiling(s, dt).tiles_h.
inline Tiling column_stats_tiling(const ConvShape& s, DType dt) {
  const int V = dt == DType::F32 ? 1 : 2;
  const int R = column_plain_rows(s, dt);
  return column_tiling(s.N * (R == 1 ? s.OH : (s.OH + 1) / 2), s.C / V, 256, column_sectors(dt));
}

template <class TT, int S, int R>
void launch_column_stats(const ConvShape& s, DType dt, const void* x, const void* w, void* y, double* partial,
                         cudaStream_t stream) {
  using Sx = typename TT::S;
  constexpr int U = R == 1 ? kColumnUnroll : column_unroll_r2<TT, S>();
  constexpr int kMinBlocks = sizeof(Sx) == 4 ? 4 : 3;
  Tiling t = column_stats_tiling(s, dt);
  t.reverse = knob(Knob::kColumnReverse, dt);
  const dim3 grid(t.groups * t.tiles_h);
  fwd_nhwc_column_kernel<TT, S, U, false, R, kMinBlocks, true><<<grid, t.block, 0, stream>>>(
      static_cast<const uint32_t*>(x), static_cast<const Sx*>(w), nullptr, static_cast<uint32_t*>(y), s, t, partial,
      InputNorm{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace mdw
