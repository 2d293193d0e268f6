// The 5x5/7x7 walks, each behind a launch knob that is off until measured (launch_plan.h):
//   NHWC forward and stride-1 input gradient (FWD_COLUMN_K57): stencil_column_k57.cuh's column walk
//   NCHW forward (NCHW_COLUMN_K57): the same walk turned by 90 degrees, below
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
// (lane = sx + sx_n * (sy + sy_n * q)) over strips of TW columns and segments of `seg` rows.
template <class TT, int K, int S, int TW>
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
  for (int k = 0; k < K * K; ++k) wk[k] = TT::to_acc(__ldg(w + c * K * K + k));
  const float bv = bias ? TT::to_acc(__ldg(bias + c)) : 0.f;
  float sum[NO][TW];
#pragma unroll
  for (int j = 0; j < NO; ++j)
#pragma unroll
    for (int jj = 0; jj < TW; ++jj) sum[j][jj] = bv;
  const Sx* xp = x + plane * s.H * s.W;
  Sx* yp = y + plane * s.OH * s.OW + ow0;
  const int iw0 = ow0 * S - s.PW;

  for (int step = oh_begin - (NO - 1); step < oh_end; ++step) {
    Sx raw[S][L];
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
        if (ow0 + jj < s.OW) yp[static_cast<size_t>(step) * s.OW + jj] = TT::from_acc(activate(sum[0][jj], s.act));
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
template <class TT, int K, int S>
void launch_nchw_column_k(const ConvShape& s, const void* x, const void* w, const void* bias, void* y,
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
  fwd_nchw_column_k_kernel<TT, K, S, TW><<<grid, t.block, 0, stream>>>(
      static_cast<const Sx*>(x), static_cast<const Sx*>(w), static_cast<const Sx*>(bias), static_cast<Sx*>(y), s, t,
      seg);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The dtype x K x stride switch; the dispatch has checked the case (NCHW, 5x5/7x7, s1/s2, dilation 1, 16/32-bit).
void nchw_column_k57(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                     cudaStream_t stream) {
  auto run = [&](auto tt) {
    using TT = decltype(tt);
    if (s.KH == 5) {
      (s.SH == 1 ? launch_nchw_column_k<TT, 5, 1> : launch_nchw_column_k<TT, 5, 2>)(s, x, w, bias, y, stream);
    } else {
      (s.SH == 1 ? launch_nchw_column_k<TT, 7, 1> : launch_nchw_column_k<TT, 7, 2>)(s, x, w, bias, y, stream);
    }
  };
  switch (dt) {
    case DType::F32: return run(F32T{});
    case DType::F16: return run(F16T{});
    case DType::BF16: return run(BF16T{});
    default: return;  // the dispatch's tiled test excludes fp64
  }
}

}  // namespace

void forward_nhwc_column_k57(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                             cudaStream_t stream) {
  column_k57<false>(s, dt, x, w, bias, y, stream);
}

// The forward walk on input_grad_as_forward(s), whose input is grad_out; stride 1 only.
void input_grad_nhwc_column_k57(const ConvShape& s, DType dt, const void* go, const void* w, void* gx,
                                cudaStream_t stream) {
  column_k57<true>(input_grad_as_forward(s), dt, go, w, nullptr, gx, stream);
}

void forward_nchw_column_k57(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                             cudaStream_t stream) {
  nchw_column_k57(s, dt, x, w, bias, y, stream);
}

}  // namespace mdw
