// NHWC 3x3 column-walking forward (and, with the kernel rotated, the stride-1 input gradient): the
// design of wgrad.cu's wgrad_nhwc_column_kernel applied to the stencil. A lane owns one 32-bit word
// of channels (a pair of 16-bit channels, or one fp32 channel) of one output row (n, oh) and walks
// ow = 0..OW-1 along it. It holds the 3 x 3 input window widened to fp32 in registers; step ow loads
// the S new input columns of the 3 rows (3 * S words, each loaded and widened once), does 9 x V FMAs
// with the lane's fp32 weights (fixed channels: loaded once from global memory, no shared memory) and
// stores one word. A warp reads lanes_c * 4 contiguous bytes of one pixel per load; the loads of U
// steps are issued before their FMAs. forward.cu's kernels hold 16-byte vectors x several columns per
// lane (~120 registers, latency-bound), as wgrad's did before its column kernel.
#include "device_common.h"

#include <climits>

namespace mdw {
namespace {

constexpr int kK = 3;

// Steps whose loads are in flight together: 4 fits 64 registers without spills in every variant
// (16-bit stride 2: 24 words in flight next to the 18 fp32 weights and the 6-float carried window,
// with the output pointer kept opaque as the kernel does; otherwise it spills 36 bytes).
constexpr int kColumnUnroll = 4;

template <class TT, int V>
__device__ __forceinline__ uint32_t narrow_word(const float (&in)[V]) {
  if constexpr (V == 2) {
    return static_cast<uint32_t>(TT::from_acc(in[0])) | static_cast<uint32_t>(TT::from_acc(in[1])) << 16;
  } else {
    return __float_as_uint(in[0]);
  }
}

// A plain global store (STG) through a pointer the compiler cannot see into (see the asm in the kernel):
// a C++ store would be a generic one (ST.E).
__device__ __forceinline__ void store_global(uint32_t* p, uint32_t v) {
  asm volatile("st.global.b32 [%0], %1;" ::"l"(p), "r"(v));
}

// Where a lane's row walk reads: its input rows as word offsets from the image (row0: first input
// row, which may lie above the image; pitch: words per input row).
struct FwdColumnRow {
  const uint32_t* xn;
  int row0, pitch, words;
  int rows_in;  // bit kh: input row kh is inside the image (and needed)
};

// The new words of U steps starting at step t0: input columns (t0 + u) * S - PW + (K - S) + d of the
// KR input rows. Checked: zeros (and no load) for steps >= OW, columns outside [0, W) and rows not in
// rows_in; unchecked: the caller has seen that every word is inside.
template <bool kChecked, int S, int U, int KR>
__device__ __forceinline__ void load_fwd_steps(const FwdColumnRow& row, int W, int OW, int PW, int t0,
                                               uint32_t (&raw)[U][KR][S]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int step = t0 + u;
#pragma unroll
    for (int d = 0; d < S; ++d) {
      const int iw = step * S - PW + (kK - S) + d;
      const int offset = row.row0 + iw * row.words;
      const bool col_in = step < OW && static_cast<unsigned>(iw) < static_cast<unsigned>(W);
#pragma unroll
      for (int kh = 0; kh < KR; ++kh) {
        if (!kChecked || (col_in && (row.rows_in >> kh & 1))) {
          raw[u][kh][d] = __ldg(row.xn + (offset + kh * row.pitch));
        } else {
          raw[u][kh][d] = 0u;
        }
      }
    }
  }
}

// Lanes: lane = cv + lanes_c * row, the block's rows are a band of consecutive rows of the flattened
// (n, oh / R) index (bands span images, so the 7- and 14-row layers still fill a block), and block b is
// channel group b % groups of band b / groups. R = 2: a lane row is a pair of output rows oh = 2p,
// 2p + 1 of one image (pairs never straddle images; with odd OH the last pair of an image has only
// its first row, whose extra input rows are then neither loaded nor stored); the walk holds the
// K + S input rows of both (stride 1: 4 rows for 2 outputs, stride 2: 5). Every (row, word) has
// exactly one lane, which writes all OW output words of its row(s). With t.reverse the bands run from
// the last image to the first: blocks start roughly in blockIdx order, so the first to run read the end
// of the input, the part its producer wrote last and most likely still in L2, and the last to run write
// the start of the output, which the next layer's kernel reads first. FLIP: the kernel rotated 180
// degrees, no bias and no activation (the input gradient of a stride-1 convolution, run on the flipped shape).
// 4 blocks of 256 per SM (64 registers), as the wgrad column kernel; MINB = 3 (up to 85 registers) for the
// deeper unrolls of FWD_COLUMN_DEEP.
template <class TT, int S, int U, bool FLIP, int R, int MINB>
__global__ void __launch_bounds__(256, MINB)
    fwd_nhwc_column_kernel(const uint32_t* __restrict__ x, const typename TT::S* __restrict__ w,
                           const typename TT::S* __restrict__ bias, uint32_t* __restrict__ y, ConvShape s, Tiling t) {
  static_assert(R == 1 || R == 2, "R: output rows per lane");
  constexpr int K = kK, KK = K * K;
  constexpr int KR = K + S * (R - 1);            // input rows held
  constexpr int V = 4 / sizeof(typename TT::S);  // channels per 32-bit word
  constexpr int KH = K - S;                      // window columns carried from one step to the next
  const int lane = threadIdx.x;
  if (lane >= t.threads) return;
  const NhwcLane ln = nhwc_lane(lane, t);
  const int words = s.C / V;
  const int cw = (blockIdx.x % t.groups) * t.lanes_c + ln.cv;
  const int OHR = R == 1 ? s.OH : (s.OH + 1) >> 1;  // lane rows per image
  const int bands = gridDim.x / t.groups;
  const int band = t.reverse ? bands - 1 - static_cast<int>(blockIdx.x) / t.groups : blockIdx.x / t.groups;
  const int r = band * t.sy_n + ln.sy;
  if (cw >= words || r >= s.N * OHR) return;
  const int n = r / OHR, oh = (r - n * OHR) * R;
  const bool second = R == 2 && oh + 1 < s.OH;  // the lane's second output row exists

  // The lane's channels are fixed: its weights (and bias) live in registers for the whole row.
  float wr[KK][V], b[V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const int c = cw * V + v;
#pragma unroll
    for (int k = 0; k < KK; ++k) wr[k][v] = TT::to_acc(__ldg(w + c * KK + (FLIP ? KK - 1 - k : k)));
    b[v] = !FLIP && bias != nullptr ? TT::to_acc(__ldg(bias + c)) : 0.f;
  }

  FwdColumnRow row;
  row.xn = x + static_cast<size_t>(n) * s.H * s.W * words + cw;
  uint32_t* yp = y + (static_cast<size_t>(n) * s.OH + oh) * s.OW * words + cw;
  // Opaque to the compiler: it keeps the pointers in registers (one IMAD.WIDE per access) instead of
  // rebuilding them from the kernel arguments at every access; yp's stores go through store_global.
  // Without it 16-bit stride 2 spills at U = 4.
  asm("" : "+l"(row.xn));
  asm("" : "+l"(yp));
  row.pitch = s.W * words;
  row.words = words;
  row.row0 = (oh * S - s.PH) * row.pitch;
  row.rows_in = 0;
#pragma unroll
  for (int kh = 0; kh < KR; ++kh) {
    const int ih = oh * S - s.PH + kh;
    row.rows_in |= (ih >= 0 && ih < s.H && (kh < K || second)) << kh;
  }
  const int ystep2 = s.OW * words;  // the second output row, from the first

  // held[kh][j] = input column step * S - PW + j (j < K - S) before step `step`, widened; zero outside.
  float held[KR][KH][V];
#pragma unroll
  for (int j = 0; j < KH; ++j) {
    const int iw = j - s.PW;
#pragma unroll
    for (int kh = 0; kh < KR; ++kh) {
      uint32_t word = 0u;
      if (static_cast<unsigned>(iw) < static_cast<unsigned>(s.W) && (row.rows_in >> kh & 1))
        word = __ldg(row.xn + (row.row0 + kh * row.pitch + iw * words));
      widen_word<TT, V>(word, held[kh][j]);
    }
  }

  for (int t0 = 0; t0 < s.OW; t0 += U) {
    // Most groups lie inside the image and the row: no bounds tests there. Columns outside load
    // zeros (the padding); steps past OW (a partial last group) neither load nor store.
    uint32_t raw[U][KR][S];
    const bool inside = row.rows_in == (1 << KR) - 1 && t0 * S - s.PW + KH >= 0 &&
                        (t0 + U - 1) * S - s.PW + K - 1 < s.W && t0 + U <= s.OW;
    if (inside) {
      load_fwd_steps<false, S, U, KR>(row, s.W, s.OW, s.PW, t0, raw);
    } else {
      load_fwd_steps<true, S, U, KR>(row, s.W, s.OW, s.PW, t0, raw);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float acc[R][V];
#pragma unroll
      for (int q = 0; q < R; ++q)
#pragma unroll
        for (int v = 0; v < V; ++v) acc[q][v] = b[v];
#pragma unroll
      for (int kh = 0; kh < KR; ++kh) {
        float fresh[S][V];
#pragma unroll
        for (int d = 0; d < S; ++d) widen_word<TT, V>(raw[u][kh][d], fresh[d]);
        // Input row kh feeds output row q through kernel row kh - q * S.
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
        // Slide: the next step's window starts S columns on.
#pragma unroll
        for (int j = 0; j < KH; ++j)
#pragma unroll
          for (int v = 0; v < V; ++v)
            held[kh][j][v] = j + S < KH ? held[kh][j + S < KH ? j + S : 0][v] : fresh[j + S >= KH ? j + S - KH : 0][v];
      }
      if constexpr (!FLIP) {
#pragma unroll
        for (int q = 0; q < R; ++q) activate(acc[q], s.act);
      }
      if (t0 + u < s.OW) {
        store_global(yp + (t0 + u) * words, narrow_word<TT, V>(acc[0]));
        if (R == 2 && second) store_global(yp + (ystep2 + (t0 + u) * words), narrow_word<TT, V>(acc[R - 1]));
      }
    }
  }
}

// Column-walk launch shape: lanes_c words of one pixel per row (all C / V words when there are at most
// 32, else 32-word groups, balanced so the last group is not mostly idle lanes), 256 / lanes_c rows of
// the flattened (n, oh) index per block, fewer when there are fewer rows, in equal bands.
Tiling column_tiling(int rows, int words) {
  Tiling t{};
  t.groups = ceil_div(words, 32);
  t.lanes_c = ceil_div(words, t.groups);
  t.sx_n = 1;
  t.sy_n = 256 / t.lanes_c < rows ? 256 / t.lanes_c : rows;
  t.tiles_h = ceil_div(rows, t.sy_n);
  t.sy_n = ceil_div(rows, t.tiles_h);
  t.tiles_w = 1;
  t.threads = t.lanes_c * t.sy_n;
  t.block = ceil_div(t.threads, 32) * 32;
  t.images = 1;
  t.group_fastest = 1;
  return t;
}

// Steps whose loads are in flight together for R = 2 (4 input rows at stride 1, 5 at stride 2).
template <class TT, int S>
constexpr int column_unroll_r2() {
  return sizeof(typename TT::S) == 4 ? (S == 1 ? kColumnUnroll : 2) : (S == 1 ? 2 : 1);
}

// DEEP: the 16-bit stride-1 walk with twice the steps in flight (8 with one row per lane, 4 with two) at 3 blocks
// per SM instead of 4 (80 and 72 registers, no spills). Off by default (FWD_COLUMN_DEEP, see column_t).
template <class TT, int S, bool FLIP, int R, bool DEEP = false>
void launch_column(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                   cudaStream_t stream) {
  using Sx = typename TT::S;
  constexpr int V = 4 / sizeof(Sx);
  constexpr int U = DEEP ? (R == 1 ? 2 * kColumnUnroll : 4) : (R == 1 ? kColumnUnroll : column_unroll_r2<TT, S>());
  constexpr int kMinBlocks = DEEP ? 3 : 4;
  Tiling t = column_tiling(s.N * (R == 1 ? s.OH : (s.OH + 1) / 2), s.C / V);
  t.reverse = knob(Knob::kColumnReverse, dt);
  const dim3 grid(t.groups * t.tiles_h);
  fwd_nhwc_column_kernel<TT, S, U, FLIP, R, kMinBlocks><<<grid, t.block, 0, stream>>>(
      static_cast<const uint32_t*>(x), static_cast<const Sx*>(w), static_cast<const Sx*>(bias),
      static_cast<uint32_t*>(y), s, t);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}


template <class TT, bool FLIP>
void column_t(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
              cudaStream_t stream) {
  if constexpr (FLIP) {
    launch_column<TT, 1, true, 1>(s, dt, x, w, bias, y, stream);  // the input gradient: stride 1 only
  } else {
    // Two output rows per lane load 4 input rows for 2 outputs instead of 3 for 1, at 2 steps in flight instead
    // of 4 (16-bit registers). Auto (0) takes it where the rows are short: at stride 1 with OW <= 28 the per-row
    // start (weights, first window) weighs most, and there it measured 5-17% faster per layer in the L2-warm
    // benchmark (fp16: 512x14 0.048 -> 0.040 ms), while the 112- and 56-wide layers and every stride-2 layer
    // were as fast or faster with one row (docs/kernel_notes.md, v9).
    const int rows = knob(Knob::kFwdColumnRows, dt);
    if constexpr (sizeof(typename TT::S) == 2) {
      // FWD_COLUMN_DEEP (16-bit, stride 1): in the 2026-11-30 sweep (docs/kernel_notes.md, commit ede22fc) it was 7-9% faster on
      // the 112-, 56- and 28-wide layers and as fast on the 14- and 7-wide ones; two rows then win up to 56 wide.
      // Off by default until the matrix's 16-bit channels_last rows are measured with it.
      if (s.SH == 1 && knob(Knob::kFwdColumnDeep, dt) == 1) {
        if (rows == 2 || (rows == 0 && s.OW <= 56)) {
          launch_column<TT, 1, false, 2, true>(s, dt, x, w, bias, y, stream);
        } else {
          launch_column<TT, 1, false, 1, true>(s, dt, x, w, bias, y, stream);
        }
        return;
      }
    }
    if (rows == 2 || (rows == 0 && s.SH == 1 && s.OW <= 28)) {
      (s.SH == 1 ? launch_column<TT, 1, false, 2> : launch_column<TT, 2, false, 2>)(s, dt, x, w, bias, y, stream);
    } else {
      (s.SH == 1 ? launch_column<TT, 1, false, 1> : launch_column<TT, 2, false, 1>)(s, dt, x, w, bias, y, stream);
    }
  }
}

template <bool FLIP>
bool dispatch_column(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                     cudaStream_t stream) {
  switch (dt) {
    case DType::F32: column_t<F32T, FLIP>(s, dt, x, w, bias, y, stream); return true;
    case DType::F16: column_t<F16T, FLIP>(s, dt, x, w, bias, y, stream); return true;
    case DType::BF16: column_t<BF16T, FLIP>(s, dt, x, w, bias, y, stream); return true;
    default: return false;
  }
}

}  // namespace

// The column walk needs a 3x3 kernel, equal strides 1 or 2, dilation 1, whole 32-bit words of channels
// (C even for 16-bit data, 4-byte pointers), and its word offsets within one image (rows -PH .. H + PH + 1
// (the last two only with R = 2), columns -PW .. 2 * OW + 12) must fit an int. s is the shape the kernel
// runs (for dgrad: flipped; for wgrad: the convolution's).
bool column_fits(const ConvShape& s, DType dt, const void* in, const void* out) {
  return dt != DType::F64 && s.channels_last && s.KH == 3 && s.KW == 3 && s.SH == s.SW &&
         (s.SH == 1 || s.SH == 2) && s.DH == 1 && s.DW == 1 && (s.C * elem_size(dt)) % 4 == 0 && aligned(in, 4) &&
         aligned(out, 4) &&
         static_cast<long long>(s.H + (s.PH > 0 ? s.PH : 0) + 2) * (s.W + 2 * s.OW + 12) * (s.C * elem_size(dt) / 4) <=
             INT_MAX;
}

bool nhwc_column_forward(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                         cudaStream_t stream) {
  if (knob(Knob::kFwdColumn, dt) < 1 || !column_fits(s, dt, x, y)) return false;
  return dispatch_column<false>(s, dt, x, w, bias, y, stream);
}

// grad_input = conv(grad_out, rot180(w), stride 1, padding K - 1 - P): the forward stencil on the shape
// whose input is grad_out (OH x OW) and whose output is grad_input (H x W).
bool nhwc_column_dgrad_s1(const ConvShape& s, DType dt, const void* grad_out, const void* w, void* grad_input,
                          cudaStream_t stream) {
  if (knob(Knob::kFwdColumn, dt) < 2 || s.SH != 1 || s.SW != 1 || s.PH > s.KH - 1 ||
      s.PW > s.KW - 1 || !column_fits(s, dt, grad_out, grad_input))
    return false;
  ConvShape f = s;
  f.H = s.OH;
  f.W = s.OW;
  f.OH = s.H;
  f.OW = s.W;
  f.PH = s.KH - 1 - s.PH;
  f.PW = s.KW - 1 - s.PW;
  if (!column_fits(f, dt, grad_out, grad_input)) return false;
  return dispatch_column<true>(f, dt, grad_out, w, nullptr, grad_input, stream);
}

}  // namespace mdw
