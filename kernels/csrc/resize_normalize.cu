// Kernel of mobilenet_data::resize_normalize (resize_normalize.h says what it computes and why in one pass).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "resize_normalize.h"

namespace mdata {
namespace {

constexpr int kBlockX = 32;  // output columns per block: one warp along a row
constexpr int kBlockY = 8;   // output rows per block

// The input window [lo, hi) of output index i along an axis of `in` inputs resized to `out`, and the filter's
// centre and inverse width (PyTorch's antialiased bilinear: the triangle widened by the scale when shrinking).
struct Window {
  int lo, hi;
  float center, inv;
};

__device__ __forceinline__ Window window(int i, int in, int out) {
  const float scale = static_cast<float>(in) / static_cast<float>(out);
  const float support = scale >= 1.f ? scale : 1.f;
  Window w;
  w.center = scale * (static_cast<float>(i) + 0.5f);
  w.inv = 1.f / support;
  // Truncation toward zero as in PyTorch; the lower bound is clipped at 0 anyway.
  w.lo = max(static_cast<int>(w.center - support + 0.5f), 0);
  w.hi = min(static_cast<int>(w.center + support + 0.5f), in);
  return w;
}

__device__ __forceinline__ float tap(const Window& w, int j) {
  return fmaxf(0.f, 1.f - fabsf((static_cast<float>(j) - w.center + 0.5f) * w.inv));
}

__device__ __forceinline__ float window_total(const Window& w) {
  float t = 0.f;
  for (int j = w.lo; j < w.hi; ++j) t += tap(w, j);
  return t;
}

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

  float acc0 = 0.f, acc1 = 0.f, acc2 = 0.f;
  for (int j = wy.lo; j < wy.hi; ++j) {
    const uint8_t* row = src + static_cast<size_t>(j) * row_stride;
    float r0 = 0.f, r1 = 0.f, r2 = 0.f;
    for (int i = wx.lo; i < wx.hi; ++i) {
      const float f = tap(wx, i);
      const uint8_t* p = row + 3 * i;
      r0 = fmaf(f, static_cast<float>(__ldg(p)), r0);
      r1 = fmaf(f, static_cast<float>(__ldg(p + 1)), r1);
      r2 = fmaf(f, static_cast<float>(__ldg(p + 2)), r2);
    }
    const float f = tap(wy, j);
    acc0 = fmaf(f, r0, acc0);
    acc1 = fmaf(f, r1, acc1);
    acc2 = fmaf(f, r2, acc2);
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
