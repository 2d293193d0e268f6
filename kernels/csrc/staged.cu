// NHWC stencil with the input staged through shared memory: the forward pass (stride 1 or 2) and the
// stride-1 input gradient (the same stencil over grad_out with the kernel rotated by 180 degrees).
//
// Why: the register-tiled kernels of forward.cu / dgrad.cu load, then compute, then store, one image at a
// time, so each lane has only one row of loads in flight and DRAM idles during compute and stores. On the
// 28/14/7-wide layers that left them at 2.2-2.8x the HBM floor (docs/kernel_notes.md, v4). Here a block
// owns one channel group (128 bytes of channels per pixel) and walks a list of (image, row band) items;
// cp.async copies item i+1's input band into the second buffer while the block computes item i from the
// first, so loads stay in flight through compute and stores. Every input byte is read once from DRAM
// (the K-S halo rows shared by neighbouring bands come again, from L2).
#include "device_common.h"

#include <algorithm>
#include <initializer_list>
#include <type_traits>

namespace mdw {
namespace {

// One 16-byte global -> shared copy that bypasses L1; `valid == false` writes zeros (padding) and reads
// nothing. Synchronous below sm_80, where cp.async does not exist.
__device__ __forceinline__ void copy16_async(void* smem, const void* gmem, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
#else
  *reinterpret_cast<uint4*>(smem) = valid ? *reinterpret_cast<const uint4*>(gmem) : make_uint4(0, 0, 0, 0);
#endif
}
__device__ __forceinline__ void copy_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Wait until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void copy_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
}

// The E channels of one 32-bit word of a staged tile, widened to fp32.
template <class TT, int E>
__device__ __forceinline__ void unpack_word(uint32_t word, float (&out)[E]) {
  if constexpr (E == 2) {
    TT::widen2(word, out[0], out[1]);
  } else {
    out[0] = __uint_as_float(word);
  }
}

// The stencil as the kernel sees it: `src` (IH x IW) -> `dst` (OH x OW), output row oh reads source rows
// oh*S - PH + kh. For the input gradient src = grad_out, dst = grad_input, padding K-1-P.
struct Stencil {
  int N, C;
  int IH, IW, OH, OW;
  int PH, PW;
  int lanes_c;  // 16-byte vectors per pixel in a channel group (power of two, <= 8)
  int groups;   // channel groups
  int TH;       // output rows per band
  int bands;    // bands per image
  int strips;   // TW-wide column strips per output row
  int WT;       // staged columns: (strips*TW - 1)*S + K
  int IR;       // staged rows: (TH - 1)*S + K
  int splits;   // blocks per channel group; block `sp` takes items sp, sp + splits, ...
};

// Queue the copies of one item's source band (rows item_band*TH*S - PH ..., all staged columns, the
// block's channel group) into `tile` [IR][WT][lanes_c]; out-of-image rows, columns and channels >= C
// become zeros, so the compute needs no bounds checks.
template <typename Sx, int S, int V>
__device__ __forceinline__ void stage_band(const Sx* __restrict__ src, const Stencil& p, int c_base, int item,
                                           Pack<Sx, V>* tile) {
  const int tile_packs = p.IR * p.WT * p.lanes_c;
  const int row_packs = p.WT * p.lanes_c;
  const int n = item / p.bands;
  const int r0 = (item - n * p.bands) * p.TH * S - p.PH;
  const Sx* img = src + static_cast<size_t>(n) * p.IH * p.IW * p.C + c_base;
  for (int e = threadIdx.x; e < tile_packs; e += blockDim.x) {
    const int rr = e / row_packs;
    const int rem = e - rr * row_packs;
    const int col = rem / p.lanes_c - p.PW;
    const int cv = rem & (p.lanes_c - 1);
    const int row = r0 + rr;
    const bool valid = row >= 0 && row < p.IH && col >= 0 && col < p.IW && c_base + cv * V < p.C;
    const Sx* g = valid ? img + (static_cast<size_t>(row) * p.IW + col) * p.C + cv * V : src;
    copy16_async(tile + e, g, valid);
  }
}

// The block's K*K weights of its channel group as fp32, tap-major, rotated by 180 degrees for the input
// gradient. Published by the barrier that follows the first tile's wait.
template <class TT, int K, bool FLIP>
__device__ __forceinline__ void stage_weights(const typename TT::S* __restrict__ w, int C, int c_base, int cw,
                                              float* w_smem) {
  for (int e = threadIdx.x; e < K * K * cw; e += blockDim.x) {
    const int kk = e / cw, c = c_base + (e - kk * cw);
    w_smem[e] = c < C ? TT::to_acc(w[c * K * K + (FLIP ? K * K - 1 - kk : kk)]) : 0.f;
  }
}

// All outputs of one item from its staged tile: a unit is (channel vector, TW-column strip, row).
template <class TT, int K, int S, int TW, int V>
__device__ __forceinline__ void compute_band(const Pack<typename TT::S, V>* tile, const float* w_smem,
                                             const typename TT::S* __restrict__ bias, typename TT::S* __restrict__ dst,
                                             const Stencil& p, int c_base, int item) {
  using Sx = typename TT::S;
  constexpr int L = (TW - 1) * S + K;
  const int cw = p.lanes_c * V;
  const int n = item / p.bands;
  const int oh_base = (item - n * p.bands) * p.TH;
  const int units = p.TH * p.strips * p.lanes_c;
#pragma unroll 1
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    const int cv = u & (p.lanes_c - 1);
    const int rest = u / p.lanes_c;
    const int strip = rest % p.strips;
    const int orow = rest / p.strips;
    const int oh = oh_base + orow;
    const int ow0 = strip * TW;
    const int c0 = c_base + cv * V;
    if (oh >= p.OH || c0 >= p.C) continue;
    float acc[TW][V];
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const float bv = bias ? TT::to_acc(bias[c0 + v]) : 0.f;
#pragma unroll
      for (int j = 0; j < TW; ++j) acc[j][v] = bv;
    }
    const float* wl = w_smem + cv * V;
#pragma unroll
    for (int kh = 0; kh < K; ++kh) {
      const Pack<Sx, V>* row = tile + ((orow * S + kh) * p.WT + ow0 * S) * p.lanes_c + cv;
      Pack<Sx, V> raw[L];
#pragma unroll
      for (int i = 0; i < L; ++i) raw[i] = row[i * p.lanes_c];
      accumulate_nhwc_row<TT, K>(raw, wl, kh, cw, acc, [](int i, int j) { return i - j * S; });
    }
    Sx* out = dst + ((static_cast<size_t>(n) * p.OH + oh) * p.OW + ow0) * p.C + c0;
#pragma unroll
    for (int j = 0; j < TW; ++j)
      if (ow0 + j < p.OW) store_vec<TT, V>(out + static_cast<size_t>(j) * p.C, acc[j]);
  }
}

template <class TT, int K, int S, int TW, int V, bool FLIP>
__global__ void __launch_bounds__(256, 2)
    staged_nhwc_kernel(const typename TT::S* __restrict__ src, const typename TT::S* __restrict__ w,
                       const typename TT::S* __restrict__ bias, typename TT::S* __restrict__ dst, Stencil p) {
  using PackT = Pack<typename TT::S, V>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int cw = p.lanes_c * V;
  const int c_base = (blockIdx.x % p.groups) * cw;
  const int split = blockIdx.x / p.groups;
  const int tile_packs = p.IR * p.WT * p.lanes_c;
  PackT* tiles = reinterpret_cast<PackT*>(smem_raw);                 // [2][IR][WT][lanes_c]
  float* w_smem = reinterpret_cast<float*>(tiles + 2 * tile_packs);  // [K*K][cw]
  const int items = p.N * p.bands;

  int item = split;
  if (item < items) stage_band<typename TT::S, S, V>(src, p, c_base, item, tiles);
  copy_async_commit();
  stage_weights<TT, K, FLIP>(w, p.C, c_base, cw, w_smem);
#pragma unroll 1
  for (int it = 0; item < items; ++it, item += p.splits) {
    const int next = item + p.splits;
    if (next < items) stage_band<typename TT::S, S, V>(src, p, c_base, next, tiles + ((it + 1) & 1) * tile_packs);
    copy_async_commit();
    copy_async_wait<1>();  // this item's tile has landed (only the next one may still be in flight)
    __syncthreads();
    compute_band<TT, K, S, TW, V>(tiles + (it & 1) * tile_packs, w_smem, bias, dst, p, c_base, item);
    __syncthreads();  // everyone is done with this tile before the next iteration refills it
  }
  copy_async_wait<0>();
}

// Both gradients of a 3x3, stride 1, padding 1 NHWC convolution in one pass, so grad_out is read once:
// per item the block stages the grad_out band and the input band (the same rows and columns), computes
// the input gradient from the first (compute_band with the rotated kernel), and adds grad_out x input
// products into per-thread weight/bias accumulators that live across all of its items. A thread owns one
// 32-bit word of channels (E channels) and every PL-th pixel; at the end the PL partial sums of a word are
// added in a fixed order and written as the block's partials ws[split][c][10], which wgrad_finalize sums
// over splits in index order: deterministic, no atomics.
template <class TT, int TW, int V>
__global__ void __launch_bounds__(256, 2)
    fused_bwd_nhwc_kernel(const typename TT::S* __restrict__ go, const typename TT::S* __restrict__ x,
                          const typename TT::S* __restrict__ w, typename TT::S* __restrict__ gx,
                          float* __restrict__ ws, Stencil p) {
  using Sx = typename TT::S;
  using PackT = Pack<Sx, V>;
  constexpr int K = 3, KK = 9;
  constexpr int E = 4 / sizeof(Sx);  // channels per 32-bit word
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int cw = p.lanes_c * V;
  const int c_base = (blockIdx.x % p.groups) * cw;
  const int split = blockIdx.x / p.groups;
  const int tile_packs = p.IR * p.WT * p.lanes_c;
  PackT* tiles = reinterpret_cast<PackT*>(smem_raw);  // [2 buffers][grad_out, input][IR][WT][lanes_c]
  const size_t tile_bytes = 4 * static_cast<size_t>(tile_packs) * sizeof(PackT);
  const size_t scratch_bytes = static_cast<size_t>(blockDim.x) * E * (KK + 1) * sizeof(float);
  float* w_smem = reinterpret_cast<float*>(smem_raw + (tile_bytes > scratch_bytes ? tile_bytes : scratch_bytes));
  const int items = p.N * p.bands;

  const int wpp = p.lanes_c * 4;  // 32-bit words per pixel of the group
  const int word = threadIdx.x % wpp;
  const int pl = threadIdx.x / wpp;
  const int PL = blockDim.x / wpp;
  float gw[E][KK + 1];
  fill(gw, 0.f);

  int item = split;
  if (item < items) {
    stage_band<Sx, 1, V>(go, p, c_base, item, tiles);
    stage_band<Sx, 1, V>(x, p, c_base, item, tiles + tile_packs);
  }
  copy_async_commit();
  stage_weights<TT, K, true>(w, p.C, c_base, cw, w_smem);
#pragma unroll 1
  for (int it = 0; item < items; ++it, item += p.splits) {
    const int next = item + p.splits;
    if (next < items) {
      PackT* buf = tiles + ((it + 1) & 1) * 2 * tile_packs;
      stage_band<Sx, 1, V>(go, p, c_base, next, buf);
      stage_band<Sx, 1, V>(x, p, c_base, next, buf + tile_packs);
    }
    copy_async_commit();
    copy_async_wait<1>();
    __syncthreads();
    const PackT* go_tile = tiles + (it & 1) * 2 * tile_packs;
    compute_band<TT, K, 1, TW, V>(go_tile, w_smem, nullptr, gx, p, c_base, item);

    // Weight gradient: grad_out pixel (r, c) of the band sits at tile (r + 1, c + 1); its 3x3 input
    // window at tile rows r..r+2, columns c..c+2 (both tiles start one row and column before the band).
    const uint32_t* gw_go = reinterpret_cast<const uint32_t*>(go_tile);
    const uint32_t* gw_x = reinterpret_cast<const uint32_t*>(go_tile + tile_packs);
    const int n = item / p.bands;
    const int rows = min(p.TH, p.OH - (item - n * p.bands) * p.TH);
    const int pixels = rows * p.OW;
#pragma unroll 1
    for (int px = pl; px < pixels; px += PL) {
      const int r = px / p.OW, c = px - r * p.OW;
      float dy[E];
      unpack_word<TT, E>(gw_go[((r + 1) * p.WT + c + 1) * wpp + word], dy);
#pragma unroll
      for (int kh = 0; kh < K; ++kh)
#pragma unroll
        for (int kw = 0; kw < K; ++kw) {
          float xv[E];
          unpack_word<TT, E>(gw_x[((r + kh) * p.WT + c + kw) * wpp + word], xv);
#pragma unroll
          for (int e = 0; e < E; ++e) gw[e][kh * K + kw] = fmaf(dy[e], xv[e], gw[e][kh * K + kw]);
        }
#pragma unroll
      for (int e = 0; e < E; ++e) gw[e][KK] += dy[e];
    }
    __syncthreads();
  }
  copy_async_wait<0>();

  // Fixed-order reduction of the PL threads of each word, through shared memory (the tiles are free now).
  float* red = reinterpret_cast<float*>(smem_raw);  // [threads][E][KK + 1]
#pragma unroll
  for (int e = 0; e < E; ++e)
#pragma unroll
    for (int k = 0; k <= KK; ++k) red[(threadIdx.x * E + e) * (KK + 1) + k] = gw[e][k];
  __syncthreads();
  for (int idx = threadIdx.x; idx < wpp * E * (KK + 1); idx += blockDim.x) {
    const int wd = idx / (E * (KK + 1)), rem = idx - wd * E * (KK + 1);
    float sum = 0.f;
    for (int q = 0; q < PL; ++q) sum += red[(q * wpp + wd) * E * (KK + 1) + rem];
    const int c = c_base + wd * E + rem / (KK + 1);
    if (c < p.C) ws[(static_cast<size_t>(split) * p.C + c) * (KK + 1) + rem % (KK + 1)] = sum;
  }
}

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 2;  // __launch_bounds__ above

// Rows per band: the most whose staged tiles (`tiles` per buffer) fit the per-buffer budget, evened out
// over the bands. Returns false when not even one output row fits.
bool plan(Stencil& p, DType dt, int vec, int K, int S, int TW, int tiles) {
  const int vectors = p.C / vec;
  p.lanes_c = floor_pow2(vectors < 8 ? vectors : 8);
  p.groups = ceil_div(vectors, p.lanes_c);
  p.strips = ceil_div(p.OW, TW);
  p.WT = (p.strips * TW - 1) * S + K;
  const long long row_bytes = static_cast<long long>(p.WT) * p.lanes_c * 16 * tiles;
  const long long rows = static_cast<long long>(knob(Knob::kStagedTileKb, dt)) * 1024 / row_bytes;
  if (rows < K) return false;
  const int th = static_cast<int>(std::min<long long>((rows - K) / S + 1, p.OH));
  p.bands = ceil_div(p.OH, th);
  p.TH = ceil_div(p.OH, p.bands);
  p.IR = (p.TH - 1) * S + K;
  const long long items = static_cast<long long>(p.N) * p.bands;
  const long long want = ceil_div(static_cast<long long>(num_sms()) * kBlocksPerSm, p.groups);
  p.splits = static_cast<int>(std::min(want, items));
  return true;
}

// Above 48 KB of dynamic shared memory a kernel must opt in (per device, so on every launch: about a
// microsecond). False when the GPU allows less per block; the caller then takes another kernel.
template <class Kernel>
bool allow_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return true;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)) ==
      cudaSuccess)
    return true;
  (void)cudaGetLastError();
  return false;
}

template <class TT>
constexpr DType dtype_of() {
  return sizeof(typename TT::S) == 4 ? DType::F32 : (std::is_same_v<TT, F16T> ? DType::F16 : DType::BF16);
}

template <class TT, int K, int S, bool FLIP>
bool launch_staged(const Stencil& shape, const void* src, const void* w, const void* bias, void* dst,
                   cudaStream_t stream) {
  using Sx = typename TT::S;
  constexpr int V = NhwcVec<Sx>::value;
  constexpr int TW = StripWidth<K, S>::value;
  Stencil p = shape;
  if (!plan(p, dtype_of<TT>(), V, K, S, TW, 1)) return false;
  const size_t smem = 2 * static_cast<size_t>(p.IR) * p.WT * p.lanes_c * 16 + sizeof(float) * K * K * p.lanes_c * V;
  auto kernel = staged_nhwc_kernel<TT, K, S, TW, V, FLIP>;
  if (!allow_smem(kernel, smem)) return false;
  kernel<<<p.groups * p.splits, kThreads, smem, stream>>>(static_cast<const Sx*>(src), static_cast<const Sx*>(w),
                                                         static_cast<const Sx*>(bias), static_cast<Sx*>(dst), p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

template <class TT, bool FLIP>
bool staged_t(const Stencil& p, int K, int S, const void* src, const void* w, const void* bias, void* dst,
              cudaStream_t st) {
  if (K == 3) return S == 1 ? launch_staged<TT, 3, 1, FLIP>(p, src, w, bias, dst, st)
                            : launch_staged<TT, 3, 2, FLIP>(p, src, w, bias, dst, st);
  if (K == 5) return S == 1 ? launch_staged<TT, 5, 1, FLIP>(p, src, w, bias, dst, st)
                            : launch_staged<TT, 5, 2, FLIP>(p, src, w, bias, dst, st);
  return S == 1 ? launch_staged<TT, 7, 1, FLIP>(p, src, w, bias, dst, st)
                : launch_staged<TT, 7, 2, FLIP>(p, src, w, bias, dst, st);
}

template <bool FLIP>
bool staged(const Stencil& p, DType dt, int K, int S, const void* src, const void* w, const void* bias, void* dst,
            cudaStream_t st) {
  switch (dt) {
    case DType::F32: return staged_t<F32T, FLIP>(p, K, S, src, w, bias, dst, st);
    case DType::F16: return staged_t<F16T, FLIP>(p, K, S, src, w, bias, dst, st);
    case DType::BF16: return staged_t<BF16T, FLIP>(p, K, S, src, w, bias, dst, st);
    default: return false;
  }
}

// The staged kernels serve NHWC fast geometries with 16-byte-aligned channel vectors whose source is no
// wider than the STAGED_MAX_W knob (0 turns them off).
bool eligible(const ConvShape& s, DType dt, int src_w, std::initializer_list<const void*> ptrs) {
  if (!s.channels_last || !fast_geometry(s, dt) || s.C % nhwc_vec(dt) != 0) return false;
  for (const void* ptr : ptrs)
    if (!aligned(ptr, 16)) return false;
  return src_w <= knob(Knob::kStagedMaxW, dt);
}

// The input gradient's stencil for stride 1: grad_out -> grad_input with the padding mirrored.
Stencil dgrad_stencil(const ConvShape& s) {
  return Stencil{s.N, s.C, s.OH, s.OW, s.H, s.W, s.KH - 1 - s.PH, s.KW - 1 - s.PW};
}

bool fused_eligible(const ConvShape& s, DType dt, std::initializer_list<const void*> ptrs) {
  return s.KH == 3 && s.KW == 3 && s.SH == 1 && s.SW == 1 && s.PH == 1 && s.PW == 1 && s.DH == 1 && s.DW == 1 &&
         knob(Knob::kFusedBwd, dt) != 0 && eligible(s, dt, s.OW, ptrs);
}

template <class TT>
Stencil fused_plan(const ConvShape& s, bool& ok) {
  Stencil p = dgrad_stencil(s);
  ok = plan(p, dtype_of<TT>(), NhwcVec<typename TT::S>::value, 3, 1, StripWidth<3, 1>::value, 2);
  return p;
}

template <class TT>
size_t fused_smem(const Stencil& p) {
  constexpr int V = NhwcVec<typename TT::S>::value;
  constexpr int E = 4 / sizeof(typename TT::S);
  const size_t tiles = 4 * static_cast<size_t>(p.IR) * p.WT * p.lanes_c * 16;
  const size_t scratch = static_cast<size_t>(kThreads) * E * 10 * sizeof(float);
  return std::max(tiles, scratch) + sizeof(float) * 9 * p.lanes_c * V;
}

template <class TT>
int fused_chunks_t(const ConvShape& s) {
  bool ok = false;
  const Stencil p = fused_plan<TT>(s, ok);
  if (!ok || !allow_smem(fused_bwd_nhwc_kernel<TT, StripWidth<3, 1>::value, NhwcVec<typename TT::S>::value>,
                         fused_smem<TT>(p)))
    return 0;
  return p.splits;
}

template <class TT>
void fused_launch_t(const ConvShape& s, const void* go, const void* x, const void* w, void* gx, float* ws,
                    cudaStream_t stream) {
  using Sx = typename TT::S;
  constexpr int V = NhwcVec<Sx>::value;
  constexpr int TW = StripWidth<3, 1>::value;
  bool ok = false;
  const Stencil p = fused_plan<TT>(s, ok);
  fused_bwd_nhwc_kernel<TT, TW, V><<<p.groups * p.splits, kThreads, fused_smem<TT>(p), stream>>>(
      static_cast<const Sx*>(go), static_cast<const Sx*>(x), static_cast<const Sx*>(w), static_cast<Sx*>(gx), ws, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool staged_forward(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                    cudaStream_t stream) {
  if (!eligible(s, dt, s.W, {x, y})) return false;
  const Stencil p{s.N, s.C, s.H, s.W, s.OH, s.OW, s.PH, s.PW};
  return staged<false>(p, dt, s.KH, s.SH, x, w, bias, y, stream);
}

bool staged_dgrad(const ConvShape& s, DType dt, const void* grad_out, const void* w, void* grad_input,
                  cudaStream_t stream) {
  if (s.SH != 1 || !eligible(s, dt, s.OW, {grad_out, grad_input})) return false;
  return staged<true>(dgrad_stencil(s), dt, s.KH, 1, grad_out, w, nullptr, grad_input, stream);
}

int fused_bwd_chunks(const ConvShape& s, DType dt, const void* grad_out, const void* x, const void* grad_input) {
  if (!fused_eligible(s, dt, {grad_out, x, grad_input})) return 0;
  switch (dt) {
    case DType::F32: return fused_chunks_t<F32T>(s);
    case DType::F16: return fused_chunks_t<F16T>(s);
    case DType::BF16: return fused_chunks_t<BF16T>(s);
    default: return 0;
  }
}

void launch_fused_bwd(const ConvShape& s, DType dt, const void* grad_out, const void* x, const void* w,
                      void* grad_input, void* ws, int chunks, void* grad_weight, void* grad_bias,
                      cudaStream_t stream) {
  float* wsf = static_cast<float*>(ws);
  switch (dt) {
    case DType::F32: fused_launch_t<F32T>(s, grad_out, x, w, grad_input, wsf, stream); break;
    case DType::F16: fused_launch_t<F16T>(s, grad_out, x, w, grad_input, wsf, stream); break;
    case DType::BF16: fused_launch_t<BF16T>(s, grad_out, x, w, grad_input, wsf, stream); break;
    default: return;
  }
  wgrad_finalize(s, dt, ws, chunks, grad_weight, grad_bias, stream);
}

}  // namespace mdw
