// The 5x5/7x7 walks, each behind a launch knob (launch_plan.h) whose default the H200 suites picked:
//   NHWC forward and stride-1 input gradient (FWD_COLUMN_K57): stencil_column_k57.cuh's column walk
//   NCHW forward (NCHW_COLUMN_K57): the same walk turned by 90 degrees, below
//   weight gradient (WGRAD_COLUMN_K57): NHWC a column walk with the kernel rows split over lanes, NCHW strips of a row
//   with a kernel row per lane, below
// In a file of their own so that the pass files are compiled from unchanged source and keep the machine code that
// was measured (builds here are not always bit-identical anyway: the same depthwise_input_grad.cu gave one tiled
// kernel two register allocations in two builds).
#include <c10/cuda/CUDAException.h>

#include "depthwise_launchers.h"
#include "device_common.h"
#include "launch_plan.h"
#include "stencil_column_k57.cuh"

namespace mdw {
namespace {

// NCHW 5x5/7x7 forward, the walk turned by 90 degrees: a lane owns TW consecutive output columns of one plane and
// walks down a segment of its output rows (NCHW rows are contiguous, so lanes run along them for coalescing).
// Step t loads the S new input rows, (TW - 1) * S + K scalars each, and adds them into the (K - 1) / S + 1 output
// rows they reach, TW outputs each (sum[j][jj]: row t + j, column ow0 + jj), with the plane's K * K fp32 weights in
// registers: each input element is loaded by about (TW - 1 + K / S) / TW lanes instead of once per tap row. The
// walk starts NO - 1 steps before the segment; those steps' sums for rows above it are dropped. Tiling: NCHW
// (lane = sx + sx_n * (sy + sy_n * q)) over strips of TW columns and segments of `seg` rows. PREFETCH
// (NCHW_COLUMN_K57_PREFETCH, stride 1): a step issues the next step's loads before its own FMAs, so that at 2 blocks
// per SM (4 warps per scheduler) their latency hides behind K * K * TW FMAs instead of stalling every step.
// FLIP: the kernel rotated 180 degrees, no bias and no activation (the stride-1 input gradient, run on
// input_grad_as_forward's shape with grad_out as the input).
template <class TT, int K, int S, int TW, bool PREFETCH, bool FLIP = false>
__global__ void __launch_bounds__(256, 2)
    fwd_nchw_column_k_kernel(const typename TT::S* __restrict__ x, const typename TT::S* __restrict__ w,
                             const typename TT::S* __restrict__ bias, typename TT::S* __restrict__ y, ConvShape s,
                             Tiling t, int seg) {
  using Sx = typename TT::S;
  constexpr int NO = (K - 1) / S + 1;
  constexpr int L = (TW - 1) * S + K;
  const int lane = threadIdx.x;
  if (lane >= t.threads) return;
  const NchwLane ln = nchw_lane(lane, t);
  const TileIndex tile = split_tile_index(blockIdx.x, t);
  const long long plane = static_cast<long long>(tile.outer) * t.lanes_c + ln.q;
  const int oh_begin = (tile.tile_h * t.sy_n + ln.sy) * seg;
  const int ow0 = (tile.tile_w * t.sx_n + ln.sx) * TW;
  if (plane >= static_cast<long long>(s.N) * s.C || oh_begin >= s.OH || ow0 >= s.OW) return;
  const int oh_end = oh_begin + seg < s.OH ? oh_begin + seg : s.OH;
  const int c = static_cast<int>(plane % s.C);

  float wk[K * K];
#pragma unroll
  for (int k = 0; k < K * K; ++k) wk[k] = TT::to_acc(__ldg(w + c * K * K + (FLIP ? K * K - 1 - k : k)));
  const float bv = !FLIP && bias ? TT::to_acc(__ldg(bias + c)) : 0.f;
  float sum[NO][TW];
#pragma unroll
  for (int j = 0; j < NO; ++j)
#pragma unroll
    for (int jj = 0; jj < TW; ++jj) sum[j][jj] = bv;
  const Sx* xp = x + plane * s.H * s.W;
  Sx* yp = y + plane * s.OH * s.OW + ow0;
  const int iw0 = ow0 * S - s.PW;

  // The S new input rows of one step: zeros above and below the image.
  auto load_step = [&](int step, Sx (&raw)[S][L]) {
#pragma unroll
    for (int d = 0; d < S; ++d) {
      const int ih = step * S - s.PH + (K - S) + d;
      if (ih >= 0 && ih < s.H) {
        load_row_scalars(xp + static_cast<size_t>(ih) * s.W, iw0, s.W, raw[d]);
      } else {
#pragma unroll
        for (int i = 0; i < L; ++i) raw[d][i] = Sx(0);
      }
    }
  };
  Sx next[PREFETCH ? S : 1][PREFETCH ? L : 1];
  if constexpr (PREFETCH) load_step(oh_begin - (NO - 1), next);
  for (int step = oh_begin - (NO - 1); step < oh_end; ++step) {
    Sx raw[S][L];
    if constexpr (PREFETCH) {
#pragma unroll
      for (int d = 0; d < S; ++d)
#pragma unroll
        for (int i = 0; i < L; ++i) raw[d][i] = next[d][i];
      if (step + 1 < oh_end) load_step(step + 1, next);
    } else {
      load_step(step, raw);
    }
#pragma unroll
    for (int d = 0; d < S; ++d)
#pragma unroll
      for (int i = 0; i < L; ++i) {
        const float xv = TT::to_acc(raw[d][i]);
#pragma unroll
        for (int j = 0; j < NO; ++j) {
          const int kh = K - S + d - j * S;
          if (kh < 0 || kh >= K) continue;
#pragma unroll
          for (int jj = 0; jj < TW; ++jj) {
            const int kw = i - jj * S;
            if (kw >= 0 && kw < K) sum[j][jj] = fmaf(wk[kh * K + kw], xv, sum[j][jj]);
          }
        }
      }
    if (step >= oh_begin) {
#pragma unroll
      for (int jj = 0; jj < TW; ++jj)
        if (ow0 + jj < s.OW)
          yp[static_cast<size_t>(step) * s.OW + jj] = TT::from_acc(FLIP ? sum[0][jj] : activate(sum[0][jj], s.act));
    }
#pragma unroll
    for (int j = 0; j + 1 < NO; ++j)
#pragma unroll
      for (int jj = 0; jj < TW; ++jj) sum[j][jj] = sum[j + 1][jj];
#pragma unroll
    for (int jj = 0; jj < TW; ++jj) sum[NO - 1][jj] = bv;
  }
}

// Segments: as few as give every SM about 16 warps of lanes (the plane count and the row width set how many lanes
// there are), but at least 16 rows each, since each segment repeats the NO - 1 rows before it.
template <class TT, int K, int S, bool FLIP = false>
void launch_nchw_column_k(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                          cudaStream_t stream) {
  using Sx = typename TT::S;
  constexpr int TW = 4;
  const int strips = ceil_div(s.OW, TW);
  const long long lanes_per_segment = static_cast<long long>(s.N) * s.C * strips;
  const long long want = static_cast<long long>(num_sms()) * 16 * 32;
  const int max_segments = ceil_div(s.OH, 16);
  int segments = static_cast<int>((want + lanes_per_segment - 1) / lanes_per_segment);
  segments = segments < 1 ? 1 : (segments > max_segments ? max_segments : segments);
  const int seg = ceil_div(s.OH, segments);
  const Tiling t = make_tiling(false, ceil_div(s.OH, seg), 0, strips, s.N * s.C);
  const dim3 grid(t.groups * t.tiles_h * t.tiles_w);
  // Stride 1 only: at stride 2 the prefetched rows (2 x 13 scalars at 7x7) spill 42-112 bytes at 128 registers.
  auto kernel = fwd_nchw_column_k_kernel<TT, K, S, TW, false, FLIP>;
  if constexpr (S == 1) {
    if (knob(Knob::kNchwColumnK57Prefetch, dt) == 1) kernel = fwd_nchw_column_k_kernel<TT, K, S, TW, true, FLIP>;
  }
  kernel<<<grid, t.block, 0, stream>>>(static_cast<const Sx*>(x), static_cast<const Sx*>(w),
                                       static_cast<const Sx*>(bias), static_cast<Sx*>(y), s, t, seg);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---- NHWC 5x5/7x7 weight gradient: the column walk with the kernel rows split over lanes ----
//
// The 3x3 weight-gradient walk gives a lane one output row and all K * K * V taps; at 7x7 that is 98 fp32
// accumulators for 16-bit data, too many (the tiled kernel instead takes V = 1 channel per lane, 2-byte loads, and
// loads every input element about 28 times). Here a lane owns one 32-bit word of channels, one output row (n, oh)
// and one kernel row kh, and walks t = 0, 1, ... along the row: step t loads grad_out column t and the S input
// columns t * S - PW + d of input row oh * S - PH + kh, and adds input column d into the taps kw = j * S + d of the
// NH = (K - 1) / S + 1 grad_out columns t - j it reaches, kept widened in a ring. So a lane holds K + 1 (bias) x V
// accumulators and NH x V grad_out values, and each grad_out and input word it needs is loaded once; the K lanes of
// one output row read the same grad_out word together (L1), and a row's input rows are the next row's but one.
// Groups of U = NH steps issue their loads before their FMAs, and the ring slot of step t is t % NH, a constant
// in each unrolled group. Lanes: lane = cw + lanes_c * (kh + K * ry); a block takes sy_n rows at a time and walks a
// contiguous run of bands of them (its chunk); lanes of the same (cw, kh) are summed in row order at the end.
struct WgradK57Plan {
  Tiling tiling;         // lanes_c words, sy_n rows, groups of words; tiles_h = bands of sy_n rows
  int chunks;            // blocks per channel group, each a contiguous run of bands
  int bands_per_chunk;
};

// 64 registers (4 blocks of 256 lanes per SM), which no instantiation needs more than.
template <class TT, int K, int S>
__global__ void __launch_bounds__(256, 4)
    wgrad_nhwc_column_k_kernel(const uint32_t* __restrict__ go, const uint32_t* __restrict__ x, float* __restrict__ ws,
                               ConvShape s, Tiling t, int bands_per_chunk) {
  constexpr int V = 4 / sizeof(typename TT::S);  // channels per 32-bit word
  constexpr int NH = (K - 1) / S + 1;  // grad_out columns an input column reaches
  constexpr int U = NH;
  constexpr int E = (K + 1) * V;  // a lane's partials: K taps and the bias, V channels each
  extern __shared__ float red[];  // [block lanes][E]

  const int lane = threadIdx.x;
  const int cl = lane % t.lanes_c;
  const int kh = (lane / t.lanes_c) % K;
  const int ry = lane / (t.lanes_c * K);
  const int group = blockIdx.x % t.groups;
  const int chunk = blockIdx.x / t.groups;
  const int words = s.C / V;
  const int cw = group * t.lanes_c + cl;
  const bool active = lane < t.threads && cw < words;
  const int rows = s.N * s.OH;
  // The last step with an input column inside the image, and the last grad_out column: every step up to the later
  // of the two is walked (past the first, steps only add grad_out to the bias).
  const int t_image = (s.W - 1 + s.PW) / S;
  const int t_used = t_image < s.OW - 1 + NH - 1 ? t_image : s.OW - 1 + NH - 1;
  const int t_last = t_used > s.OW - 1 ? t_used : s.OW - 1;

  float acc[K + 1][V];
  fill(acc, 0.f);
  if (active) {
    const int band_end = (chunk + 1) * bands_per_chunk < t.tiles_h ? (chunk + 1) * bands_per_chunk : t.tiles_h;
    for (int band = chunk * bands_per_chunk; band < band_end; ++band) {
      const int r = band * t.sy_n + ry;
      if (r >= rows) break;
      const int n = r / s.OH, oh = r - n * s.OH;
      const int ih = oh * S - s.PH + kh;
      const bool row_in = ih >= 0 && ih < s.H;
      const uint32_t* gp = go + static_cast<size_t>(r) * s.OW * words + cw;
      const uint32_t* xp = x + (static_cast<size_t>(n) * s.H + (row_in ? ih : 0)) * s.W * words + cw;
      // Opaque to the compiler, as in the 3x3 walk: otherwise it rebuilds the addresses at every load.
      asm("" : "+l"(gp));
      asm("" : "+l"(xp));
      float ring[NH][V];
      fill(ring, 0.f);
      for (int t0 = 0; t0 <= t_last; t0 += U) {
        uint32_t graw[U], xraw[U][S];
        const bool inside = row_in && t0 * S - s.PW >= 0 && (t0 + U) * S - s.PW <= s.W && t0 + U <= s.OW;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int step = t0 + u;
          graw[u] = (inside || step < s.OW) ? __ldg(gp + step * words) : 0u;
#pragma unroll
          for (int d = 0; d < S; ++d) {
            const int iw = step * S - s.PW + d;
            xraw[u][d] = (inside || (row_in && static_cast<unsigned>(iw) < static_cast<unsigned>(s.W)))
                             ? __ldg(xp + iw * words)
                             : 0u;
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          widen_word<TT, V>(graw[u], ring[u]);
#pragma unroll
          for (int v = 0; v < V; ++v) acc[K][v] += ring[u][v];
#pragma unroll
          for (int d = 0; d < S; ++d) {
            float xv[V];
            widen_word<TT, V>(xraw[u][d], xv);
#pragma unroll
            for (int j = 0; j < NH; ++j) {
              const int kw = j * S + d;
              if (kw >= K) continue;
              const int slot = (u - j + NH) % NH;  // grad_out column step - j
#pragma unroll
              for (int v = 0; v < V; ++v) acc[kw][v] = fmaf(ring[slot][v], xv[v], acc[kw][v]);
            }
          }
        }
      }
    }
  }

  // Every lane (inactive ones with zeros) writes its partials; then lanes (cw, kh) are summed over ry in order.
  const int block_lanes = blockDim.x;
#pragma unroll
  for (int k = 0; k <= K; ++k)
#pragma unroll
    for (int v = 0; v < V; ++v) red[lane * E + k * V + v] = acc[k][v];
  __syncthreads();
  const int per_row = t.lanes_c * K;
  for (int idx = lane; idx < per_row * E; idx += block_lanes) {
    const int l = idx / E, e = idx - l * E;
    const int ocw = group * t.lanes_c + l % t.lanes_c, okh = l / t.lanes_c;
    const int kw = e / V, c = ocw * V + e % V;
    if (ocw >= words || (kw == K && okh != 0)) continue;  // the bias: one copy, from the kh = 0 lanes
    float sum = 0.f;
    for (int y = 0; y < t.sy_n; ++y) sum += red[(l + per_row * y) * E + e];
    ws[(static_cast<size_t>(chunk) * s.C + c) * (K * K + 1) + (kw == K ? K * K : okh * K + kw)] = sum;
  }
}

// Lanes: the words of a pixel over ceil(words / 32) groups of at most 32, times K kernel rows, times as many rows as
// fit 256 lanes. Blocks: about WGRAD_K57_BLOCKS_PER_SM per SM (resident at once: one wave), each a contiguous run of
// bands, so that consecutive rows, which share K - S of their input rows, run on one SM one after the other.
WgradK57Plan plan_wgrad_column_k57(const ConvShape& s, DType dt) {
  WgradK57Plan p{};
  const int words = s.C * elem_size(dt) / 4;
  const int rows = s.N * s.OH;
  Tiling& t = p.tiling;
  t.groups = ceil_div(words, 32);
  t.lanes_c = ceil_div(words, t.groups);
  const int per_row = t.lanes_c * s.KH;
  t.sy_n = 256 / per_row < rows ? 256 / per_row : rows;
  if (t.sy_n < 1) t.sy_n = 1;
  t.tiles_h = ceil_div(rows, t.sy_n);
  t.sx_n = 1;
  t.tiles_w = 1;
  t.threads = per_row * t.sy_n;
  t.block = ceil_div(t.threads, 32) * 32;
  const int target_blocks = num_sms() * knob(Knob::kWgradK57BlocksPerSm, dt);
  int chunks = ceil_div(target_blocks, t.groups);
  if (chunks > t.tiles_h) chunks = t.tiles_h;
  if (chunks < 1) chunks = 1;
  p.bands_per_chunk = ceil_div(t.tiles_h, chunks);
  p.chunks = ceil_div(t.tiles_h, p.bands_per_chunk);  // no empty chunk
  return p;
}

template <class TT, int K, int S>
void launch_wgrad_column_k(const ConvShape& s, const WgradK57Plan& p, const void* go, const void* x, void* ws,
                           cudaStream_t stream) {
  constexpr int V = 4 / sizeof(typename TT::S);
  const Tiling& t = p.tiling;
  const size_t smem = sizeof(float) * t.block * (K + 1) * V;
  const dim3 grid(t.groups * p.chunks);
  wgrad_nhwc_column_k_kernel<TT, K, S><<<grid, t.block, smem, stream>>>(
      static_cast<const uint32_t*>(go), static_cast<const uint32_t*>(x), static_cast<float*>(ws), s, t,
      p.bands_per_chunk);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---- NCHW 5x5/7x7 weight gradient: strips of a row, a kernel row per lane, 32-bit word loads ----
//
// The tiled NCHW kernel gives a lane 2 output columns and all K * K taps (49 accumulators at 7x7) and loads the
// inputs one 16-bit element at a time. Here a lane owns TW = 4 output columns of one output row and one kernel row
// kh: per tile it loads its TW grad_out values and the L = (TW - 1) * S + K input columns of input row
// oh * S - PH + kh that they reach, and adds the TW x K products into its K taps (plus the bias). 16-bit data moves
// as whole 32-bit words: the input window starts at an element of the padding's parity, so the lane loads the
// words around it and picks each element by that parity (the same for every lane). Lanes: consecutive lanes take
// consecutive strips of a row (coalesced), then the K kernel rows, then RY rows; a tile is (n, RY rows, LX strips).
// Block (chunk, channel c): a contiguous run of tiles, so consecutive rows, which share K - S input rows, run on one
// SM one after the other; lanes of the same kh are summed in a fixed order at the end.
template <class TT, int K, int S>
struct WgradNchwK57 {
  static constexpr int kStrip = 4;                              // TW: output columns per lane
  static constexpr int kCols = (kStrip - 1) * S + K;            // L: input columns a strip reaches
  static constexpr int kV = 4 / sizeof(typename TT::S);         // elements per 32-bit word
  static constexpr int kWords = kV == 2 ? kCols / 2 + 1 : kCols;  // words covering L columns from either parity
  static constexpr int kGWords = kStrip / kV;
};

struct WgradNchwK57Plan {
  int lx, ry;             // strips per tile row, rows per tile
  int strip_groups, row_groups, tiles, tiles_per_chunk, chunks, threads, block;
};

template <class TT, int K, int S>
__global__ void __launch_bounds__(256)
    wgrad_nchw_column_k_kernel(const uint32_t* __restrict__ go, const uint32_t* __restrict__ x, float* __restrict__ ws,
                               ConvShape s, WgradNchwK57Plan p) {
  using Shape = WgradNchwK57<TT, K, S>;
  constexpr int TW = Shape::kStrip, L = Shape::kCols, V = Shape::kV, NW = Shape::kWords, NG = Shape::kGWords;
  __shared__ float red[256][K + 1];
  const int lane = threadIdx.x;
  const int sx = lane % p.lx;
  const int kh = (lane / p.lx) % K;
  const int ry = lane / (p.lx * K);
  const int c = blockIdx.y, chunk = blockIdx.x;
  const bool active = lane < p.threads;
  const int row_words = s.W / V, grow_words = s.OW / V;  // whole words per row (16-bit: W and OW even)
  // The input window of strip column ow0 starts at ow0 * S - PW: its parity is PW's (ow0 * S is even).
  const int odd = V == 2 ? (s.PW & 1) : 0;

  float acc[K + 1];
#pragma unroll
  for (int k = 0; k <= K; ++k) acc[k] = 0.f;
  if (active) {
    const int tile_end = (chunk + 1) * p.tiles_per_chunk < p.tiles ? (chunk + 1) * p.tiles_per_chunk : p.tiles;
    for (int tile = chunk * p.tiles_per_chunk; tile < tile_end; ++tile) {
      const int sg = tile % p.strip_groups;
      const int rest = tile / p.strip_groups;
      const int rg = rest % p.row_groups, n = rest / p.row_groups;
      const int oh = rg * p.ry + ry;
      const int ow0 = (sg * p.lx + sx) * TW;
      if (oh >= s.OH || ow0 >= s.OW) continue;
      const size_t plane = static_cast<size_t>(n) * s.C + c;
      const uint32_t* gp = go + (plane * s.OH + oh) * grow_words + ow0 / V;
      float g[TW];
#pragma unroll
      for (int q = 0; q < NG; ++q) {
        const uint32_t word = ow0 / V + q < grow_words ? __ldg(gp + q) : 0u;
        float pair[V];
        widen_word<TT, V>(word, pair);
#pragma unroll
        for (int v = 0; v < V; ++v) g[q * V + v] = pair[v];
      }
#pragma unroll
      for (int j = 0; j < TW; ++j) acc[K] += g[j];
      const int ih = oh * S - s.PH + kh;
      if (ih < 0 || ih >= s.H) continue;
      // Words w0 .. w0 + NW - 1 of the input row, w0 = floor((ow0 * S - PW) / V); zeros outside the row.
      const int start = ow0 * S - s.PW;
      const int w0 = (start - odd) / V;  // exact: start - odd is a multiple of V
      const uint32_t* xp = x + (plane * s.H + ih) * row_words;
      float e[NW * V];
#pragma unroll
      for (int q = 0; q < NW; ++q) {
        const int wi = w0 + q;
        const uint32_t word = static_cast<unsigned>(wi) < static_cast<unsigned>(row_words) ? __ldg(xp + wi) : 0u;
        float pair[V];
        widen_word<TT, V>(word, pair);
#pragma unroll
        for (int v = 0; v < V; ++v) e[q * V + v] = pair[v];
      }
#pragma unroll
      for (int i = 0; i < L; ++i) {
        float xv = e[i];
        if constexpr (V == 2) xv = odd ? e[i + 1] : xv;  // NW * V >= L + 1 for 16-bit
#pragma unroll
        for (int j = 0; j < TW; ++j) {
          const int kw = i - j * S;
          if (kw >= 0 && kw < K) acc[kw] = fmaf(g[j], xv, acc[kw]);
        }
      }
    }
  }

#pragma unroll
  for (int k = 0; k <= K; ++k) red[lane][k] = acc[k];
  __syncthreads();
  // Thread (kh, e) sums its kernel row's lanes: strips, then rows, in index order. The bias from the kh = 0 lanes.
  // (A block can have fewer lanes than the K * (K + 1) sums: one strip of a few rows.)
  for (int idx = lane; idx < K * (K + 1); idx += blockDim.x) {
    const int okh = idx / (K + 1), e = idx - okh * (K + 1);
    if (e < K || okh == 0) {
      float sum = 0.f;
      for (int y = 0; y < p.ry; ++y)
        for (int x_ = 0; x_ < p.lx; ++x_) sum += red[x_ + p.lx * (okh + K * y)][e];
      ws[(static_cast<size_t>(chunk) * s.C + c) * (K * K + 1) + (e == K ? K * K : okh * K + e)] = sum;
    }
  }
}

// Strips: as many of a row as fit 32 lanes; rows: as many as fit 256 lanes with the K kernel rows. Chunks: about 8
// blocks per SM over all channels, each a contiguous run of tiles.
WgradNchwK57Plan plan_wgrad_nchw_column_k57(const ConvShape& s) {
  WgradNchwK57Plan p{};
  const int strips = ceil_div(s.OW, 4);
  p.lx = strips < 32 ? strips : 32;
  p.ry = 256 / (p.lx * s.KH);
  if (p.ry > s.OH) p.ry = s.OH;
  if (p.ry < 1) p.ry = 1;
  p.strip_groups = ceil_div(strips, p.lx);
  p.row_groups = ceil_div(s.OH, p.ry);
  p.tiles = s.N * p.row_groups * p.strip_groups;
  p.threads = p.lx * s.KH * p.ry;
  p.block = ceil_div(p.threads, 32) * 32;
  int chunks = ceil_div(static_cast<long long>(num_sms()) * 8, s.C);
  if (chunks > p.tiles) chunks = p.tiles;
  if (chunks < 1) chunks = 1;
  p.tiles_per_chunk = ceil_div(p.tiles, chunks);
  p.chunks = ceil_div(p.tiles, p.tiles_per_chunk);
  return p;
}

}  // namespace

int weight_grad_column_k57_chunks(const ConvShape& s, DType dt) {
  return s.channels_last ? plan_wgrad_column_k57(s, dt).chunks : plan_wgrad_nchw_column_k57(s).chunks;
}

int weight_grad_column_k57(const ConvShape& s, DType dt, const void* go, const void* x, void* ws,
                           cudaStream_t stream) {
  if (!s.channels_last) {
    const WgradNchwK57Plan p = plan_wgrad_nchw_column_k57(s);
    dispatch_k57(s, dt, [&](auto tt, auto k, auto st) {
      wgrad_nchw_column_k_kernel<decltype(tt), decltype(k)::value, decltype(st)::value>
          <<<dim3(p.chunks, s.C), p.block, 0, stream>>>(static_cast<const uint32_t*>(go),
                                                         static_cast<const uint32_t*>(x), static_cast<float*>(ws), s, p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    return p.chunks;
  }
  const WgradK57Plan p = plan_wgrad_column_k57(s, dt);
  dispatch_k57(s, dt, [&](auto tt, auto k, auto st) {
    launch_wgrad_column_k<decltype(tt), decltype(k)::value, decltype(st)::value>(s, p, go, x, ws, stream);
  });
  return p.chunks;
}

void forward_nhwc_column_k57(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                             cudaStream_t stream) {
  column_k57<false>(s, dt, x, w, bias, y, stream);
}

// The forward walk on input_grad_as_forward(s), whose input is grad_out; stride 1 only.
void input_grad_nhwc_column_k57(const ConvShape& s, DType dt, const void* go, const void* w, void* gx,
                                cudaStream_t stream) {
  column_k57<true>(input_grad_as_forward(s), dt, go, w, nullptr, gx, stream);
}

// The dispatch has checked the case (NCHW, 5x5/7x7, s1/s2, dilation 1, 16/32-bit).
void forward_nchw_column_k57(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                             cudaStream_t stream) {
  dispatch_k57(s, dt, [&](auto tt, auto k, auto st) {
    launch_nchw_column_k<decltype(tt), decltype(k)::value, decltype(st)::value>(s, dt, x, w, bias, y, stream);
  });
}

// The NCHW forward walk on input_grad_as_forward(s), whose input is grad_out; stride 1 only.
void input_grad_nchw_column_k57(const ConvShape& s, DType dt, const void* go, const void* w, void* gx,
                                cudaStream_t stream) {
  const ConvShape f = input_grad_as_forward(s);
  dispatch_k57(f, dt, [&](auto tt, auto k, auto st) {
    if constexpr (decltype(st)::value == 1)
      launch_nchw_column_k<decltype(tt), decltype(k)::value, 1, true>(f, dt, go, w, nullptr, gx, stream);
  });
}

}  // namespace mdw
