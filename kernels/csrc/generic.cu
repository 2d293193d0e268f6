// Generic kernels: every supported case (kernel 1..7 odd, non-square, stride 1/2, dilation 1/2, any
// padding, fp64, C not a multiple of the vector width), one output element per thread, indexed in
// memory order so loads and stores stay coalesced in either layout. Also the wgrad finalize stage.
#include "device_common.h"

#include <atomic>
#include <cstdlib>
#include <string>

namespace mdw {

int num_sms() {
  static std::atomic<int> cached[64] = {};
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 64 && cached[dev].load() > 0) return cached[dev].load();
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  if (dev < 64) cached[dev].store(n);
  return n;
}

static int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

int knob(Knob k, DType dt) {
  constexpr int kKnobs = static_cast<int>(Knob::kCount);
  static const char* names[kKnobs] = {"GROUP_FASTEST", "IMAGES", "WGRAD_BLOCKS_PER_SM", "NCHW_ROWS", "WGRAD_COLUMN",
                                      "FWD_COLUMN",    "FWD_COLUMN_ROWS", "COLUMN_REVERSE", "FWD_COLUMN_DEEP"};
  static const char* suffix[] = {"F32", "F16", "BF16", "F64"};
  static int cache[kKnobs][4];
  static bool ready[kKnobs][4];
  const int ki = static_cast<int>(k), di = static_cast<int>(dt);
  if (!ready[ki][di]) {
    // Defaults picked by the H200 sweeps of docs/kernel_notes.md, per dtype {F32, F16, BF16, F64}.
    static const int defaults[kKnobs][4] = {
        {1, 1, 1, 1},     // GROUP_FASTEST
        {0, -6, -6, 0},   // IMAGES (0: auto, 16 blocks/SM; -6: auto, 6 blocks/SM)
        {8, 4, 4, 8},     // WGRAD_BLOCKS_PER_SM (NHWC)
        {2, 2, 2, 2},     // NCHW_ROWS (NCHW 3x3 stride 1 forward)
        {1, 1, 1, 0},     // WGRAD_COLUMN (NHWC 3x3 weight gradient: column-walking kernel)
        {2, 2, 2, 0},     // FWD_COLUMN (NHWC 3x3 column-walking forward; 2: also the stride-1 input gradient)
        {2, 0, 0, 1},     // FWD_COLUMN_ROWS (column-walking forward: output rows per lane; 0: auto, see column.cu)
        {1, 1, 1, 1},     // COLUMN_REVERSE (column walks: images last to first, see column.cu)
        {0, 0, 0, 0},     // FWD_COLUMN_DEEP (16-bit stride-1 column forward: more steps in flight, see column.cu)
    };
    const std::string base = std::string("MDW_") + names[ki];
    int v = env_int(base.c_str(), defaults[ki][di]);
    v = env_int((base + "_" + suffix[di]).c_str(), v);
    cache[ki][di] = v;
    ready[ki][di] = true;
  }
  return cache[ki][di];
}

int images_per_block(DType dt, int blocks_per_image, int N) {
  // > 0: that many; 0: auto with ~16 blocks per SM; < 0: auto with -value blocks per SM.
  const int setting = knob(Knob::kImages, dt);
  int images = setting;
  if (images <= 0) {
    const long long target = static_cast<long long>(num_sms()) * (setting < 0 ? -setting : 16);
    images = static_cast<int>((static_cast<long long>(blocks_per_image) * N + target - 1) / target);
  }
  return images < 1 ? 1 : (images > N ? N : images);
}

namespace {

constexpr int kMaxK = 7;

struct Index4 {
  int n, c, h, w;
};

// Decode a linear index of an (N, C, H, W) tensor stored in the given layout.
__device__ __forceinline__ Index4 decode(long long idx, int C, int H, int W, bool channels_last) {
  Index4 r;
  if (channels_last) {
    r.c = static_cast<int>(idx % C); idx /= C;
    r.w = static_cast<int>(idx % W); idx /= W;
    r.h = static_cast<int>(idx % H); r.n = static_cast<int>(idx / H);
  } else {
    r.w = static_cast<int>(idx % W); idx /= W;
    r.h = static_cast<int>(idx % H); idx /= H;
    r.c = static_cast<int>(idx % C); r.n = static_cast<int>(idx / C);
  }
  return r;
}

__device__ __forceinline__ size_t offset(int n, int c, int h, int w, int C, int H, int W, bool channels_last) {
  return channels_last ? ((static_cast<size_t>(n) * H + h) * W + w) * C + c
                       : ((static_cast<size_t>(n) * C + c) * H + h) * W + w;
}

template <class TT>
__global__ void fwd_generic_kernel(const typename TT::S* __restrict__ x, const typename TT::S* __restrict__ w,
                                   const typename TT::S* __restrict__ bias, typename TT::S* __restrict__ y,
                                   ConvShape s, long long total) {
  using Acc = typename TT::Acc;
  for (long long idx = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<long long>(gridDim.x) * blockDim.x) {
    const Index4 o = decode(idx, s.C, s.OH, s.OW, s.channels_last);
    Acc acc = bias ? TT::to_acc(bias[o.c]) : Acc(0);
    for (int kh = 0; kh < s.KH; ++kh) {
      const int ih = o.h * s.SH - s.PH + kh * s.DH;
      if (ih < 0 || ih >= s.H) continue;
      for (int kw = 0; kw < s.KW; ++kw) {
        const int iw = o.w * s.SW - s.PW + kw * s.DW;
        if (iw < 0 || iw >= s.W) continue;
        acc += TT::to_acc(x[offset(o.n, o.c, ih, iw, s.C, s.H, s.W, s.channels_last)]) *
               TT::to_acc(w[(o.c * s.KH + kh) * s.KW + kw]);
      }
    }
    y[idx] = TT::from_acc(activate(acc, s.act));
  }
}

template <class TT>
__global__ void dgrad_generic_kernel(const typename TT::S* __restrict__ go, const typename TT::S* __restrict__ w,
                                     typename TT::S* __restrict__ gx, ConvShape s, long long total) {
  using Acc = typename TT::Acc;
  for (long long idx = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<long long>(gridDim.x) * blockDim.x) {
    const Index4 i = decode(idx, s.C, s.H, s.W, s.channels_last);
    Acc acc = Acc(0);
    for (int kh = 0; kh < s.KH; ++kh) {
      const int th = i.h + s.PH - kh * s.DH;
      if (th < 0 || th % s.SH != 0 || th / s.SH >= s.OH) continue;
      for (int kw = 0; kw < s.KW; ++kw) {
        const int tw = i.w + s.PW - kw * s.DW;
        if (tw < 0 || tw % s.SW != 0 || tw / s.SW >= s.OW) continue;
        acc += TT::to_acc(go[offset(i.n, i.c, th / s.SH, tw / s.SW, s.C, s.OH, s.OW, s.channels_last)]) *
               TT::to_acc(w[(i.c * s.KH + kh) * s.KW + kw]);
      }
    }
    gx[idx] = TT::from_acc(acc);
  }
}

// Lanes of a generic wgrad block: channels x elements of (n, oh, ow). NHWC puts 32 channels side by
// side (coalesced); NCHW gives the whole block to one channel and runs along its plane.
inline int generic_channel_lanes(const ConvShape& s) { return s.channels_last ? 32 : 1; }

template <class TT>
__global__ void __launch_bounds__(256)
    wgrad_generic_kernel(const typename TT::S* __restrict__ go, const typename TT::S* __restrict__ x,
                         typename TT::Acc* __restrict__ ws, ConvShape s, int channel_lanes) {
  using Acc = typename TT::Acc;
  __shared__ Acc buf[256];
  const int elem_lanes = blockDim.x / channel_lanes;
  const int tx = threadIdx.x % channel_lanes, ty = threadIdx.x / channel_lanes;
  const int c = blockIdx.y * channel_lanes + tx;
  const long long total = static_cast<long long>(s.N) * s.OH * s.OW;
  Acc acc[kMaxK][kMaxK];
  Acc acc_b = Acc(0);
#pragma unroll
  for (int kh = 0; kh < kMaxK; ++kh)
#pragma unroll
    for (int kw = 0; kw < kMaxK; ++kw) acc[kh][kw] = Acc(0);
  if (c < s.C) {
    for (long long m = static_cast<long long>(blockIdx.x) * elem_lanes + ty; m < total;
         m += static_cast<long long>(gridDim.x) * elem_lanes) {
      const int ow = static_cast<int>(m % s.OW);
      const int oh = static_cast<int>((m / s.OW) % s.OH);
      const int n = static_cast<int>(m / (static_cast<long long>(s.OW) * s.OH));
      const Acc g = TT::to_acc(go[offset(n, c, oh, ow, s.C, s.OH, s.OW, s.channels_last)]);
      acc_b += g;
#pragma unroll
      for (int kh = 0; kh < kMaxK; ++kh) {
        const int ih = oh * s.SH - s.PH + kh * s.DH;
        if (kh >= s.KH || ih < 0 || ih >= s.H) continue;
#pragma unroll
        for (int kw = 0; kw < kMaxK; ++kw) {
          const int iw = ow * s.SW - s.PW + kw * s.DW;
          if (kw >= s.KW || iw < 0 || iw >= s.W) continue;
          acc[kh][kw] += g * TT::to_acc(x[offset(n, c, ih, iw, s.C, s.H, s.W, s.channels_last)]);
        }
      }
    }
  }
  // Fixed-order reduction over the element lanes, one tap at a time.
  const int KK = s.KH * s.KW;
  auto reduce_slot = [&](Acc v, int slot) {
    buf[threadIdx.x] = v;
    __syncthreads();
    if (ty == 0 && c < s.C) {
      Acc sum = Acc(0);
      for (int e = 0; e < elem_lanes; ++e) sum += buf[e * channel_lanes + tx];
      ws[(static_cast<size_t>(blockIdx.x) * s.C + c) * (KK + 1) + slot] = sum;
    }
    __syncthreads();
  };
#pragma unroll
  for (int kh = 0; kh < kMaxK; ++kh)
#pragma unroll
    for (int kw = 0; kw < kMaxK; ++kw)
      if (kh < s.KH && kw < s.KW) reduce_slot(acc[kh][kw], kh * s.KW + kw);
  reduce_slot(acc_b, KK);
}

template <class TT>
__global__ void wgrad_finalize_kernel(const typename TT::Acc* __restrict__ ws, int chunks, int C, int KK,
                                      typename TT::S* __restrict__ gw, typename TT::S* __restrict__ gb) {
  using Acc = typename TT::Acc;
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  const int slots = KK + 1;
  if (idx >= C * slots) return;
  Acc sum = Acc(0);
  for (int g = 0; g < chunks; ++g) sum += ws[static_cast<size_t>(g) * C * slots + idx];
  const int c = idx / slots, k = idx - c * slots;
  if (k < KK) {
    if (gw) gw[c * KK + k] = TT::from_acc(sum);
  } else if (gb) {
    gb[c] = TT::from_acc(sum);
  }
}

inline int grid_for(long long total, int block) {
  const long long want = (total + block - 1) / block;
  const long long cap = static_cast<long long>(num_sms()) * 32;
  return static_cast<int>(want < cap ? (want > 0 ? want : 1) : cap);
}

template <class TT>
void fwd_generic_t(const ConvShape& s, const void* x, const void* w, const void* b, void* y, cudaStream_t st) {
  using Sx = typename TT::S;
  const long long total = static_cast<long long>(s.N) * s.C * s.OH * s.OW;
  fwd_generic_kernel<TT><<<grid_for(total, 256), 256, 0, st>>>(
      static_cast<const Sx*>(x), static_cast<const Sx*>(w), static_cast<const Sx*>(b), static_cast<Sx*>(y), s, total);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT>
void dgrad_generic_t(const ConvShape& s, const void* go, const void* w, void* gx, cudaStream_t st) {
  using Sx = typename TT::S;
  const long long total = static_cast<long long>(s.N) * s.C * s.H * s.W;
  dgrad_generic_kernel<TT><<<grid_for(total, 256), 256, 0, st>>>(
      static_cast<const Sx*>(go), static_cast<const Sx*>(w), static_cast<Sx*>(gx), s, total);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT>
void wgrad_generic_t(const ConvShape& s, const void* go, const void* x, void* ws, int chunks, cudaStream_t st) {
  using Sx = typename TT::S;
  const int lanes = generic_channel_lanes(s);
  const dim3 grid(chunks, ceil_div(s.C, lanes));
  wgrad_generic_kernel<TT><<<grid, 256, 0, st>>>(static_cast<const Sx*>(go), static_cast<const Sx*>(x),
                                                 static_cast<typename TT::Acc*>(ws), s, lanes);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT>
void finalize_t(const ConvShape& s, const void* ws, int chunks, void* gw, void* gb, cudaStream_t st) {
  using Sx = typename TT::S;
  const int KK = s.KH * s.KW;
  const int total = s.C * (KK + 1);
  wgrad_finalize_kernel<TT><<<ceil_div(total, 256), 256, 0, st>>>(
      static_cast<const typename TT::Acc*>(ws), chunks, s.C, KK, static_cast<Sx*>(gw), static_cast<Sx*>(gb));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

#define MDW_DISPATCH(dt, FN, ...)                               \
  switch (dt) {                                                 \
    case DType::F32: return FN<F32T>(__VA_ARGS__);              \
    case DType::F16: return FN<F16T>(__VA_ARGS__);              \
    case DType::BF16: return FN<BF16T>(__VA_ARGS__);            \
    case DType::F64: return FN<F64T>(__VA_ARGS__);              \
  }

void forward_generic(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                     cudaStream_t stream) {
  MDW_DISPATCH(dt, fwd_generic_t, s, x, w, bias, y, stream)
}

void dgrad_generic(const ConvShape& s, DType dt, const void* go, const void* w, void* gx, cudaStream_t stream) {
  MDW_DISPATCH(dt, dgrad_generic_t, s, go, w, gx, stream)
}

int wgrad_generic_chunks(const ConvShape& s) {
  const int lanes = generic_channel_lanes(s);
  const int elem_lanes = 256 / lanes;
  const long long total = static_cast<long long>(s.N) * s.OH * s.OW;
  const int max_chunks = ceil_div(total, elem_lanes);
  int chunks = ceil_div(num_sms() * 8, ceil_div(s.C, lanes));
  if (chunks > max_chunks) chunks = max_chunks;
  return chunks < 1 ? 1 : chunks;
}

void wgrad_generic_partials(const ConvShape& s, DType dt, const void* go, const void* x, void* ws, int chunks,
                            cudaStream_t stream) {
  MDW_DISPATCH(dt, wgrad_generic_t, s, go, x, ws, chunks, stream)
}

void wgrad_finalize(const ConvShape& s, DType dt, const void* ws, int chunks, void* gw, void* gb,
                    cudaStream_t stream) {
  MDW_DISPATCH(dt, finalize_t, s, ws, chunks, gw, gb, stream)
}

}  // namespace mdw
