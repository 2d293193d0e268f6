// Weight and bias gradients, deterministic and without atomics:
//   stage 1: block (chunk g, channel group) sums grad_out * x over a fixed set of tiles of
//            (n, oh, ow) into registers, reduces its lanes in a fixed order (warp butterfly, then
//            warps in index order) and writes fp32 partials ws[g][c][K*K + 1] (last slot: bias);
//   stage 2: one thread per (c, tap) adds the partials over g in index order.
// The chunk count depends only on the shape and the GPU, so reruns are bitwise identical.
#include "device_common.h"

namespace mdw {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

// Output columns per lane: 2 keeps the accumulators, the grad_out strip and one input row segment
// within 80 registers (3 blocks per SM); neighbouring lanes share the rest through L1.
constexpr int kWgradStrip = 2;

// Channels per NHWC lane: K*K*V fp32 accumulators must fit in registers next to the loads.
template <int K>
struct WgradVec {
  static constexpr int value = K == 3 ? 4 : (K == 5 ? 2 : 1);
};

// Sum the lanes' accumulators of one channel vector in a fixed order (butterfly inside each warp,
// then warps in index order) and write the block's partials ws[chunk][c][tap].
// Lanes with the same cv sit lanes_c apart in a warp (lanes_c is a power of two <= 16).
template <int KK, int V>
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
    if (c < s.C) ws[(static_cast<size_t>(chunk) * s.C + c) * (KK + 1) + k] = sum;
  }
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

// Row-streaming variant (K=3, stride 1, 16-bit): a lane walks `rows_per_lane` consecutive output rows of one
// strip, keeping the K input rows it needs in registers, so each output row costs one grad_out strip
// and S new input rows instead of K; the loads for the next row are issued before this row's FMAs.
template <class TT, int K, int S, int TW, int V>
__global__ void __launch_bounds__(256, 2)
    wgrad_nhwc_stream_kernel(const typename TT::S* __restrict__ go, const typename TT::S* __restrict__ x,
                             float* __restrict__ ws, ConvShape s, Tiling t, int num_tiles, int rows_per_lane) {
  using Sx = typename TT::S;
  using P = Pack<Sx, V>;
  constexpr int L = (TW - 1) * S + K;
  constexpr int KK = K * K;
  extern __shared__ float red[];

  const int lane = threadIdx.x;
  const NhwcLane ln = nhwc_lane(lane, t);
  const WgradNhwcBlock blk = wgrad_nhwc_block(t);
  const int c0 = (blk.group * t.lanes_c + ln.cv) * V;
  const bool active = lane < t.threads && c0 < s.C;
  float acc[KK + 1][V];
  fill(acc, 0.f);

  // One input row segment (L vectors) at row ih; zeros outside the image. Not load_row_packs: folding
  // the row test into it changed this kernel's machine code.
  auto load_row = [&](const Sx* xn, int ih, int iw0, P (&dst)[L]) {
    load_image_row_packs(xn, ih, s.H, iw0, s.W, s.C, dst);
  };

  if (active) {
    for (int tile_index = blk.chunk; tile_index < num_tiles; tile_index += blk.chunks) {
      const TileIndex tile = split_tile_index(tile_index, t);
      const int n = tile.outer;
      const int oh0 = (tile.tile_h * t.sy_n + ln.sy) * rows_per_lane;
      const int ow0 = (tile.tile_w * t.sx_n + ln.sx) * TW;
      if (oh0 >= s.OH || ow0 >= s.OW) continue;
      const int oh_end = oh0 + rows_per_lane < s.OH ? oh0 + rows_per_lane : s.OH;
      const Sx* xn = x + static_cast<size_t>(n) * s.H * s.W * s.C + c0;
      const Sx* gn = go + static_cast<size_t>(n) * s.OH * s.OW * s.C + c0;
      const int iw0 = ow0 * S - s.PW;
      P win[K][L];
#pragma unroll
      for (int kh = 0; kh < K; ++kh) load_row(xn, oh0 * S - s.PH + kh, iw0, win[kh]);
      for (int oh = oh0; oh < oh_end; ++oh) {
        P graw[TW];
        const Sx* gp = gn + (static_cast<size_t>(oh) * s.OW + ow0) * s.C;
#pragma unroll
        for (int j = 0; j < TW; ++j) {
          if (ow0 + j < s.OW) {
            graw[j] = *reinterpret_cast<const P*>(gp + static_cast<size_t>(j) * s.C);
          } else {
#pragma unroll
            for (int v = 0; v < V; ++v) graw[j].v[v] = Sx(0);
          }
        }
        // Rows entering the window for the next output row, loaded before this row's arithmetic.
        P next[S][L];
#pragma unroll
        for (int r = 0; r < S; ++r) load_row(xn, (oh + 1) * S - s.PH + K - S + r, iw0, next[r]);
        float g[TW][V];
#pragma unroll
        for (int j = 0; j < TW; ++j) {
          widen<TT, V>(graw[j], g[j]);
#pragma unroll
          for (int v = 0; v < V; ++v) acc[KK][v] += g[j][v];
        }
#pragma unroll
        for (int kh = 0; kh < K; ++kh)
#pragma unroll
          for (int i = 0; i < L; ++i) {
            float xv[V];
            widen<TT, V>(win[kh][i], xv);
            accumulate_wgrad_column<K, S>(kh, i, xv, g, acc);
          }
#pragma unroll
        for (int kh = 0; kh < K; ++kh)
#pragma unroll
          for (int i = 0; i < L; ++i) win[kh][i] = kh + S < K ? win[kh + S < K ? kh + S : 0][i] : next[kh + S >= K ? kh + S - K : 0][i];
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

struct WgradPlan {
  bool fast;
  bool stream;        // NHWC row-streaming kernel
  int rows_per_lane;  // stream: output rows each lane walks
  int chunks;         // blocks along grid.x; partial sums per (c, tap)
  Tiling tiling;
  int num_tiles;
};

template <int K, int S>
WgradPlan plan_fast(const ConvShape& s, DType dt) {
  const int elem_bytes = elem_size(dt);
  constexpr int TW = kWgradStrip;
  WgradPlan p{};
  p.fast = true;
  const int strips = ceil_div(s.OW, TW);
  const int target_blocks = num_sms() * (s.channels_last ? knob(Knob::kWgradBlocksPerSm, dt) : 8);
  if (s.channels_last) {
    constexpr int V = WgradVec<K>::value;
    // <= 16 lanes: the block reduction's shared memory stays under 48 KB for every K.
    const int lanes = nhwc_lanes_c(V, elem_bytes) < 16 ? nhwc_lanes_c(V, elem_bytes) : 16;
    p.stream = K == 3 && S == 1 && elem_bytes == 2 && knob(Knob::kWgradStream, dt) != 0;
    p.rows_per_lane = p.stream ? 8 : 1;
    p.tiling = make_tiling(true, ceil_div(s.OH, p.rows_per_lane), 0, strips, s.C / V, lanes);
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

WgradPlan make_plan(const ConvShape& s, DType dt, const void* go, const void* x) {
  bool fast = fast_geometry(s, dt);
  if (fast && s.channels_last) {
    const int v = s.KH == 3 ? 4 : (s.KH == 5 ? 2 : 1);
    const size_t bytes = static_cast<size_t>(v) * elem_size(dt);
    fast = s.C % v == 0 && aligned(go, bytes) && aligned(x, bytes);
  }
  if (!fast) {
    WgradPlan p{};
    p.fast = false;
    p.chunks = wgrad_generic_chunks(s);
    return p;
  }
  const int k = s.KH, str = s.SH;
  if (k == 3) return str == 1 ? plan_fast<3, 1>(s, dt) : plan_fast<3, 2>(s, dt);
  if (k == 5) return str == 1 ? plan_fast<5, 1>(s, dt) : plan_fast<5, 2>(s, dt);
  return str == 1 ? plan_fast<7, 1>(s, dt) : plan_fast<7, 2>(s, dt);
}

template <class TT, int K, int S>
void run_wgrad(const ConvShape& s, const WgradPlan& p, const void* go, const void* x, float* ws, cudaStream_t stream) {
  using Sx = typename TT::S;
  constexpr int TW = kWgradStrip;
  const Tiling& t = p.tiling;
  if (s.channels_last) {
    constexpr int V = WgradVec<K>::value;
    const size_t smem = sizeof(float) * (t.block / 32) * t.lanes_c * (K * K + 1) * V;
    const dim3 grid(t.groups * p.chunks);
    if constexpr (K == 3 && S == 1 && sizeof(Sx) == 2) {
      if (p.stream) {
        wgrad_nhwc_stream_kernel<TT, K, S, TW, V><<<grid, t.block, smem, stream>>>(
            static_cast<const Sx*>(go), static_cast<const Sx*>(x), ws, s, t, p.num_tiles, p.rows_per_lane);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return;
      }
    }
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
void wgrad_fast(const ConvShape& s, const WgradPlan& p, const void* go, const void* x, float* ws, cudaStream_t st) {
  const int k = s.KH, str = s.SH;
  if (k == 3) (str == 1 ? run_wgrad<TT, 3, 1> : run_wgrad<TT, 3, 2>)(s, p, go, x, ws, st);
  else if (k == 5) (str == 1 ? run_wgrad<TT, 5, 1> : run_wgrad<TT, 5, 2>)(s, p, go, x, ws, st);
  else (str == 1 ? run_wgrad<TT, 7, 1> : run_wgrad<TT, 7, 2>)(s, p, go, x, ws, st);
}

}  // namespace

size_t wgrad_workspace_elems(const ConvShape& s, DType dt, const void* go, const void* x) {
  const WgradPlan p = make_plan(s, dt, go, x);
  return static_cast<size_t>(p.chunks) * s.C * (s.KH * s.KW + 1);
}

void launch_wgrad(const ConvShape& s, DType dt, const void* go, const void* x, void* ws, void* gw, void* gb,
                  cudaStream_t stream) {
  const WgradPlan p = make_plan(s, dt, go, x);
  if (!p.fast) {
    wgrad_generic_partials(s, dt, go, x, ws, p.chunks, stream);
  } else {
    float* wsf = static_cast<float*>(ws);
    switch (dt) {
      case DType::F32: wgrad_fast<F32T>(s, p, go, x, wsf, stream); break;
      case DType::F16: wgrad_fast<F16T>(s, p, go, x, wsf, stream); break;
      case DType::BF16: wgrad_fast<BF16T>(s, p, go, x, wsf, stream); break;
      default: break;  // F64 never takes the fast path
    }
  }
  wgrad_finalize(s, dt, ws, p.chunks, gw, gb, stream);
}

}  // namespace mdw
