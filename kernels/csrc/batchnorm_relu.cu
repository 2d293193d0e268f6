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

// The arithmetic these kernels share with the depthwise kernels that apply a BatchNorm to their input.
using mdw::bn_pre_activation;
using mdw::bn_relu;
using mdw::bn_relu_input_grad;
using mdw::bn_scale;
using mdw::relu_passes;

// --- per-element operations of the reduce passes: sums a (first) and b (second) per channel ----------------------

// Forward statistics: a += x - pivot, b += (x - pivot)^2.
template <class TT>
struct StatsOp {
  using S = typename TT::S;
  static constexpr int K = 1;          // per-channel constants: the pivot
  static constexpr int kUnroll = 8;     // one tensor read: more loads in flight per thread
  static constexpr int kMinBlocks = 3;  // blocks per SM the registers must allow (the plan fills one wave of them)
  const S* x;
  int pivot_stride;  // elements between channel c's first element and channel c + 1's (1 NHWC, HW NCHW)
  template <int V>
  struct Loaded {
    Pack<S, V> x;
  };
  __device__ __forceinline__ void channel_constants(int c, float (&k)[K]) const {
    k[0] = TT::to_acc(x[static_cast<size_t>(c) * pivot_stride]);
  }
  template <int V>
  __device__ __forceinline__ void load(size_t off, Loaded<V>& l) const {
    l.x = load_pack<TT, V>(x + off);
  }
  template <int V>
  __device__ __forceinline__ void accumulate(const Loaded<V>& l, const float (&k)[K][V], float (&a)[V],
                                             float (&b)[V]) const {
    float xv[V];
    widen<TT, V>(l.x, xv);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float d = xv[i] - k[0][i];
      a[i] += d;
      b[i] = fmaf(d, d, b[i]);
    }
  }
};

// Backward sums with the ReLU's backward folded in: g = grad_y where y > 0 else 0; a += g, b += g * (x - mean).
// The mask comes from x (relu_passes, device_common.h), so y is not read: two tensors instead of three.
template <class TT>
struct GradSumsOp {
  using S = typename TT::S;
  static constexpr int K = 3;  // mean, and the forward's scale and bias (for the mask)
  static constexpr int kUnroll = 4;
  static constexpr int kMinBlocks = 2;
  const S* grad_y;
  const S* x;
  const float* mean;
  const float* weight;
  const float* bias;
  const float* invstd;
  template <int V>
  struct Loaded {
    Pack<S, V> g, x;
  };
  __device__ __forceinline__ void channel_constants(int c, float (&k)[K]) const {
    k[0] = mean[c];
    k[1] = bn_scale(weight[c], invstd[c]);
    k[2] = bias[c];
  }
  template <int V>
  __device__ __forceinline__ void load(size_t off, Loaded<V>& l) const {
    l.g = load_pack<TT, V>(grad_y + off);
    l.x = load_pack<TT, V>(x + off);
  }
  template <int V>
  __device__ __forceinline__ void accumulate(const Loaded<V>& l, const float (&k)[K][V], float (&a)[V],
                                             float (&b)[V]) const {
    float gv[V], xv[V];
    widen<TT, V>(l.g, gv);
    widen<TT, V>(l.x, xv);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float g = relu_passes<TT>(xv[i], k[0][i], k[1][i], k[2][i]) ? gv[i] : 0.f;
      a[i] += g;
      b[i] = fmaf(g, xv[i] - k[0][i], b[i]);
    }
  }
};

// --- per-element operations of the apply passes, with K per-channel constants ------------------------------------

// y = relu((x - mean) * scale + bias).
template <class TT>
struct NormalizeOp {
  using S = typename TT::S;
  static constexpr int K = 3;
  static constexpr int kUnroll = 4;
  static constexpr int kMinBlocks = 4;
  const S* x;
  S* y;
  const float* consts[K];  // mean, scale, bias
  template <int V>
  struct Loaded {
    Pack<S, V> x;
  };
  __device__ __forceinline__ void channel_constants(int c, float (&k)[K]) const {
#pragma unroll
    for (int j = 0; j < K; ++j) k[j] = consts[j][c];
  }
  template <int V>
  __device__ __forceinline__ void load(size_t off, Loaded<V>& l) const {
    l.x = load_pack<TT, V>(x + off);
  }
  template <int V>
  __device__ __forceinline__ void apply(size_t off, const Loaded<V>& l, const float (&k)[K][V]) const {
    float v[V];
    widen<TT, V>(l.x, v);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = bn_relu(bn_pre_activation(v[i], k[0][i], k[1][i], k[2][i]));
    store_vec<TT, V>(y + off, v);
  }
};

// grad_x = c_g * g + c_x * (x - mean) + c_0, with g = grad_y where y > 0 else 0 (finalize_backward's coefficients;
// the mask from x, as in GradSumsOp).
template <class TT>
struct InputGradOp {
  using S = typename TT::S;
  static constexpr int K = 6;
  static constexpr int kUnroll = 4;
  static constexpr int kMinBlocks = 2;  // six constants for each of a thread's V channels: a register-heavy pass
  const S* grad_y;
  const S* x;
  S* grad_x;
  const float* consts[K];  // mean, c_g, c_x, c_0, scale, bias
  template <int V>
  struct Loaded {
    Pack<S, V> g, x;
  };
  __device__ __forceinline__ void channel_constants(int c, float (&k)[K]) const {
#pragma unroll
    for (int j = 0; j < K; ++j) k[j] = consts[j][c];
  }
  template <int V>
  __device__ __forceinline__ void load(size_t off, Loaded<V>& l) const {
    l.g = load_pack<TT, V>(grad_y + off);
    l.x = load_pack<TT, V>(x + off);
  }
  template <int V>
  __device__ __forceinline__ void apply(size_t off, const Loaded<V>& l, const float (&k)[K][V]) const {
    float gv[V], xv[V], out[V];
    widen<TT, V>(l.g, gv);
    widen<TT, V>(l.x, xv);
#pragma unroll
    for (int i = 0; i < V; ++i)
      out[i] = bn_relu_input_grad<TT>(gv[i], xv[i], k[0][i], k[1][i], k[2][i], k[3][i], k[4][i], k[5][i]);
    store_vec<TT, V>(grad_x + off, out);
  }
};

// --- the streaming loop shared by every kernel ---------------------------------------------------------------

// Visits i = first, first + step, ... < end, loading U of them before using any, so U loads are in flight per
// thread. The last round is predicated rather than finished one index at a time: a chunk's rest would otherwise
// cost one memory latency per index, which dominates the small layers (14x14, 7x7).
template <int U, class Loaded, class Load, class Use>
__device__ __forceinline__ void stream(int first, int end, int step, Load load, Use use) {
  for (int i = first; i < end; i += U * step) {
    Loaded l[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + u * step < end) load(i + u * step, l[u]);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + u * step < end) use(i + u * step, l[u]);
  }
}

// Per-channel constants of channels c0 .. c0 + V - 1, as k[constant][channel].
template <int V, class Op>
__device__ __forceinline__ void load_constants(const Op& op, int c0, int stride, float (&k)[Op::K][V]) {
#pragma unroll
  for (int i = 0; i < V; ++i) {
    float ki[Op::K];
    op.channel_constants(c0 + i * stride, ki);
#pragma unroll
    for (int j = 0; j < Op::K; ++j) k[j][i] = ki[j];
  }
}

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
__global__ void __launch_bounds__(kThreads, Op::kMinBlocks)
    reduce_nhwc(Op op, int M, int C, int rows_per_chunk, float* partial) {
  __shared__ float sums[2][kThreads * kMaxVec];
  using Loaded = typename Op::template Loaded<V>;
  const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * V;
  const bool active = c0 < C;
  float k[Op::K][V], a[V], b[V];
#pragma unroll
  for (int i = 0; i < V; ++i) a[i] = b[i] = 0.f;
  if (active) {
    load_constants<V>(op, c0, 1, k);
    const RowRange rr = chunk_range(M, rows_per_chunk);
    stream<Op::kUnroll, Loaded>(
        rr.begin + threadIdx.y, rr.end, blockDim.y,
        [&](int r, Loaded& l) { op.load(static_cast<size_t>(r) * C + c0, l); },
        [&](int, const Loaded& l) { op.accumulate(l, k, a, b); });
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
__global__ void __launch_bounds__(kThreads, Op::kMinBlocks) apply_nhwc(Op op, int M, int C, int rows_per_chunk) {
  using Loaded = typename Op::template Loaded<V>;
  const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * V;
  if (c0 >= C) return;
  float k[Op::K][V];
  load_constants<V>(op, c0, 1, k);
  const RowRange rr = chunk_range(M, rows_per_chunk);
  stream<Op::kUnroll, Loaded>(
      rr.begin + threadIdx.y, rr.end, blockDim.y,
      [&](int r, Loaded& l) { op.load(static_cast<size_t>(r) * C + c0, l); },
      [&](int r, const Loaded& l) { op.apply(static_cast<size_t>(r) * C + c0, l, k); });
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
__global__ void __launch_bounds__(kThreads, Op::kMinBlocks)
    reduce_nchw(Op op, int C, int plane_vecs, FastDiv div, int units, int units_per_chunk, float* partial) {
  using Loaded = typename Op::template Loaded<V>;
  const int c = blockIdx.x;
  float k[Op::K][V], a[V], b[V];
  load_constants<V>(op, c, 0, k);  // one channel: the same constants for every element of a vector
#pragma unroll
  for (int i = 0; i < V; ++i) a[i] = b[i] = 0.f;
  const RowRange ur = chunk_range(units, units_per_chunk);
  stream<Op::kUnroll, Loaded>(
      ur.begin + threadIdx.x, ur.end, blockDim.x,
      [&](int u, Loaded& l) { op.load(nchw_offset<V>(u, c, C, plane_vecs, div), l); },
      [&](int, const Loaded& l) { op.accumulate(l, k, a, b); });
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
__global__ void __launch_bounds__(kThreads, Op::kMinBlocks)
    apply_nchw(Op op, int C, int plane_vecs, FastDiv div, int units, int units_per_chunk) {
  using Loaded = typename Op::template Loaded<V>;
  const int c = blockIdx.x;
  float k[Op::K][V];
  load_constants<V>(op, c, 0, k);
  const RowRange ur = chunk_range(units, units_per_chunk);
  stream<Op::kUnroll, Loaded>(
      ur.begin + threadIdx.x, ur.end, blockDim.x,
      [&](int u, Loaded& l) { op.load(nchw_offset<V>(u, c, C, plane_vecs, div), l); },
      [&](int u, const Loaded& l) { op.apply(nchw_offset<V>(u, c, C, plane_vecs, div), l, k); });
}

// --- finalize: per channel, the chunks' partial sums added in fp64, in a fixed order --------------------------------

constexpr int kFinalizeWarps = 8;  // channels per finalize block, one warp each

struct ChannelSums {
  double a, b;
};

// Channel c's sums over all chunks: the warp's lanes stride over the chunks, then a butterfly; the order of the
// additions is fixed by (chunks, C) alone. Valid in every lane.
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

struct ChannelMoments {
  double mean, var;  // var biased
};

// Channel c's mean and biased variance from its sums of x - pivot over `count` values, the pivot being the
// channel's first element (x[c * pivot_stride]).
template <class TT>
__device__ __forceinline__ ChannelMoments channel_moments(const ChannelSums& s, double count, const typename TT::S* x,
                                                          int pivot_stride, int c) {
  const double shifted_mean = s.a / count;
  const double v = fmax(s.b / count - shifted_mean * shifted_mean, 0.0);
  return {static_cast<double>(TT::to_acc(x[static_cast<size_t>(c) * pivot_stride])) + shifted_mean, v};
}

// running = (1 - f) * running + f * batch for channel c, with the unbiased variance, in the operations and roundings
// of nn.BatchNorm2d's update written as torch ops (mul_, add_), so the two agree bit for bit.
__device__ __forceinline__ void update_channel(int c, float mean, float var, float unbias, float f, float keep,
                                               float* running_mean, float* running_var) {
  running_mean[c] = __fadd_rn(__fmul_rn(running_mean[c], keep), __fmul_rn(mean, f));
  running_var[c] = __fadd_rn(__fmul_rn(running_var[c], keep), __fmul_rn(__fmul_rn(var, unbias), f));
}

// RunningUpdate as the finalize kernel takes it: the factors rounded on the host as launch_update rounds them.
struct FinalizeUpdate {
  float* running_mean;  // nullptr: no update
  float* running_var;
  int64_t* num_batches_tracked;
  float momentum, keep, unbias;
};

// Batch statistics from the pivot-shifted sums, and the forward's scale (weight * invstd); with u.running_mean, the
// running statistics too (momentum >= 0, so no channel needs the batch count that channel 0 increments).
template <class TT>
__global__ void __launch_bounds__(kFinalizeWarps * 32)
    finalize_stats(const float* partial, int chunks, int C, double count, const typename TT::S* x, int pivot_stride,
                   const float* weight, float eps, float* mean, float* invstd, float* var, float* scale,
                   FinalizeUpdate u) {
  const int c = finalize_channel();
  if (c >= C) return;  // a whole warp: the shuffles in sum_chunks see full warps only
  const ChannelSums s = sum_chunks(partial, chunks, C, c);
  if (threadIdx.x % 32 != 0) return;
  const ChannelMoments m = channel_moments<TT>(s, count, x, pivot_stride, c);
  const double is = 1.0 / sqrt(m.var + static_cast<double>(eps));
  const float mf = static_cast<float>(m.mean), isf = static_cast<float>(is), vf = static_cast<float>(m.var);
  mean[c] = mf;
  invstd[c] = isf;
  var[c] = vf;
  scale[c] = bn_scale(weight[c], isf);
  if (u.running_mean != nullptr) {
    update_channel(c, mf, vf, u.unbias, u.momentum, u.keep, u.running_mean, u.running_var);
    if (c == 0) *u.num_batches_tracked += 1;
  }
}

// grad_bias = sum(g), grad_weight = sum(g * xhat), and the input gradient's coefficients:
// grad_x = w * invstd * (g - mean(g) - xhat * mean(g * xhat)) = c_g * g + c_x * (x - mean) + c_0; and the forward's
// scale again, for the input gradient's ReLU mask. consts (may be null): [6][C], the six constants of the input
// gradient in OutputGradNorm's order, for a depthwise walk that applies it (c_g, c_x, c_0 and scale then point into
// it; mean and bias are copied in).
__global__ void __launch_bounds__(kFinalizeWarps * 32)
    finalize_backward(const float* partial, int chunks, int C, double count, const float* weight, const float* invstd,
                      float* grad_weight, float* grad_bias, float* c_g, float* c_x, float* c_0, float* scale,
                      const float* mean, const float* bias, float* consts) {
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
  scale[c] = bn_scale(weight[c], invstd[c]);
  if (consts != nullptr) {
    consts[c] = mean[c];
    consts[5 * static_cast<size_t>(C) + c] = bias[c];
  }
}

// The running statistics from this batch's (update_channel). One block: every thread reads the old batch count
// before thread 0 increments it (the cumulative average's f = 1 / count needs the new one).
__global__ void __launch_bounds__(256)
    update_running_stats(int C, const float* mean, const float* var, float unbias, float momentum, float keep,
                         float* running_mean, float* running_var, int64_t* num_batches_tracked) {
  const int64_t batches = *num_batches_tracked + 1;
  __syncthreads();
  if (threadIdx.x == 0) *num_batches_tracked = batches;
  const bool cumulative = momentum < 0.f;
  const float f = cumulative ? __fdiv_rn(1.f, static_cast<float>(batches)) : momentum;
  if (cumulative) keep = __fsub_rn(1.f, f);
  for (int c = threadIdx.x; c < C; c += blockDim.x)
    update_channel(c, mean[c], var[c], unbias, f, keep, running_mean, running_var);
}

// --- host side ----------------------------------------------------------------------------------------------------

constexpr int kWorkspaceConstants = 4;  // per-channel constants of the passes, [C] each

struct Workspace {
  float* partial;  // [chunks][2][C]
  float* k[kWorkspaceConstants];
};

Workspace split_workspace(float* ws, const BnShape& s, const BnPlan& p) {
  Workspace w{};
  w.partial = ws;
  float* next = ws + static_cast<size_t>(p.reduce.chunks) * 2 * s.C;
  for (int j = 0; j < kWorkspaceConstants; ++j, next += s.C) w.k[j] = next;
  return w;
}

template <int V, class Op>
void launch_reduce(const BnShape& s, const BnPlan& p, const Op& op, float* partial, cudaStream_t stream) {
  const dim3 grid(p.groups, p.reduce.chunks);
  if (s.nhwc) {
    reduce_nhwc<V, Op><<<grid, dim3(p.lanes, p.rows), 0, stream>>>(op, s.N * s.HW, s.C, p.reduce.per_chunk, partial);
  } else {
    const int plane_vecs = s.HW / V;
    reduce_nchw<V, Op><<<grid, p.lanes, 0, stream>>>(op, s.C, plane_vecs, make_fast_div(plane_vecs),
                                                     s.N * plane_vecs, p.reduce.per_chunk, partial);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int V, class Op>
void launch_apply(const BnShape& s, const BnPlan& p, const Op& op, cudaStream_t stream) {
  const dim3 grid(p.groups, p.apply.chunks);
  if (s.nhwc) {
    apply_nhwc<V, Op><<<grid, dim3(p.lanes, p.rows), 0, stream>>>(op, s.N * s.HW, s.C, p.apply.per_chunk);
  } else {
    const int plane_vecs = s.HW / V;
    apply_nchw<V, Op><<<grid, p.lanes, 0, stream>>>(op, s.C, plane_vecs, make_fast_div(plane_vecs), s.N * plane_vecs,
                                                    p.apply.per_chunk);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

constexpr int kFinalizeBlock = kFinalizeWarps * 32;
int finalize_blocks(int C) { return ceil_div(C, kFinalizeWarps); }

// StatsOp's pivot_stride: elements between channel c's first element and channel c + 1's.
int pivot_stride_of(const BnShape& s) { return s.nhwc ? 1 : s.HW; }

// 1 - momentum in double, then rounded, as torch turns the Python scalar of mul_(1 - momentum) into a float.
float keep_of(double momentum) { return static_cast<float>(1.0 - momentum); }

// count / (count - 1), the factor that turns a biased variance over `count` values into the unbiased one.
float unbias_of(int64_t count) { return static_cast<float>(static_cast<double>(count) / static_cast<double>(count - 1)); }

FinalizeUpdate finalize_update(const RunningUpdate& r) {
  return {r.running_mean, r.running_var, r.num_batches_tracked, static_cast<float>(r.momentum), keep_of(r.momentum),
          r.running_mean != nullptr ? unbias_of(r.count) : 1.f};
}

// The running-statistics update; `unbias` turns the batch's variance into the unbiased one (1 when it already is).
void launch_update(int C, const float* mean, const float* var, float unbias, double momentum, float* running_mean,
                   float* running_var, int64_t* num_batches_tracked, cudaStream_t stream) {
  const float keep = keep_of(momentum);
  update_running_stats<<<1, 256, 0, stream>>>(C, mean, var, unbias, static_cast<float>(momentum), keep, running_mean,
                                               running_var, num_batches_tracked);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT, int V>
void forward_typed(const BnShape& s, const BnPlan& p, const void* x_, const float* weight, const float* bias,
                   float eps, void* y_, float* mean, float* invstd, float* var, float* workspace,
                   const RunningUpdate* update, cudaStream_t stream) {
  using S = typename TT::S;
  const S* x = static_cast<const S*>(x_);
  const Workspace ws = split_workspace(workspace, s, p);
  const int pivot_stride = pivot_stride_of(s);
  launch_reduce<V>(s, p, StatsOp<TT>{x, pivot_stride}, ws.partial, stream);
  finalize_stats<TT><<<finalize_blocks(s.C), kFinalizeBlock, 0, stream>>>(
      ws.partial, p.reduce.chunks, s.C, static_cast<double>(s.N) * s.HW, x, pivot_stride, weight, eps, mean, invstd,
      var, ws.k[0], finalize_update(*update));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (y_ != nullptr) launch_apply<V>(s, p, NormalizeOp<TT>{x, static_cast<S*>(y_), {mean, ws.k[0], bias}}, stream);
}

template <class TT, int V>
void backward_typed(const BnShape& s, const BnPlan& p, const void* grad_y_, const void* x_, const float* weight,
                    const float* bias, const float* mean, const float* invstd, void* grad_x, float* grad_weight,
                    float* grad_bias, float* workspace, const float* sums, int sums_chunks, float* consts,
                    cudaStream_t stream) {
  using S = typename TT::S;
  const S* grad_y = static_cast<const S*>(grad_y_);
  const S* x = static_cast<const S*>(x_);
  Workspace ws = split_workspace(workspace, s, p);
  if (consts != nullptr) {  // the constants go to the caller (OutputGradNorm's rows), not to the apply pass
    for (int j = 0; j < kWorkspaceConstants; ++j) ws.k[j] = consts + static_cast<size_t>(j + 1) * s.C;
  }
  // The gradient sums: the reduce pass, or given (sums_chunks partials in the reduce's layout).
  if (sums == nullptr) {
    launch_reduce<V>(s, p, GradSumsOp<TT>{grad_y, x, mean, weight, bias, invstd}, ws.partial, stream);
    sums = ws.partial;
    sums_chunks = p.reduce.chunks;
  }
  finalize_backward<<<finalize_blocks(s.C), kFinalizeBlock, 0, stream>>>(
      sums, sums_chunks, s.C, static_cast<double>(s.N) * s.HW, weight, invstd, grad_weight, grad_bias, ws.k[0],
      ws.k[1], ws.k[2], ws.k[3], mean, bias, consts);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (consts != nullptr) return;
  const InputGradOp<TT> op{grad_y, x, static_cast<S*>(grad_x), {mean, ws.k[0], ws.k[1], ws.k[2], ws.k[3], bias}};
  launch_apply<V>(s, p, op, stream);
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

namespace {

// Chunks of a pass: as many blocks as fill one wave (every SM holding `blocks_per_sm` of them), each with at least
// `min_per_chunk` rows or units; a second, partial wave would leave most SMs idle at the end of the pass.
Chunking make_chunking(long long work, int groups, int num_sms, int blocks_per_sm, int min_per_chunk) {
  int chunks = ceil_div(static_cast<long long>(num_sms) * blocks_per_sm, groups);
  const int max_chunks = ceil_div(work, min_per_chunk);
  if (chunks > max_chunks) chunks = max_chunks;
  if (chunks > 65535) chunks = 65535;
  if (chunks < 1) chunks = 1;
  Chunking c;
  c.per_chunk = ceil_div(work, chunks);
  c.chunks = ceil_div(work, c.per_chunk);
  return c;
}

}  // namespace

BnPlan make_plan(const BnShape& s, DType dt, uintptr_t address_bits, int num_sms, BnPass pass) {
  const int elem = dt == DType::F32 ? 4 : 2;
  const int extent = s.nhwc ? s.C : s.HW;  // the contiguous run that vectors must tile
  int vec = 16 / elem;
  while (vec > 1 && (extent % vec != 0 || address_bits % (static_cast<uintptr_t>(vec) * elem) != 0)) vec /= 2;
  BnPlan p{};
  p.vec = vec;
  long long work;  // rows (NHWC) or units (NCHW) per channel group
  int per_round;   // rows or units a block covers per loop round
  if (s.nhwc) {
    const int channel_vecs = s.C / vec;
    p.groups = ceil_div(channel_vecs, 32);
    p.lanes = ceil_div(channel_vecs, p.groups);  // balanced groups: no group of mostly idle lanes
    p.rows = kThreads / p.lanes;
    work = static_cast<long long>(s.N) * s.HW;
    per_round = p.rows;
  } else {
    p.groups = s.C;
    p.lanes = kThreads;
    p.rows = 1;
    work = static_cast<long long>(s.N) * (s.HW / vec);
    per_round = kThreads;
  }
  // The passes' occupancy and unrolling; the ops' constants do not depend on the element type.
  const bool fwd = pass == BnPass::kForward;
  const int reduce_blocks = fwd ? StatsOp<F16T>::kMinBlocks : GradSumsOp<F16T>::kMinBlocks;
  const int reduce_unroll = fwd ? StatsOp<F16T>::kUnroll : GradSumsOp<F16T>::kUnroll;
  const int apply_blocks = fwd ? NormalizeOp<F16T>::kMinBlocks : InputGradOp<F16T>::kMinBlocks;
  const int apply_unroll = fwd ? NormalizeOp<F16T>::kUnroll : InputGradOp<F16T>::kUnroll;
  p.reduce = make_chunking(work, p.groups, num_sms, reduce_blocks, per_round * reduce_unroll);
  p.apply = make_chunking(work, p.groups, num_sms, apply_blocks, per_round * apply_unroll);
  return p;
}

size_t workspace_floats(const BnShape& s, const BnPlan& p) {
  return (static_cast<size_t>(p.reduce.chunks) * 2 + kWorkspaceConstants) * s.C;
}

void launch_forward(const BnShape& s, const BnPlan& p, DType dt, const void* x, const float* weight, const float* bias,
                    float eps, void* y, float* mean, float* invstd, float* var, float* workspace,
                    const RunningUpdate& update, cudaStream_t stream) {
  dispatch<ForwardLaunch>(dt, p.vec, s, p, x, weight, bias, eps, y, mean, invstd, var, workspace, &update, stream);
}

void launch_backward(const BnShape& s, const BnPlan& p, DType dt, const void* grad_y, const void* x, const float* weight,
                     const float* bias, const float* mean, const float* invstd, void* grad_x, float* grad_weight,
                     float* grad_bias, float* workspace, cudaStream_t stream) {
  dispatch<BackwardLaunch>(dt, p.vec, s, p, grad_y, x, weight, bias, mean, invstd, grad_x, grad_weight, grad_bias,
                           workspace, static_cast<const float*>(nullptr), 0, static_cast<float*>(nullptr), stream);
}

void launch_backward_consts(const BnShape& s, const BnPlan& p, DType dt, const void* grad_y, const void* x,
                            const float* weight, const float* bias, const float* mean, const float* invstd,
                            float* consts, float* grad_weight, float* grad_bias, float* workspace,
                            cudaStream_t stream) {
  dispatch<BackwardLaunch>(dt, p.vec, s, p, grad_y, x, weight, bias, mean, invstd, static_cast<void*>(nullptr),
                           grad_weight, grad_bias, workspace, static_cast<const float*>(nullptr), 0, consts, stream);
}

void launch_backward_consts_from_sums(const BnShape& s, const BnPlan& p, DType dt, const void* x,
                                      const float* weight, const float* bias, const float* mean, const float* invstd,
                                      const float* sums, int chunks, float* consts, float* grad_weight,
                                      float* grad_bias, float* workspace, cudaStream_t stream) {
  // With both the sums and consts given, backward_typed runs only its finalize (grad_y is not read).
  dispatch<BackwardLaunch>(dt, p.vec, s, p, x, x, weight, bias, mean, invstd, static_cast<void*>(nullptr),
                           grad_weight, grad_bias, workspace, sums, chunks, consts, stream);
}

void launch_backward_from_sums(const BnShape& s, const BnPlan& p, DType dt, const void* grad_y, const void* x,
                               const float* weight, const float* bias, const float* mean, const float* invstd,
                               const float* sums, int chunks, void* grad_x, float* grad_weight, float* grad_bias,
                               float* workspace, cudaStream_t stream) {
  dispatch<BackwardLaunch>(dt, p.vec, s, p, grad_y, x, weight, bias, mean, invstd, grad_x, grad_weight, grad_bias,
                           workspace, sums, chunks, static_cast<float*>(nullptr), stream);
}

void launch_update_running_stats(int C, const float* mean, const float* var, int64_t count, double momentum,
                                 float* running_mean, float* running_var, int64_t* num_batches_tracked,
                                 cudaStream_t stream) {
  launch_update(C, mean, var, unbias_of(count), momentum, running_mean, running_var, num_batches_tracked, stream);
}

// --- the forward from statistics partials of x (the depthwise forward's, depthwise_fwd_stats) ---------------------
//
// finalize_stats' outputs from per-block (count, mean, M2) instead of this op's own statistics pass, then the same
// apply pass: x is read once instead of twice.

namespace {

struct Moments {
  double n, mean, m2;
};

// Chan et al.'s pairwise combination of two sets' (count, mean, M2): no difference of large sums, so a large mean
// does not cancel the variance away. An empty b leaves a unchanged (bit for bit); an empty a gives b.
__device__ __forceinline__ Moments merge_moments(const Moments& a, const Moments& b) {
  if (b.n == 0.0) return a;
  const double n = a.n + b.n, delta = b.mean - a.mean;
  return {n, a.mean + delta * (b.n / n), a.m2 + b.m2 + delta * delta * (a.n * (b.n / n))};
}

// Channel c's moments over all bands of partial [bands][3][C]: lane l adds bands l, l + 32, ... in order as sums
// shifted to the mean of its first band (Chan's combination, sum of M2 plus count * (mean - ref)^2, with no division
// per band; the bands' means lie within the channel's spread of each other, so nothing cancels in fp64), then a tree
// of Chan merges over the lanes (lane i takes lane i + m for m = 16, ..., 1). The order depends on (bands, C) alone.
// Valid in lane 0.
__device__ __forceinline__ Moments merge_bands(const double* partial, int bands, int C, int c) {
  const int lane = threadIdx.x % 32;
  const double* first = partial + static_cast<size_t>(lane) * 3 * C + c;
  const double ref = lane < bands && first[0] > 0.0 ? first[C] : 0.0;
  double n = 0.0, a = 0.0, q = 0.0;
  for (int i = lane; i < bands; i += 32) {
    const double* p = partial + static_cast<size_t>(i) * 3 * C + c;
    const double nb = p[0];
    if (nb == 0.0) continue;
    const double d = p[C] - ref;
    n += nb;
    a = fma(nb, d, a);
    q += fma(nb * d, d, p[2 * C]);
  }
  Moments acc{0.0, 0.0, 0.0};
  if (n > 0.0) {
    const double shifted_mean = a / n;
    acc = Moments{n, ref + shifted_mean, fmax(q - a * shifted_mean, 0.0)};
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    const Moments other{__shfl_down_sync(0xffffffffu, acc.n, m), __shfl_down_sync(0xffffffffu, acc.mean, m),
                        __shfl_down_sync(0xffffffffu, acc.m2, m)};
    if (lane + m < 32) acc = merge_moments(acc, other);
  }
  return acc;
}

// finalize_stats' outputs (mean, invstd, biased var, and the forward's scale) from the merged moments.
__global__ void __launch_bounds__(kFinalizeWarps * 32)
    finalize_partials(const double* partial, int bands, int C, const float* weight, float eps, float* mean,
                      float* invstd, float* var, float* scale) {
  const int c = finalize_channel();
  if (c >= C) return;  // a whole warp, as in finalize_stats
  const Moments m = merge_bands(partial, bands, C, c);
  if (threadIdx.x % 32 != 0) return;
  const double v = m.n > 0.0 ? m.m2 / m.n : 0.0;
  const double is = 1.0 / sqrt(v + static_cast<double>(eps));
  const float isf = static_cast<float>(is);
  mean[c] = static_cast<float>(m.mean);
  invstd[c] = isf;
  var[c] = static_cast<float>(v);
  scale[c] = bn_scale(weight[c], isf);
}

template <class TT, int V>
void forward_from_partials_typed(const BnShape& s, const BnPlan& p, const void* x_, const double* partial, int bands,
                                 const float* weight, const float* bias, float eps, void* y_, float* mean,
                                 float* invstd, float* var, float* workspace, cudaStream_t stream) {
  using S = typename TT::S;
  finalize_partials<<<finalize_blocks(s.C), kFinalizeBlock, 0, stream>>>(partial, bands, s.C, weight, eps, mean,
                                                                           invstd, var, workspace);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_apply<V>(s, p, NormalizeOp<TT>{static_cast<const S*>(x_), static_cast<S*>(y_), {mean, workspace, bias}},
                  stream);
}

template <class TT, int V>
struct FromPartialsLaunch {
  template <class... A>
  static void run(A... a) { forward_from_partials_typed<TT, V>(a...); }
};

}  // namespace

void launch_forward_from_partials(const BnShape& s, const BnPlan& p, DType dt, const void* x, const double* partial,
                                  int bands, const float* weight, const float* bias, float eps, void* y, float* mean,
                                  float* invstd, float* var, float* workspace, cudaStream_t stream) {
  dispatch<FromPartialsLaunch>(dt, p.vec, s, p, x, partial, bands, weight, bias, eps, y, mean, invstd, var, workspace,
                               stream);
}

// --- sync_bn: the same passes, split where the statistics or the gradient sums are combined across ranks ----------
//
// The reduce and apply passes and the backward's finalize are the ones above (the same instantiations); only the
// small per-channel kernels below are new. The combine itself runs between these calls, in Python.

namespace {

// finalize_backward's six outputs, [C] each: grad_weight and grad_bias (unused here), c_g, c_x, c_0, scale.
constexpr int kSyncInputGradConstants = 6;

// This batch's mean and biased variance per channel, kept in fp64 for the combine across ranks (channel_moments,
// as finalize_stats: sums of x - pivot, so a large mean does not cancel the variance away).
template <class TT>
__global__ void __launch_bounds__(kFinalizeWarps * 32)
    finalize_local_stats(const float* partial, int chunks, int C, double count, const typename TT::S* x,
                         int pivot_stride, double* mean, double* var) {
  const int c = finalize_channel();
  if (c >= C) return;
  const ChannelSums s = sum_chunks(partial, chunks, C, c);
  if (threadIdx.x % 32 != 0) return;
  const ChannelMoments m = channel_moments<TT>(s, count, x, pivot_stride, c);
  mean[c] = m.mean;
  var[c] = m.var;
}

// The chunks' sums per channel in fp64, as [2][C].
__global__ void __launch_bounds__(kFinalizeWarps * 32)
    finalize_sums(const float* partial, int chunks, int C, double* sums) {
  const int c = finalize_channel();
  if (c >= C) return;
  const ChannelSums s = sum_chunks(partial, chunks, C, c);
  if (threadIdx.x % 32 != 0) return;
  sums[c] = s.a;
  sums[C + c] = s.b;
}

// The forward's scale, as finalize_stats derives it, so that y is the fused forward's arithmetic.
__global__ void __launch_bounds__(256) channel_scale(int C, const float* weight, const float* invstd, float* scale) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c < C) scale[c] = bn_scale(weight[c], invstd[c]);
}

template <class TT, int V>
void local_stats_typed(const BnShape& s, const BnPlan& p, const void* x_, double* mean, double* var, float* workspace,
                       cudaStream_t stream) {
  const auto* x = static_cast<const typename TT::S*>(x_);
  launch_reduce<V>(s, p, StatsOp<TT>{x, pivot_stride_of(s)}, workspace, stream);
  finalize_local_stats<TT><<<finalize_blocks(s.C), kFinalizeBlock, 0, stream>>>(
      workspace, p.reduce.chunks, s.C, static_cast<double>(s.N) * s.HW, x, pivot_stride_of(s), mean, var);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT, int V>
void normalize_typed(const BnShape& s, const BnPlan& p, const void* x, const float* weight, const float* bias,
                     const float* mean, const float* invstd, void* y, float* workspace, cudaStream_t stream) {
  using S = typename TT::S;
  channel_scale<<<ceil_div(s.C, 256), 256, 0, stream>>>(s.C, weight, invstd, workspace);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_apply<V>(s, p, NormalizeOp<TT>{static_cast<const S*>(x), static_cast<S*>(y), {mean, workspace, bias}},
                  stream);
}

template <class TT, int V>
void grad_sums_typed(const BnShape& s, const BnPlan& p, const void* grad_y, const void* x, const float* weight,
                     const float* bias, const float* mean, const float* invstd, double* sums, float* workspace,
                     cudaStream_t stream) {
  using S = typename TT::S;
  const GradSumsOp<TT> op{static_cast<const S*>(grad_y), static_cast<const S*>(x), mean, weight, bias, invstd};
  launch_reduce<V>(s, p, op, workspace, stream);
  finalize_sums<<<finalize_blocks(s.C), kFinalizeBlock, 0, stream>>>(workspace, p.reduce.chunks, s.C, sums);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// finalize_backward over a single "chunk" that holds the means of g and g * (x - mean) over the whole batch, with a
// count of 1: its c_g, c_x and c_0 are then the global batch's coefficients. Its grad_weight and grad_bias (of those
// means) go to the workspace unused: each rank's own are its local sums (SyncBatchNorm's convention under DDP).
template <class TT, int V>
void input_grad_typed(const BnShape& s, const BnPlan& p, const void* grad_y, const void* x, const float* weight,
                      const float* bias, const float* mean, const float* invstd, const float* grad_means,
                      void* grad_x, float* workspace, cudaStream_t stream) {
  using S = typename TT::S;
  float* k[kSyncInputGradConstants];
  for (int j = 0; j < kSyncInputGradConstants; ++j) k[j] = workspace + static_cast<size_t>(j) * s.C;
  finalize_backward<<<finalize_blocks(s.C), kFinalizeBlock, 0, stream>>>(grad_means, 1, s.C, 1.0, weight, invstd,
                                                                           k[0], k[1], k[2], k[3], k[4], k[5],
                                                                           nullptr, nullptr, nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const InputGradOp<TT> op{static_cast<const S*>(grad_y), static_cast<const S*>(x), static_cast<S*>(grad_x),
                           {mean, k[2], k[3], k[4], k[5], bias}};
  launch_apply<V>(s, p, op, stream);
}

// A typed launcher as a class template, for dispatch().
#define MBN_SYNC_LAUNCH(Name, fn)                      \
  template <class TT, int V>                           \
  struct Name {                                        \
    template <class... A>                              \
    static void run(A... a) { fn<TT, V>(a...); }       \
  };
MBN_SYNC_LAUNCH(LocalStatsLaunch, local_stats_typed)
MBN_SYNC_LAUNCH(NormalizeLaunch, normalize_typed)
MBN_SYNC_LAUNCH(GradSumsLaunch, grad_sums_typed)
MBN_SYNC_LAUNCH(InputGradLaunch, input_grad_typed)
#undef MBN_SYNC_LAUNCH

}  // namespace

size_t sync_workspace_floats(const BnShape& s, const BnPlan& p) {
  const size_t reduce = static_cast<size_t>(p.reduce.chunks) * 2 * s.C;
  const size_t constants = static_cast<size_t>(kSyncInputGradConstants) * s.C;
  return reduce > constants ? reduce : constants;
}

void launch_local_stats(const BnShape& s, const BnPlan& p, DType dt, const void* x, double* mean, double* var,
                        float* workspace, cudaStream_t stream) {
  dispatch<LocalStatsLaunch>(dt, p.vec, s, p, x, mean, var, workspace, stream);
}

void launch_normalize(const BnShape& s, const BnPlan& p, DType dt, const void* x, const float* weight,
                      const float* bias, const float* mean, const float* invstd, void* y, float* workspace,
                      cudaStream_t stream) {
  dispatch<NormalizeLaunch>(dt, p.vec, s, p, x, weight, bias, mean, invstd, y, workspace, stream);
}

void launch_grad_sums(const BnShape& s, const BnPlan& p, DType dt, const void* grad_y, const void* x,
                      const float* weight, const float* bias, const float* mean, const float* invstd, double* sums,
                      float* workspace, cudaStream_t stream) {
  dispatch<GradSumsLaunch>(dt, p.vec, s, p, grad_y, x, weight, bias, mean, invstd, sums, workspace, stream);
}

void launch_input_grad(const BnShape& s, const BnPlan& p, DType dt, const void* grad_y, const void* x,
                       const float* weight, const float* bias, const float* mean, const float* invstd,
                       const float* grad_means, void* grad_x, float* workspace, cudaStream_t stream) {
  dispatch<InputGradLaunch>(dt, p.vec, s, p, grad_y, x, weight, bias, mean, invstd, grad_means, grad_x, workspace,
                            stream);
}

void launch_update_running_stats_unbiased(int C, const float* mean, const float* unbiased_var, double momentum,
                                          float* running_mean, float* running_var, int64_t* num_batches_tracked,
                                          cudaStream_t stream) {
  // The variance arrives unbiased (the global count lives on the device), so the factor is 1.
  launch_update(C, mean, unbiased_var, 1.f, momentum, running_mean, running_var, num_batches_tracked, stream);
}

// --- norm.apply_in_pointwise: the per-channel kernels around cuDNN's fused convolutions -----------------------------

namespace {

// scale = weight * invstd (the forward's, bn_scale) and shift = bias - mean * scale, rounded to T: the per-channel
// operands of a cuDNN convolution that applies relu(x * scale + shift) to its input as it loads it. The shift is
// taken against the rounded scale, so that x * scale + shift = (x - mean) * scale + bias up to the shift's own
// rounding, |bias - mean * scale| * 2^-11 in fp16 (2^-8 in bf16): small where |mean| is within a few deviations.
template <class TT>
__global__ void __launch_bounds__(256) scale_shift(int C, const float* mean, const float* invstd, const float* weight,
                                                   const float* bias, typename TT::S* out) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const typename TT::S scale = TT::from_acc(bn_scale(weight[c], invstd[c]));
  out[c] = scale;
  out[C + c] = TT::from_acc(__fsub_rn(bias[c], __fmul_rn(mean[c], TT::to_acc(scale))));
}

// The batch statistics from the sum and the sum of squares of `count` values per channel (sums [2][C], fp32, as
// cuDNN's genstats writes them), in fp64 from there, and the running statistics updated from them as
// finalize_stats updates them (momentum >= 0; u.running_mean == nullptr: no update).
__global__ void __launch_bounds__(256)
    stats_from_sums(int C, const float* sums, double count, float eps, float* mean, float* invstd, float* var,
                    FinalizeUpdate u) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const double m = static_cast<double>(sums[c]) / count;
  const double v = fmax(static_cast<double>(sums[C + c]) / count - m * m, 0.0);
  const float mf = static_cast<float>(m), vf = static_cast<float>(v);
  mean[c] = mf;
  invstd[c] = static_cast<float>(1.0 / sqrt(v + static_cast<double>(eps)));
  var[c] = vf;
  if (u.running_mean != nullptr) {
    update_channel(c, mf, vf, u.unbias, u.momentum, u.keep, u.running_mean, u.running_var);
    if (c == 0) *u.num_batches_tracked += 1;
  }
}

}  // namespace

void launch_scale_shift(int C, DType dt, const float* mean, const float* invstd, const float* weight,
                        const float* bias, void* out, cudaStream_t stream) {
  const int blocks = ceil_div(C, 256);
  if (dt == DType::F16)
    scale_shift<F16T><<<blocks, 256, 0, stream>>>(C, mean, invstd, weight, bias, static_cast<F16T::S*>(out));
  else if (dt == DType::BF16)
    scale_shift<BF16T><<<blocks, 256, 0, stream>>>(C, mean, invstd, weight, bias, static_cast<BF16T::S*>(out));
  else
    scale_shift<F32T><<<blocks, 256, 0, stream>>>(C, mean, invstd, weight, bias, static_cast<F32T::S*>(out));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_stats_from_sums(int C, const float* sums, int64_t count, float eps, float* mean, float* invstd,
                            float* var, const RunningUpdate& update, cudaStream_t stream) {
  stats_from_sums<<<ceil_div(C, 256), 256, 0, stream>>>(C, sums, static_cast<double>(count), eps, mean, invstd, var,
                                                         finalize_update(update));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace mbn
