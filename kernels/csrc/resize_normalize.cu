// Kernel of mobilenet_data::resize_normalize (resize_normalize.h says what it computes and why in one pass).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "resize_normalize.h"

namespace mdata {
namespace {

constexpr int kBlockX = 32;  // output columns per block: one warp along a row
constexpr int kBlockY = 8;   // output rows per block

// The input window [lo, hi) of output index i along an axis of `in` inputs resized to `out`, and its taps' weights
// (PyTorch's antialiased bilinear: the triangle widened by the scale when shrinking). The window and the distance
// of its first input from the centre are set up in double, as PyTorch computes them; the taps then need only small
// float offsets (a float centre alone would be off by up to 3e-5 pixels at 500 px).
struct Window {
  int lo, hi;
  float first;  // (lo + 0.5 - centre) / support: the first tap's signed distance, in filter widths
  float inv;    // 1 / support
};

__device__ __forceinline__ Window window(int i, int in, int out) {
  const double scale = static_cast<double>(in) / out;
  const double support = scale >= 1.0 ? scale : 1.0;
  const double center = scale * (i + 0.5);
  Window w;
  // Truncation toward zero as in PyTorch; the lower bound is clipped at 0 anyway.
  w.lo = max(static_cast<int>(center - support + 0.5), 0);
  w.hi = min(static_cast<int>(center + support + 0.5), in);
  w.first = static_cast<float>((w.lo + 0.5 - center) / support);
  w.inv = static_cast<float>(1.0 / support);
  return w;
}

__device__ __forceinline__ float tap(const Window& w, int k) {  // the k-th input of the window
  return fmaxf(0.f, 1.f - fabsf(fmaf(static_cast<float>(k), w.inv, w.first)));
}

__device__ __forceinline__ float window_total(const Window& w) {
  float t = 0.f;
  for (int k = 0; k < w.hi - w.lo; ++k) t += tap(w, k);
  return t;
}

// A byte as a float without the I2F conversion (a quarter-rate instruction): 2^23 + b is exact in fp32.
__device__ __forceinline__ float byte_to_float(uint8_t b) {
  return __uint_as_float(0x4B000000u | b) - 8388608.f;
}

constexpr int kMaxRegisterTaps = 8;  // horizontal windows up to this many inputs keep their weights in registers

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
__global__ void __launch_bounds__(kBlockX * kBlockY)
resize_normalize_kernel(ResizeNormalizeArgs a) {
  const int ox = blockIdx.x * kBlockX + threadIdx.x;
  const int oy = blockIdx.y * kBlockY + threadIdx.y;
  const int n = blockIdx.z;
  if (ox >= a.out_w || oy >= a.out_h) return;
  const int64_t* d = a.desc + static_cast<int64_t>(n) * kDescWords;
  const uint8_t* src = reinterpret_cast<const uint8_t*>(d[0]);
  const int h = static_cast<int>(d[1]);
  const int w = static_cast<int>(d[2]);
  // A mirrored crop's output column ox is the resized crop's column out_w - 1 - ox.
  const int sx = d[3] ? a.out_w - 1 - ox : ox;
  const Window wx = window(sx, w, a.out_w);
  const Window wy = window(oy, h, a.out_h);
  const size_t row_stride = static_cast<size_t>(w) * 3;

  const int nx = wx.hi - wx.lo;
  float acc0 = 0.f, acc1 = 0.f, acc2 = 0.f;
  if (nx <= kMaxRegisterTaps) {  // shrinking by up to ~3.5x: the usual crop
    float fx[kMaxRegisterTaps];
#pragma unroll
    for (int k = 0; k < kMaxRegisterTaps; ++k) fx[k] = k < nx ? tap(wx, k) : 0.f;
    for (int j = wy.lo; j < wy.hi; ++j) {
      const uint8_t* p = src + static_cast<size_t>(j) * row_stride + 3 * wx.lo;
      float r0 = 0.f, r1 = 0.f, r2 = 0.f;
#pragma unroll
      for (int k = 0; k < kMaxRegisterTaps; ++k) {
        if (k < nx) {
          r0 = fmaf(fx[k], byte_to_float(__ldg(p + 3 * k)), r0);
          r1 = fmaf(fx[k], byte_to_float(__ldg(p + 3 * k + 1)), r1);
          r2 = fmaf(fx[k], byte_to_float(__ldg(p + 3 * k + 2)), r2);
        }
      }
      const float f = tap(wy, j - wy.lo);
      acc0 = fmaf(f, r0, acc0);
      acc1 = fmaf(f, r1, acc1);
      acc2 = fmaf(f, r2, acc2);
    }
  } else {
    for (int j = wy.lo; j < wy.hi; ++j) {
      const uint8_t* p = src + static_cast<size_t>(j) * row_stride + 3 * wx.lo;
      float r0 = 0.f, r1 = 0.f, r2 = 0.f;
      for (int k = 0; k < nx; ++k) {
        const float f = tap(wx, k);
        r0 = fmaf(f, byte_to_float(__ldg(p + 3 * k)), r0);
        r1 = fmaf(f, byte_to_float(__ldg(p + 3 * k + 1)), r1);
        r2 = fmaf(f, byte_to_float(__ldg(p + 3 * k + 2)), r2);
      }
      const float f = tap(wy, j - wy.lo);
      acc0 = fmaf(f, r0, acc0);
      acc1 = fmaf(f, r1, acc1);
      acc2 = fmaf(f, r2, acc2);
    }
  }
  const float norm = 1.f / (window_total(wx) * window_total(wy));
  const float v[3] = {acc0 * norm, acc1 * norm, acc2 * norm};
  T* out = static_cast<T*>(a.out);
  const int64_t plane = static_cast<int64_t>(a.out_h) * a.out_w;
  const int64_t pixel = static_cast<int64_t>(oy) * a.out_w + ox;
#pragma unroll
  for (int c = 0; c < 3; ++c) {
    const T y = from_float<T>(fmaf(v[c], a.scale[c], a.shift[c]));
    if (a.nhwc)
      out[(static_cast<int64_t>(n) * plane + pixel) * 3 + c] = y;
    else
      out[(static_cast<int64_t>(n) * 3 + c) * plane + pixel] = y;
  }
}

}  // namespace

void launch_resize_normalize(const ResizeNormalizeArgs& a, DType dt, cudaStream_t stream) {
  const dim3 block(kBlockX, kBlockY);
  const dim3 grid((a.out_w + kBlockX - 1) / kBlockX, (a.out_h + kBlockY - 1) / kBlockY, a.n);
  switch (dt) {
    case DType::F32: resize_normalize_kernel<float><<<grid, block, 0, stream>>>(a); break;
    case DType::F16: resize_normalize_kernel<__half><<<grid, block, 0, stream>>>(a); break;
    case DType::BF16: resize_normalize_kernel<__nv_bfloat16><<<grid, block, 0, stream>>>(a); break;
    default: break;  // the op accepts these three only
  }
}

}  // namespace mdata
