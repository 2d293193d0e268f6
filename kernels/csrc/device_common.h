// Device-side helpers shared by the CUDA kernels: element types, vector loads, the decoding of a Tiling
// (launch_plan.h, which the host fills) into a lane's tile, the stencil rows, the generic kernels' indexing.
#pragma once

#include <type_traits>

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "depthwise.h"
#include "launch_plan.h"  // Tiling

namespace mdw {

// Storage type S plus conversions to/from the accumulation type. 16-bit types are stored as raw
// uint16_t so that PyTorch's __CUDA_NO_HALF_CONVERSIONS__ flags never get in the way.
struct F32T {
  using S = float;
  using Acc = float;
  static __device__ __forceinline__ float to_acc(S v) { return v; }
  static __device__ __forceinline__ S from_acc(float v) { return v; }
};
struct F16T {
  using S = uint16_t;
  using Acc = float;
  static __device__ __forceinline__ float to_acc(S v) { return __half2float(__ushort_as_half(v)); }
  static __device__ __forceinline__ S from_acc(float v) { return __half_as_ushort(__float2half_rn(v)); }
  static __device__ __forceinline__ void widen2(uint32_t w, float& lo, float& hi) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w));
    lo = f.x;
    hi = f.y;
  }
};
struct BF16T {
  using S = uint16_t;
  using Acc = float;
  // bf16 is the top half of an fp32: widening is a shift.
  static __device__ __forceinline__ float to_acc(S v) { return __uint_as_float(static_cast<uint32_t>(v) << 16); }
  static __device__ __forceinline__ S from_acc(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
  static __device__ __forceinline__ void widen2(uint32_t w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
  }
};
struct F64T {
  using S = double;
  using Acc = double;
  static __device__ __forceinline__ double to_acc(S v) { return v; }
  static __device__ __forceinline__ S from_acc(double v) { return v; }
};

// The forward epilogue's activation on the accumulator, before it is rounded to the storage type (one rounding,
// as a separate ReLU of the rounded value would give the same bits: rounding is monotonic and keeps 0 and 6).
// `act` is uniform across the grid, so the branch costs no divergence. NaN stays NaN, as in torch.relu.
template <typename A>
__device__ __forceinline__ A activate(A v, int act) {
  if (act == kActNone) return v;
  v = v < A(0) ? A(0) : v;
  return act == kActReLU6 && v > A(6) ? A(6) : v;
}
template <int N>
__device__ __forceinline__ void activate(float (&v)[N], int act) {
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = activate(v[i], act);
}

template <typename S, int V>
struct alignas(sizeof(S) * V) Pack {
  S v[V];
};

// Widen a pack to fp32. 16-bit packs are converted a 32-bit word (two elements) at a time: for bf16
// that is one shift and one mask per pair instead of extract-then-shift per element.
template <class TT, int V>
__device__ __forceinline__ void widen(const Pack<typename TT::S, V>& pk, float (&out)[V]) {
  if constexpr (sizeof(typename TT::S) == 2 && V % 2 == 0) {
    const uint32_t* words = reinterpret_cast<const uint32_t*>(pk.v);
#pragma unroll
    for (int i = 0; i < V / 2; ++i) TT::widen2(words[i], out[2 * i], out[2 * i + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = TT::to_acc(pk.v[i]);
  }
}

// cp.async: 16 bytes from global memory to shared memory (`dst`, a shared-space address) through L2 only; zeros,
// and nothing read, where !valid. cp_async_commit closes a group of them, cp_async_wait<N> waits until at most N
// groups are in flight.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// A plain global store (STG) through a pointer the compiler cannot see into (the walks keep their output pointers
// opaque with an empty asm): a C++ store would be a generic one (ST.E).
__device__ __forceinline__ void store_global(uint32_t* p, uint32_t v) {
  asm volatile("st.global.b32 [%0], %1;" ::"l"(p), "r"(v));
}

// One 32-bit word to V fp32 values (V = 2: a pair of 16-bit channels; V = 1: an fp32 channel); the column-walking
// kernels move channels a word at a time.
template <class TT, int V>
__device__ __forceinline__ void widen_word(uint32_t w, float (&out)[V]) {
  if constexpr (V == 2) {
    TT::widen2(w, out[0], out[1]);
  } else {
    out[0] = __uint_as_float(w);
  }
}

// V fp32 values to one 32-bit word, rounded to the element type: widen_word's inverse.
template <class TT, int V>
__device__ __forceinline__ uint32_t narrow_word(const float (&in)[V]) {
  if constexpr (V == 2) {
    return static_cast<uint32_t>(TT::from_acc(in[0])) | static_cast<uint32_t>(TT::from_acc(in[1])) << 16;
  } else {
    return __float_as_uint(in[0]);
  }
}

// One step of the 3x3 column walks (stencil_3x3.cuh's walk and depthwise_ring.cu's): the R output rows' V channels
// from the bias b, the window held (K - S widened columns per input row) and the step's raw words (S new columns per
// input row), each output's products added kernel row by kernel row, column by column; then the window slides S
// columns on. Input row kh feeds output row q through kernel row kh - q * S. Both walks share it so that their
// outputs are the same bits.
template <class TT, int S, int R, int V>
__device__ __forceinline__ void column_window_step(const float (&wr)[9][V], const float (&b)[V],
                                                   float (&held)[3 + S * (R - 1)][3 - S][V],
                                                   const uint32_t (&raw)[3 + S * (R - 1)][S], float (&acc)[R][V]) {
  constexpr int K = 3, KR = K + S * (R - 1), KH = K - S;
#pragma unroll
  for (int q = 0; q < R; ++q)
#pragma unroll
    for (int v = 0; v < V; ++v) acc[q][v] = b[v];
#pragma unroll
  for (int kh = 0; kh < KR; ++kh) {
    float fresh[S][V];
#pragma unroll
    for (int d = 0; d < S; ++d) widen_word<TT, V>(raw[kh][d], fresh[d]);
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const int kr = kh - q * S;
      if (kr < 0 || kr >= K) continue;
#pragma unroll
      for (int kw = 0; kw < K; ++kw)
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const float xv = kw < KH ? held[kh][kw < KH ? kw : 0][v] : fresh[kw >= KH ? kw - KH : 0][v];
          acc[q][v] = fmaf(wr[kr * K + kw][v], xv, acc[q][v]);
        }
    }
#pragma unroll
    for (int j = 0; j < KH; ++j)
#pragma unroll
      for (int v = 0; v < V; ++v)
        held[kh][j][v] = j + S < KH ? held[kh][j + S < KH ? j + S : 0][v] : fresh[j + S >= KH ? j + S - KH : 0][v];
  }
}

// grad_input at input column iw of a stride-1 padding-1 3x3 input-row walk: the rotated kernel's taps in row-major
// order, that is grad_out row ih + 1 - kh for kh = 2, 1, 0, and in each row the columns iw - 1, iw, iw + 1
// (held[kh][1], held[kh][0], fresh[kh]), the order of the rotated-kernel column walk (stencil_3x3.cuh, FLIP). The
// input-row walk (depthwise_weight_grad.cu) and the backward ring (depthwise_ring.cu) share it so that their input
// gradients are the same bits.
template <int V>
__device__ __forceinline__ void input_row_grad(const float (&wr)[9][V], const float (&held)[3][2][V],
                                               const float (&fresh)[3][V], float (&d)[V]) {
  constexpr int K = 3;
#pragma unroll
  for (int v = 0; v < V; ++v) d[v] = 0.f;
#pragma unroll
  for (int kr = 0; kr < K; ++kr) {
    const int kh = K - 1 - kr;
#pragma unroll
    for (int v = 0; v < V; ++v) {
      d[v] = fmaf(wr[kh * K + 2][v], held[kh][1][v], d[v]);
      d[v] = fmaf(wr[kh * K + 1][v], held[kh][0][v], d[v]);
      d[v] = fmaf(wr[kh * K + 0][v], fresh[kh][v], d[v]);
    }
  }
}

// --- BatchNorm + ReLU arithmetic, shared by its own kernels (batchnorm_relu.cu) and the depthwise kernels that apply
// it to their input as they load it (InputNorm), so that both compute the same bits ------------------------------

// The pre-activation (x - mean) * scale + bias with scale = weight * invstd, in correctly rounded operations: the
// backward recomputes it to derive the ReLU mask from x, bit for bit the forward's. Centring first, as
// nn.BatchNorm2d does: x * scale + (bias - mean * scale) cancels catastrophically in fp32 when |mean| >> std.
__device__ __forceinline__ float bn_scale(float weight, float invstd) { return __fmul_rn(weight, invstd); }
__device__ __forceinline__ float bn_pre_activation(float x, float mean, float scale, float bias) {
  return __fmaf_rn(__fsub_rn(x, mean), scale, bias);
}
// NaN stays NaN, as in torch.relu (a NaN output is how GradScaler and the loss see a bad step).
__device__ __forceinline__ float bn_relu(float v) { return v < 0.f ? 0.f : v; }

// Whether y = bn_relu(bn_pre_activation(x)), stored in TT, is > 0: the ReLU's backward mask, recomputed from x (the
// rounding to TT is part of it: a positive value that underflows to zero let no gradient through in the forward's y).
template <class TT>
__device__ __forceinline__ bool relu_passes(float x, float mean, float scale, float bias) {
  return TT::to_acc(TT::from_acc(bn_pre_activation(x, mean, scale, bias))) > 0.f;
}

// The BatchNorm + ReLU backward's input gradient at one element, from its output gradient g and input x:
// c_g * g' + c_x * (x - mean) + c_0 with g' = g where the ReLU passed, else 0 (k: the six constants of
// batchnorm_relu.cu's finalize_backward, in OutputGradNorm's order: mean, c_g, c_x, c_0, scale, bias).
template <class TT>
__device__ __forceinline__ float bn_relu_input_grad(float g, float x, float mean, float c_g, float c_x, float c_0,
                                                    float scale, float bias) {
  const float gm = relu_passes<TT>(x, mean, scale, bias) ? g : 0.f;
  return fmaf(c_g, gm, fmaf(c_x, __fsub_rn(x, mean), c_0));
}

// A lane's grad_out words computed from the BatchNorm + ReLU after the convolution (OutputGradNorm, depthwise.h): the
// gradient of that BatchNorm's output and its input, both at the word, give the word batchnorm_relu.cu's input-gradient
// pass would have stored, so the walk reads bitwise its grad_out and that grad_out is never written. A word outside
// the output is not an output word: the caller keeps it zero. ON = false: the word as loaded (no registers).
template <class TT, int V, bool ON>
struct WordGradNorm {
  __device__ __forceinline__ void setup(const OutputGradNorm&, int) {}
  __device__ __forceinline__ uint32_t load(const uint32_t* g, const uint32_t*, size_t off) const { return __ldg(g + off); }
  __device__ __forceinline__ uint32_t apply(uint32_t g, uint32_t) const { return g; }
};
template <class TT, int V>
struct WordGradNorm<TT, V, true> {
  float k[6][V];
  __device__ __forceinline__ void setup(const OutputGradNorm& n, int c0) {
#pragma unroll
    for (int j = 0; j < 6; ++j)
#pragma unroll
      for (int v = 0; v < V; ++v) k[j][v] = __ldg(n.consts + static_cast<size_t>(j) * n.C + c0 + v);
  }
  // g: the BatchNorm's output gradient word, x: its input word.
  __device__ __forceinline__ uint32_t apply(uint32_t g, uint32_t x) const {
    float gv[V], xv[V];
    widen_word<TT, V>(g, gv);
    widen_word<TT, V>(x, xv);
#pragma unroll
    for (int v = 0; v < V; ++v)
      gv[v] = bn_relu_input_grad<TT>(gv[v], xv[v], k[0][v], k[1][v], k[2][v], k[3][v], k[4][v], k[5][v]);
    return narrow_word<TT, V>(gv);
  }
  // Both words at the same offset, then apply.
  __device__ __forceinline__ uint32_t load(const uint32_t* g, const uint32_t* x, size_t off) const {
    return apply(__ldg(g + off), __ldg(x + off));
  }
};

// A lane's transform of its channels' input words by the InputNorm (depthwise.h) of the layer before: x =
// relu(bn_pre_activation(y)) rounded to the element type, the word batchnorm_relu.cu's apply pass would have stored,
// so the convolution sees bitwise the x of the two separate ops and x is never written. Padding is not an input word:
// it stays zero. ON = false is the identity (no registers).
template <class TT, int V, bool ON>
struct WordNorm {
  __device__ __forceinline__ void setup(const InputNorm&, int) {}
  __device__ __forceinline__ uint32_t operator()(uint32_t w) const { return w; }
};
template <class TT, int V>
struct WordNorm<TT, V, true> {
  float mean[V], scale[V], bias[V];
  // c0: the first of the lane's V channels.
  __device__ __forceinline__ void setup(const InputNorm& n, int c0) {
#pragma unroll
    for (int v = 0; v < V; ++v) {
      mean[v] = __ldg(n.mean + c0 + v);
      scale[v] = bn_scale(__ldg(n.weight + c0 + v), __ldg(n.invstd + c0 + v));
      bias[v] = __ldg(n.bias + c0 + v);
    }
  }
  // The walks run this on every word they load, several times per element, so it is kept to the fewest
  // instructions that give the same bits: from sm_80 the ReLU is folded into the rounding (cvt.rn.relu packs two
  // 16-bit values; max.NaN keeps a NaN as bn_relu does), which rounds and clamps as bn_relu then from_acc do.
  __device__ __forceinline__ uint32_t operator()(uint32_t w) const {
    float f[V];
    widen_word<TT, V>(w, f);
#pragma unroll
    for (int v = 0; v < V; ++v) f[v] = bn_pre_activation(f[v], mean[v], scale[v], bias[v]);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint32_t out;
    if constexpr (V == 1) {
      float r;
      asm("max.NaN.f32 %0, %1, 0f00000000;" : "=f"(r) : "f"(f[0]));
      out = __float_as_uint(r);
    } else if constexpr (std::is_same_v<TT, F16T>) {
      asm("cvt.rn.relu.f16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(f[1]), "f"(f[0]));
    } else {
      asm("cvt.rn.relu.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(f[1]), "f"(f[0]));
    }
    return out;
#else
#pragma unroll
    for (int v = 0; v < V; ++v) f[v] = bn_relu(f[v]);
    return narrow_word<TT, V>(f);
#endif
  }
};

// The BatchNorm + ReLU backward's per-channel sums at one word a backward walk wrote (the input-row walks of
// depthwise_weight_grad.cu, the backward ring of depthwise_ring.cu): g = the grad_input word as stored,
// counted where the ReLU passed (x, the normalized word, > 0: the mask bn_relu_bwd recomputes from y) and the word is
// inside the row; bn_sums += (g, g * (y - mean)).
template <class TT, int V>
__device__ __forceinline__ void add_grad_sums(uint32_t stored, uint32_t y_word, const float (&x)[V], bool inside,
                                              const float (&mean)[V], float (&bn_sums)[2][V]) {
  float g[V], yv[V];
  widen_word<TT, V>(stored, g);
  widen_word<TT, V>(y_word, yv);
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const float gm = inside && x[v] > 0.f ? g[v] : 0.f;
    bn_sums[0][v] += gm;
    bn_sums[1][v] = fmaf(gm, yv[v] - mean[v], bn_sums[1][v]);
  }
}

// V consecutive elements in one load instruction (the caller guarantees alignment).
template <class TT, int V>
__device__ __forceinline__ void load_vec(const typename TT::S* p, float (&out)[V]) {
  const Pack<typename TT::S, V> pk = *reinterpret_cast<const Pack<typename TT::S, V>*>(p);
  widen<TT, V>(pk, out);
}

template <class TT, int V>
__device__ __forceinline__ void store_vec(typename TT::S* p, const float (&in)[V]) {
  Pack<typename TT::S, V> pk;
#pragma unroll
  for (int i = 0; i < V; ++i) pk.v[i] = TT::from_acc(in[i]);
  *reinterpret_cast<Pack<typename TT::S, V>*>(p) = pk;
}

template <int V>
__device__ __forceinline__ void load_f32(const float* p, float (&out)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int i = 0; i < V; i += 4) {
      const float4 q = *reinterpret_cast<const float4*>(p + i);
      out[i] = q.x; out[i + 1] = q.y; out[i + 2] = q.z; out[i + 3] = q.w;
    }
  } else if constexpr (V % 2 == 0) {
#pragma unroll
    for (int i = 0; i < V; i += 2) {
      const float2 q = *reinterpret_cast<const float2*>(p + i);
      out[i] = q.x; out[i + 1] = q.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = p[i];
  }
}

// Which tile a linear tile index names: tile_w varies fastest, then tile_h, then `outer` (the image,
// plane group or image batch, depending on the kernel).
struct TileIndex {
  int tile_w, tile_h, outer;
};
__device__ __forceinline__ TileIndex split_tile_index(int b, const Tiling& t) {
  TileIndex r;
  r.tile_w = b % t.tiles_w;
  b /= t.tiles_w;
  r.tile_h = b % t.tiles_h;
  r.outer = b / t.tiles_h;
  return r;
}

// A lane's place in its block, decoded as the Tiling comment above describes.
struct NhwcLane {
  int cv, sx, sy;
};
__device__ __forceinline__ NhwcLane nhwc_lane(int lane, const Tiling& t) {
  NhwcLane p;
  p.cv = lane % t.lanes_c;
  const int sp = lane / t.lanes_c;
  p.sx = sp % t.sx_n;
  p.sy = sp / t.sx_n;
  return p;
}
struct NchwLane {
  int q, sx, sy;
};
__device__ __forceinline__ NchwLane nchw_lane(int lane, const Tiling& t) {
  NchwLane p;
  p.sx = lane % t.sx_n;
  const int r = lane / t.sx_n;
  p.sy = r % t.sy_n;
  p.q = r / t.sy_n;
  return p;
}

// NHWC forward/dgrad blocks: channel group fastest across blocks (default) so that the blocks sharing
// a pixel's cache lines run together; the rest of the block index is the tile index.
__device__ __forceinline__ int nhwc_block_group(const Tiling& t) {
  return t.group_fastest ? blockIdx.x % t.groups : blockIdx.x / t.blocks_per_group;
}
__device__ __forceinline__ int nhwc_block_tile(const Tiling& t) {
  return t.group_fastest ? blockIdx.x / t.groups : blockIdx.x % t.blocks_per_group;
}

// Images [begin, end) of the `batch`-th run of t.images images.
struct ImageRange {
  int begin, end;
};
__device__ __forceinline__ ImageRange image_range(int batch, const Tiling& t, int N) {
  ImageRange r;
  r.begin = batch * t.images;
  r.end = r.begin + t.images < N ? r.begin + t.images : N;
  return r;
}

// The block's K*K weights of channels [c_base, c_base + cw) into shared memory as fp32, tap-major
// (w_smem[kk * cw + c - c_base]); channels >= C get zeros. Ends with a barrier.
template <class TT, int K>
__device__ __forceinline__ void stage_weights_f32(const typename TT::S* w, int C, int c_base, int cw, float* w_smem) {
  for (int e = threadIdx.x; e < K * K * cw; e += blockDim.x) {
    const int kk = e / cw, c = c_base + (e - kk * cw);
    w_smem[e] = c < C ? TT::to_acc(w[c * K * K + kk]) : 0.f;
  }
  __syncthreads();
}

// L packed vectors at columns col0, col0 + 1, ... of one row, `pitch` elements apart; zeros for
// columns outside [0, cols). All loads of the row are issued before any use, so they overlap.
template <typename S, int V, int L>
__device__ __forceinline__ void load_row_packs(const S* row, int col0, int cols, int pitch, Pack<S, V> (&dst)[L]) {
#pragma unroll
  for (int i = 0; i < L; ++i) {
    const int col = col0 + i;
    if (col >= 0 && col < cols) {
      dst[i] = *reinterpret_cast<const Pack<S, V>*>(row + static_cast<size_t>(col) * pitch);
    } else {
#pragma unroll
      for (int v = 0; v < V; ++v) dst[i].v[v] = S(0);
    }
  }
}

// L packed vectors at columns col0, col0 + 1, ... of row `row` of one NHWC image (rows x cols pixels of
// `pitch` elements); zeros outside the image, and no memory access at all for a row outside it. The
// row-streaming kernels call it for rows above/below the image.
template <typename S, int V, int L>
__device__ __forceinline__ void load_image_row_packs(const S* image, int row, int rows, int col0, int cols, int pitch,
                                                     Pack<S, V> (&dst)[L]) {
  const bool row_ok = row >= 0 && row < rows;
  const S* rp = image + static_cast<size_t>(row_ok ? row : 0) * cols * pitch;
#pragma unroll
  for (int i = 0; i < L; ++i) {
    const int col = col0 + i;
    if (row_ok && col >= 0 && col < cols) {
      dst[i] = *reinterpret_cast<const Pack<S, V>*>(rp + static_cast<size_t>(col) * pitch);
    } else {
#pragma unroll
      for (int v = 0; v < V; ++v) dst[i].v[v] = S(0);
    }
  }
}

// The same for scalars of one NCHW row (contiguous columns).
template <typename S, int L>
__device__ __forceinline__ void load_row_scalars(const S* row, int col0, int cols, S (&dst)[L]) {
#pragma unroll
  for (int i = 0; i < L; ++i) {
    const int col = col0 + i;
    dst[i] = (col >= 0 && col < cols) ? row[col] : S(0);
  }
}

// One kernel row kh of the NHWC forward/dgrad stencil: acc[j] += w[kh][kw] * in[i] for each input
// vector i and output column j whose tap kw = tap(i, j) is in [0, K). The weights come from the
// block's fp32 copy in shared memory (wl: this lane's channels, cw: channels per tap), held in
// registers for the row when K*V is small enough.
template <class TT, int K, int L, int TW, int V, class TapOf>
__device__ __forceinline__ void accumulate_nhwc_row(const Pack<typename TT::S, V> (&raw)[L], const float* wl, int kh,
                                                    int cw, float (&acc)[TW][V], TapOf tap) {
  constexpr bool kWeightsInRegs = K * V <= 32;
  float wk[kWeightsInRegs ? K : 1][V];
  if constexpr (kWeightsInRegs) {
#pragma unroll
    for (int kw = 0; kw < K; ++kw) load_f32<V>(wl + (kh * K + kw) * cw, wk[kw]);
  }
#pragma unroll
  for (int i = 0; i < L; ++i) {
    float in[V];
    widen<TT, V>(raw[i], in);
#pragma unroll
    for (int j = 0; j < TW; ++j) {
      const int kw = tap(i, j);
      if (kw >= 0 && kw < K) {
        float wv[V];
        if constexpr (kWeightsInRegs) {
#pragma unroll
          for (int v = 0; v < V; ++v) wv[v] = wk[kw][v];
        } else {
          load_f32<V>(wl + (kh * K + kw) * cw, wv);
        }
#pragma unroll
        for (int v = 0; v < V; ++v) acc[j][v] = fmaf(wv[v], in[v], acc[j][v]);
      }
    }
  }
}

// One kernel row kh of the NCHW forward/dgrad stencil: acc[j] += w[kh][kw] * in[i] for each input
// column i and output column j whose tap kw = tap(i, j) is in [0, K); wc: the channel's K*K weights.
template <class TT, int K, int L, int TW, class TapOf>
__device__ __forceinline__ void accumulate_nchw_row(const typename TT::S (&raw)[L], const typename TT::S* wc, int kh,
                                                    float (&acc)[TW], TapOf tap) {
  float wk[K];
#pragma unroll
  for (int kw = 0; kw < K; ++kw) wk[kw] = TT::to_acc(wc[kh * K + kw]);
#pragma unroll
  for (int i = 0; i < L; ++i) {
    const float in = TT::to_acc(raw[i]);
#pragma unroll
    for (int j = 0; j < TW; ++j) {
      const int kw = tap(i, j);
      if (kw >= 0 && kw < K) acc[j] = fmaf(wk[kw], in, acc[j]);
    }
  }
}

template <int A, int B>
__device__ __forceinline__ void fill(float (&a)[A][B], float value) {
#pragma unroll
  for (int i = 0; i < A; ++i)
#pragma unroll
    for (int j = 0; j < B; ++j) a[i][j] = value;
}

// The generic kernels take the whole DepthwiseShape in index type I: int where every size and index of the case
// fits 32 bits (generic_fits_int), else long long. They run over a tensor's elements in memory order, in either
// layout.
template <class I>
struct GenericShape {
  I N, C, M, H, W, OH, OW, KH, KW, SH, SW, PH, PW, DH, DW;
  bool channels_last;
  int act;
  __host__ __device__ I OC() const { return C * M; }
};

template <class I>
inline GenericShape<I> generic_shape(const DepthwiseShape& d) {
  return {static_cast<I>(d.N),  static_cast<I>(d.C),  static_cast<I>(d.M),  static_cast<I>(d.H),
          static_cast<I>(d.W),  static_cast<I>(d.OH), static_cast<I>(d.OW), static_cast<I>(d.KH),
          static_cast<I>(d.KW), static_cast<I>(d.SH), static_cast<I>(d.SW), static_cast<I>(d.PH),
          static_cast<I>(d.PW), static_cast<I>(d.DH), static_cast<I>(d.DW), d.channels_last, d.act};
}

// Whether 32-bit index math is exact for the case: every tensor (input, output, weight, the weight-gradient
// workspace of `ws_elems`) below 2^31 - 2^26 elements (the margin keeps a grid-stride loop's last step, at most
// grid_for()'s 32 blocks per SM x 256 threads, from overflowing), and every intermediate row/column index
// (o * S - P + k * D, and the input gradient's i + P - k * D) below that too.
inline bool generic_fits_int(const DepthwiseShape& d, long long ws_elems = 0) {
  const long long lim = (1LL << 31) - (1LL << 26);
  const long long oc = d.C * d.M;
  auto span = [](long long in, long long out, long long k, long long s, long long p, long long dl) {
    return in + out * s + p + k * dl;  // bounds |o * S - P + k * D| and |i + P - k * D|
  };
  return d.N * d.C * d.H * d.W < lim && d.N * oc * d.OH * d.OW < lim && oc * d.KH * d.KW < lim &&
         oc * (d.KH * d.KW + 1) < lim && ws_elems < lim && span(d.H, d.OH, d.KH, d.SH, d.PH, d.DH) < lim &&
         span(d.W, d.OW, d.KW, d.SW, d.PW, d.DW) < lim && d.N * d.OH * d.OW < lim;
}

template <class I>
struct Index4 {
  I n, c, h, w;
};

// Decode a linear index of an (N, C, H, W) tensor stored in the given layout.
template <class I>
__device__ __forceinline__ Index4<I> decode(I idx, I C, I H, I W, bool channels_last) {
  Index4<I> r;
  if (channels_last) {
    r.c = idx % C; idx /= C;
    r.w = idx % W; idx /= W;
    r.h = idx % H; r.n = idx / H;
  } else {
    r.w = idx % W; idx /= W;
    r.h = idx % H; idx /= H;
    r.c = idx % C; r.n = idx / C;
  }
  return r;
}

template <class I>
__device__ __forceinline__ I offset(I n, I c, I h, I w, I C, I H, I W, bool channels_last) {
  return channels_last ? ((n * H + h) * W + w) * C + c : ((n * C + c) * H + h) * W + w;
}

}  // namespace mdw
