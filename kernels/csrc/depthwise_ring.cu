// The NHWC 3x3 forward fed by bulk copies into a ring of input rows (FWD_RING), and the stride-1 backward fed the same
// way from rings of grad_out and x rows (BWD_RING, further down); Hopper and later.
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

// Lanes per block: kRingLanes (launch_plan.h), kRingBlocksPerSM blocks per SM. One block of 512 lanes per SM, with
// twice the shared memory for its ring, measured slower on MobileNetV1's layers (docs/kernels.md).
constexpr int kRingBlocksPerSM = 2;

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
// GNORM: the words of out_norm.x a lane loads together when it turns a grad_out row (bwd_nhwc_ring_kernel).
constexpr int kZWords = 14;

// Block b: image b / blocks_per_image, output rows [part * bands * band_rows, +bands * band_rows). Lane t: word
// t % words, p = t / words; row group p % rg (neighbouring lanes of a warp take neighbouring rows, whose slots the
// padding puts on other banks), segment p / rg.
// NORM: the input is relu(batch_norm(x)) (norm.apply_in_depthwise): once a band's new rows have landed, the block
// applies `input_norm` to their words in place (WordNorm, the normalizing column walk's bits), each word once, where
// that walk normalizes each as every lane that reads it loads it; padding stays zero.
template <class TT, int S, int R, bool NORM = false>
__global__ void __launch_bounds__(kRingLanes, kRingBlocksPerSM)
    fwd_nhwc_ring_kernel(const uint32_t* __restrict__ x, const typename TT::S* __restrict__ w,
                         const typename TT::S* __restrict__ bias, uint32_t* __restrict__ y, ConvShape s, RingPlan p,
                         InputNorm input_norm) {
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

  WordNorm<TT, V, NORM> norm;
  norm.setup(input_norm, cw * V);
  int normed_until = r_first;  // NORM: rows below it are normalized in place

  for (int band = 0; band < p.bands; ++band) {
    const int ohb = oh_begin + band * p.band_rows;
    if (ohb >= oh_end) break;  // the same for every lane
    if constexpr (NORM) {
      // The band's rows not yet normalized: every lane waits for them, then takes the words of its own channel word
      // (word i of a row is channel word i % words: lanes step by words * P).
      const int band_last = min(r_last, (min(oh_end, ohb + p.band_rows) - 1) * S - s.PH + K - 1);
      for (int r = normed_until; r <= band_last; ++r) {
        const int k = (r - r_first) / p.nslot, slot = r - r_first - k * p.nslot;
        ring_wait(bar + slot, k & 1);
        if (pp < p.P) {
          uint32_t* row = slots + slot * p.slot_words + pad_words;
          for (int i = tid; i < s.W * p.words; i += p.words * p.P) row[i] = norm(row[i]);
        }
      }
      normed_until = max(normed_until, band_last + 1);
      __syncthreads();
    }
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
static_assert(kRingBlocksPerSM * (kRingBudget + 1024) <= 228 * 1024, "the rings of kRingBlocksPerSM blocks fit an SM");

// A block's cost besides its bands, in bands; the likely reasons, not separately measured: at its start every
// resident block asks for a full ring of rows at once, and the first band waits for them; at its end the last bands
// compute with no copy in flight. On the H200, fp16 16x112x112 (8-row bands, 14 an image, batch 256) took 0.075,
// 0.083 and 0.093 ms at 14, 7 and 4 bands per block (1, 2 and 4 waves): 1-1.7 bands a wave besides the bands
// themselves (docs/kernels.md).
constexpr float kRingBandFixed = 1.5f;

// Bands per block for a ring over `rows` rows of n images in bands of band_rows: RING_BLOCK_ROWS > 0 rows (rounded up
// to whole bands), 0 the whole image, < 0 (the default) by whole waves of the SMs' resident blocks (work_by_waves).
// A fixed 28 rows would run that layer as four waves of 4 bands; at a batch of 64, whole images would fill a quarter
// of the SMs' block slots.
int ring_bands(int n, int rows, int band_rows, int rows_per_block) {
  const int total = ceil_div(rows, band_rows);
  if (rows_per_block == 0) return total;
  if (rows_per_block > 0) return ceil_div(rows_per_block < rows ? rows_per_block : rows, band_rows);
  const long long resident = static_cast<long long>(num_sms()) * kRingBlocksPerSM;
  return work_by_waves(total, resident, kRingBandFixed,
                       [&](int bands) { return static_cast<long long>(n) * ceil_div(total, bands); });
}

// The row slots both rings keep, or false where the channels do not fit them: words of channels per pixel a multiple
// of 4 (16-byte rows, slots and padding offsets for the bulk copies) and at most kRingLanes (a lane each), P lanes per
// word, slots of W + 2 * pad columns; rows of neighbouring row groups sit in neighbouring slots, and a slot stride of
// words (mod 32) puts the 32 / words rows a warp reads on different banks.
struct RingRows {
  int words, P, slot_words;
  unsigned row_bytes;  // one row of the tensor: W * words * 4
};
bool ring_rows(const ConvShape& s, DType dt, int pad, RingRows* out) {
  RingRows r{};
  r.words = s.C / (dt == DType::F32 ? 1 : 2);
  if (r.words % 4 != 0 || r.words > kRingLanes) return false;
  r.P = kRingLanes / r.words;
  r.slot_words = (s.W + 2 * pad) * r.words;
  if (r.words < 32) {
    while (r.slot_words % 32 != r.words) r.slot_words += 4;
  }
  r.row_bytes = static_cast<unsigned>(s.W) * r.words * 4;
  *out = r;
  return true;
}

// The mbarriers of nslot slots, padded so that the slots after them start 128-byte aligned.
constexpr size_t ring_bar_bytes(int nslot) { return (static_cast<size_t>(nslot) * 8 + 127) / 128 * 128; }

// A plan for R output rows per lane, or false when the case does not fit: the channels ring_rows takes and a ring of
// at least one band plus one band ahead within kRingBudget. Of the segmentations (nseg dividing P) the one with the
// fewest segments whose ring holds two bands ahead, else one; then as many slots as the budget holds (36 words, 72
// 16-bit channels, leave P = 7: one segment needs 7-row bands, which no ring of 56-wide rows holds at 2 blocks per
// SM; 7 segments of one row group fit). rows_per_block: RING_BLOCK_ROWS (ring_bands).
bool plan_ring(const ConvShape& s, DType dt, int S, int R, int rows_per_block, RingPlan* out) {
  RingPlan p{};
  RingRows rows;
  if (!ring_rows(s, dt, s.PW, &rows)) return false;
  p.words = rows.words;
  p.P = rows.P;
  p.slot_words = rows.slot_words;
  p.row_bytes = rows.row_bytes;
  const int KH = 3 - S;
  const size_t slot_bytes = static_cast<size_t>(p.slot_words) * 4;
  auto ring_bytes = [&](int nslot) { return ring_bar_bytes(nslot) + (nslot + 1) * slot_bytes; };  // + the zero slot
  bool found = false;
  for (int ahead = 2; ahead >= 1 && !found; --ahead) {
    for (int nseg = 1; nseg <= p.P && !found; ++nseg) {
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
  p.bar_bytes = static_cast<int>(ring_bar_bytes(p.nslot));
  p.bands = ring_bands(s.N, s.OH, p.band_rows, rows_per_block);
  p.blocks_per_image = ceil_div(s.OH, p.bands * p.band_rows);
  p.smem = ring_bytes(p.nslot);
  *out = p;
  return true;
}

template <class TT, int S, int R, bool NORM>
void launch_ring(const ConvShape& s, const RingPlan& p, const void* x, const void* w, const void* bias, void* y,
                 cudaStream_t stream, const InputNorm& norm) {
  using Sx = typename TT::S;
  auto kernel = fwd_nhwc_ring_kernel<TT, S, R, NORM>;
  static std::atomic<uint64_t> opted_in{0};
  opt_in_shared_memory(kernel, static_cast<int>(kRingBudget), opted_in);
  const long long blocks = static_cast<long long>(s.N) * p.blocks_per_image;
  kernel<<<static_cast<unsigned>(blocks), kRingLanes, p.smem, stream>>>(
      static_cast<const uint32_t*>(x), static_cast<const Sx*>(w), static_cast<const Sx*>(bias),
      static_cast<uint32_t*>(y), s, p, norm);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT, bool NORM>
bool ring_by_shape(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                   cudaStream_t stream, const InputNorm& norm) {
  const int R = knob(Knob::kRingRows, dt) == 1 ? 1 : 2;
  RingPlan p;
  if (!plan_ring(s, dt, s.SH, R, knob(Knob::kRingBlockRows, dt), &p)) return false;
  if (s.SH == 1) {
    (R == 2 ? launch_ring<TT, 1, 2, NORM> : launch_ring<TT, 1, 1, NORM>)(s, p, x, w, bias, y, stream, norm);
  } else {
    (R == 2 ? launch_ring<TT, 2, 2, NORM> : launch_ring<TT, 2, 1, NORM>)(s, p, x, w, bias, y, stream, norm);
  }
  return true;
}

// ---- the backward: both gradients of the NHWC 3x3 stride-1 padding-1 convolution (BWD_RING) ----
//
// The input-row walk of depthwise_weight_grad.cu (wgrad_nhwc_input_row_kernel, NORM false, DGRAD) with its rows
// streamed in by bulk copies: a block takes an image's band of input rows with every channel and keeps two rings, one
// of x rows and one of grad_out rows (a padding column of zeros at each end, as the forward's; a zero slot for the
// output rows outside the image). Lane (cw, p): input row p % rg of each band, column segment p / rg. At column iw it
// holds grad_out columns iw and iw - 1 of output rows ih + 1 - kh and takes the new column iw + 1 and x(ih, iw) from
// shared memory: grad_input(ih, iw) summed in the input-row walk's order (the same bits), the 9 weight taps' and the
// bias's products into the lane's sums. At the end the block adds its lanes' sums per word in lane order and writes
// the partials ws[block][C][10]; weight_grad_finalize adds the blocks in index order. Bitwise repeatable; the weight
// gradient groups its products otherwise than the input-row walk's grid, so it is that walk's to a rounding.
// NORM: norm.apply_in_depthwise's backward with the BatchNorm's gradient sums (the sums walk of
// depthwise_weight_grad.cu, wgrad_nhwc_input_row_kernel with SUMS): x is y, the BatchNorm + ReLU's input, each word
// normalized as the lane reads it (each is read by one lane only); no bias slot (written 0); the lane adds sum(g) and
// sum(g * (y - mean)) at each word it writes (add_grad_sums), and the block adds its lanes' in lane order into
// sums[block][2][C]. grad_input has the walk's bits; the sums, grouped by block, are the walk's to a rounding.
// GNORM (with NORM): grad_out is the gradient of the BatchNorm + ReLU after the convolution (out_norm): once a band's
// new grad_out rows have landed, the block turns their words in place into that BatchNorm's input gradient
// (WordGradNorm, the bits its own input-gradient pass would have stored), each word once, loading out_norm.x's words
// from global memory (a third ring does not fit beside the two at 2 blocks per SM); the lanes then read them as above.

struct BwdRingPlan {
  int words, P, nseg, seg, rg;  // a band is rg input rows; nseg * rg = P lanes per word
  int bands, blocks_per_image;
  int nslot_x, nslot_g;         // slots of the two rings; one zero slot after the grad_out ring's
  int slot_words;               // (W + 2) * words, padded as the forward's
  unsigned row_bytes;           // one row of x or grad_out: W * words * 4
  int bar_bytes;                // nslot_x + nslot_g mbarriers, padded to 128 bytes
  size_t smem;                  // its slots at least the final reduction's P * words * (10, NORM: 12) * V floats
};

template <class TT, bool NORM = false, bool GNORM = false>
__global__ void __launch_bounds__(kRingLanes, kRingBlocksPerSM)
    bwd_nhwc_ring_kernel(const uint32_t* __restrict__ go, const uint32_t* __restrict__ x,
                         const typename TT::S* __restrict__ w, uint32_t* __restrict__ gx, float* __restrict__ ws,
                         ConvShape s, BwdRingPlan p, InputNorm input_norm, float* __restrict__ sums,
                         OutputGradNorm out_norm) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(NORM || !GNORM, "the BatchNorm after the convolution is applied by the sums backward only");
  constexpr int K = 3, KK = K * K;
  constexpr int V = 4 / sizeof(typename TT::S);
  constexpr int U = kRingUnroll;
  extern __shared__ __align__(128) unsigned char ring_smem[];
  uint64_t* bar_x = reinterpret_cast<uint64_t*>(ring_smem);
  uint64_t* bar_g = bar_x + p.nslot_x;
  uint32_t* slots_x = reinterpret_cast<uint32_t*>(ring_smem + p.bar_bytes);
  uint32_t* slots_g = slots_x + p.nslot_x * p.slot_words;
  uint32_t* zero_slot = slots_g + p.nslot_g * p.slot_words;
  const int tid = threadIdx.x;
  const int n = blockIdx.x / p.blocks_per_image;
  const int part = blockIdx.x - n * p.blocks_per_image;
  const int ih_begin = part * p.bands * p.rg;
  const int ih_end = min(s.H, ih_begin + p.bands * p.rg);
  const int g_first = max(0, ih_begin - 1), g_last = min(s.H - 1, ih_end);  // grad_out rows (OH == H)
  const size_t image = static_cast<size_t>(n) * s.H * s.W * p.words;
  const uint32_t* xn = x + image;
  const uint32_t* gn = go + image;

  if (tid == 0) {
    for (int i = 0; i < p.nslot_x + p.nslot_g; ++i) ring_bar_init(bar_x + i);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // Padding columns of every slot (x's are never read there; zeroed alike) and the zero slot.
  const int nslots = p.nslot_x + p.nslot_g;
  for (int i = tid; i < nslots * 2 * p.words; i += blockDim.x) {
    const int slot = i / (2 * p.words), j = i - slot * 2 * p.words;
    slots_x[slot * p.slot_words + (j < p.words ? j : s.W * p.words + j)] = 0u;
  }
  for (int i = tid; i < p.slot_words; i += blockDim.x) zero_slot[i] = 0u;
  __syncthreads();

  int x_next = ih_begin, g_next = g_first;  // lane 0's next rows to copy
  auto issue_until = [&](int x_end, int g_end) {
    for (; x_next < ih_end && x_next < x_end; ++x_next) {
      const int slot = (x_next - ih_begin) % p.nslot_x;
      ring_copy(slots_x + slot * p.slot_words + p.words, xn + static_cast<size_t>(x_next) * s.W * p.words, p.row_bytes,
                bar_x + slot);
    }
    for (; g_next <= g_last && g_next < g_end; ++g_next) {
      const int slot = (g_next - g_first) % p.nslot_g;
      ring_copy(slots_g + slot * p.slot_words + p.words, gn + static_cast<size_t>(g_next) * s.W * p.words, p.row_bytes,
                bar_g + slot);
    }
  };
  if (tid == 0) issue_until(ih_begin + p.nslot_x, g_first + p.nslot_g);

  const int cw = tid % p.words, pp = tid / p.words;
  const int q = pp % p.rg, sgi = pp / p.rg;
  const int c0 = sgi * p.seg, c1 = min(s.W, c0 + p.seg);
  const bool lane_works = pp < p.P && c0 < c1;
  float wr[KK][V];
#pragma unroll
  for (int v = 0; v < V; ++v)
#pragma unroll
    for (int k = 0; k < KK; ++k) wr[k][v] = TT::to_acc(__ldg(w + (cw * V + v) * KK + k));
  float acc[KK + 1][V];
  fill(acc, 0.f);
  float bn_sums[2][V];  // NORM: sum(g), sum(g * (y - mean))
  fill(bn_sums, 0.f);
  WordNorm<TT, V, NORM> norm;
  norm.setup(input_norm, cw * V);
  WordGradNorm<TT, V, GNORM> gnorm;
  gnorm.setup(out_norm, cw * V);
  const uint32_t* zn = GNORM ? static_cast<const uint32_t*>(out_norm.x) + image : nullptr;
  int g_applied = g_first;  // GNORM: grad_out rows below it hold the BatchNorm's input gradient

  for (int band = 0; band < p.bands; ++band) {
    const int ib = ih_begin + band * p.rg;
    if (ib >= ih_end) break;  // the same for every lane
    if constexpr (GNORM) {
      // The band's grad_out rows not yet turned: every lane waits for them and takes the words of its own channel
      // word (word i of a row is channel word i % words: lanes step by words * P), out_norm.x's words loaded
      // kZWords at a time before the row's copy is waited for (14: a whole row of MobileNetV1's ring layers per lane,
      // one round trip to memory).
      const int g_until = min(g_last, ib + p.rg);
      for (int r = g_applied; r <= g_until; ++r) {
        const int k = (r - g_first) / p.nslot_g, slot = r - g_first - k * p.nslot_g;
        uint32_t* row = slots_g + slot * p.slot_words + p.words;
        const uint32_t* zr = zn + static_cast<size_t>(r) * s.W * p.words;
        const int row_words = s.W * p.words, step = p.words * p.P;
        bool waited = false;
        for (int i0 = tid; pp < p.P && i0 < row_words; i0 += kZWords * step) {
          uint32_t zw[kZWords];
#pragma unroll
          for (int u = 0; u < kZWords; ++u) zw[u] = i0 + u * step < row_words ? __ldg(zr + i0 + u * step) : 0u;
          if (!waited) ring_wait(bar_g + slot, k & 1);
          waited = true;
#pragma unroll
          for (int u = 0; u < kZWords; ++u)
            if (i0 + u * step < row_words) row[i0 + u * step] = gnorm.apply(row[i0 + u * step], zw[u]);
        }
      }
      g_applied = max(g_applied, g_until + 1);
      __syncthreads();
    }
    const int ih = ib + q;
    if (lane_works && ih < ih_end) {
      {
        const int k = (ih - ih_begin) / p.nslot_x, slot = ih - ih_begin - k * p.nslot_x;
        ring_wait(bar_x + slot, k & 1);
      }
      const uint32_t* xr = slots_x + ((ih - ih_begin) % p.nslot_x) * p.slot_words + p.words + cw;  // x column 0
      // grad_out row ih + 1 - kh from its column -1 (the padding), or the zero slot outside the image.
      const uint32_t* gr[K];
#pragma unroll
      for (int kh = 0; kh < K; ++kh) {
        const int oh = ih + 1 - kh;
        if (oh >= g_first && oh <= g_last) {
          const int k = (oh - g_first) / p.nslot_g, slot = oh - g_first - k * p.nslot_g;
          ring_wait(bar_g + slot, k & 1);
          gr[kh] = slots_g + slot * p.slot_words + cw;
        } else {
          gr[kh] = zero_slot + cw;
        }
      }
      // held[kh][j] = grad_out column iw - j of row kh before step iw.
      float held[K][2][V];
#pragma unroll
      for (int kh = 0; kh < K; ++kh) {
        widen_word<TT, V>(gr[kh][(c0 + 1) * p.words], held[kh][0]);
        widen_word<TT, V>(gr[kh][c0 * p.words], held[kh][1]);
      }
      const uint32_t* gnext[K];  // grad_out column iw + 1 of each row at step iw
#pragma unroll
      for (int kh = 0; kh < K; ++kh) gnext[kh] = gr[kh] + (c0 + 2) * p.words;
      const uint32_t* xnext = xr + c0 * p.words;
      uint32_t* gxp = gx + image + (static_cast<size_t>(ih) * s.W + c0) * p.words + cw;
      asm("" : "+l"(gxp));
      auto steps = [&](auto checked, int iw0) {
        constexpr bool kChecked = decltype(checked)::value;
        uint32_t xraw[U], graw[U][K];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const bool ok = !kChecked || iw0 + u < c1;
          xraw[u] = ok ? xnext[u * p.words] : 0u;
#pragma unroll
          for (int kh = 0; kh < K; ++kh) graw[u][kh] = ok ? gnext[kh][u * p.words] : 0u;
        }
        xnext += U * p.words;
#pragma unroll
        for (int kh = 0; kh < K; ++kh) gnext[kh] += U * p.words;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          float xv[V], fresh[K][V];
          widen_word<TT, V>(norm(xraw[u]), xv);
#pragma unroll
          for (int kh = 0; kh < K; ++kh) widen_word<TT, V>(graw[u][kh], fresh[kh]);
          float d[V];
          input_row_grad<V>(wr, held, fresh, d);  // grad_input(ih, iw), in the input-row walk's order
          if (!kChecked || iw0 + u < c1) {
            const uint32_t stored = narrow_word<TT, V>(d);
            store_global(gxp + u * p.words, stored);
            if constexpr (NORM) {
              add_grad_sums<TT, V>(stored, xraw[u], xv, true, norm.mean, bn_sums);
            } else {
#pragma unroll
              for (int v = 0; v < V; ++v) acc[KK][v] += held[1][0][v];  // the bias: grad_out(ih, iw)
            }
#pragma unroll
            for (int kh = 0; kh < K; ++kh)
#pragma unroll
              for (int v = 0; v < V; ++v) {
                acc[kh * K + 0][v] = fmaf(fresh[kh][v], xv[v], acc[kh * K + 0][v]);
                acc[kh * K + 1][v] = fmaf(held[kh][0][v], xv[v], acc[kh * K + 1][v]);
                acc[kh * K + 2][v] = fmaf(held[kh][1][v], xv[v], acc[kh * K + 2][v]);
              }
          }
#pragma unroll
          for (int kh = 0; kh < K; ++kh)
#pragma unroll
            for (int v = 0; v < V; ++v) {
              held[kh][1][v] = held[kh][0][v];
              held[kh][0][v] = fresh[kh][v];
            }
        }
        gxp += U * p.words;
      };
      int iw = c0;
      for (; iw + U <= c1; iw += U) steps(std::false_type{}, iw);
      if (iw < c1) steps(std::true_type{}, iw);
    }
    __syncthreads();  // every lane is done with the rows below the next band's
    if (tid == 0) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      const int ib_next = ib + p.rg;
      issue_until(ib_next + p.nslot_x, max(g_first, ib_next - 1) + p.nslot_g);
    }
  }

  // Every copy has landed (each row was waited for by some lane before the last barrier): the slots' memory now
  // takes the lanes' sums, [p][word][(KK + 1 + NORM's 2) * V], added per word in lane order. (Not the mbarriers':
  // memory of a live mbarrier is not to be reused.)
  constexpr int E = (KK + 1 + (NORM ? 2 : 0)) * V;
  float* red = reinterpret_cast<float*>(slots_x);
  __syncthreads();
  if (pp < p.P) {
#pragma unroll
    for (int k = 0; k <= KK; ++k)
#pragma unroll
      for (int v = 0; v < V; ++v) red[(pp * p.words + cw) * E + k * V + v] = acc[k][v];
    if constexpr (NORM) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int v = 0; v < V; ++v) red[(pp * p.words + cw) * E + (KK + 1 + j) * V + v] = bn_sums[j][v];
    }
  }
  __syncthreads();
  for (int idx = tid; idx < p.words * E; idx += blockDim.x) {
    const int c_word = idx / E, e = idx - c_word * E;
    float sum = 0.f;
    for (int lane_p = 0; lane_p < p.P; ++lane_p) sum += red[(lane_p * p.words + c_word) * E + e];
    const int c = c_word * V + e % V, k = e / V;
    if (k <= KK) {
      ws[(static_cast<size_t>(blockIdx.x) * s.C + c) * (KK + 1) + k] = sum;
    } else {
      sums[(static_cast<size_t>(blockIdx.x) * 2 + (k - KK - 1)) * s.C + c] = sum;  // batchnorm_relu.cu's layout
    }
  }
#endif
}

// A plan for the backward, or false when it does not fit: as plan_ring, with both rings (x: a band plus `ahead`
// bands; grad_out: the band, its two neighbour rows and `ahead` bands) and the zero slot within kRingBudget, and the
// final reduction's floats too.
bool plan_bwd_ring(const ConvShape& s, DType dt, int rows_per_block, bool norm, BwdRingPlan* out) {
  BwdRingPlan p{};
  RingRows rows;
  if (!ring_rows(s, dt, 1, &rows)) return false;  // padding 1 (bwd_ring_shape)
  p.words = rows.words;
  p.P = rows.P;
  p.slot_words = rows.slot_words;
  p.row_bytes = rows.row_bytes;
  const int V = dt == DType::F32 ? 1 : 2;
  const size_t slot_bytes = static_cast<size_t>(p.slot_words) * 4;
  const size_t red_bytes = static_cast<size_t>(p.P) * p.words * (norm ? 12 : 10) * V * 4;
  auto bytes = [&](int nx, int ng) {
    const size_t bars = ring_bar_bytes(nx + ng);
    const size_t slots = static_cast<size_t>(nx + ng + 1) * slot_bytes;
    return bars + (slots > red_bytes ? slots : red_bytes);
  };
  bool found = false;
  for (int ahead = 2; ahead >= 1 && !found; --ahead) {
    for (int nseg = 1; nseg <= p.P && !found; ++nseg) {
      if (p.P % nseg != 0) continue;
      const int rg = p.P / nseg;
      if (bytes(rg * (1 + ahead), rg + 2 + ahead * rg) > kRingBudget) continue;
      p.nseg = nseg;
      p.rg = rg;
      found = true;
    }
  }
  if (!found) return false;
  p.seg = ceil_div(s.W, p.nseg);
  // The slots the budget holds beyond the band's own, shared by the two rings (grad_out's the larger half).
  p.nslot_x = p.rg;
  p.nslot_g = p.rg + 2;
  for (bool to_g = true; bytes(p.nslot_x + (to_g ? 0 : 1), p.nslot_g + (to_g ? 1 : 0)) <= kRingBudget; to_g = !to_g) {
    if (to_g) ++p.nslot_g; else ++p.nslot_x;
  }
  p.bar_bytes = static_cast<int>(ring_bar_bytes(p.nslot_x + p.nslot_g));
  p.bands = ring_bands(s.N, s.H, p.rg, rows_per_block);
  p.blocks_per_image = ceil_div(s.H, p.bands * p.rg);
  p.smem = bytes(p.nslot_x, p.nslot_g);
  *out = p;
  return true;
}

template <class TT, bool NORM = false, bool GNORM = false>
void launch_bwd_ring(const ConvShape& s, const BwdRingPlan& p, const void* go, const void* x, const void* w, void* gx,
                     void* ws, cudaStream_t stream, const InputNorm& norm = {}, float* sums = nullptr,
                     const OutputGradNorm& out_norm = {}) {
  using Sx = typename TT::S;
  auto kernel = bwd_nhwc_ring_kernel<TT, NORM, GNORM>;
  static std::atomic<uint64_t> opted_in{0};
  opt_in_shared_memory(kernel, static_cast<int>(kRingBudget), opted_in);
  const long long blocks = static_cast<long long>(s.N) * p.blocks_per_image;
  kernel<<<static_cast<unsigned>(blocks), kRingLanes, p.smem, stream>>>(
      static_cast<const uint32_t*>(go), static_cast<const uint32_t*>(x), static_cast<const Sx*>(w),
      static_cast<uint32_t*>(gx), static_cast<float*>(ws), s, p, norm, sums, out_norm);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The normalizing backward with the sums, and with the BatchNorm after the convolution where out_norm is given.
template <class TT>
void launch_bwd_ring_normed(const ConvShape& s, const BwdRingPlan& p, const void* go, const void* y, const void* w,
                            void* gx, void* ws, float* sums, const InputNorm& norm, const OutputGradNorm* out_norm,
                            cudaStream_t stream) {
  if (out_norm != nullptr) {
    launch_bwd_ring<TT, true, true>(s, p, go, y, w, gx, ws, stream, norm, sums, *out_norm);
  } else {
    launch_bwd_ring<TT, true, false>(s, p, go, y, w, gx, ws, stream, norm, sums);
  }
}

// The backward's shape conditions, beyond the pointers' alignment (backward_nhwc_ring checks those).
bool bwd_ring_shape(const ConvShape& s) {
  return s.KH == 3 && s.KW == 3 && s.SH == 1 && s.SW == 1 && s.PH == 1 && s.PW == 1 && s.DH == 1 && s.DW == 1 &&
         s.OH == s.H && s.OW == s.W;
}

}  // namespace

namespace {

// norm null: the plain forward (with bias); else the normalizing one.
template <class TT>
bool ring_forward_t(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                    const InputNorm* norm, cudaStream_t stream) {
  return norm == nullptr ? ring_by_shape<TT, false>(s, dt, x, w, bias, y, stream, InputNorm{})
                         : ring_by_shape<TT, true>(s, dt, x, w, nullptr, y, stream, *norm);
}

bool ring_forward(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                  const InputNorm* norm, cudaStream_t stream) {
  // 3x3 kernels; bulk copies: 16-byte rows, sm_90.
  if (s.KH != 3 || s.KW != 3 || !aligned(x, 16) || compute_capability_major() < 9) return false;
  switch (dt) {
    case DType::F32: return ring_forward_t<F32T>(s, dt, x, w, bias, y, norm, stream);
    case DType::F16: return ring_forward_t<F16T>(s, dt, x, w, bias, y, norm, stream);
    case DType::BF16: return ring_forward_t<BF16T>(s, dt, x, w, bias, y, norm, stream);
    default: return false;
  }
}

}  // namespace

bool forward_nhwc_ring(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                       cudaStream_t stream) {
  return ring_forward(s, dt, x, w, bias, y, nullptr, stream);
}

bool forward_nhwc_ring_normed(const ConvShape& s, DType dt, const void* x, const void* w, const InputNorm& norm,
                              void* y, cudaStream_t stream) {
  return ring_forward(s, dt, x, w, nullptr, y, &norm, stream);
}


// The backward's plan for this shape and dtype (norm: the normalizing ring's), false where the rings do not take it.
static bool plan_bwd_ring_for(const ConvShape& s, DType dt, bool norm, BwdRingPlan* p) {
  return dt != DType::F64 && bwd_ring_shape(s) && plan_bwd_ring(s, dt, knob(Knob::kRingBlockRows, dt), norm, p);
}

// The same, where this launch can also make its bulk copies: 16-byte aligned grad_out and x rows, compute capability
// 9.0 or later.
static bool plan_bwd_ring_launch(const ConvShape& s, DType dt, const void* go, const void* x, bool norm,
                                 BwdRingPlan* p) {
  return aligned(go, 16) && aligned(x, 16) && compute_capability_major() >= 9 && plan_bwd_ring_for(s, dt, norm, p);
}

int backward_nhwc_ring_chunks(const ConvShape& s, DType dt, bool norm) {
  BwdRingPlan p;
  return plan_bwd_ring_for(s, dt, norm, &p) ? s.N * p.blocks_per_image : 0;
}

int backward_nhwc_ring_normed(const ConvShape& s, DType dt, const void* go, const void* y, const void* w,
                              const InputNorm& norm, void* gx, void* ws, float* sums, const OutputGradNorm* out_norm,
                              cudaStream_t stream) {
  BwdRingPlan p;
  if (!plan_bwd_ring_launch(s, dt, go, y, true, &p)) return 0;
  switch (dt) {
    case DType::F32: launch_bwd_ring_normed<F32T>(s, p, go, y, w, gx, ws, sums, norm, out_norm, stream); break;
    case DType::F16: launch_bwd_ring_normed<F16T>(s, p, go, y, w, gx, ws, sums, norm, out_norm, stream); break;
    case DType::BF16: launch_bwd_ring_normed<BF16T>(s, p, go, y, w, gx, ws, sums, norm, out_norm, stream); break;
    default: return 0;
  }
  return s.N * p.blocks_per_image;
}

int backward_nhwc_ring(const ConvShape& s, DType dt, const void* go, const void* x, const void* w, void* gx, void* ws,
                       cudaStream_t stream) {
  BwdRingPlan p;
  if (!plan_bwd_ring_launch(s, dt, go, x, false, &p)) return 0;
  switch (dt) {
    case DType::F32: launch_bwd_ring<F32T>(s, p, go, x, w, gx, ws, stream); break;
    case DType::F16: launch_bwd_ring<F16T>(s, p, go, x, w, gx, ws, stream); break;
    case DType::BF16: launch_bwd_ring<BF16T>(s, p, go, x, w, gx, ws, stream); break;
    default: return 0;
  }
  return s.N * p.blocks_per_image;
}

}  // namespace mdw
