// The few-input-channel convolution's weight gradient; the scheme is described in stem_weight_grad.h.
#include "stem_weight_grad.h"

#include <c10/cuda/CUDAException.h>

#include "device_common.h"

namespace mstem {
namespace {

using mdw::BF16T;
using mdw::F16T;
using mdw::F32T;

constexpr int kDyVecSlots = 4;  // 16-byte grad_out vectors a thread holds for the next tile
constexpr int kXSlots = 16;     // input elements a thread holds for the next tile
constexpr int kTileTargetPixels = 192;  // output pixels per tile to aim for: 6 steps of a warp at least

int ceil_div(long long a, long long b) { return static_cast<int>((a + b - 1) / b); }

// A tile's layout in shared memory, the same for every tile and block of a launch.
struct TileGeom {
  int rows;            // output rows per tile
  int tiles_per_image;
  int dy_stride;       // floats per pixel in the grad_out tile: the slice's channels rounded up to 8, plus 4, so
                       // that the 8 lanes of an LDS.128 phase (consecutive pixels) hit distinct banks
  int in_rows;         // input rows under a tile: (rows - 1) * stride + 3
  int cols;            // input columns under a row, from -pad: (Wo - 1) * stride + 3
  int cols_per_plane;  // columns of one parity plane: ceil(cols / stride)
  int x_elems;         // C * in_rows * cols
  int dy_floats;       // rows * Wo * dy_stride: where the input tile starts
};

TileGeom geometry(const StemShape& s, int rows) {
  TileGeom g{};
  g.rows = rows;
  g.tiles_per_image = ceil_div(s.Ho, rows);
  const int kb = s.K < 32 ? s.K : 32;
  g.dy_stride = (kb + 7) / 8 * 8 + 4;
  g.in_rows = (rows - 1) * s.stride + 3;
  g.cols = (s.Wo - 1) * s.stride + 3;
  g.cols_per_plane = ceil_div(g.cols, s.stride);
  g.x_elems = s.C * g.in_rows * g.cols;
  g.dy_floats = rows * s.Wo * g.dy_stride;
  return g;
}

size_t smem_bytes(const StemShape& s, const TileGeom& g) {
  return (static_cast<size_t>(g.dy_floats) + static_cast<size_t>(s.C) * g.in_rows * s.stride * g.cols_per_plane) *
         sizeof(float);
}

// One tile: image n, output rows oh0 .. oh0 + valid_rows - 1.
struct Tile {
  int n, oh0, valid_rows;
};
__device__ __forceinline__ Tile tile_at(int t, const StemShape& s, const TileGeom& g) {
  Tile tl;
  tl.n = t / g.tiles_per_image;
  tl.oh0 = (t % g.tiles_per_image) * g.rows;
  tl.valid_rows = min(g.rows, s.Ho - tl.oh0);
  return tl;
}

// Position (c, r, j) of flat input-tile element f = c * in_rows * cols + r * cols + j (input channel, tile row,
// column from -pad), and how f advances by a block's thread count without a division per element: the tile's
// geometry is the same for every tile, and the loads' index arithmetic would otherwise cost as much as the FMAs.
struct InputCursor {
  int c, r, j;     // element f's position
  int dc, dr, dj;  // the step's, with dj < cols and dr < in_rows: one carry each
  __device__ __forceinline__ InputCursor(int f, int step, const TileGeom& g) {
    split(f, g, c, r, j);
    split(step, g, dc, dr, dj);
  }
  static __device__ __forceinline__ void split(int f, const TileGeom& g, int& c, int& r, int& j) {
    const int rows_total = f / g.cols;
    j = f - rows_total * g.cols;
    c = rows_total / g.in_rows;
    r = rows_total - c * g.in_rows;
  }
  __device__ __forceinline__ void advance(const TileGeom& g) {
    j += dj;
    if (j >= g.cols) {
      j -= g.cols;
      ++r;
    }
    r += dr;
    if (r >= g.in_rows) {
      r -= g.in_rows;
      ++c;
    }
    c += dc;
  }
};

// Pixel p and channel offset k of the grad_out tile's element e = p * kb + k (kb: the block's channels), advanced
// the same way.
struct DyCursor {
  int p, k, dp, dk;
  __device__ __forceinline__ DyCursor(int e, int step, int kb) : p(e / kb), k(e - (e / kb) * kb),
                                                                dp(step / kb), dk(step - (step / kb) * kb) {}
  __device__ __forceinline__ void advance(int kb) {
    k += dk;
    if (k >= kb) {
      k -= kb;
      ++p;
    }
    p += dp;
  }
};

// Shared-memory float index of input (c, r, j): parity planes of the columns at stride 2.
template <int STRIDE>
__device__ __forceinline__ int x_index(int c, int r, int j, const TileGeom& g) {
  return ((c * g.in_rows + r) * STRIDE + j % STRIDE) * g.cols_per_plane + j / STRIDE;
}

// The input element under tile position q, zero outside the image (the convolution's padding).
template <class TT, int STRIDE>
__device__ __forceinline__ typename TT::S load_input(const typename TT::S* x, const StemShape& s, const Tile& tl,
                                                     const InputCursor& q) {
  const int ih = tl.oh0 * STRIDE - s.pad + q.r, iw = q.j - s.pad;
  if (ih < 0 || ih >= s.H || iw < 0 || iw >= s.W) return typename TT::S(0);
  return x[((static_cast<size_t>(tl.n) * s.H + ih) * s.W + iw) * s.C + q.c];
}

// 16 bytes of grad_out as floats into the tile: 4 (fp32) or 8 (16-bit) channels of one pixel.
template <class TT>
__device__ __forceinline__ void store_dy_vec(float* dst, const uint4& v) {
  if constexpr (sizeof(typename TT::S) == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z),
                                                  __uint_as_float(v.w));
  } else {
    float f[8];
    TT::widen2(v.x, f[0], f[1]);
    TT::widen2(v.y, f[2], f[3]);
    TT::widen2(v.z, f[4], f[5]);
    TT::widen2(v.w, f[6], f[7]);
    *reinterpret_cast<float4*>(dst) = make_float4(f[0], f[1], f[2], f[3]);
    *reinterpret_cast<float4*>(dst + 4) = make_float4(f[4], f[5], f[6], f[7]);
  }
}

template <class TT, int C, int STRIDE>
__global__ void __launch_bounds__(32 * kMaxChannelGroups * C, 1)
    stem_weight_grad_kernel(const typename TT::S* __restrict__ grad_out, const typename TT::S* __restrict__ x,
                            StemShape s, TileGeom g, int tiles, bool prefetch, float* __restrict__ partial) {
  using S = typename TT::S;
  constexpr int VE = 16 / sizeof(S);  // elements per 16-byte vector
  extern __shared__ float4 smem_vec[];
  float* const sdy = reinterpret_cast<float*>(smem_vec);  // [rows * Wo][dy_stride]
  float* const sx = sdy + g.dy_floats;                     // [C][in_rows][STRIDE][cols_per_plane]

  const int tid = threadIdx.x, nthreads = blockDim.x;
  const int lane = tid % 32, warp = tid / 32;
  const int kg = warp / C, c = warp % C;
  const int k0 = blockIdx.y * 32;
  const int kb = min(32, s.K - k0);  // this block's output channels
  const bool computes = kg * kChannelsPerWarp < kb;

  // The padding channels of the grad_out tile, which no load writes, read as zeros.
  const int pad_cols = g.dy_stride - kb;
  for (int i = tid; i < g.rows * s.Wo * pad_cols; i += nthreads)
    sdy[(i / pad_cols) * g.dy_stride + kb + i % pad_cols] = 0.f;

  uint4 rdy[kDyVecSlots];
  S rx[kXSlots];
  // grad_out vector v of tile tl holds element e = v * VE of the tile's [pixels][kb] slice: pixel e / kb, channels
  // k0 + e % kb onwards. Thread tid's vectors are v = tid, tid + nthreads, ...
  auto dy_vecs = [&](const Tile& tl) { return tl.valid_rows * s.Wo * kb / VE; };
  auto dy_src = [&](const Tile& tl, const DyCursor& d) {
    const size_t pixel = (static_cast<size_t>(tl.n) * s.Ho + tl.oh0) * s.Wo + d.p;
    return reinterpret_cast<const uint4*>(grad_out + pixel * s.K + k0 + d.k);
  };
  auto dy_dst = [&](const DyCursor& d) { return sdy + d.p * g.dy_stride + d.k; };
  auto load_regs = [&](const Tile& tl) {
    const int nv = dy_vecs(tl);
    DyCursor d(tid * VE, nthreads * VE, kb);
#pragma unroll
    for (int q = 0; q < kDyVecSlots; ++q, d.advance(kb))
      if (tid + q * nthreads < nv) rdy[q] = __ldg(dy_src(tl, d));
    InputCursor ic(tid, nthreads, g);
#pragma unroll
    for (int q = 0; q < kXSlots; ++q, ic.advance(g))
      if (tid + q * nthreads < g.x_elems) rx[q] = load_input<TT, STRIDE>(x, s, tl, ic);
  };
  auto store_regs = [&](const Tile& tl) {
    const int nv = dy_vecs(tl);
    DyCursor d(tid * VE, nthreads * VE, kb);
#pragma unroll
    for (int q = 0; q < kDyVecSlots; ++q, d.advance(kb))
      if (tid + q * nthreads < nv) store_dy_vec<TT>(dy_dst(d), rdy[q]);
    InputCursor ic(tid, nthreads, g);
#pragma unroll
    for (int q = 0; q < kXSlots; ++q, ic.advance(g))
      if (tid + q * nthreads < g.x_elems) sx[x_index<STRIDE>(ic.c, ic.r, ic.j, g)] = TT::to_acc(rx[q]);
  };
  // Tiles too large for the register slots: loaded straight into shared memory.
  auto load_direct = [&](const Tile& tl) {
    const int nv = dy_vecs(tl);
    DyCursor d(tid * VE, nthreads * VE, kb);
    for (int v = tid; v < nv; v += nthreads, d.advance(kb)) store_dy_vec<TT>(dy_dst(d), __ldg(dy_src(tl, d)));
    InputCursor ic(tid, nthreads, g);
    for (int f = tid; f < g.x_elems; f += nthreads, ic.advance(g))
      sx[x_index<STRIDE>(ic.c, ic.r, ic.j, g)] = TT::to_acc(load_input<TT, STRIDE>(x, s, tl, ic));
  };

  float acc[kChannelsPerWarp][kTaps];
#pragma unroll
  for (int k = 0; k < kChannelsPerWarp; ++k)
#pragma unroll
    for (int t = 0; t < kTaps; ++t) acc[k][t] = 0.f;

  int t = blockIdx.x;
  if (t < tiles) {
    const Tile first = tile_at(t, s, g);
    if (prefetch) {
      load_regs(first);
      store_regs(first);
    } else {
      load_direct(first);
    }
  }
  __syncthreads();
  for (; t < tiles; t += gridDim.x) {
    const Tile cur = tile_at(t, s, g);
    const int next_t = t + gridDim.x;
    const bool has_next = next_t < tiles;
    Tile next{};
    if (has_next) {
      next = tile_at(next_t, s, g);
      if (prefetch) load_regs(next);  // in flight while this tile is computed
    }
    if (computes) {
      const int pixels = cur.valid_rows * s.Wo;
      int r = lane / s.Wo, ow = lane - r * s.Wo;
      for (int p = lane; p < pixels; p += 32) {
        const float* d = sdy + p * g.dy_stride + kg * kChannelsPerWarp;
        const float4 d0 = *reinterpret_cast<const float4*>(d);
        const float4 d1 = *reinterpret_cast<const float4*>(d + 4);
        const float dv[kChannelsPerWarp] = {d0.x, d0.y, d0.z, d0.w, d1.x, d1.y, d1.z, d1.w};
        float xv[kTaps];
#pragma unroll
        for (int kh = 0; kh < 3; ++kh) {
          const float* row = sx + ((c * g.in_rows + r * STRIDE + kh) * STRIDE) * g.cols_per_plane;
#pragma unroll
          for (int kw = 0; kw < 3; ++kw) xv[kh * 3 + kw] = row[(kw % STRIDE) * g.cols_per_plane + ow + kw / STRIDE];
        }
#pragma unroll
        for (int k = 0; k < kChannelsPerWarp; ++k)
#pragma unroll
          for (int tap = 0; tap < kTaps; ++tap) acc[k][tap] = fmaf(dv[k], xv[tap], acc[k][tap]);
        ow += 32;
        while (ow >= s.Wo) {
          ow -= s.Wo;
          ++r;
        }
      }
    }
    __syncthreads();  // every warp is done with this tile
    if (has_next) {
      if (prefetch) {
        store_regs(next);
      } else {
        load_direct(next);
      }
    }
    __syncthreads();
  }

  // The warp's sum of each accumulator by a fixed xor tree; lane 0 writes this block's partials.
#pragma unroll
  for (int k = 0; k < kChannelsPerWarp; ++k)
#pragma unroll
    for (int tap = 0; tap < kTaps; ++tap) {
      float v = acc[k][tap];
#pragma unroll
      for (int m = 16; m >= 1; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
      acc[k][tap] = v;
    }
  if (computes && lane == 0) {
    float* out = partial + static_cast<size_t>(blockIdx.x) * s.K * C * kTaps;
#pragma unroll
    for (int k = 0; k < kChannelsPerWarp; ++k) {
      const int ko = k0 + kg * kChannelsPerWarp + k;
      if (ko < s.K) {
#pragma unroll
        for (int tap = 0; tap < kTaps; ++tap) out[(static_cast<size_t>(ko) * C + c) * kTaps + tap] = acc[k][tap];
      }
    }
  }
}

// grad_w[e] = the blocks' partials added in block order.
__global__ void __launch_bounds__(256) sum_partials(const float* __restrict__ partial, int blocks, int n,
                                                    float* __restrict__ grad_w) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= n) return;
  float a = 0.f;
  for (int b = 0; b < blocks; ++b) a += partial[static_cast<size_t>(b) * n + e];
  grad_w[e] = a;
}

template <class TT, int STRIDE>
auto kernel_of() {
  return &stem_weight_grad_kernel<TT, kInputChannels, STRIDE>;
}

template <class TT>
const void* kernel_for(int stride) {
  return stride == 1 ? reinterpret_cast<const void*>(kernel_of<TT, 1>())
                     : reinterpret_cast<const void*>(kernel_of<TT, 2>());
}
const void* kernel_for(DType dt, int stride) {
  switch (dt) {
    case DType::F16: return kernel_for<F16T>(stride);
    case DType::BF16: return kernel_for<BF16T>(stride);
    default: return kernel_for<F32T>(stride);
  }
}

template <class TT, int STRIDE>
void launch_typed(const StemShape& s, const StemPlan& p, const TileGeom& g, const void* grad_out, const void* x,
                  float* partial, cudaStream_t stream) {
  using S = typename TT::S;
  const auto kernel = kernel_of<TT, STRIDE>();  // its shared-memory limit raised by make_stem_plan, on this device
  kernel<<<dim3(p.blocks, p.k_blocks), p.threads, p.smem, stream>>>(
      static_cast<const S*>(grad_out), static_cast<const S*>(x), s, g, p.tiles, p.prefetch, partial);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT>
void launch_stride(const StemShape& s, const StemPlan& p, const TileGeom& g, const void* grad_out, const void* x,
                   float* partial, cudaStream_t stream) {
  if (s.stride == 1) {
    launch_typed<TT, 1>(s, p, g, grad_out, x, partial, stream);
  } else {
    launch_typed<TT, 2>(s, p, g, grad_out, x, partial, stream);
  }
}

}  // namespace

StemPlan make_stem_plan(const StemShape& s, DType dt, int num_sms, size_t max_smem) {
  const int elem = dt == DType::F32 ? 4 : 2;
  const int ve = 16 / elem;
  const int kb = s.K < 32 ? s.K : 32;
  StemPlan p{};
  p.k_blocks = ceil_div(s.K, 32);
  p.threads = 32 * ceil_div(kb, kChannelsPerWarp) * s.C;
  auto fits_registers = [&](int rows) {
    const TileGeom g = geometry(s, rows);
    return static_cast<long long>(rows) * s.Wo * kb / ve <= static_cast<long long>(kDyVecSlots) * p.threads &&
           g.x_elems <= kXSlots * p.threads;
  };
  int rows = ceil_div(kTileTargetPixels, s.Wo);
  if (rows > s.Ho) rows = s.Ho;
  while (rows > 1 && (smem_bytes(s, geometry(s, rows)) > max_smem || !fits_registers(rows))) --rows;
  p.rows = rows;
  p.smem = smem_bytes(s, geometry(s, rows));
  if (p.smem > max_smem) return p;  // blocks == 0: one output row does not fit
  p.prefetch = fits_registers(rows);
  p.tiles = s.N * geometry(s, rows).tiles_per_image;
  int per_sm = 0;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel_for(dt, s.stride), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(p.smem)));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel_for(dt, s.stride), p.threads, p.smem));
  if (per_sm < 1) per_sm = 1;
  // One wave: every block strides over the tiles, so the partials (and the final sum's work) stay few.
  const int wave = num_sms * per_sm / p.k_blocks;
  p.blocks = wave < 1 ? 1 : wave;
  if (p.blocks > p.tiles) p.blocks = p.tiles;
  return p;
}

size_t stem_partial_floats(const StemShape& s, const StemPlan& p) {
  return static_cast<size_t>(p.blocks) * s.K * s.C * kTaps;
}

void launch_stem_weight_grad(const StemShape& s, const StemPlan& p, DType dt, const void* grad_out, const void* x,
                             float* partial, float* grad_w, cudaStream_t stream) {
  const TileGeom g = geometry(s, p.rows);
  switch (dt) {
    case DType::F16: launch_stride<F16T>(s, p, g, grad_out, x, partial, stream); break;
    case DType::BF16: launch_stride<BF16T>(s, p, g, grad_out, x, partial, stream); break;
    default: launch_stride<F32T>(s, p, g, grad_out, x, partial, stream); break;
  }
  const int n = s.K * s.C * kTaps;
  sum_partials<<<ceil_div(n, 256), 256, 0, stream>>>(partial, p.blocks, n, grad_w);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace mstem
