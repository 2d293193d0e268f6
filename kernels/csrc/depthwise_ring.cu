// The NHWC 3x3 forward fed by bulk copies into a ring of input rows (FWD_RING; Hopper and later).
//
// The column walk (stencil_3x3.cuh) loads its input words itself, so the bytes it keeps in flight are bounded by its
// registers: the 16-bit walks on the 112- and 56-wide layers stay well below the HBM's bandwidth and trail cuDNN.
// Here a block owns an image's band of output rows and every channel (in NHWC one input row of all channels is one
// contiguous run of bytes), and one lane streams the block's input rows into shared memory with cp.async.bulk, each
// row one copy whose completion an mbarrier counts. The ring holds as many rows as shared memory allows, so the
// copies run several bands of rows ahead of the lanes that compute, with no load instruction and no register of
// theirs tied up in flight. The compute is the column walk's, on shared memory: a lane owns one 32-bit word of
// channels of R output rows and walks a segment of their columns, holding its 3 x 3 window widened to fp32. Each
// output's products are added in the walk's order (bias, then kernel rows, then columns, fmaf), so y is bit for bit
// the column walk's. Padding columns are zeros kept at both ends of every slot; rows above and below the image read
// a slot of zeros.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <type_traits>

#include "depthwise_launchers.h"
#include "device_common.h"
#include "launch_plan.h"

namespace mdw {
namespace {

// What the host decided for one launch (plan_ring).
struct RingPlan {
  int words;             // 32-bit words of channels per pixel (C / V)
  int P;                 // lanes per word; the block has words * P lanes
  int nseg, seg;         // column segments per output row, columns per segment
  int rg;                // row groups (nseg * rg = P); a band is rg * R output rows
  int band_rows;         // output rows per band
  int bands;             // bands per block
  int blocks_per_image;
  int nslot;             // ring slots, one input row each; slot nslot is the zero row
  int slot_words;        // words per slot: (W + 2 * PW) * words, padded (plan_ring)
  unsigned row_bytes;    // one input row: W * words * 4
  int bar_bytes;         // the mbarriers, before the slots
  size_t smem;
};

// Lanes per block: kRingLanes (launch_plan.h), 2 blocks per SM. One block of 512 lanes per SM, with twice the shared
// memory for its ring, measured slower on MobileNetV1's layers (docs/kernels.md).

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ring_bar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
}

// One bulk copy of `bytes` into `dst`, counted by `bar` (which expects exactly those bytes for its phase).
__device__ __forceinline__ void ring_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

// Until the phase of `bar` with this parity has completed (the copy has landed).
__device__ __forceinline__ void ring_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "RING_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra RING_WAIT;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
#endif

// Steps whose shared-memory loads are issued before their FMAs.
constexpr int kRingUnroll = 2;

// Block b: image b / blocks_per_image, output rows [part * bands * band_rows, +bands * band_rows). Lane t: word
// t % words, p = t / words; row group p % rg (neighbouring lanes of a warp take neighbouring rows, whose slots the
// padding puts on other banks), segment p / rg.
template <class TT, int S, int R>
__global__ void __launch_bounds__(kRingLanes, 2)
    fwd_nhwc_ring_kernel(const uint32_t* __restrict__ x, const typename TT::S* __restrict__ w,
                         const typename TT::S* __restrict__ bias, uint32_t* __restrict__ y, ConvShape s, RingPlan p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int K = 3, KK = K * K;
  constexpr int KR = K + S * (R - 1);            // input rows a lane reads
  constexpr int KH = K - S;                      // window columns carried from one step to the next
  constexpr int V = 4 / sizeof(typename TT::S);  // channels per word
  extern __shared__ __align__(128) unsigned char ring_smem[];
  uint64_t* bar = reinterpret_cast<uint64_t*>(ring_smem);
  uint32_t* slots = reinterpret_cast<uint32_t*>(ring_smem + p.bar_bytes);
  const int tid = threadIdx.x;
  const int n = blockIdx.x / p.blocks_per_image;
  const int part = blockIdx.x - n * p.blocks_per_image;
  const int oh_begin = part * p.bands * p.band_rows;
  const int oh_end = min(s.OH, oh_begin + p.bands * p.band_rows);
  const int r_first = max(0, oh_begin * S - s.PH);                 // the block's input rows
  const int r_last = min(s.H - 1, (oh_end - 1) * S - s.PH + K - 1);
  const uint32_t* xn = x + static_cast<size_t>(n) * s.H * s.W * p.words;
  const int pad_words = s.PW * p.words;

  if (tid == 0) {
    for (int i = 0; i < p.nslot; ++i) ring_bar_init(bar + i);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // The padding columns of every slot and the zero row; the copies never write there.
  for (int i = tid; i < p.nslot * 2 * pad_words; i += blockDim.x) {
    const int slot = i / (2 * pad_words), j = i - slot * 2 * pad_words;
    slots[slot * p.slot_words + (j < pad_words ? j : (s.W + s.PW) * p.words + j - pad_words)] = 0u;
  }
  for (int i = tid; i < p.slot_words; i += blockDim.x) slots[p.nslot * p.slot_words + i] = 0u;
  __syncthreads();

  // Lane 0 issues the copies: row r goes to slot (r - r_first) % nslot, its k-th use of that slot, k =
  // (r - r_first) / nslot, completing that slot's barrier phase k.
  int next_row = r_first;
  auto issue_until = [&](int end_row) {  // rows [next_row, min(end_row, r_last + 1))
    for (; next_row <= r_last && next_row < end_row; ++next_row) {
      const int slot = (next_row - r_first) % p.nslot;
      ring_copy(slots + slot * p.slot_words + pad_words, xn + static_cast<size_t>(next_row) * s.W * p.words,
                p.row_bytes, bar + slot);
    }
  };
  if (tid == 0) issue_until(r_first + p.nslot);

  const int cw = tid % p.words, pp = tid / p.words;
  const int q = pp % p.rg, sgi = pp / p.rg;
  const int c0 = sgi * p.seg, c1 = min(s.OW, c0 + p.seg);
  const bool lane_works = pp < p.P && c0 < c1;

  // The lane's channels are fixed: its weights (and bias) live in registers.
  float wr[KK][V], b[V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const int c = cw * V + v;
#pragma unroll
    for (int k = 0; k < KK; ++k) wr[k][v] = TT::to_acc(__ldg(w + c * KK + k));
    b[v] = bias != nullptr ? TT::to_acc(__ldg(bias + c)) : 0.f;
  }

  for (int band = 0; band < p.bands; ++band) {
    const int ohb = oh_begin + band * p.band_rows;
    if (ohb >= oh_end) break;  // the same for every lane
    const int oh = ohb + q * R;
    if (lane_works && oh < oh_end) {
      const int rows = min(R, oh_end - oh);  // the lane's output rows that exist
      // Input row kh of the lane: its slot once the copy has landed, else the zero row (padding, or a row only an
      // output row past oh_end would read).
      const uint32_t* rp[KR];
#pragma unroll
      for (int kh = 0; kh < KR; ++kh) {
        const int ih = oh * S - s.PH + kh;
        if (ih >= r_first && ih <= r_last && kh < (rows - 1) * S + K) {
          const int k = (ih - r_first) / p.nslot, slot = ih - r_first - k * p.nslot;
          ring_wait(bar + slot, k & 1);
          rp[kh] = slots + slot * p.slot_words + cw;
        } else {
          rp[kh] = slots + p.nslot * p.slot_words + cw;
        }
      }
      // held[kh][j]: slot column ow * S + j (input column ow * S - PW + j) before step ow, widened.
      float held[KR][KH][V];
#pragma unroll
      for (int kh = 0; kh < KR; ++kh)
#pragma unroll
        for (int j = 0; j < KH; ++j) widen_word<TT, V>(rp[kh][(c0 * S + j) * p.words], held[kh][j]);
      const uint32_t* next[KR];
#pragma unroll
      for (int kh = 0; kh < KR; ++kh) next[kh] = rp[kh] + (c0 * S + KH) * p.words;
      // Opaque to the compiler, as in the column walk: the pointer stays in registers and each store is one
      // address add, instead of the output offset rebuilt from the shape at every store.
      uint32_t* yp = y + ((static_cast<size_t>(n) * s.OH + oh) * s.OW + c0) * p.words + cw;
      asm("" : "+l"(yp));
      const int row_words = s.OW * p.words;  // from one output row to the next
      const int step_words = S * p.words;
      // U steps from column ow: their new words first, then the products; CHECKED: some of the U steps may lie
      // past the segment's end (the last group), which then neither load nor store.
      auto steps = [&](auto checked, int ow) {
        constexpr bool kChecked = decltype(checked)::value;
        uint32_t raw[kRingUnroll][KR][S];
#pragma unroll
        for (int u = 0; u < kRingUnroll; ++u)
#pragma unroll
          for (int kh = 0; kh < KR; ++kh)
#pragma unroll
            for (int d = 0; d < S; ++d)
              raw[u][kh][d] = !kChecked || ow + u < c1 ? next[kh][u * step_words + d * p.words] : 0u;
#pragma unroll
        for (int kh = 0; kh < KR; ++kh) next[kh] += kRingUnroll * step_words;
#pragma unroll
        for (int u = 0; u < kRingUnroll; ++u) {
          float acc[R][V];
          column_window_step<TT, S, R, V>(wr, b, held, raw[u], acc);
          if (s.act != kActNone) {
#pragma unroll
            for (int r = 0; r < R; ++r) activate(acc[r], s.act);
          }
          if (!kChecked || ow + u < c1) {
#pragma unroll
            for (int r = 0; r < R; ++r)
              if (r < rows) store_global(yp + (r * row_words + u * p.words), narrow_word<TT, V>(acc[r]));
          }
        }
        yp += kRingUnroll * p.words;
      };
      int ow = c0;
      for (; ow + kRingUnroll <= c1; ow += kRingUnroll) steps(std::false_type{}, ow);
      if (ow < c1) steps(std::true_type{}, ow);
    }
    __syncthreads();  // every lane is done with the rows below the next band's first
    if (tid == 0) {
      // The async proxy's writes into the freed slots come after the lanes' reads of them.
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      issue_until(max(r_first, (ohb + p.band_rows) * S - s.PH) + p.nslot);
    }
  }
#endif
}

// Shared memory per block for 2 blocks per SM: 228 KB per SM, of which the hardware reserves 1 KB per block.
constexpr size_t kRingBudget = 113 * 1024;

// A plan for R output rows per lane, or false when the case does not fit: words a multiple of 4 (16-byte rows,
// slots and padding offsets for the bulk copies), at most 256 of them, and a ring of at least one band plus one
// band ahead within kRingBudget. Of the segmentations (nseg a power of two dividing P) the one with the fewest
// segments whose ring holds two bands ahead, else one; then as many slots as the budget holds. rows_per_block: the
// output rows a block takes (RING_BLOCK_ROWS, rounded to whole bands).
bool plan_ring(const ConvShape& s, DType dt, int S, int R, int rows_per_block, RingPlan* out) {
  RingPlan p{};
  const int V = dt == DType::F32 ? 1 : 2;
  p.words = s.C / V;
  if (p.words % 4 != 0 || p.words > kRingLanes) return false;
  p.P = kRingLanes / p.words;
  const int KH = 3 - S;
  p.slot_words = (s.W + 2 * s.PW) * p.words;
  // Rows of neighbouring row groups sit in neighbouring slots: a slot stride of words (mod 32) puts the 32 / words
  // rows a warp reads on different banks.
  if (p.words < 32) {
    while (p.slot_words % 32 != p.words) p.slot_words += 4;
  }
  p.row_bytes = static_cast<unsigned>(s.W) * p.words * 4;
  const size_t slot_bytes = static_cast<size_t>(p.slot_words) * 4;
  auto bar_bytes = [](int nslot) { return (nslot * 8 + 127) / 128 * 128; };  // the slots start 128-byte aligned
  auto ring_bytes = [&](int nslot) { return bar_bytes(nslot) + (nslot + 1) * slot_bytes; };  // + the zero slot
  bool found = false;
  for (int ahead = 2; ahead >= 1 && !found; --ahead) {
    for (int nseg = 1; nseg <= p.P && !found; nseg *= 2) {
      if (p.P % nseg != 0) continue;
      const int rg = p.P / nseg;
      const int band_rows = rg * R;
      const int band_in = band_rows * S + KH;
      if (ring_bytes(band_in + ahead * band_rows * S) > kRingBudget) continue;
      p.nseg = nseg;
      p.rg = rg;
      p.band_rows = band_rows;
      found = true;
    }
  }
  if (!found) return false;
  p.seg = ceil_div(s.OW, p.nseg);
  for (p.nslot = static_cast<int>(kRingBudget / slot_bytes); ring_bytes(p.nslot) > kRingBudget;) --p.nslot;
  p.bar_bytes = bar_bytes(p.nslot);
  const int want = rows_per_block > 0 ? rows_per_block : s.OH;
  p.bands = ceil_div(want < s.OH ? want : s.OH, p.band_rows);
  p.blocks_per_image = ceil_div(s.OH, p.bands * p.band_rows);
  p.smem = ring_bytes(p.nslot);
  *out = p;
  return true;
}

template <class TT, int S, int R>
void launch_ring(const ConvShape& s, const RingPlan& p, const void* x, const void* w, const void* bias, void* y,
                 cudaStream_t stream) {
  using Sx = typename TT::S;
  auto kernel = fwd_nhwc_ring_kernel<TT, S, R>;
  static std::atomic<uint64_t> opted_in{0};
  opt_in_shared_memory(kernel, static_cast<int>(kRingBudget), opted_in);
  const long long blocks = static_cast<long long>(s.N) * p.blocks_per_image;
  kernel<<<static_cast<unsigned>(blocks), kRingLanes, p.smem, stream>>>(
      static_cast<const uint32_t*>(x), static_cast<const Sx*>(w), static_cast<const Sx*>(bias),
      static_cast<uint32_t*>(y), s, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT>
bool ring_by_shape(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                   cudaStream_t stream) {
  const int R = knob(Knob::kRingRows, dt) == 1 ? 1 : 2;
  RingPlan p;
  if (!plan_ring(s, dt, s.SH, R, knob(Knob::kRingBlockRows, dt), &p)) return false;
  if (s.SH == 1) {
    (R == 2 ? launch_ring<TT, 1, 2> : launch_ring<TT, 1, 1>)(s, p, x, w, bias, y, stream);
  } else {
    (R == 2 ? launch_ring<TT, 2, 2> : launch_ring<TT, 2, 1>)(s, p, x, w, bias, y, stream);
  }
  return true;
}

}  // namespace

bool forward_nhwc_ring(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                       cudaStream_t stream) {
  if (!aligned(x, 16) || compute_capability_major() < 9) return false;  // bulk copies: 16-byte rows, sm_90
  switch (dt) {
    case DType::F32: return ring_by_shape<F32T>(s, dt, x, w, bias, y, stream);
    case DType::F16: return ring_by_shape<F16T>(s, dt, x, w, bias, y, stream);
    case DType::BF16: return ring_by_shape<BF16T>(s, dt, x, w, bias, y, stream);
    default: return false;
  }
}

}  // namespace mdw
