// NHWC 3x3 row-streaming forward (stride 1 and 2). A lane owns one 16-byte channel vector and TW=2 output
// columns of a band of R output rows. It keeps the K input rows of the current output row in registers
// and slides down: each output row costs S new input rows instead of K, and the next rows' loads are
// issued before the current row's arithmetic. forward.cu's kernel reloads all K rows per output row
// and relies on L1 for the reuse. Measured on the H200 (docs/kernel_notes.md, v6): faster for fp32,
// slower for 16-bit data, so the FWD_STREAM knob defaults to fp32 only.
#include "device_common.h"

#include <type_traits>

namespace mdw {
namespace {

template <class TT, int K, int S, int TW, int V>
__global__ void __launch_bounds__(256, 2)
    nhwc_stream_kernel(const typename TT::S* __restrict__ x, const typename TT::S* __restrict__ w,
                       const typename TT::S* __restrict__ bias, typename TT::S* __restrict__ y, ConvShape s, Tiling t,
                       int rows_per_lane, int bands) {
  using Sx = typename TT::S;
  using P = Pack<Sx, V>;
  constexpr int L = (TW - 1) * S + K;
  extern __shared__ float w_smem[];  // [K*K][channels of this block], fp32
  const int cw = t.lanes_c * V;
  const int group = blockIdx.x % t.groups;
  const int c_base = group * cw;
  stage_weights_f32<TT, K>(w, s.C, c_base, cw, w_smem);

  const int lane = threadIdx.x;
  if (lane >= t.threads) return;
  const NhwcLane ln = nhwc_lane(lane, t);
  const int c0 = c_base + ln.cv * V;
  const TileIndex tile = split_tile_index(blockIdx.x / t.groups, t);
  const int row = tile.tile_h * t.sy_n + ln.sy;  // (image, band)
  const int n = row / bands;
  const int oh0 = (row - n * bands) * rows_per_lane;
  const int ow0 = (tile.tile_w * t.sx_n + ln.sx) * TW;
  if (c0 >= s.C || n >= s.N || oh0 >= s.OH || ow0 >= s.OW) return;
  const int oh_end = oh0 + rows_per_lane < s.OH ? oh0 + rows_per_lane : s.OH;
  const int iw0 = ow0 * S - s.PW;
  const float* wl = w_smem + ln.cv * V;
  const Sx* xn = x + static_cast<size_t>(n) * s.H * s.W * s.C + c0;

  auto load_row = [&](int ih, P(&dst)[L]) { load_image_row_packs(xn, ih, s.H, iw0, s.W, s.C, dst); };

  P win[K][L];
#pragma unroll
  for (int kh = 0; kh < K; ++kh) load_row(oh0 * S - s.PH + kh, win[kh]);
#pragma unroll 1
  for (int oh = oh0; oh < oh_end; ++oh) {
    const bool more = oh + 1 < oh_end;
    P next[S][L];
#pragma unroll
    for (int r = 0; r < S; ++r) load_row(more ? (oh + 1) * S - s.PH + K - S + r : -1, next[r]);
    float acc[TW][V];
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const float b = bias ? TT::to_acc(bias[c0 + v]) : 0.f;  // re-read per row: registers are the limit
#pragma unroll
      for (int j = 0; j < TW; ++j) acc[j][v] = b;
    }
#pragma unroll
    for (int kh = 0; kh < K; ++kh)
      accumulate_nhwc_row<TT, K>(win[kh], wl, kh, cw, acc, [](int i, int j) { return i - j * S; });
    Sx* yp = y + ((static_cast<size_t>(n) * s.OH + oh) * s.OW + ow0) * s.C + c0;
#pragma unroll
    for (int j = 0; j < TW; ++j)
      if (ow0 + j < s.OW) store_vec<TT, V>(yp + static_cast<size_t>(j) * s.C, acc[j]);
#pragma unroll
    for (int kh = 0; kh < K; ++kh)
#pragma unroll
      for (int i = 0; i < L; ++i) win[kh][i] = kh + S < K ? win[kh + S < K ? kh + S : 0][i] : next[kh + S >= K ? kh + S - K : 0][i];
  }
}

template <class TT, int S>
void launch_stream(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                   cudaStream_t stream) {
  using Sx = typename TT::S;
  constexpr int K = 3, TW = 2, V = 16 / sizeof(Sx);
  int rows_per_lane = knob(Knob::kStreamRows, dt);
  if (rows_per_lane < 1) rows_per_lane = 1;
  if (rows_per_lane > s.OH) rows_per_lane = s.OH;
  const int bands = ceil_div(s.OH, rows_per_lane);
  // Whole rows of strips per block, so neighbouring lanes share their halo columns through L1; the tile
  // rows run over (image, band) pairs, so the 14- and 7-wide layers still fill a block.
  const Tiling t = make_tiling(true, s.N * bands, 0, ceil_div(s.OW, TW), s.C / V, nhwc_lanes_c(V, sizeof(Sx)), 0);
  const dim3 grid(t.groups * t.tiles_h * t.tiles_w);
  const size_t smem = sizeof(float) * K * K * t.lanes_c * V;
  nhwc_stream_kernel<TT, K, S, TW, V><<<grid, t.block, smem, stream>>>(
      static_cast<const Sx*>(x), static_cast<const Sx*>(w), static_cast<const Sx*>(bias), static_cast<Sx*>(y), s, t,
      rows_per_lane, bands);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT>
void stream_t(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
              cudaStream_t stream) {
  (s.SH == 1 ? launch_stream<TT, 1> : launch_stream<TT, 2>)(s, dt, x, w, bias, y, stream);
}

}  // namespace

bool nhwc_stream_forward(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                         cudaStream_t stream) {
  if (knob(Knob::kFwdStream, dt) == 0 || !s.channels_last || s.KH != 3 || s.KW != 3 || s.SH != s.SW ||
      (s.SH != 1 && s.SH != 2) || s.DH != 1 || s.DW != 1 || s.C % (16 / elem_size(dt)) != 0 || !aligned(x, 16) ||
      !aligned(y, 16))
    return false;
  switch (dt) {
    case DType::F32: stream_t<F32T>(s, dt, x, w, bias, y, stream); return true;
    case DType::F16: stream_t<F16T>(s, dt, x, w, bias, y, stream); return true;
    case DType::BF16: stream_t<BF16T>(s, dt, x, w, bias, y, stream); return true;
    default: return false;
  }
}

}  // namespace mdw
