// Input gradient of the depthwise convolution: every kernel that runs it, one section per technique. Which one
// runs a case is decided by the input-gradient table in depthwise_dispatch.cpp.
//   tiled:      NHWC and NCHW, 3/5/7 square, stride 1/2, dilation 1, 16/32-bit (register tiles of a few columns)
//   vec3x3:     NCHW 3x3, stride 1, padding 1, 16-bit: the forward's vector stencil, kernel rotated (stencil_3x3.cuh)
//   column:     NHWC 3x3, stride 1: the forward's column walk, kernel rotated (stencil_3x3.cuh)
//   generic:    everything else (one input element per thread)
// The NHWC 5x5/7x7 walk, kernel rotated (behind a knob that is off by default), is in depthwise_k57.cu.
#include <c10/cuda/CUDAException.h>

#include <type_traits>

#include "depthwise_launchers.h"
#include "device_common.h"
#include "stencil_3x3.cuh"

namespace mdw {
namespace {

// ---- tiled ----

// grad_input[ih, iw] = sum over taps (kh, kw) with ih = oh*S - P + kh, iw = ow*S - P + kw
// of grad_out[oh, ow] * w[kh, kw]. A lane owns TW consecutive input columns, aligned in padded
// coordinates (vw = iw + P) to a multiple of the stride, so which taps hit which grad_out column is
// known at compile time for stride 2 too (output parity); the row parity is checked at run time.
// BN: the input is relu(batch_norm(y)) and the lane writes the gradient of y instead (bn.y, bn.consts: the BatchNorm
// backward's per-channel constants from its sums): each grad_input value rounded to the element type, as
// depthwise_bwd stores it, then batchnorm_relu.cu's input-gradient arithmetic with y's value at the same place. That
// pass then does not run, and grad_input is never written or read back.
template <class TT, int K, int S, int TW, int V, bool BN = false>
__global__ void __launch_bounds__(256, V == 8 ? 2 : 3)
    dgrad_nhwc_kernel(const typename TT::S* __restrict__ go, const typename TT::S* __restrict__ w,
                      typename TT::S* __restrict__ gx, ConvShape s, Tiling t, InputGradNorm bn = {}) {
  using Sx = typename TT::S;
  constexpr int A = (K - 1) / S;  // grad_out columns left of vw0/S that reach this strip
  constexpr int L = A + (TW - 1) / S + 1;
  extern __shared__ float w_smem[];
  const int cw = t.lanes_c * V;
  const int c_base = nhwc_block_group(t) * cw;
  stage_weights_f32<TT, K>(w, s.C, c_base, cw, w_smem);

  const int lane = threadIdx.x;
  if (lane >= t.threads) return;
  const NhwcLane ln = nhwc_lane(lane, t);
  const int c0 = c_base + ln.cv * V;
  const TileIndex tile = split_tile_index(nhwc_block_tile(t), t);
  const ImageRange images = image_range(tile.outer, t, s.N);
  const int ih = tile.tile_h * t.sy_n + ln.sy;
  const int vw0 = (t.strip0 + tile.tile_w * t.sx_n + ln.sx) * TW;
  if (c0 >= s.C || ih >= s.H || vw0 >= s.PW + s.W) return;

#pragma unroll 1
  for (int n = images.begin; n < images.end; ++n) {
    float acc[TW][V];
    fill(acc, 0.f);
    const int owb = vw0 / S - A;
    const int vh = ih + s.PH;
    const float* wl = w_smem + ln.cv * V;
#pragma unroll
    for (int kh = 0; kh < K; ++kh) {
      const int th = vh - kh;
      if (th < 0 || th % S != 0) continue;
      const int oh = th / S;
      if (oh >= s.OH) continue;
      Pack<Sx, V> raw[L];
      load_row_packs(go + ((static_cast<size_t>(n) * s.OH + oh) * s.OW) * s.C + c0, owb, s.OW, s.C, raw);
      accumulate_nhwc_row<TT, K>(raw, wl, kh, cw, acc, [](int i, int j) { return j - (i - A) * S; });
    }
    const size_t row = (static_cast<size_t>(n) * s.H + ih) * s.W * s.C + c0;
    Sx* xp = gx + row;
    if constexpr (BN) {
      // The constants once per image: reloading them here (L1) keeps them out of the accumulation's registers.
      float k[6][V];
#pragma unroll
      for (int j = 0; j < 6; ++j)
#pragma unroll
        for (int v = 0; v < V; ++v) k[j][v] = __ldg(bn.consts + static_cast<size_t>(j) * s.C + c0 + v);
      const Sx* yp = static_cast<const Sx*>(bn.y) + row;
#pragma unroll
      for (int j = 0; j < TW; ++j) {
        const int iw = vw0 + j - s.PW;
        if (iw < 0 || iw >= s.W) continue;
        float yv[V], out[V];
        load_vec<TT, V>(yp + static_cast<size_t>(iw) * s.C, yv);
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const float g = TT::to_acc(TT::from_acc(acc[j][v]));  // grad_input as depthwise_bwd would store it
          out[v] = bn_relu_input_grad<TT>(g, yv[v], k[0][v], k[1][v], k[2][v], k[3][v], k[4][v], k[5][v]);
        }
        store_vec<TT, V>(xp + static_cast<size_t>(iw) * s.C, out);
      }
    } else {
#pragma unroll
      for (int j = 0; j < TW; ++j) {
        const int iw = vw0 + j - s.PW;
        if (iw >= 0 && iw < s.W) store_vec<TT, V>(xp + static_cast<size_t>(iw) * s.C, acc[j]);
      }
    }
  }
}

template <class TT, int K, int S, int TW>
__global__ void __launch_bounds__(256)
    dgrad_nchw_kernel(const typename TT::S* __restrict__ go, const typename TT::S* __restrict__ w,
                      typename TT::S* __restrict__ gx, ConvShape s, Tiling t) {
  using Sx = typename TT::S;
  constexpr int A = (K - 1) / S;
  constexpr int L = A + (TW - 1) / S + 1;
  const int lane = threadIdx.x;
  if (lane >= t.threads) return;
  const NchwLane ln = nchw_lane(lane, t);
  const TileIndex tile = split_tile_index(blockIdx.x, t);
  const long long plane = static_cast<long long>(tile.outer) * t.lanes_c + ln.q;
  const int ih = tile.tile_h * t.sy_n + ln.sy;
  const int vw0 = (t.strip0 + tile.tile_w * t.sx_n + ln.sx) * TW;
  if (plane >= static_cast<long long>(s.N) * s.C || ih >= s.H || vw0 >= s.PW + s.W) return;
  const int c = static_cast<int>(plane % s.C);

  float acc[TW];
#pragma unroll
  for (int j = 0; j < TW; ++j) acc[j] = 0.f;
  const Sx* gp = go + plane * s.OH * s.OW;
  const Sx* wc = w + c * K * K;
  const int owb = vw0 / S - A;
  const int vh = ih + s.PH;
#pragma unroll
  for (int kh = 0; kh < K; ++kh) {
    const int th = vh - kh;
    if (th < 0 || th % S != 0) continue;
    const int oh = th / S;
    if (oh >= s.OH) continue;
    Sx raw[L];
    load_row_scalars(gp + static_cast<size_t>(oh) * s.OW, owb, s.OW, raw);
    accumulate_nchw_row<TT, K>(raw, wc, kh, acc, [](int i, int j) { return j - (i - A) * S; });
  }
  Sx* xp = gx + (plane * s.H + ih) * s.W;
#pragma unroll
  for (int j = 0; j < TW; ++j) {
    const int iw = vw0 + j - s.PW;
    if (iw >= 0 && iw < s.W) xp[iw] = TT::from_acc(acc[j]);
  }
}

template <class TT, int K, int S, int TW, int V, bool BN = false>
void launch_dgrad_nhwc(const ConvShape& s, const void* go, const void* w, void* gx, int strip0, int strips,
                       cudaStream_t stream, const InputGradNorm& bn = {}) {
  using Sx = typename TT::S;
  Tiling t = make_tiling(true, s.H, strip0, strips, s.C / V, nhwc_lanes_c(V, sizeof(Sx)));
  const int blocks_per_image = t.groups * t.tiles_h * t.tiles_w;
  const DType dt = sizeof(Sx) == 4 ? DType::F32 : (std::is_same_v<TT, F16T> ? DType::F16 : DType::BF16);
  t.images = images_per_block(dt, blocks_per_image, s.N);
  t.group_fastest = knob(Knob::kGroupFastest, dt);
  t.blocks_per_group = t.tiles_h * t.tiles_w * ceil_div(s.N, t.images);
  const dim3 grid(blocks_per_image * ceil_div(s.N, t.images));
  const size_t smem = sizeof(float) * K * K * t.lanes_c * V;
  dgrad_nhwc_kernel<TT, K, S, TW, V, BN><<<grid, t.block, smem, stream>>>(
      static_cast<const Sx*>(go), static_cast<const Sx*>(w), static_cast<Sx*>(gx), s, t, bn);
}

// BN: the NHWC kernel with the BatchNorm's input gradient as its epilogue (its caller runs it on NHWC only).
template <class TT, int K, int S, bool BN = false>
void run_dgrad(const ConvShape& s, const void* go, const void* w, void* gx, cudaStream_t stream,
               const InputGradNorm& bn) {
  using Sx = typename TT::S;
  constexpr int TW = StripWidth<K, S>::value;
  static_assert(TW % S == 0, "strips must start on a stride multiple");
  // Strips tile the padded columns [PW, PW + W).
  const int strip0 = s.PW / TW;
  const int strips = (s.PW + s.W - 1) / TW - strip0 + 1;
  if (BN || s.channels_last) {
    launch_dgrad_nhwc<TT, K, S, TW, NhwcVec<Sx>::value, BN>(s, go, w, gx, strip0, strips, stream, bn);
  } else {
    const Tiling t = make_tiling(false, s.H, strip0, strips, s.N * s.C);
    const dim3 grid(t.groups * t.tiles_h * t.tiles_w);
    dgrad_nchw_kernel<TT, K, S, TW><<<grid, t.block, 0, stream>>>(
        static_cast<const Sx*>(go), static_cast<const Sx*>(w), static_cast<Sx*>(gx), s, t);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT>
void dgrad_fast(const ConvShape& s, const void* go, const void* w, void* gx, cudaStream_t st) {
  const int k = s.KH, str = s.SH;
  const InputGradNorm plain{};
  if (k == 3) (str == 1 ? run_dgrad<TT, 3, 1> : run_dgrad<TT, 3, 2>)(s, go, w, gx, st, plain);
  else if (k == 5) (str == 1 ? run_dgrad<TT, 5, 1> : run_dgrad<TT, 5, 2>)(s, go, w, gx, st, plain);
  else (str == 1 ? run_dgrad<TT, 7, 1> : run_dgrad<TT, 7, 2>)(s, go, w, gx, st, plain);
}

// The tiled NHWC 3x3 kernel with the BatchNorm's input gradient as its epilogue, at stride 1 or 2.
template <class TT>
void dgrad_normed_t(const ConvShape& s, const void* go, const void* w, const InputGradNorm& bn, void* gy,
                    cudaStream_t stream) {
  (s.SH == 1 ? run_dgrad<TT, 3, 1, true> : run_dgrad<TT, 3, 2, true>)(s, go, w, gy, stream, bn);
}

// ---- generic ----

// Any kernel size, stride, padding, dilation and depth multiplier: input channel c gathers over the M output
// channels c * M .. c * M + M - 1 it feeds.
template <class TT, class I>
__global__ void dgrad_generic_kernel(const typename TT::S* __restrict__ go, const typename TT::S* __restrict__ w,
                                     typename TT::S* __restrict__ gx, GenericShape<I> s, I total) {
  using Acc = typename TT::Acc;
  const I OC = s.OC();
  for (I idx = blockIdx.x * static_cast<I>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<I>(gridDim.x) * blockDim.x) {
    const Index4<I> i = decode<I>(idx, s.C, s.H, s.W, s.channels_last);
    Acc acc = Acc(0);
    for (I kh = 0; kh < s.KH; ++kh) {
      const I th = i.h + s.PH - kh * s.DH;
      if (th < 0 || th % s.SH != 0 || th / s.SH >= s.OH) continue;
      for (I kw = 0; kw < s.KW; ++kw) {
        const I tw = i.w + s.PW - kw * s.DW;
        if (tw < 0 || tw % s.SW != 0 || tw / s.SW >= s.OW) continue;
        for (I j = 0; j < s.M; ++j) {
          const I oc = i.c * s.M + j;
          acc += TT::to_acc(go[offset<I>(i.n, oc, th / s.SH, tw / s.SW, OC, s.OH, s.OW, s.channels_last)]) *
                 TT::to_acc(w[(oc * s.KH + kh) * s.KW + kw]);
        }
      }
    }
    gx[idx] = TT::from_acc(acc);
  }
}

template <class TT, class I>
void dgrad_generic_i(const DepthwiseShape& d, const void* go, const void* w, void* gx, cudaStream_t st) {
  using Sx = typename TT::S;
  const long long total = d.N * d.C * d.H * d.W;
  dgrad_generic_kernel<TT, I><<<grid_for(total, 256), 256, 0, st>>>(
      static_cast<const Sx*>(go), static_cast<const Sx*>(w), static_cast<Sx*>(gx), generic_shape<I>(d),
      static_cast<I>(total));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT>
void dgrad_generic_t(const DepthwiseShape& d, const void* go, const void* w, void* gx, cudaStream_t st) {
  (generic_fits_int(d) ? dgrad_generic_i<TT, int> : dgrad_generic_i<TT, long long>)(d, go, w, gx, st);
}

}  // namespace

void input_grad_tiled(const ConvShape& s, DType dt, const void* go, const void* w, void* gx, cudaStream_t stream) {
  switch (dt) {
    case DType::F32: return dgrad_fast<F32T>(s, go, w, gx, stream);
    case DType::F16: return dgrad_fast<F16T>(s, go, w, gx, stream);
    case DType::BF16: return dgrad_fast<BF16T>(s, go, w, gx, stream);
    default: return;  // the dispatch's tiled test excludes fp64
  }
}

void input_grad_tiled_normed(const ConvShape& s, DType dt, const void* go, const void* w, const InputGradNorm& bn,
                             void* gy, cudaStream_t stream) {
  switch (dt) {
    case DType::F32: return dgrad_normed_t<F32T>(s, go, w, bn, gy, stream);
    case DType::F16: return dgrad_normed_t<F16T>(s, go, w, bn, gy, stream);
    case DType::BF16: return dgrad_normed_t<BF16T>(s, go, w, bn, gy, stream);
    default: return;  // dgrad_normed_fits excludes fp64
  }
}

// 3x3/stride 1/padding 1: the input gradient is the same stencil with the kernel rotated.
bool input_grad_nchw_vec3x3(const ConvShape& s, DType dt, const void* go, const void* w, void* gx,
                            cudaStream_t stream) {
  return conv3x3_nchw_vec<true>(s, dt, go, w, nullptr, gx, stream);
}

// The forward stencil on input_grad_as_forward(s), whose input is grad_out; stride 1 only. DGRAD_COLUMN_ROWS = 1:
// one output row and 4 steps per lane; 0: the rows and steps the forward's rule picks for that shape (column_walk).
template <class TT>
void dgrad_column(const ConvShape& f, DType dt, const void* go, const void* w, void* gx, cudaStream_t stream) {
  if (knob(Knob::kDgradColumnRows, dt) == 0) {
    column_walk<TT, true>(f, dt, go, w, nullptr, gx, stream);
  } else {
    launch_column<TT, 1, true, 1>(f, dt, go, w, nullptr, gx, stream);
  }
}

void input_grad_nhwc_column(const ConvShape& s, DType dt, const void* go, const void* w, void* gx,
                            cudaStream_t stream) {
  const ConvShape f = input_grad_as_forward(s);
  switch (dt) {
    case DType::F32: return dgrad_column<F32T>(f, dt, go, w, gx, stream);
    case DType::F16: return dgrad_column<F16T>(f, dt, go, w, gx, stream);
    case DType::BF16: return dgrad_column<BF16T>(f, dt, go, w, gx, stream);
    default: return;  // the dispatch's column test excludes fp64
  }
}

void input_grad_generic(const DepthwiseShape& s, DType dt, const void* go, const void* w, void* gx, cudaStream_t stream) {
  MDW_DISPATCH(dt, dgrad_generic_t, s, go, w, gx, stream)
}

}  // namespace mdw
