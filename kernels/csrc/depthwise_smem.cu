// The NHWC shared-memory tile (FWD_SMEM): forward and stride-1 input gradient for square 3x3, 5x5 and 7x7 kernels,
// stride 1 or 2, whole 32-bit words of channels.
//
// A block owns a channel group (up to 32 words: 64 16-bit or 32 fp32 channels, one 128-byte line per pixel) and a
// tile of th output rows x nseg * TW output columns of one image. It copies the tile's input rectangle, halo
// included, into shared memory with cp.async (16-byte copies where the channel words allow, zero-fill for the
// padding), once; every lane then reads its windows from there, each input row of a segment widened once for the
// output rows it feeds. The 5x5 column walk (stencil_column_k57.cuh) and the tiled kernels load each input word
// through L1 once per kernel row that uses it.
//
// By default (depthwise_dispatch.cpp smem_wanted) it runs only where the H200 suites measured it faster: 16-bit 5x5
// at stride 1 on 14-28 input rows. On 3x3 layers it executes more instructions per output than the column walks
// (the copy loop, the segment bookkeeping) and took 1.03-1.74x their time; the knob forces it on for A/B runs.
//
// Compute: lane (c, p) takes channel word c and output segments p, p + P, ... (a segment: R rows x TW columns). Each
// output's products are added in the order kh, then kw, from the bias, with fmaf (the 3x3 column walk's order).
// In a file of its own so that the pass files are compiled from unchanged source and keep their measured machine code.
#include <c10/cuda/CUDAException.h>

#include <type_traits>

#include "depthwise_launchers.h"
#include "device_common.h"
#include "launch_plan.h"

namespace mdw {
namespace {

// What the host decided for one launch (plan_smem_tile).
struct SmemTile {
  int words;    // 32-bit words of channels per pixel (C / V)
  int cw;       // words per channel group (the last group may hold fewer)
  int groups;   // channel groups
  int lanes;    // lanes that compute: cw * P, P = lanes / cw segments in parallel
  int th;       // output rows per tile
  int nseg;     // segments per tile row (TW outputs each)
  int tiles_h, tiles_w;
  int ih, iw;   // input rows and columns of the tile
  int rs;       // words per tile row in shared memory: iw * cw, padded to spread the banks (plan_smem_tile)
  int vec4;     // 16-byte copies: words and cw multiples of 4, x 16-byte aligned
  size_t smem;  // bytes: the input tile, then K * K * cw * V fp32 weights
};

__device__ __forceinline__ void cp_async4(uint32_t* dst, const uint32_t* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src), "r"(valid ? 4 : 0));
}

// FLIP: the kernel rotated 180 degrees, no bias, no activation (the stride-1 input gradient run on
// input_grad_as_forward's shape).
// 3 blocks of 256 per SM: up to 85 registers (the 16-bit stride-1 segments hold 2 x 8 x 2 fp32 sums next to the
// weights of two kernel rows).
template <class TT, int K, int S, int TW, bool FLIP>
__global__ void __launch_bounds__(256, 3)
    fwd_nhwc_smem_kernel(const uint32_t* __restrict__ x, const typename TT::S* __restrict__ w,
                         const typename TT::S* __restrict__ bias, uint32_t* __restrict__ y, ConvShape s, SmemTile t) {
  constexpr int V = 4 / sizeof(typename TT::S);  // channels per word
  constexpr int KK = K * K;
  constexpr int L = (TW - 1) * S + K;  // input columns of one segment's row
  constexpr int R = S == 1 ? 2 : 1;    // output rows per segment (at stride 2 two rows share one input row in 5)
  constexpr int KR = (R - 1) * S + K;  // input rows of a segment
  extern __shared__ __align__(16) uint32_t smem[];
  uint32_t* tile = smem;
  float* wsm = reinterpret_cast<float*>(smem + static_cast<size_t>(t.ih) * t.rs);

  int b = blockIdx.x;
  const int g = b % t.groups;
  b /= t.groups;
  const int tw_i = b % t.tiles_w;
  b /= t.tiles_w;
  const int th_i = b % t.tiles_h;
  const int n = b / t.tiles_h;
  const int g0 = g * t.cw;  // first word of the group
  const int cwg = min(t.cw, t.words - g0);
  const int oh0 = th_i * t.th, ow0 = tw_i * t.nseg * TW;
  const int ih0 = oh0 * S - s.PH, iw0 = ow0 * S - s.PW;
  const uint32_t* xn = x + static_cast<size_t>(n) * s.H * s.W * t.words + g0;

  // The input rectangle, zeros outside the image and past the group's words. A lane keeps one 16- or 4-byte piece
  // q of each pixel it copies and steps through the pixels by adding, without a division per copy: the copy loop
  // issues several copies per lane, and integer divisions by runtime values there cost as much as the convolution.
  {
    const int unit = t.vec4 ? 4 : 1;  // words per copy
    const int q_n = t.cw / unit, step = blockDim.x / q_n;
    const int q = threadIdx.x % q_n, first = threadIdx.x / q_n;
    if (first < step) {
      int r = first / t.iw, c = first - r * t.iw;
      const bool q_in = q * unit < cwg;
      for (; r < t.ih;) {
        const int gh = ih0 + r, gw = iw0 + c;
        const bool valid = q_in && gh >= 0 && gh < s.H && gw >= 0 && gw < s.W;
        const uint32_t* src = valid ? xn + (static_cast<size_t>(gh) * s.W + gw) * t.words + q * unit : x;
        uint32_t* dst = tile + r * t.rs + c * t.cw + q * unit;
        if (t.vec4) {
          cp_async16(static_cast<unsigned>(__cvta_generic_to_shared(dst)), src, valid);
        } else {
          cp_async4(dst, src, valid);
        }
        c += step;
        while (c >= t.iw) {
          c -= t.iw;
          ++r;
        }
      }
    }
  }
  cp_async_commit();
  // The weights, widened once: wsm[k][c][v] for tap k (rotated for FLIP) of channel (g0 + c) * V + v.
  for (int i = threadIdx.x; i < KK * t.cw; i += blockDim.x) {
    const int k = i / t.cw, c = i - k * t.cw;
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const int ch = (g0 + c) * V + v;
      wsm[i * V + v] = c < cwg ? TT::to_acc(__ldg(w + static_cast<size_t>(ch) * KK + (FLIP ? KK - 1 - k : k))) : 0.f;
    }
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();

  const int c = threadIdx.x % t.cw, p = threadIdx.x / t.cw;
  if (threadIdx.x >= t.lanes || c >= cwg) return;
  const int P = t.lanes / t.cw;
  float bv[V];
#pragma unroll
  for (int v = 0; v < V; ++v) bv[v] = !FLIP && bias != nullptr ? TT::to_acc(__ldg(bias + (g0 + c) * V + v)) : 0.f;
  uint32_t* yn = y + static_cast<size_t>(n) * s.OH * s.OW * t.words + g0 + c;

  // A segment is R rows x TW columns; rows (pairs) fastest, so the lanes of one warp that take different segments
  // read rows R * S apart. Each input row of a segment is read and widened once for the R output rows it feeds.
  const int pairs = t.th / R;  // the planner makes th a multiple of R
  for (int seg = p; seg < pairs * t.nseg; seg += P) {
    const int r = (seg % pairs) * R, sx = seg / pairs;
    const int oh = oh0 + r, owb = ow0 + sx * TW;
    if (oh >= s.OH || owb >= s.OW) continue;
    float acc[R][TW][V];
#pragma unroll
    for (int q = 0; q < R; ++q)
#pragma unroll
      for (int j = 0; j < TW; ++j)
#pragma unroll
        for (int v = 0; v < V; ++v) acc[q][j][v] = bv[v];
    const uint32_t* rows = tile + r * S * t.rs + sx * TW * S * t.cw + c;
#pragma unroll
    for (int ir = 0; ir < KR; ++ir) {
      // Input row ir feeds output row q through kernel row ir - q * S: those rows' weights, then one pass along
      // the row, each word widened once.
      float wr[R][K][V];
#pragma unroll
      for (int q = 0; q < R; ++q) {
        const int kh = ir - q * S;
        if (kh < 0 || kh >= K) continue;
#pragma unroll
        for (int kw = 0; kw < K; ++kw)
#pragma unroll
          for (int v = 0; v < V; ++v) wr[q][kw][v] = wsm[((kh * K + kw) * t.cw + c) * V + v];
      }
#pragma unroll
      for (int i = 0; i < L; ++i) {
        float xv[V];
        widen_word<TT, V>(rows[ir * t.rs + i * t.cw], xv);
#pragma unroll
        for (int q = 0; q < R; ++q) {
          const int kh = ir - q * S;
          if (kh < 0 || kh >= K) continue;
#pragma unroll
          for (int j = 0; j < TW; ++j) {
            const int kw = i - j * S;
            if (kw < 0 || kw >= K) continue;
#pragma unroll
            for (int v = 0; v < V; ++v) acc[q][j][v] = fmaf(wr[q][kw][v], xv[v], acc[q][j][v]);
          }
        }
      }
    }
    if (!FLIP && s.act != kActNone) {  // uniform: no per-element selects when there is no activation
#pragma unroll
      for (int q = 0; q < R; ++q)
#pragma unroll
        for (int j = 0; j < TW; ++j) activate(acc[q][j], s.act);
    }
#pragma unroll
    for (int q = 0; q < R; ++q) {
      if (oh + q >= s.OH) break;
      uint32_t* yp = yn + (static_cast<size_t>(oh + q) * s.OW + owb) * t.words;
#pragma unroll
      for (int j = 0; j < TW; ++j)
        if (owb + j < s.OW) yp[static_cast<size_t>(j) * t.words] = narrow_word<TT, V>(acc[q][j]);
    }
  }
}

// Output columns per segment: 8 (fewer weight and window reads per output) unless 4 wastes fewer lanes on the
// row's last segment (28 columns: 4 x 7 exactly, against 8 x 4 with 4 idle).
int smem_segment_width(int OW) {
  const int waste8 = ceil_div(OW, 8) * 8 - OW, waste4 = ceil_div(OW, 4) * 4 - OW;
  return waste8 <= waste4 ? 8 : 4;
}

// Channel groups of at most 32 words, balanced (72 words: 3 of 24, not 32 + 32 + 8) and kept to multiples of 4
// words where the channels allow 16-byte copies; tiles of at most 48 KB of shared memory. With 8 or 16 words per
// pixel a warp holds 4 or 2 lanes per word, on different segments; the row stride is padded so that rows S apart
// start cw banks apart (S * rs = cw mod 32). The segments' first rows are R * S apart, so at stride 1 (R = 2) this
// padding does not separate their banks; the suites' default cases have groups of 32 words and never pad.
SmemTile plan_smem_tile(const ConvShape& s, DType dt, const void* x, int K, int S, int TW) {
  SmemTile t{};
  const int V = dt == DType::F32 ? 1 : 2;
  t.words = s.C / V;
  t.groups = ceil_div(t.words, 32);
  t.cw = ceil_div(t.words, t.groups);
  t.vec4 = t.words % 4 == 0 && aligned(x, 16);
  if (t.vec4) t.cw = ceil_div(t.cw, 4) * 4;
  t.groups = ceil_div(t.words, t.cw);
  const int P = 256 / t.cw;
  const int R = S == 1 ? 2 : 1;  // the kernel's output rows per segment
  t.lanes = P * t.cw;
  auto row_stride = [&](int nseg) {
    int rs = ((nseg * TW - 1) * S + K) * t.cw;
    if (t.cw == 8 || t.cw == 16) {
      const int target = S == 1 ? t.cw : t.cw / 2;  // multiples of 4: the 16-byte copies stay aligned
      while (rs % 32 != target) rs += 4;
    }
    return rs;
  };
  auto bytes = [&](int th, int nseg) {
    const int ih = (th - 1) * S + K;
    return static_cast<size_t>(ih) * row_stride(nseg) * 4 + static_cast<size_t>(K) * K * t.cw * V * 4;
  };
  constexpr size_t kBudget = 48 * 1024;
  // Of the tile shapes that fit (at most 4 segments per row and per lane), the one that copies the fewest input
  // pixels per image and channel group, halos and the idle columns of a row's last tile included.
  const int max_seg = ceil_div(s.OW, TW) < 4 ? ceil_div(s.OW, TW) : 4;
  long long best = -1;
  for (int nseg = max_seg; nseg >= 1; --nseg) {
    int th = ceil_div(4 * R * P, nseg);
    if (th > s.OH) th = s.OH;
    th = ceil_div(th, R) * R;
    while (th > R && bytes(th, nseg) > kBudget) th -= R;
    if (bytes(th, nseg) > kBudget) continue;
    const int tiles_h = ceil_div(s.OH, th), tiles_w = ceil_div(s.OW, nseg * TW);
    const int th_eq = ceil_div(ceil_div(s.OH, tiles_h), R) * R;
    const long long copied = static_cast<long long>(tiles_h) * tiles_w * ((th_eq - 1) * S + K) *
                             ((nseg * TW - 1) * S + K);
    if (best < 0 || copied < best) {
      best = copied;
      t.nseg = nseg;
      t.th = th;
    }
  }
  t.tiles_h = ceil_div(s.OH, t.th);
  t.tiles_w = ceil_div(s.OW, t.nseg * TW);
  t.th = ceil_div(ceil_div(s.OH, t.tiles_h), R) * R;  // equal tiles (14 rows: 2 x 7, not 8 + 6) of whole segments
  t.ih = (t.th - 1) * S + K;
  t.iw = (t.nseg * TW - 1) * S + K;
  t.rs = row_stride(t.nseg);
  t.smem = bytes(t.th, t.nseg);
  return t;
}

template <class TT, int K, int S, int TW, bool FLIP>
void launch_smem(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                 cudaStream_t stream) {
  using Sx = typename TT::S;
  const SmemTile t = plan_smem_tile(s, dt, x, K, S, TW);
  const long long blocks = static_cast<long long>(t.groups) * t.tiles_w * t.tiles_h * s.N;
  fwd_nhwc_smem_kernel<TT, K, S, TW, FLIP><<<static_cast<unsigned>(blocks), 256, t.smem, stream>>>(
      static_cast<const uint32_t*>(x), static_cast<const Sx*>(w), static_cast<const Sx*>(bias),
      static_cast<uint32_t*>(y), s, t);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT, int K, int S, bool FLIP>
void smem_by_width(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                   cudaStream_t stream) {
  (smem_segment_width(s.OW) == 8 ? launch_smem<TT, K, S, 8, FLIP> : launch_smem<TT, K, S, 4, FLIP>)(s, dt, x, w, bias,
                                                                                                   y, stream);
}

template <class TT, bool FLIP>
void smem_by_shape(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                   cudaStream_t stream) {
  if constexpr (FLIP) {  // the input gradient: stride 1 only
    if (s.KH == 3) smem_by_width<TT, 3, 1, true>(s, dt, x, w, bias, y, stream);
    else if (s.KH == 5) smem_by_width<TT, 5, 1, true>(s, dt, x, w, bias, y, stream);
    else smem_by_width<TT, 7, 1, true>(s, dt, x, w, bias, y, stream);
  } else {
    auto run = s.KH == 3   ? (s.SH == 1 ? smem_by_width<TT, 3, 1, false> : smem_by_width<TT, 3, 2, false>)
               : s.KH == 5 ? (s.SH == 1 ? smem_by_width<TT, 5, 1, false> : smem_by_width<TT, 5, 2, false>)
                           : (s.SH == 1 ? smem_by_width<TT, 7, 1, false> : smem_by_width<TT, 7, 2, false>);
    run(s, dt, x, w, bias, y, stream);
  }
}

template <bool FLIP>
void smem_by_dtype(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                   cudaStream_t stream) {
  switch (dt) {
    case DType::F32: return smem_by_shape<F32T, FLIP>(s, dt, x, w, bias, y, stream);
    case DType::F16: return smem_by_shape<F16T, FLIP>(s, dt, x, w, bias, y, stream);
    case DType::BF16: return smem_by_shape<BF16T, FLIP>(s, dt, x, w, bias, y, stream);
    default: return;  // smem_fits excludes fp64
  }
}

}  // namespace

void forward_nhwc_smem(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                       cudaStream_t stream) {
  smem_by_dtype<false>(s, dt, x, w, bias, y, stream);
}

// The forward tile on input_grad_as_forward(s), whose input is grad_out; stride 1 only.
void input_grad_nhwc_smem(const ConvShape& s, DType dt, const void* go, const void* w, void* gx,
                          cudaStream_t stream) {
  smem_by_dtype<true>(input_grad_as_forward(s), dt, go, w, nullptr, gx, stream);
}

}  // namespace mdw
