// Forward depthwise convolution: fast NHWC and NCHW kernels for 3/5/7 square kernels, stride 1/2,
// dilation 1; everything else goes to the generic kernel.
#include "device_common.h"

#include <type_traits>

namespace mdw {
namespace {

// NHWC: a lane owns V channels (one 16-byte vector) and TW consecutive output columns of one row.
// Per kernel row it loads the (TW-1)*S+K input vectors it needs once and reuses them across the
// TW outputs in registers; neighbouring lanes of the block share rows/columns through L1.
template <class TT, int K, int S, int TW, int V>
__global__ void __launch_bounds__(256, V == 8 ? 2 : 3)
    fwd_nhwc_kernel(const typename TT::S* __restrict__ x, const typename TT::S* __restrict__ w,
                    const typename TT::S* __restrict__ bias, typename TT::S* __restrict__ y, ConvShape s, Tiling t) {
  using Sx = typename TT::S;
  constexpr int L = (TW - 1) * S + K;
  extern __shared__ float w_smem[];  // [K*K][channels of this block], fp32
  const int cw = t.lanes_c * V;
  const int c_base = nhwc_block_group(t) * cw;
  stage_weights_f32<TT, K>(w, s.C, c_base, cw, w_smem);

  const int lane = threadIdx.x;
  if (lane >= t.threads) return;
  const NhwcLane ln = nhwc_lane(lane, t);
  const int c0 = c_base + ln.cv * V;
  const TileIndex tile = split_tile_index(nhwc_block_tile(t), t);
  const ImageRange images = image_range(tile.outer, t, s.N);
  const int oh = tile.tile_h * t.sy_n + ln.sy;
  const int ow0 = (tile.tile_w * t.sx_n + ln.sx) * TW;
  if (c0 >= s.C || oh >= s.OH || ow0 >= s.OW) return;

#pragma unroll 1
  for (int n = images.begin; n < images.end; ++n) {
    float acc[TW][V];
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const float bv = bias ? TT::to_acc(bias[c0 + v]) : 0.f;
#pragma unroll
      for (int j = 0; j < TW; ++j) acc[j][v] = bv;
    }
    const Sx* xn = x + static_cast<size_t>(n) * s.H * s.W * s.C + c0;
    const int iw0 = ow0 * S - s.PW;
    const float* wl = w_smem + ln.cv * V;
#pragma unroll
    for (int kh = 0; kh < K; ++kh) {
      const int ih = oh * S - s.PH + kh;
      if (ih < 0 || ih >= s.H) continue;
      Pack<Sx, V> raw[L];
      load_row_packs(xn + static_cast<size_t>(ih) * s.W * s.C, iw0, s.W, s.C, raw);
      accumulate_nhwc_row<TT, K>(raw, wl, kh, cw, acc, [](int i, int j) { return i - j * S; });
    }
    Sx* yp = y + ((static_cast<size_t>(n) * s.OH + oh) * s.OW + ow0) * s.C + c0;
#pragma unroll
    for (int j = 0; j < TW; ++j) {
      activate(acc[j], s.act);
      if (ow0 + j < s.OW) store_vec<TT, V>(yp + static_cast<size_t>(j) * s.C, acc[j]);
    }
  }
}

// NCHW: a lane owns TW consecutive output columns of one row of one (n, c) plane; lanes along sx
// read consecutive addresses, and the rows of a tile share input rows through L1.
template <class TT, int K, int S, int TW>
__global__ void __launch_bounds__(256)
    fwd_nchw_kernel(const typename TT::S* __restrict__ x, const typename TT::S* __restrict__ w,
                    const typename TT::S* __restrict__ bias, typename TT::S* __restrict__ y, ConvShape s, Tiling t) {
  using Sx = typename TT::S;
  constexpr int L = (TW - 1) * S + K;
  const int lane = threadIdx.x;
  if (lane >= t.threads) return;
  const NchwLane ln = nchw_lane(lane, t);
  const TileIndex tile = split_tile_index(blockIdx.x, t);
  const long long plane = static_cast<long long>(tile.outer) * t.lanes_c + ln.q;
  const int oh = tile.tile_h * t.sy_n + ln.sy;
  const int ow0 = (tile.tile_w * t.sx_n + ln.sx) * TW;
  if (plane >= static_cast<long long>(s.N) * s.C || oh >= s.OH || ow0 >= s.OW) return;
  const int c = static_cast<int>(plane % s.C);

  float acc[TW];
  const float bv = bias ? TT::to_acc(bias[c]) : 0.f;
#pragma unroll
  for (int j = 0; j < TW; ++j) acc[j] = bv;
  const Sx* xp = x + plane * s.H * s.W;
  const Sx* wc = w + c * K * K;
  const int iw0 = ow0 * S - s.PW;
#pragma unroll
  for (int kh = 0; kh < K; ++kh) {
    const int ih = oh * S - s.PH + kh;
    if (ih < 0 || ih >= s.H) continue;
    Sx raw[L];
    load_row_scalars(xp + static_cast<size_t>(ih) * s.W, iw0, s.W, raw);
    accumulate_nchw_row<TT, K>(raw, wc, kh, acc, [](int i, int j) { return i - j * S; });
  }
  Sx* yp = y + (plane * s.OH + oh) * s.OW + ow0;
#pragma unroll
  for (int j = 0; j < TW; ++j)
    if (ow0 + j < s.OW) yp[j] = TT::from_acc(activate(acc[j], s.act));
}


// NCHW, K=3, stride 1, TH output rows per lane: each of the TH+2 input rows is loaded once for all
// TH output rows, (TH+2)/TH row loads per output row instead of 3.
template <class TT, int TW, int TH>
__global__ void __launch_bounds__(256)
    fwd_nchw_rows_kernel(const typename TT::S* __restrict__ x, const typename TT::S* __restrict__ w,
                         const typename TT::S* __restrict__ bias, typename TT::S* __restrict__ y, ConvShape s,
                         Tiling t) {
  using Sx = typename TT::S;
  constexpr int K = 3;
  constexpr int L = TW - 1 + K;
  constexpr int R = TH - 1 + K;
  const int lane = threadIdx.x;
  if (lane >= t.threads) return;
  const NchwLane ln = nchw_lane(lane, t);
  const TileIndex tile = split_tile_index(blockIdx.x, t);
  const long long plane = static_cast<long long>(tile.outer) * t.lanes_c + ln.q;
  const int oh0 = (tile.tile_h * t.sy_n + ln.sy) * TH;
  const int ow0 = (tile.tile_w * t.sx_n + ln.sx) * TW;
  if (plane >= static_cast<long long>(s.N) * s.C || oh0 >= s.OH || ow0 >= s.OW) return;
  const int c = static_cast<int>(plane % s.C);

  float wk[K * K];
#pragma unroll
  for (int k = 0; k < K * K; ++k) wk[k] = TT::to_acc(w[c * K * K + k]);
  float acc[TH][TW];
  const float bv = bias ? TT::to_acc(bias[c]) : 0.f;
#pragma unroll
  for (int h = 0; h < TH; ++h)
#pragma unroll
    for (int j = 0; j < TW; ++j) acc[h][j] = bv;
  const Sx* xp = x + plane * s.H * s.W;
  const int iw0 = ow0 - s.PW;
#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
    const int ih = oh0 - s.PH + rr;
    if (ih < 0 || ih >= s.H) continue;
    Sx raw[L];
    load_row_scalars(xp + static_cast<size_t>(ih) * s.W, iw0, s.W, raw);
#pragma unroll
    for (int i = 0; i < L; ++i) {
      const float xv = TT::to_acc(raw[i]);
#pragma unroll
      for (int h = 0; h < TH; ++h) {
        const int kh = rr - h;
        if (kh < 0 || kh >= K) continue;
#pragma unroll
        for (int j = 0; j < TW; ++j) {
          const int kw = i - j;
          if (kw >= 0 && kw < K) acc[h][j] = fmaf(wk[kh * K + kw], xv, acc[h][j]);
        }
      }
    }
  }
#pragma unroll
  for (int h = 0; h < TH; ++h) {
    if (oh0 + h >= s.OH) break;
    Sx* yp = y + (plane * s.OH + oh0 + h) * s.OW + ow0;
#pragma unroll
    for (int j = 0; j < TW; ++j)
      if (ow0 + j < s.OW) yp[j] = TT::from_acc(activate(acc[h][j], s.act));
  }
}

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

template <class TT, int K, int S, int TW, int V>
void launch_fwd_nhwc(const ConvShape& s, const void* x, const void* w, const void* bias, void* y, int strips,
                     cudaStream_t stream) {
  using Sx = typename TT::S;
  Tiling t = make_tiling(true, s.OH, 0, strips, s.C / V, nhwc_lanes_c(V, sizeof(Sx)));
  const int blocks_per_image = t.groups * t.tiles_h * t.tiles_w;
  const DType dt = sizeof(Sx) == 4 ? DType::F32 : (std::is_same_v<TT, F16T> ? DType::F16 : DType::BF16);
  t.images = images_per_block(dt, blocks_per_image, s.N);
  t.group_fastest = knob(Knob::kGroupFastest, dt);
  t.blocks_per_group = t.tiles_h * t.tiles_w * ceil_div(s.N, t.images);
  const dim3 grid(blocks_per_image * ceil_div(s.N, t.images));
  const size_t smem = sizeof(float) * K * K * t.lanes_c * V;
  fwd_nhwc_kernel<TT, K, S, TW, V><<<grid, t.block, smem, stream>>>(
      static_cast<const Sx*>(x), static_cast<const Sx*>(w), static_cast<const Sx*>(bias), static_cast<Sx*>(y), s, t);
}

template <class TT, int K, int S>
void run_forward(const ConvShape& s, const void* x, const void* w, const void* bias, void* y, cudaStream_t stream) {
  using Sx = typename TT::S;
  constexpr int TW = StripWidth<K, S>::value;
  const int strips = ceil_div(s.OW, TW);
  if (s.channels_last) {
    launch_fwd_nhwc<TT, K, S, TW, NhwcVec<Sx>::value>(s, x, w, bias, y, strips, stream);
  } else {
    if constexpr (K == 3 && S == 1) {
      const DType dt = sizeof(Sx) == 4 ? DType::F32 : (std::is_same_v<TT, F16T> ? DType::F16 : DType::BF16);
      if (knob(Knob::kNchwRows, dt) == 2) {
        const Tiling t = make_tiling(false, ceil_div(s.OH, 2), 0, strips, s.N * s.C);
        const dim3 grid(t.groups * t.tiles_h * t.tiles_w);
        fwd_nchw_rows_kernel<TT, TW, 2><<<grid, t.block, 0, stream>>>(
            static_cast<const Sx*>(x), static_cast<const Sx*>(w), static_cast<const Sx*>(bias), static_cast<Sx*>(y),
            s, t);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return;
      }
    }
    const Tiling t = make_tiling(false, s.OH, 0, strips, s.N * s.C);
    const dim3 grid(t.groups * t.tiles_h * t.tiles_w);
    fwd_nchw_kernel<TT, K, S, TW><<<grid, t.block, 0, stream>>>(
        static_cast<const Sx*>(x), static_cast<const Sx*>(w), static_cast<const Sx*>(bias), static_cast<Sx*>(y), s, t);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT>
void forward_fast(const ConvShape& s, const void* x, const void* w, const void* b, void* y, cudaStream_t st) {
  const int k = s.KH, str = s.SH;
  if (k == 3) (str == 1 ? run_forward<TT, 3, 1> : run_forward<TT, 3, 2>)(s, x, w, b, y, st);
  else if (k == 5) (str == 1 ? run_forward<TT, 5, 1> : run_forward<TT, 5, 2>)(s, x, w, b, y, st);
  else (str == 1 ? run_forward<TT, 7, 1> : run_forward<TT, 7, 2>)(s, x, w, b, y, st);
}

}  // namespace

bool conv3x3_nchw_vec(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                      bool flip, cudaStream_t stream) {
  if (s.channels_last || dt == DType::F64 || s.KH != 3 || s.KW != 3 || s.SH != 1 || s.SW != 1 || s.PH != 1 ||
      s.PW != 1 || s.DH != 1 || s.DW != 1 || s.OH != s.H || s.OW != s.W)
    return false;
  switch (dt) {
    case DType::F32:
      return flip ? conv3x3_nchw_vec_t<F32T, true>(s, x, w, bias, y, stream)
                  : conv3x3_nchw_vec_t<F32T, false>(s, x, w, bias, y, stream);
    case DType::F16:
      return flip ? conv3x3_nchw_vec_t<F16T, true>(s, x, w, bias, y, stream)
                  : conv3x3_nchw_vec_t<F16T, false>(s, x, w, bias, y, stream);
    case DType::BF16:
      return flip ? conv3x3_nchw_vec_t<BF16T, true>(s, x, w, bias, y, stream)
                  : conv3x3_nchw_vec_t<BF16T, false>(s, x, w, bias, y, stream);
    default: return false;
  }
}

void launch_forward(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                    cudaStream_t stream) {
  bool fast = fast_geometry(s, dt);
  if (fast && s.channels_last) {
    const int v = nhwc_vec(dt);
    fast = s.C % v == 0 && aligned(x, v * elem_size(dt)) && aligned(y, v * elem_size(dt));
  }
  if (!fast) return forward_generic(s, dt, x, w, bias, y, stream);
  if (nhwc_column_forward(s, dt, x, w, bias, y, stream)) return;
  if (conv3x3_nchw_vec(s, dt, x, w, bias, y, /*flip=*/false, stream)) return;
  switch (dt) {
    case DType::F32: return forward_fast<F32T>(s, x, w, bias, y, stream);
    case DType::F16: return forward_fast<F16T>(s, x, w, bias, y, stream);
    case DType::BF16: return forward_fast<BF16T>(s, x, w, bias, y, stream);
    default: return forward_generic(s, dt, x, w, bias, y, stream);
  }
}

}  // namespace mdw
