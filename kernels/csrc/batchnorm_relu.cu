// Fused BatchNorm + ReLU (training) kernels; the scheme is described in batchnorm_relu.h.
//
// Memory-bound: every pass streams its tensors once with 16-byte accesses where the shape allows.
//   NHWC: a thread owns `vec` consecutive channels; a block's threads cover lanes * vec channels of `rows`
//         consecutive pixels, so a warp reads whole contiguous runs of a row (all of it when C is small).
//   NCHW: a block owns one channel; its threads walk that channel's planes `vec` elements at a time, so
//         consecutive threads read consecutive elements of a plane row.
// Per-channel constants (pivot, mean, scale, ...) are loaded once per thread, outside the streaming loops.
#include "batchnorm_relu.h"

#include <c10/cuda/CUDAException.h>

#include "device_common.h"

namespace mbn {
namespace {

using mdw::BF16T;
using mdw::F16T;
using mdw::F32T;
using mdw::Pack;
using mdw::store_vec;
using mdw::widen;

constexpr int kThreads = 256;
constexpr int kMaxVec = 8;         // 16 bytes of 16-bit elements
constexpr int kUnroll = 4;         // independent loads in flight per thread
constexpr int kBlocksPerSm = 8;    // 8 x 256 threads: a full SM
constexpr int kFinalizeWarps = 8;  // channels per finalize block (one warp each)

inline int ceil_div(long long a, long long b) { return static_cast<int>((a + b - 1) / b); }

// n / d for n < 2^31 by a multiply-high: the NCHW kernels split a channel's flat index into (image, offset) per
// access, which a hardware-less integer division would make compute-bound for small planes (7x7).
struct FastDiv {
  uint32_t mul, shift;
  __device__ __forceinline__ uint32_t operator()(uint32_t n) const { return (__umulhi(n, mul) + n) >> shift; }
};
FastDiv make_fast_div(uint32_t d) {
  uint32_t l = 0;
  while ((uint64_t(1) << l) < d) ++l;
  FastDiv f;
  f.mul = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << l) - d)) / d + 1);
  f.shift = l;
  return f;
}

template <class TT, int V>
__device__ __forceinline__ Pack<typename TT::S, V> load_pack(const typename TT::S* p) {
  return *reinterpret_cast<const Pack<typename TT::S, V>*>(p);
}

// NaN stays NaN, as in torch.relu (a NaN output is how GradScaler and the loss see a bad step).
__device__ __forceinline__ float relu(float v) { return v < 0.f ? 0.f : v; }

// --- per-element operations of the reduce passes: sums a (first) and b (second) per channel ----------------------

// Forward statistics: a += x - pivot, b += (x - pivot)^2.
template <class TT>
struct StatsOp {
  using S = typename TT::S;
  const S* x;
  int pivot_stride;  // elements between channel c's first element and channel c + 1's (1 NHWC, HW NCHW)
  template <int V>
  struct Loaded {
    Pack<S, V> x;
  };
  __device__ __forceinline__ float channel_constant(int c) const {
    return TT::to_acc(x[static_cast<size_t>(c) * pivot_stride]);
  }
  template <int V>
  __device__ __forceinline__ void load(size_t off, Loaded<V>& l) const {
    l.x = load_pack<TT, V>(x + off);
  }
  template <int V>
  __device__ __forceinline__ void accumulate(const Loaded<V>& l, const float (&k)[V], float (&a)[V],
                                             float (&b)[V]) const {
    float xv[V];
    widen<TT, V>(l.x, xv);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float d = xv[i] - k[i];
      a[i] += d;
      b[i] = fmaf(d, d, b[i]);
    }
  }
};

// Backward sums with the ReLU's backward folded in: g = grad_y where y > 0 else 0; a += g, b += g * (x - mean).
template <class TT>
struct GradSumsOp {
  using S = typename TT::S;
  const S* grad_y;
  const S* x;
  const S* y;
  const float* mean;
  template <int V>
  struct Loaded {
    Pack<S, V> g, x, y;
  };
  __device__ __forceinline__ float channel_constant(int c) const { return mean[c]; }
  template <int V>
  __device__ __forceinline__ void load(size_t off, Loaded<V>& l) const {
    l.g = load_pack<TT, V>(grad_y + off);
    l.x = load_pack<TT, V>(x + off);
    l.y = load_pack<TT, V>(y + off);
  }
  template <int V>
  __device__ __forceinline__ void accumulate(const Loaded<V>& l, const float (&k)[V], float (&a)[V],
                                             float (&b)[V]) const {
    float gv[V], xv[V], yv[V];
    widen<TT, V>(l.g, gv);
    widen<TT, V>(l.x, xv);
    widen<TT, V>(l.y, yv);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float g = yv[i] > 0.f ? gv[i] : 0.f;
      a[i] += g;
      b[i] = fmaf(g, xv[i] - k[i], b[i]);
    }
  }
};

// --- per-element operations of the apply passes, with K per-channel constants ------------------------------------

// y = relu(x * scale + shift).
template <class TT>
struct NormalizeOp {
  using S = typename TT::S;
  static constexpr int K = 2;
  const S* x;
  S* y;
  const float* consts[K];  // scale, shift
  template <int V>
  struct Loaded {
    Pack<S, V> x;
  };
  template <int V>
  __device__ __forceinline__ void load(size_t off, Loaded<V>& l) const {
    l.x = load_pack<TT, V>(x + off);
  }
  template <int V>
  __device__ __forceinline__ void apply(size_t off, const Loaded<V>& l, const float (&k)[K][V]) const {
    float v[V];
    widen<TT, V>(l.x, v);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = relu(fmaf(v[i], k[0][i], k[1][i]));
    store_vec<TT, V>(y + off, v);
  }
};

// grad_x = c_g * g + c_x * (x - mean) + c_0, with g = grad_y where y > 0 else 0 (finalize_backward's coefficients).
template <class TT>
struct InputGradOp {
  using S = typename TT::S;
  static constexpr int K = 4;
  const S* grad_y;
  const S* x;
  const S* y;
  S* grad_x;
  const float* consts[K];  // mean, c_g, c_x, c_0
  template <int V>
  struct Loaded {
    Pack<S, V> g, x, y;
  };
  template <int V>
  __device__ __forceinline__ void load(size_t off, Loaded<V>& l) const {
    l.g = load_pack<TT, V>(grad_y + off);
    l.x = load_pack<TT, V>(x + off);
    l.y = load_pack<TT, V>(y + off);
  }
  template <int V>
  __device__ __forceinline__ void apply(size_t off, const Loaded<V>& l, const float (&k)[K][V]) const {
    float gv[V], xv[V], yv[V], out[V];
    widen<TT, V>(l.g, gv);
    widen<TT, V>(l.x, xv);
    widen<TT, V>(l.y, yv);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float g = yv[i] > 0.f ? gv[i] : 0.f;
      out[i] = fmaf(k[1][i], g, fmaf(k[2][i], xv[i] - k[0][i], k[3][i]));
    }
    store_vec<TT, V>(grad_x + off, out);
  }
};

// --- NHWC kernels -------------------------------------------------------------------------------------------------

// The rows [begin, end) of this block's chunk.
struct RowRange {
  int begin, end;
};
__device__ __forceinline__ RowRange chunk_range(int total, int per_chunk) {
  RowRange r;
  r.begin = blockIdx.y * per_chunk;
  r.end = min(total, r.begin + per_chunk);
  return r;
}

template <int V, class Op>
__global__ void __launch_bounds__(kThreads) reduce_nhwc(Op op, int M, int C, int rows_per_chunk, float* partial) {
  __shared__ float sums[2][kThreads * kMaxVec];
  const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * V;
  const bool active = c0 < C;
  float k[V], a[V], b[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    k[i] = active ? op.channel_constant(c0 + i) : 0.f;
    a[i] = b[i] = 0.f;
  }
  if (active) {
    const RowRange rr = chunk_range(M, rows_per_chunk);
    const int step = blockDim.y;
    int r = rr.begin + threadIdx.y;
    for (; r + (kUnroll - 1) * step < rr.end; r += kUnroll * step) {
      typename Op::template Loaded<V> l[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) op.load(static_cast<size_t>(r + u * step) * C + c0, l[u]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) op.accumulate(l[u], k, a, b);
    }
    for (; r < rr.end; r += step) {
      typename Op::template Loaded<V> l;
      op.load(static_cast<size_t>(r) * C + c0, l);
      op.accumulate(l, k, a, b);
    }
  }
  // Fixed-order tree over the block's rows: row i accumulates row i + s for s = 2^k, ..., 1.
  const int width = blockDim.x * V, col = threadIdx.x * V;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    sums[0][threadIdx.y * width + col + i] = a[i];
    sums[1][threadIdx.y * width + col + i] = b[i];
  }
  __syncthreads();
  int half = 1;
  while (half * 2 < static_cast<int>(blockDim.y)) half *= 2;
  for (int s = half; s > 0; s >>= 1) {
    if (threadIdx.y < s && threadIdx.y + s < blockDim.y) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        sums[0][threadIdx.y * width + col + i] += sums[0][(threadIdx.y + s) * width + col + i];
        sums[1][threadIdx.y * width + col + i] += sums[1][(threadIdx.y + s) * width + col + i];
      }
    }
    __syncthreads();
  }
  if (threadIdx.y == 0 && active) {
    float* out = partial + static_cast<size_t>(blockIdx.y) * 2 * C;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      out[c0 + i] = sums[0][col + i];
      out[C + c0 + i] = sums[1][col + i];
    }
  }
}

template <int V, class Op>
__global__ void __launch_bounds__(kThreads) apply_nhwc(Op op, int M, int C, int rows_per_chunk) {
  const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * V;
  if (c0 >= C) return;
  float k[Op::K][V];
#pragma unroll
  for (int j = 0; j < Op::K; ++j)
#pragma unroll
    for (int i = 0; i < V; ++i) k[j][i] = op.consts[j][c0 + i];
  const RowRange rr = chunk_range(M, rows_per_chunk);
  const int step = blockDim.y;
  int r = rr.begin + threadIdx.y;
  for (; r + (kUnroll - 1) * step < rr.end; r += kUnroll * step) {
    typename Op::template Loaded<V> l[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) op.load(static_cast<size_t>(r + u * step) * C + c0, l[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) op.apply(static_cast<size_t>(r + u * step) * C + c0, l[u], k);
  }
  for (; r < rr.end; r += step) {
    typename Op::template Loaded<V> l;
    op.load(static_cast<size_t>(r) * C + c0, l);
    op.apply(static_cast<size_t>(r) * C + c0, l, k);
  }
}

// --- NCHW kernels -------------------------------------------------------------------------------------------------

// Element offset of channel c's vector unit u (image u / plane_vecs, vector u % plane_vecs of its plane).
template <int V>
__device__ __forceinline__ size_t nchw_offset(uint32_t u, int c, int C, int plane_vecs, FastDiv div) {
  const uint32_t n = div(u);
  const uint32_t i = u - n * static_cast<uint32_t>(plane_vecs);
  return ((static_cast<size_t>(n) * C + c) * plane_vecs + i) * V;
}

// Fixed-order sum of a pair over the block: a butterfly within each warp, then the warps in order.
__device__ __forceinline__ void block_sum2(float& a, float& b) {
  __shared__ float warp_sums[2][kThreads / 32];
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, m);
    b += __shfl_xor_sync(0xffffffffu, b, m);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_sums[0][warp] = a;
    warp_sums[1][warp] = b;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    a = b = 0.f;
    for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) {
      a += warp_sums[0][w];
      b += warp_sums[1][w];
    }
  }
}

template <int V, class Op>
__global__ void __launch_bounds__(kThreads) reduce_nchw(Op op, int C, int plane_vecs, FastDiv div, int units,
                                                        int units_per_chunk, float* partial) {
  const int c = blockIdx.x;
  const float kc = op.channel_constant(c);
  float k[V], a[V], b[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    k[i] = kc;
    a[i] = b[i] = 0.f;
  }
  const RowRange ur = chunk_range(units, units_per_chunk);
  const int step = blockDim.x;
  int u = ur.begin + threadIdx.x;
  for (; u + (kUnroll - 1) * step < ur.end; u += kUnroll * step) {
    typename Op::template Loaded<V> l[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) op.load(nchw_offset<V>(u + j * step, c, C, plane_vecs, div), l[j]);
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) op.accumulate(l[j], k, a, b);
  }
  for (; u < ur.end; u += step) {
    typename Op::template Loaded<V> l;
    op.load(nchw_offset<V>(u, c, C, plane_vecs, div), l);
    op.accumulate(l, k, a, b);
  }
  float sa = 0.f, sb = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    sa += a[i];
    sb += b[i];
  }
  block_sum2(sa, sb);
  if (threadIdx.x == 0) {
    float* out = partial + static_cast<size_t>(blockIdx.y) * 2 * C;
    out[c] = sa;
    out[C + c] = sb;
  }
}

template <int V, class Op>
__global__ void __launch_bounds__(kThreads) apply_nchw(Op op, int C, int plane_vecs, FastDiv div, int units,
                                                       int units_per_chunk) {
  const int c = blockIdx.x;
  float k[Op::K][V];
#pragma unroll
  for (int j = 0; j < Op::K; ++j) {
    const float v = op.consts[j][c];
#pragma unroll
    for (int i = 0; i < V; ++i) k[j][i] = v;
  }
  const RowRange ur = chunk_range(units, units_per_chunk);
  const int step = blockDim.x;
  int u = ur.begin + threadIdx.x;
  for (; u + (kUnroll - 1) * step < ur.end; u += kUnroll * step) {
    typename Op::template Loaded<V> l[kUnroll];
    size_t off[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      off[j] = nchw_offset<V>(u + j * step, c, C, plane_vecs, div);
      op.load(off[j], l[j]);
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) op.apply(off[j], l[j], k);
  }
  for (; u < ur.end; u += step) {
    typename Op::template Loaded<V> l;
    const size_t off = nchw_offset<V>(u, c, C, plane_vecs, div);
    op.load(off, l);
    op.apply(off, l, k);
  }
}

// --- finalize: one warp per channel sums the chunks in fp64, in a fixed order ------------------------------------

struct ChannelSums {
  double a, b;
};
__device__ __forceinline__ ChannelSums sum_chunks(const float* partial, int chunks, int C, int c) {
  const int lane = threadIdx.x % 32;
  double a = 0.0, b = 0.0;
  for (int i = lane; i < chunks; i += 32) {
    a += partial[static_cast<size_t>(i) * 2 * C + c];
    b += partial[static_cast<size_t>(i) * 2 * C + C + c];
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, m);
    b += __shfl_xor_sync(0xffffffffu, b, m);
  }
  return {a, b};
}

__device__ __forceinline__ int finalize_channel() { return blockIdx.x * kFinalizeWarps + threadIdx.x / 32; }

// Batch statistics from the pivot-shifted sums, and the forward's scale and shift.
template <class TT>
__global__ void __launch_bounds__(kFinalizeWarps * 32)
    finalize_stats(const float* partial, int chunks, int C, double count, const typename TT::S* x, int pivot_stride,
                   const float* weight, const float* bias, float eps, float* mean, float* invstd, float* var,
                   float* scale, float* shift) {
  const int c = finalize_channel();
  if (c >= C) return;  // a whole warp: the shuffles below see full warps only
  const ChannelSums s = sum_chunks(partial, chunks, C, c);
  if (threadIdx.x % 32 != 0) return;
  const double shifted_mean = s.a / count;
  const double v = fmax(s.b / count - shifted_mean * shifted_mean, 0.0);
  const double m = static_cast<double>(TT::to_acc(x[static_cast<size_t>(c) * pivot_stride])) + shifted_mean;
  const double is = 1.0 / sqrt(v + static_cast<double>(eps));
  const double sc = static_cast<double>(weight[c]) * is;
  mean[c] = static_cast<float>(m);
  invstd[c] = static_cast<float>(is);
  var[c] = static_cast<float>(v);
  scale[c] = static_cast<float>(sc);
  shift[c] = static_cast<float>(static_cast<double>(bias[c]) - m * sc);
}

// grad_bias = sum(g), grad_weight = sum(g * xhat), and the input gradient's coefficients:
// grad_x = w * invstd * (g - mean(g) - xhat * mean(g * xhat)) = c_g * g + c_x * (x - mean) + c_0.
__global__ void __launch_bounds__(kFinalizeWarps * 32)
    finalize_backward(const float* partial, int chunks, int C, double count, const float* weight, const float* invstd,
                      float* grad_weight, float* grad_bias, float* c_g, float* c_x, float* c_0) {
  const int c = finalize_channel();
  if (c >= C) return;
  const ChannelSums s = sum_chunks(partial, chunks, C, c);
  if (threadIdx.x % 32 != 0) return;
  const double is = invstd[c], w = weight[c];
  const double gw = s.b * is;
  grad_bias[c] = static_cast<float>(s.a);
  grad_weight[c] = static_cast<float>(gw);
  c_g[c] = static_cast<float>(w * is);
  c_x[c] = static_cast<float>(-w * is * is * (gw / count));
  c_0[c] = static_cast<float>(-w * is * (s.a / count));
}

// --- host side ----------------------------------------------------------------------------------------------------

struct Workspace {
  float* partial;  // [chunks][2][C]
  float* k0;       // per-channel constants of the apply pass, [C] each
  float* k1;
  float* k2;
};
Workspace split_workspace(float* ws, const BnShape& s, const BnPlan& p) {
  const size_t part = static_cast<size_t>(p.chunks) * 2 * s.C;
  return {ws, ws + part, ws + part + s.C, ws + part + 2 * static_cast<size_t>(s.C)};
}

template <int V, class Op>
void launch_reduce(const BnShape& s, const BnPlan& p, const Op& op, float* partial, cudaStream_t stream) {
  const dim3 grid(p.groups, p.chunks);
  if (s.nhwc) {
    reduce_nhwc<V, Op><<<grid, dim3(p.lanes, p.rows), 0, stream>>>(op, s.N * s.HW, s.C, p.per_chunk, partial);
  } else {
    const int plane_vecs = s.HW / V;
    reduce_nchw<V, Op><<<grid, p.lanes, 0, stream>>>(op, s.C, plane_vecs, make_fast_div(plane_vecs),
                                                     s.N * plane_vecs, p.per_chunk, partial);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int V, class Op>
void launch_apply(const BnShape& s, const BnPlan& p, const Op& op, cudaStream_t stream) {
  const dim3 grid(p.groups, p.chunks);
  if (s.nhwc) {
    apply_nhwc<V, Op><<<grid, dim3(p.lanes, p.rows), 0, stream>>>(op, s.N * s.HW, s.C, p.per_chunk);
  } else {
    const int plane_vecs = s.HW / V;
    apply_nchw<V, Op><<<grid, p.lanes, 0, stream>>>(op, s.C, plane_vecs, make_fast_div(plane_vecs), s.N * plane_vecs,
                                                    p.per_chunk);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

int finalize_blocks(int C) { return ceil_div(C, kFinalizeWarps); }

template <class TT, int V>
void forward_typed(const BnShape& s, const BnPlan& p, const void* x_, const float* weight, const float* bias,
                   float eps, void* y_, float* mean, float* invstd, float* var, float* workspace,
                   cudaStream_t stream) {
  using S = typename TT::S;
  const S* x = static_cast<const S*>(x_);
  const Workspace ws = split_workspace(workspace, s, p);
  const int pivot_stride = s.nhwc ? 1 : s.HW;
  launch_reduce<V>(s, p, StatsOp<TT>{x, pivot_stride}, ws.partial, stream);
  finalize_stats<TT><<<finalize_blocks(s.C), kFinalizeWarps * 32, 0, stream>>>(
      ws.partial, p.chunks, s.C, static_cast<double>(s.N) * s.HW, x, pivot_stride, weight, bias, eps, mean, invstd,
      var, ws.k0, ws.k1);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_apply<V>(s, p, NormalizeOp<TT>{x, static_cast<S*>(y_), {ws.k0, ws.k1}}, stream);
}

template <class TT, int V>
void backward_typed(const BnShape& s, const BnPlan& p, const void* grad_y_, const void* x_, const void* y_,
                    const float* weight, const float* mean, const float* invstd, void* grad_x, float* grad_weight,
                    float* grad_bias, float* workspace, cudaStream_t stream) {
  using S = typename TT::S;
  const S* grad_y = static_cast<const S*>(grad_y_);
  const S* x = static_cast<const S*>(x_);
  const S* y = static_cast<const S*>(y_);
  const Workspace ws = split_workspace(workspace, s, p);
  launch_reduce<V>(s, p, GradSumsOp<TT>{grad_y, x, y, mean}, ws.partial, stream);
  finalize_backward<<<finalize_blocks(s.C), kFinalizeWarps * 32, 0, stream>>>(
      ws.partial, p.chunks, s.C, static_cast<double>(s.N) * s.HW, weight, invstd, grad_weight, grad_bias, ws.k0,
      ws.k1, ws.k2);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_apply<V>(s, p, InputGradOp<TT>{grad_y, x, y, static_cast<S*>(grad_x), {mean, ws.k0, ws.k1, ws.k2}}, stream);
}

// The typed launchers as class templates, so that one dispatch serves both directions.
template <class TT, int V>
struct ForwardLaunch {
  template <class... A>
  static void run(A... a) { forward_typed<TT, V>(a...); }
};
template <class TT, int V>
struct BackwardLaunch {
  template <class... A>
  static void run(A... a) { backward_typed<TT, V>(a...); }
};

template <template <class, int> class Launch, class TT, class... A>
void dispatch_vec(int vec, A... a) {
  switch (vec) {
    case 1: Launch<TT, 1>::run(a...); break;
    case 2: Launch<TT, 2>::run(a...); break;
    case 4: Launch<TT, 4>::run(a...); break;
    default:
      if constexpr (sizeof(typename TT::S) == 2) Launch<TT, 8>::run(a...);
      break;
  }
}

template <template <class, int> class Launch, class... A>
void dispatch(DType dt, int vec, A... a) {
  switch (dt) {
    case DType::F32: dispatch_vec<Launch, F32T>(vec, a...); break;
    case DType::F16: dispatch_vec<Launch, F16T>(vec, a...); break;
    case DType::BF16: dispatch_vec<Launch, BF16T>(vec, a...); break;
    default: break;  // refused by the op's checks
  }
}

}  // namespace

BnPlan make_plan(const BnShape& s, DType dt, uintptr_t address_bits, int num_sms) {
  const int elem = dt == DType::F32 ? 4 : 2;
  const int extent = s.nhwc ? s.C : s.HW;  // the contiguous run that vectors must tile
  int vec = 16 / elem;
  while (vec > 1 && (extent % vec != 0 || address_bits % (static_cast<uintptr_t>(vec) * elem) != 0)) vec /= 2;
  BnPlan p{};
  p.vec = vec;
  const int target_blocks = num_sms * kBlocksPerSm;
  long long work;  // rows (NHWC) or units (NCHW) per channel group, and the most chunks worth having
  int min_per_chunk;
  if (s.nhwc) {
    const int channel_vecs = s.C / vec;
    p.groups = ceil_div(channel_vecs, 32);
    p.lanes = ceil_div(channel_vecs, p.groups);  // balanced groups: no group of mostly idle lanes
    p.rows = kThreads / p.lanes;
    work = static_cast<long long>(s.N) * s.HW;
    min_per_chunk = p.rows * kUnroll;
  } else {
    p.groups = s.C;
    p.lanes = kThreads;
    p.rows = 1;
    work = static_cast<long long>(s.N) * (s.HW / vec);
    min_per_chunk = kThreads * kUnroll;
  }
  int chunks = ceil_div(target_blocks, p.groups);
  const int max_chunks = ceil_div(work, min_per_chunk);
  if (chunks > max_chunks) chunks = max_chunks;
  if (chunks > 65535) chunks = 65535;
  if (chunks < 1) chunks = 1;
  p.per_chunk = ceil_div(work, chunks);
  p.chunks = ceil_div(work, p.per_chunk);
  return p;
}

size_t workspace_floats(const BnShape& s, const BnPlan& p) {
  return (static_cast<size_t>(p.chunks) * 2 + 3) * s.C;
}

void launch_forward(const BnShape& s, const BnPlan& p, DType dt, const void* x, const float* weight, const float* bias,
                    float eps, void* y, float* mean, float* invstd, float* var, float* workspace,
                    cudaStream_t stream) {
  dispatch<ForwardLaunch>(dt, p.vec, s, p, x, weight, bias, eps, y, mean, invstd, var, workspace, stream);
}

void launch_backward(const BnShape& s, const BnPlan& p, DType dt, const void* grad_y, const void* x, const void* y,
                     const float* weight, const float* mean, const float* invstd, void* grad_x, float* grad_weight,
                     float* grad_bias, float* workspace, cudaStream_t stream) {
  dispatch<BackwardLaunch>(dt, p.vec, s, p, grad_y, x, y, weight, mean, invstd, grad_x, grad_weight, grad_bias,
                           workspace, stream);
}

}  // namespace mbn
