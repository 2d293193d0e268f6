// NHWC 5x5 and 7x7 column-walking forward and, with the kernel rotated 180 degrees (FLIP), the stride-1 input
// gradient: the walk of stencil_3x3.cuh's fwd_nhwc_column_kernel (a lane owns one 32-bit word of channels of one
// output row and walks ow = 0..OW-1, loading each input word of its K rows once), with the window kept as output
// partial sums instead of input columns. The 3x3 kernel holds K x (K - S) input columns; at K = 7 that is 42 words
// (84 fp32 registers for 16-bit data) next to the 49 x V fp32 weights, too many. Here step t loads the S new input
// columns of the K rows and adds each into the (K - 1) / S + 1 outputs it reaches (t .. t + (K - 1) / S), so the
// carried state is those outputs' fp32 sums (K x V at stride 1, (K + 1) / 2 x V at stride 2) and output t is
// complete after step t. The FMAs per output are still K * K * V and the loads K * S words per step.
// depthwise_k57.cu instantiates it with FLIP = false (forward) and FLIP = true (input gradient).
#pragma once

#include <c10/cuda/CUDAException.h>

#include <type_traits>

#include "device_common.h"
#include "stencil_3x3.cuh"

namespace mdw {
namespace {

// The new words of U steps starting at step t0 (which may be negative: the first steps only start sums): input
// columns step * S - PW + (K - S) + d of the K input rows. Checked: zeros (and no load) for steps >= OW, columns
// outside [0, W) and rows not in rows_in; unchecked: the caller has seen that every word is inside.
template <bool kChecked, int K, int S, int U>
__device__ __forceinline__ void load_column_k_steps(const FwdColumnRow& row, int W, int OW, int PW, int t0,
                                                    uint32_t (&raw)[U][K][S]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int step = t0 + u;
#pragma unroll
    for (int d = 0; d < S; ++d) {
      const int iw = step * S - PW + (K - S) + d;
      const int offset = row.row0 + iw * row.words;
      const bool col_in = step < OW && static_cast<unsigned>(iw) < static_cast<unsigned>(W);
#pragma unroll
      for (int kh = 0; kh < K; ++kh) {
        if (!kChecked || (col_in && (row.rows_in >> kh & 1))) {
          raw[u][kh][d] = __ldg(row.xn + (offset + kh * row.pitch));
        } else {
          raw[u][kh][d] = 0u;
        }
      }
    }
  }
}

// One step's S new columns of the K input rows into the open outputs' sums: column d feeds sum[j] through kernel
// column K - S + d - j * S.
template <class TT, int K, int S, int V, int NO>
__device__ __forceinline__ void add_column_k_step(const uint32_t (&raw)[K][S], const float (&wr)[K * K][V],
                                                  float (&sum)[NO][V]) {
#pragma unroll
  for (int kh = 0; kh < K; ++kh)
#pragma unroll
    for (int d = 0; d < S; ++d) {
      float fresh[V];
      widen_word<TT, V>(raw[kh][d], fresh);
#pragma unroll
      for (int j = 0; j < NO; ++j) {
        const int kw = K - S + d - j * S;
        if (kw < 0 || kw >= K) continue;
#pragma unroll
        for (int v = 0; v < V; ++v) sum[j][v] = fmaf(wr[kh * K + kw][v], fresh[v], sum[j][v]);
      }
    }
}

// After the first open output is stored: the second is first now, and a new last one starts from the bias.
template <int NO, int V>
__device__ __forceinline__ void slide_sums(float (&sum)[NO][V], const float (&b)[V]) {
#pragma unroll
  for (int j = 0; j + 1 < NO; ++j)
#pragma unroll
    for (int v = 0; v < V; ++v) sum[j][v] = sum[j + 1][v];
#pragma unroll
  for (int v = 0; v < V; ++v) sum[NO - 1][v] = b[v];
}

// Lanes and blocks as fwd_nhwc_column_kernel with one output row per lane (lane = cv + lanes_c * row, bands of
// the flattened (n, oh) rows, t.reverse: last image first). sum[j] is output t + j before step t; input column
// step * S - PW + (K - S) + d feeds it through kernel column K - S + d - j * S. FLIP: the kernel rotated, no bias
// and no activation. THREADS x MINB is set by the launcher so that the K * K * V fp32 weights fit without spills.
// PREFETCH (FWD_COLUMN_K57_PREFETCH): the next U steps' words are loaded before this U steps' FMAs, as the NCHW walk
// of depthwise_k57.cu does, so that their latency hides behind K * K * V * U FMAs.
template <class TT, int K, int S, int U, bool FLIP, int THREADS, int MINB, bool PREFETCH>
__global__ void __launch_bounds__(THREADS, MINB)
    fwd_nhwc_column_k_kernel(const uint32_t* __restrict__ x, const typename TT::S* __restrict__ w,
                             const typename TT::S* __restrict__ bias, uint32_t* __restrict__ y, ConvShape s,
                             Tiling t) {
  constexpr int KK = K * K;
  constexpr int V = 4 / sizeof(typename TT::S);  // channels per 32-bit word
  constexpr int NO = (K - 1) / S + 1;            // outputs a step's input columns reach: the sums carried
  const int lane = threadIdx.x;
  if (lane >= t.threads) return;
  const NhwcLane ln = nhwc_lane(lane, t);
  const int words = s.C / V;
  const int cw = (blockIdx.x % t.groups) * t.lanes_c + ln.cv;
  const int bands = gridDim.x / t.groups;
  const int band = t.reverse ? bands - 1 - static_cast<int>(blockIdx.x) / t.groups : blockIdx.x / t.groups;
  const int r = band * t.sy_n + ln.sy;
  if (cw >= words || r >= s.N * s.OH) return;
  const int n = r / s.OH, oh = r - n * s.OH;

  // Weights and row set-up as in fwd_nhwc_column_kernel, written out again: moving them into shared helpers
  // changed the 3x3 kernels' machine code (register allocation), and those are the measured ones.
  float wr[KK][V], b[V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const int c = cw * V + v;
#pragma unroll
    for (int k = 0; k < KK; ++k) wr[k][v] = TT::to_acc(__ldg(w + c * KK + (FLIP ? KK - 1 - k : k)));
    b[v] = !FLIP && bias != nullptr ? TT::to_acc(__ldg(bias + c)) : 0.f;
  }

  FwdColumnRow row;
  row.xn = x + static_cast<size_t>(n) * s.H * s.W * words + cw;
  uint32_t* yp = y + (static_cast<size_t>(n) * s.OH + oh) * s.OW * words + cw;
  // Opaque pointers, as in fwd_nhwc_column_kernel: kept in registers instead of rebuilt at every access.
  asm("" : "+l"(row.xn));
  asm("" : "+l"(yp));
  row.pitch = s.W * words;
  row.words = words;
  row.row0 = (oh * S - s.PH) * row.pitch;
  row.rows_in = 0;
#pragma unroll
  for (int kh = 0; kh < K; ++kh) {
    const int ih = oh * S - s.PH + kh;
    row.rows_in |= (ih >= 0 && ih < s.H) << kh;
  }

  float sum[NO][V];
#pragma unroll
  for (int j = 0; j < NO; ++j)
#pragma unroll
    for (int v = 0; v < V; ++v) sum[j][v] = b[v];

  // U steps' words from step t0 on: most groups lie inside the image and the row, where no bounds are tested.
  auto load_steps = [&](int t0, uint32_t (&raw)[U][K][S]) {
    const bool inside = row.rows_in == (1 << K) - 1 && t0 * S - s.PW + (K - S) >= 0 &&
                        (t0 + U - 1) * S - s.PW + K - 1 < s.W && t0 + U <= s.OW;
    if (inside) {
      load_column_k_steps<false, K, S, U>(row, s.W, s.OW, s.PW, t0, raw);
    } else {
      load_column_k_steps<true, K, S, U>(row, s.W, s.OW, s.PW, t0, raw);
    }
  };
  // The walk starts NO - 1 steps early, so that output 0's first columns are in its sum; those steps store nothing.
  uint32_t next[PREFETCH ? U : 1][K][S];
  if constexpr (PREFETCH) load_steps(1 - NO, next);
  for (int t0 = 1 - NO; t0 < s.OW; t0 += U) {
    uint32_t raw[U][K][S];
    if constexpr (PREFETCH) {
      take_words(next, raw);
      if (t0 + U < s.OW) load_steps(t0 + U, next);
    } else {
      load_steps(t0, raw);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      add_column_k_step<TT, K, S>(raw[u], wr, sum);
      const int step = t0 + u;
      if (step >= 0 && step < s.OW) {
        if constexpr (!FLIP) activate(sum[0], s.act);
        store_global(yp + step * words, narrow_word<TT, V>(sum[0]));
      }
      slide_sums(sum, b);
    }
  }
}

// Launch shape per instantiation: 16-bit 7x7 holds 98 fp32 weights, so it runs 128-lane blocks at 3 per SM (up to
// 168 registers); the others 256-lane blocks at 2 per SM (up to 128). Steps in flight: as many as fit next to them.
template <class TT, int K, int S>
struct ColumnK57Shape {
  static constexpr bool kWide = sizeof(typename TT::S) == 2 && K == 7;
  static constexpr int kThreads = kWide ? 128 : 256;
  static constexpr int kMinBlocks = kWide ? 3 : 2;
  static constexpr int kUnroll = S == 1 ? 2 : 1;
};

template <class TT, int K, int S, bool FLIP>
void launch_column_k(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                     cudaStream_t stream) {
  using Sx = typename TT::S;
  using Shape = ColumnK57Shape<TT, K, S>;
  constexpr int V = 4 / sizeof(Sx);
  Tiling t = column_tiling(s.N * s.OH, s.C / V, Shape::kThreads, column_sectors(dt));
  t.reverse = knob(Knob::kColumnReverse, dt);
  const dim3 grid(t.groups * t.tiles_h);
  const bool prefetch = knob(Knob::kFwdColumnK57Prefetch, dt) == 1;
  (prefetch ? fwd_nhwc_column_k_kernel<TT, K, S, Shape::kUnroll, FLIP, Shape::kThreads, Shape::kMinBlocks, true>
            : fwd_nhwc_column_k_kernel<TT, K, S, Shape::kUnroll, FLIP, Shape::kThreads, Shape::kMinBlocks, false>)
      <<<grid, t.block, 0, stream>>>(static_cast<const uint32_t*>(x), static_cast<const Sx*>(w),
                                     static_cast<const Sx*>(bias), static_cast<uint32_t*>(y), s, t);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// f(TT{}, K, S) with K and S as std::integral_constant, for the walks' cases: 16/32-bit data (the dispatch's tests
// exclude fp64), square 5x5 or 7x7, equal strides 1 or 2.
template <class F>
void dispatch_k57(const ConvShape& s, DType dt, F&& f) {
  auto by_shape = [&](auto tt) {
    using I5 = std::integral_constant<int, 5>;
    using I7 = std::integral_constant<int, 7>;
    using S1 = std::integral_constant<int, 1>;
    using S2 = std::integral_constant<int, 2>;
    if (s.KH == 5) {
      s.SH == 1 ? f(tt, I5{}, S1{}) : f(tt, I5{}, S2{});
    } else {
      s.SH == 1 ? f(tt, I7{}, S1{}) : f(tt, I7{}, S2{});
    }
  };
  switch (dt) {
    case DType::F32: return by_shape(F32T{});
    case DType::F16: return by_shape(F16T{});
    case DType::BF16: return by_shape(BF16T{});
    default: return;
  }
}

// The dispatch has checked the case (column_k57_fits in depthwise_dispatch.cpp); the input gradient (FLIP) runs this
// way at stride 1 only.
template <bool FLIP>
void column_k57(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                cudaStream_t stream) {
  dispatch_k57(s, dt, [&](auto tt, auto k, auto st) {
    if constexpr (!FLIP || decltype(st)::value == 1)
      launch_column_k<decltype(tt), decltype(k)::value, decltype(st)::value, FLIP>(s, dt, x, w, bias, y, stream);
  });
}

}  // namespace
}  // namespace mdw
