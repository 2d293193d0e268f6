// Kernel of mobilenet_data::resize_normalize (resize_normalize.h says what it computes).
//
// A block computes a tile of kTileW x kTileH output pixels of one crop, separably through shared memory:
//   1. the tile's columns and rows get their filter windows and weights, set up in double as PyTorch computes them
//      and normalised (a float centre alone would be off by up to 3e-5 pixels at 500 px);
//   2. the source rectangle under the tile is staged as bytes, each byte read once from global memory;
//   3. the horizontal pass filters each staged row into the tile's columns (fp32, in shared memory);
//   4. the vertical pass filters those into the tile's rows, normalises, mirrors and writes.
// Per output pixel that is about (rows staged / kTileH) horizontal windows and one vertical window, where a direct
// 2-D filter would weigh every (row, column) pair of its window. A tile whose source rectangle or windows exceed the
// shared-memory budget (shrinking by more than about 2.8x) is computed directly, pixel by pixel, from global memory.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "resize_normalize.h"

namespace mdata {
namespace {

constexpr int kTileW = 32;      // output columns per block: one warp across
constexpr int kTileH = 16;      // output rows per block
constexpr int kThreads = 256;   // 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTapsX = 8;    // horizontal window, inputs (shrinking by up to ~3.5x)
constexpr int kMaxTapsY = 10;   // vertical window, inputs
constexpr int kMaxRows = 56;    // source rows staged per tile
constexpr int kMaxRowBytes = 288;  // source bytes staged per row: 96 pixels

// The window of output index i along an axis of `in` inputs resized to `out` (PyTorch's antialiased bilinear: a
// triangle widened by the scale when shrinking): its first input, its length, and the centre and support in double.
struct Window {
  int lo, n;
  double center, inv;
};

__device__ __forceinline__ Window window(int i, int in, int out) {
  const double scale = static_cast<double>(in) / out;
  const double support = scale >= 1.0 ? scale : 1.0;
  Window w;
  w.center = scale * (i + 0.5);
  w.inv = 1.0 / support;
  // Truncation toward zero as in PyTorch; the lower bound is clipped at 0 anyway.
  w.lo = max(static_cast<int>(w.center - support + 0.5), 0);
  w.n = min(static_cast<int>(w.center + support + 0.5), in) - w.lo;
  return w;
}

__device__ __forceinline__ double tap(const Window& w, int k) {  // the weight of the window's k-th input, unnormalised
  return fmax(0.0, 1.0 - fabs((w.lo + k + 0.5 - w.center) * w.inv));
}

// The window's first input and length, and its first `max_taps` weights normalised, as float.
__device__ void set_up_taps(int i, int in, int out, int max_taps, int* lo, int* n, float* weights, int stride) {
  const Window w = window(i, in, out);
  double total = 0.0;
  for (int k = 0; k < w.n; ++k) total += tap(w, k);
  for (int k = 0; k < min(w.n, max_taps); ++k) weights[k * stride] = static_cast<float>(tap(w, k) / total);
  *lo = w.lo;
  *n = w.n;
}

// A byte as a float without the I2F conversion (a quarter-rate instruction): 2^23 + b is exact in fp32.
__device__ __forceinline__ float byte_to_float(uint8_t b) { return __uint_as_float(0x4B000000u | b) - 8388608.f; }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Output pixel (oy, resized column rx) of crop n, its three values in [0, 255], written normalised at column ox.
template <typename T>
__device__ __forceinline__ void write_pixel(const ResizeNormalizeArgs& a, int n, int oy, int ox, float v0, float v1,
                                            float v2) {
  T* out = static_cast<T*>(a.out);
  const int64_t plane = static_cast<int64_t>(a.out_h) * a.out_w;
  const int64_t pixel = static_cast<int64_t>(oy) * a.out_w + ox;
  const float v[3] = {v0, v1, v2};
#pragma unroll
  for (int c = 0; c < 3; ++c) {
    const T y = from_float<T>(fmaf(v[c], a.scale[c], a.shift[c]));
    if (a.nhwc)
      out[(static_cast<int64_t>(n) * plane + pixel) * 3 + c] = y;
    else
      out[(static_cast<int64_t>(n) * 3 + c) * plane + pixel] = y;
  }
}

// One output pixel straight from global memory, for tiles beyond the shared-memory budget.
__device__ void direct_pixel(const uint8_t* src, int h, int w, int out_h, int out_w, int oy, int rx, float* v) {
  const Window wx = window(rx, w, out_w);
  const Window wy = window(oy, h, out_h);
  double tx = 0.0, ty = 0.0;
  for (int k = 0; k < wx.n; ++k) tx += tap(wx, k);
  for (int k = 0; k < wy.n; ++k) ty += tap(wy, k);
  float acc[3] = {0.f, 0.f, 0.f};
  for (int j = 0; j < wy.n; ++j) {
    const uint8_t* p = src + (static_cast<size_t>(wy.lo + j) * w + wx.lo) * 3;
    float r[3] = {0.f, 0.f, 0.f};
    for (int k = 0; k < wx.n; ++k) {
      const float f = static_cast<float>(tap(wx, k) / tx);
#pragma unroll
      for (int c = 0; c < 3; ++c) r[c] = fmaf(f, byte_to_float(__ldg(p + 3 * k + c)), r[c]);
    }
    const float f = static_cast<float>(tap(wy, j) / ty);
#pragma unroll
    for (int c = 0; c < 3; ++c) acc[c] = fmaf(f, r[c], acc[c]);
  }
#pragma unroll
  for (int c = 0; c < 3; ++c) v[c] = acc[c];
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 4) resize_normalize_kernel(ResizeNormalizeArgs a) {
  __shared__ int col_lo[kTileW], col_n[kTileW], row_lo[kTileH], row_n[kTileH];
  __shared__ float col_w[kMaxTapsX * kTileW];  // [k][column]: a warp's lanes read consecutive words
  __shared__ float row_w[kTileH * kMaxTapsY];  // [row][k]: a warp reads one row's, broadcast
  __shared__ uint8_t staged[kMaxRows * kMaxRowBytes];
  __shared__ float across[kMaxRows * kTileW * 3];  // the horizontal pass: [source row][column][channel]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n = blockIdx.z;
  const int x0 = blockIdx.x * kTileW, y0 = blockIdx.y * kTileH;
  const int64_t* d = a.desc + static_cast<int64_t>(n) * kDescWords;
  const uint8_t* src = reinterpret_cast<const uint8_t*>(d[0]);
  const int h = static_cast<int>(d[1]), w = static_cast<int>(d[2]);
  const bool mirror = d[3] != 0;
  const int cols = min(kTileW, a.out_w - x0), rows = min(kTileH, a.out_h - y0);

  bool too_wide = false;
  if (tid < kTileW) {
    const int x = x0 + min(tid, cols - 1);  // columns past the edge repeat the last one: valid, never written
    set_up_taps(x, w, a.out_w, kMaxTapsX, &col_lo[tid], &col_n[tid], &col_w[tid], kTileW);
    too_wide = col_n[tid] > kMaxTapsX;
  } else if (tid < kTileW + kTileH) {
    const int r = tid - kTileW, y = y0 + min(r, rows - 1);
    set_up_taps(y, h, a.out_h, kMaxTapsY, &row_lo[r], &row_n[r], &row_w[r * kMaxTapsY], 1);
    too_wide = row_n[r] > kMaxTapsY;
  }
  too_wide = __syncthreads_or(too_wide);
  const int cx0 = col_lo[0], cx1 = col_lo[cols - 1] + col_n[cols - 1];  // windows move monotonically
  const int ry0 = row_lo[0], ry1 = row_lo[rows - 1] + row_n[rows - 1];
  const int src_rows = ry1 - ry0, row_bytes = (cx1 - cx0) * 3;

  if (too_wide || src_rows > kMaxRows || row_bytes > kMaxRowBytes) {
    for (int i = tid; i < kTileW * kTileH; i += kThreads) {
      const int tx = i % kTileW, ty = i / kTileW;
      if (tx >= cols || ty >= rows) continue;
      float v[3];
      direct_pixel(src, h, w, a.out_h, a.out_w, y0 + ty, x0 + tx, v);
      write_pixel<T>(a, n, y0 + ty, mirror ? a.out_w - 1 - (x0 + tx) : x0 + tx, v[0], v[1], v[2]);
    }
    return;
  }

  for (int r = warp; r < src_rows; r += kWarps) {
    const uint8_t* g = src + (static_cast<size_t>(ry0 + r) * w + cx0) * 3;
    for (int b = lane; b < row_bytes; b += 32) staged[r * kMaxRowBytes + b] = __ldg(g + b);
  }
  __syncthreads();

  if (lane < cols) {
    const int taps = col_n[lane], first = (col_lo[lane] - cx0) * 3;
    for (int r = warp; r < src_rows; r += kWarps) {
      const uint8_t* s = staged + r * kMaxRowBytes + first;
      float acc0 = 0.f, acc1 = 0.f, acc2 = 0.f;
      for (int k = 0; k < taps; ++k) {
        const float f = col_w[k * kTileW + lane];
        acc0 = fmaf(f, byte_to_float(s[3 * k]), acc0);
        acc1 = fmaf(f, byte_to_float(s[3 * k + 1]), acc1);
        acc2 = fmaf(f, byte_to_float(s[3 * k + 2]), acc2);
      }
      float* o = across + (r * kTileW + lane) * 3;
      o[0] = acc0;
      o[1] = acc1;
      o[2] = acc2;
    }
  }
  __syncthreads();

  if (lane < cols) {
    const int ox = mirror ? a.out_w - 1 - (x0 + lane) : x0 + lane;
    for (int r = warp; r < rows; r += kWarps) {
      const int taps = row_n[r];
      const float* in = across + ((row_lo[r] - ry0) * kTileW + lane) * 3;
      float acc0 = 0.f, acc1 = 0.f, acc2 = 0.f;
      for (int k = 0; k < taps; ++k) {
        const float f = row_w[r * kMaxTapsY + k];
        const float* p = in + k * kTileW * 3;
        acc0 = fmaf(f, p[0], acc0);
        acc1 = fmaf(f, p[1], acc1);
        acc2 = fmaf(f, p[2], acc2);
      }
      write_pixel<T>(a, n, y0 + r, ox, acc0, acc1, acc2);
    }
  }
}

}  // namespace

void launch_resize_normalize(const ResizeNormalizeArgs& a, DType dt, cudaStream_t stream) {
  const dim3 grid((a.out_w + kTileW - 1) / kTileW, (a.out_h + kTileH - 1) / kTileH, a.n);
  switch (dt) {
    case DType::F32: resize_normalize_kernel<float><<<grid, kThreads, 0, stream>>>(a); break;
    case DType::F16: resize_normalize_kernel<__half><<<grid, kThreads, 0, stream>>>(a); break;
    case DType::BF16: resize_normalize_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(a); break;
    default: break;  // the op accepts these three only
  }
}

}  // namespace mdata
