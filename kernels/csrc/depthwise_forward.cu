// Forward depthwise convolution, y = act(conv(x, w) + bias): every kernel that runs it, one section per
// technique. Which one runs a case is decided by the forward table in depthwise_dispatch.cpp.
//   tiled:      NHWC and NCHW, 3/5/7 square, stride 1/2, dilation 1, 16/32-bit (register tiles of a few columns)
//   vec3x3:     NCHW 3x3, stride 1, padding 1, 16-bit (vector loads; the kernel is in stencil_3x3.cuh)
//   column:     NHWC 3x3, stride 1/2, whole 32-bit words of channels (column walk; the kernel is in stencil_3x3.cuh),
//               and its variant that also writes the statistics of y per block (depthwise_fwd_stats)
//   generic:    everything else (one output element per thread)
// The 5x5/7x7 walks (NHWC and NCHW, behind knobs that are off by default) are in depthwise_k57.cu.
#include <c10/cuda/CUDAException.h>

#include <type_traits>

#include "depthwise_launchers.h"
#include "device_common.h"
#include "stencil_3x3.cuh"

namespace mdw {
namespace {

// ---- tiled ----

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

// ---- column ----

// The statistics walk: stride and rows per lane to their instantiation.
template <class TT>
void column_forward_stats(const ConvShape& s, DType dt, const void* x, const void* w, void* y, double* partial,
                          cudaStream_t stream) {
  if (column_plain_rows(s, dt) == 2) {
    (s.SH == 1 ? launch_column_stats<TT, 1, 2> : launch_column_stats<TT, 2, 2>)(s, dt, x, w, y, partial, stream);
  } else {
    (s.SH == 1 ? launch_column_stats<TT, 1, 1> : launch_column_stats<TT, 2, 1>)(s, dt, x, w, y, partial, stream);
  }
}

// ---- generic ----

// Any kernel size, stride, padding, dilation and depth multiplier: output channel oc reads input channel oc / M.
template <class TT, class I>
__global__ void fwd_generic_kernel(const typename TT::S* __restrict__ x, const typename TT::S* __restrict__ w,
                                   const typename TT::S* __restrict__ bias, typename TT::S* __restrict__ y,
                                   GenericShape<I> s, I total) {
  using Acc = typename TT::Acc;
  const I OC = s.OC();
  for (I idx = blockIdx.x * static_cast<I>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<I>(gridDim.x) * blockDim.x) {
    const Index4<I> o = decode<I>(idx, OC, s.OH, s.OW, s.channels_last);
    const I c = o.c / s.M;
    Acc acc = bias ? TT::to_acc(bias[o.c]) : Acc(0);
    for (I kh = 0; kh < s.KH; ++kh) {
      const I ih = o.h * s.SH - s.PH + kh * s.DH;
      if (ih < 0 || ih >= s.H) continue;
      for (I kw = 0; kw < s.KW; ++kw) {
        const I iw = o.w * s.SW - s.PW + kw * s.DW;
        if (iw < 0 || iw >= s.W) continue;
        acc += TT::to_acc(x[offset<I>(o.n, c, ih, iw, s.C, s.H, s.W, s.channels_last)]) *
               TT::to_acc(w[(o.c * s.KH + kh) * s.KW + kw]);
      }
    }
    y[idx] = TT::from_acc(activate(acc, s.act));
  }
}

template <class TT, class I>
void fwd_generic_i(const DepthwiseShape& d, const void* x, const void* w, const void* b, void* y, cudaStream_t st) {
  using Sx = typename TT::S;
  const GenericShape<I> s = generic_shape<I>(d);
  const long long total = d.N * d.C * d.M * d.OH * d.OW;
  fwd_generic_kernel<TT, I><<<grid_for(total, 256), 256, 0, st>>>(
      static_cast<const Sx*>(x), static_cast<const Sx*>(w), static_cast<const Sx*>(b), static_cast<Sx*>(y), s,
      static_cast<I>(total));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT>
void fwd_generic_t(const DepthwiseShape& d, const void* x, const void* w, const void* b, void* y, cudaStream_t st) {
  (generic_fits_int(d) ? fwd_generic_i<TT, int> : fwd_generic_i<TT, long long>)(d, x, w, b, y, st);
}

}  // namespace

void forward_tiled(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                   cudaStream_t stream) {
  switch (dt) {
    case DType::F32: return forward_fast<F32T>(s, x, w, bias, y, stream);
    case DType::F16: return forward_fast<F16T>(s, x, w, bias, y, stream);
    case DType::BF16: return forward_fast<BF16T>(s, x, w, bias, y, stream);
    default: return;  // the dispatch's tiled test excludes fp64
  }
}

bool forward_nchw_vec3x3(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                         cudaStream_t stream) {
  return conv3x3_nchw_vec<false>(s, dt, x, w, bias, y, stream);
}

void forward_nhwc_column(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                         cudaStream_t stream) {
  switch (dt) {
    case DType::F32: return column_walk<F32T, false>(s, dt, x, w, bias, y, stream);
    case DType::F16: return column_walk<F16T, false>(s, dt, x, w, bias, y, stream);
    case DType::BF16: return column_walk<BF16T, false>(s, dt, x, w, bias, y, stream);
    default: return;  // the dispatch's column test excludes fp64
  }
}

void forward_nhwc_column_normed(const ConvShape& s, DType dt, const void* x, const void* w, const InputNorm& norm,
                                void* y, cudaStream_t stream) {
  switch (dt) {
    case DType::F32: return column_walk<F32T, false, true>(s, dt, x, w, nullptr, y, stream, norm);
    case DType::F16: return column_walk<F16T, false, true>(s, dt, x, w, nullptr, y, stream, norm);
    case DType::BF16: return column_walk<BF16T, false, true>(s, dt, x, w, nullptr, y, stream, norm);
    default: return;  // normed_fits excludes fp64
  }
}

int forward_nhwc_column_stats_bands(const ConvShape& s, DType dt) { return column_stats_tiling(s, dt).tiles_h; }

void forward_nhwc_column_stats(const ConvShape& s, DType dt, const void* x, const void* w, void* y, double* partial,
                               cudaStream_t stream) {
  switch (dt) {
    case DType::F32: return column_forward_stats<F32T>(s, dt, x, w, y, partial, stream);
    case DType::F16: return column_forward_stats<F16T>(s, dt, x, w, y, partial, stream);
    case DType::BF16: return column_forward_stats<BF16T>(s, dt, x, w, y, partial, stream);
    default: return;  // the op's check (forward_stats_fits) excludes fp64
  }
}

void forward_generic(const DepthwiseShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                     cudaStream_t stream) {
  MDW_DISPATCH(dt, fwd_generic_t, s, x, w, bias, y, stream)
}

}  // namespace mdw
