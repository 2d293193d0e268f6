// The NHWC tensor-core tile (FWD_MMA): the 16-bit forward and stride-1 input gradient of square 3x3, 5x5 and 7x7
// kernels at stride 1, computed by mma.sync.
//
// Per channel, one kernel row's share of 16 output rows x 8 output columns is a matrix product:
//   out[m][n] += sum_k in[row(m) + kh][col0 + k] * T[k][n],   T[k][n] = w[kh][k - n] (0 unless 0 <= k - n < K),
// k over the 16 input columns that feed those 8 outputs (8 + K - 1 <= 16 for K <= 9): one m16n8k16 mma with 16-bit
// products and fp32 sums, K of them per 128 outputs of a channel, where CUDA cores issue 4 * K * K FMAs per lane
// for the same outputs. That is what the fp16 channels_last forward lost on: the CUDA-core kernels issue more
// instructions per output than cuDNN's (docs/kernel_notes.md, "Open"), and the tensor cores take the products off
// the issue slots.
//
// A block owns a group of 8, 16 or 32 channels and a tile of output rows x columns of one or more images (small
// images: several whole images, their rows stacked along the product's 16 rows). It copies the tile's input, halo
// and padding included, into shared memory as one plane per channel (the transpose of NHWC: rows of pixels), so that
// one ldmatrix reads a product's 16 x 16 inputs; T comes from a per-channel table of weight pairs. The results go
// through shared memory back to NHWC, so that both copies move whole sectors of a pixel's channels (lanes writing
// one pixel each made the tile 3-4x the HBM floor, Nsight Compute showing L2 busy and DRAM at a quarter of its
// bandwidth). The products add the kernel rows in the order kh = 0 .. K - 1, so the result is deterministic, though
// not bitwise the CUDA-core kernels' (the tensor core adds a row's products in its own order).
//
// Measured (docs/kernels.md, "The tensor-core tile"): faster than the CUDA-core kernels only on 5x5 layers of 14 to
// 28 rows, and still slower than cuDNN's fp16 kernel there; the copies in and out and the idle halo cost more issue
// slots than the products save, and a block's copy, products and copy out do not overlap.
// In a file of its own so that the other pass files are compiled from unchanged source and keep their machine code.
#include <c10/cuda/CUDAException.h>

#include <atomic>

#include "depthwise_launchers.h"
#include "device_common.h"
#include "launch_plan.h"
#include "mma_sync.cuh"

namespace mdw {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxSmem = 110 * 1024;  // 2 blocks per SM; the planner prefers tiles of at most 72 KB (3 blocks)
constexpr int kWeightPairs = 22;  // words (w[d], w[d + 1]) of one kernel row, d = -7 .. 14 (the B fragments' reach)

// What the host decided for one launch (plan_mma_tile).
struct MmaTile {
  int cg;          // channels per block (8, 16 or 32; C is a multiple): cg / 8 octets
  int groups;      // C / cg
  int img;         // images per block (several only when th == OH)
  int th;          // output rows per image in the tile
  int ir;          // input rows per image in the tile: th + K - 1
  int nb;          // 8-column blocks per tile row
  int pitch;       // 16-bit elements per row in shared memory: 8 * odd (ldmatrix's 8 rows fall in 8 bank groups)
  int plane;       // 16-bit elements per channel plane: img * ir * pitch
  int slots;       // output rows of the tile: img * th (the products' M dimension, in blocks of 16)
  int mblocks;     // ceil(slots / 16)
  int tiles_h, tiles_w, img_blocks;
  size_t smem;     // bytes (mma_smem_bytes)
};

// The 16-bit halves of two words: lo halves (sel 0x5410) or hi halves (0x7632), the first word's in the low half.
__device__ __forceinline__ uint32_t halves(uint32_t a, uint32_t b, unsigned sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// Loads in flight per lane in the copy: each step of the copy loop takes two pixels' 16-byte vectors.
constexpr int kCopyUnroll = 4;

// Words between the starts of neighbouring channel octets' planes beyond the planes themselves: the copy's lanes of
// one warp write octs octets x 32 / octs pairs of pixels, and these offsets put them in 32 different banks.
__host__ __device__ constexpr int octet_shift(int octs) { return octs > 1 ? 32 / octs : 0; }

// Shared memory, in 32-bit words: the channel planes (8 * octs of them, plane / 2 words each, octet o's shifted by
// o * octet_shift), the weight pairs, then the output tile as NHWC pixels of cg channels and 16 spare bytes (the
// epilogue's 16-byte writes of 8 lanes then fall in different banks).
__host__ __device__ inline int mma_planes_words(const MmaTile& t) { return t.cg * (t.plane / 2) + 32; }
__host__ __device__ inline int mma_pixel_words(const MmaTile& t) { return t.cg / 2 + 4; }

// FLIP: the kernel rotated 180 degrees, no bias, no activation (the stride-1 input gradient run on
// input_grad_as_forward's shape).
template <class TT, int K, bool FLIP>
__global__ void __launch_bounds__(kThreads, 3)
    fwd_nhwc_mma_kernel(const uint4* __restrict__ x, const uint16_t* __restrict__ w,
                        const uint16_t* __restrict__ bias, uint4* __restrict__ y, ConvShape s, MmaTile t) {
  extern __shared__ __align__(16) uint32_t smem[];
  const int hp = t.pitch / 2;  // words per row
  const int plane_w = t.plane / 2;
  const int octs = t.cg / 8;
  const int oshift = octet_shift(octs);
  const int tw = 8 * t.nb;
  const int ps = mma_pixel_words(t);
  uint32_t* planes = smem;
  uint32_t* wpairs = smem + mma_planes_words(t);
  uint32_t* ostage = wpairs + t.cg * K * kWeightPairs;

  int b = blockIdx.x;
  const int grp = b % t.groups;
  b /= t.groups;
  const int tw_i = b % t.tiles_w;
  b /= t.tiles_w;
  const int th_i = b % t.tiles_h;
  const int n0 = (b / t.tiles_h) * t.img;
  const int c0 = grp * t.cg;
  const int oh0 = th_i * t.th, ow0 = tw_i * tw;
  const int ih0 = oh0 - s.PH, iw0 = ow0 - s.PW;
  const int vecs = s.C / 8;  // 16-byte vectors per pixel

  // The input: lane (o, cp, row) reads octet o of pixels 2cp and 2cp + 1 of a row (neighbouring lanes: the rest of
  // those pixels' channels, so a warp reads whole 32-byte sectors) and writes each channel's pair of them as one word
  // of that channel's plane; zeros outside the image. Rows step without divisions (integer divisions by runtime
  // values in a copy loop cost as much as the convolution).
  {
    const int lanes_row = octs * hp;     // the planner keeps it <= kThreads
    const int step = kThreads / lanes_row;  // rows in parallel
    const int o = threadIdx.x % octs;
    const int cp = (threadIdx.x / octs) % hp;
    int r = threadIdx.x / lanes_row;
    if (r < step) {
      int img_i = 0;
      while (r >= t.ir) r -= t.ir, ++img_i;
      const int iw = iw0 + 2 * cp;
      const bool a_in = iw >= 0 && iw < s.W, b_in = iw + 1 >= 0 && iw + 1 < s.W;
      const uint4* xo = x + c0 / 8 + o;
      uint32_t* dst0 = planes + 8 * o * plane_w + o * oshift + cp;
      while (img_i < t.img) {
        uint4 va[kCopyUnroll], vb[kCopyUnroll];
        int row_at[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          va[u] = vb[u] = make_uint4(0, 0, 0, 0);
          row_at[u] = -1;
          if (img_i < t.img) {
            const int ih = ih0 + r, n = n0 + img_i;
            if (n < s.N && ih >= 0 && ih < s.H) {
              const uint4* src = xo + ((static_cast<size_t>(n) * s.H + ih) * s.W + iw) * vecs;
              if (a_in) va[u] = __ldg(src);
              if (b_in) vb[u] = __ldg(src + vecs);
            }
            row_at[u] = (img_i * t.ir + r) * hp;
            r += step;
            while (r >= t.ir) r -= t.ir, ++img_i;
          }
        }
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          if (row_at[u] < 0) continue;
          uint32_t* d = dst0 + row_at[u];
          d[0 * plane_w] = halves(va[u].x, vb[u].x, 0x5410);
          d[1 * plane_w] = halves(va[u].x, vb[u].x, 0x7632);
          d[2 * plane_w] = halves(va[u].y, vb[u].y, 0x5410);
          d[3 * plane_w] = halves(va[u].y, vb[u].y, 0x7632);
          d[4 * plane_w] = halves(va[u].z, vb[u].z, 0x5410);
          d[5 * plane_w] = halves(va[u].z, vb[u].z, 0x7632);
          d[6 * plane_w] = halves(va[u].w, vb[u].w, 0x5410);
          d[7 * plane_w] = halves(va[u].w, vb[u].w, 0x7632);
        }
      }
    }
  }
  // The weight pairs: wpairs[(c * K + kh) * 22 + d + 7] = (w[kh][d], w[kh][d + 1]), zero outside the row (rotated
  // for FLIP), so that each lane's B fragment is two loads.
  for (int i = threadIdx.x; i < t.cg * K * kWeightPairs; i += kThreads) {
    const int e = i % kWeightPairs, ck = i / kWeightPairs;
    const int kh = ck % K, c = ck / K;
    const uint16_t* wc = w + static_cast<size_t>(c0 + c) * K * K;
    auto tap = [&](int kw) -> uint32_t {
      if (kw < 0 || kw >= K) return 0u;
      return FLIP ? wc[(K - 1 - kh) * K + (K - 1 - kw)] : wc[kh * K + kw];
    };
    wpairs[i] = tap(e - 7) | tap(e - 6) << 16;
  }
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;
  const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8;  // the row this lane gives ldmatrix
  const int lcol = (lane >> 4) * 8;                      // and its first column
  const int e0 = 2 * tq - g + 7;                         // its B fragment's weight pairs: e0 and e0 + 8
  const unsigned planes_addr = static_cast<unsigned>(__cvta_generic_to_shared(planes));
  const int items = octs * t.mblocks * t.nb;
  for (int it = warp; it < items; it += kThreads / 32) {
    const int nbi = it % t.nb;
    const int mbi = (it / t.nb) % t.mblocks;
    const int q = it / (t.nb * t.mblocks);
    int slot = mbi * 16 + lrow;
    if (slot >= t.slots) slot = t.slots - 1;  // a row past the tile: any row, its outputs are not stored
    const int li = slot / t.th;
    const unsigned a_base =
        planes_addr + 4u * static_cast<unsigned>(8 * q * plane_w + q * oshift) +
        2u * static_cast<unsigned>((li * t.ir + slot - li * t.th) * t.pitch + 8 * nbi + lcol);
    float acc[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float bv = !FLIP && bias != nullptr ? TT::to_acc(__ldg(bias + c0 + 8 * q + i)) : 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = bv;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t* wp = wpairs + (8 * q + i) * K * kWeightPairs + e0;
#pragma unroll
      for (int kh = 0; kh < K; ++kh) {
        uint32_t a[4];
        ldmatrix_x4(a, a_base + 2u * static_cast<unsigned>(i * t.plane + kh * t.pitch));
        mma_16816<TT>(acc[i], a, wp[kh * kWeightPairs], wp[kh * kWeightPairs + 8]);
      }
    }
    // The accumulators: (row g, columns 2tq, 2tq + 1) and (row g + 8, the same columns), 8 channels each, into the
    // output tile; the copy below writes them out a pixel's channels at a time.
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int sl = mbi * 16 + g + 8 * (p >> 1);
      if (sl >= t.slots) continue;
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = acc[i][p];
      if (!FLIP && s.act != kActNone) activate(v, s.act);
      uint4 out;
      out.x = narrow_word<TT, 2>({v[0], v[1]});
      out.y = narrow_word<TT, 2>({v[2], v[3]});
      out.z = narrow_word<TT, 2>({v[4], v[5]});
      out.w = narrow_word<TT, 2>({v[6], v[7]});
      const int col = 8 * nbi + 2 * tq + (p & 1);
      *reinterpret_cast<uint4*>(ostage + (sl * tw + col) * ps + 4 * q) = out;
    }
  }
  __syncthreads();

  // The output tile to y: lane (o, pixel), neighbouring lanes a pixel's neighbouring channels.
  {
    const int o = threadIdx.x % octs;
    const int pstep = kThreads / octs;  // pixels per pass
    const int dslot = pstep / tw, dcol = pstep - dslot * tw;
    int col = threadIdx.x / octs, slot = col / tw;
    col -= slot * tw;
    int li = slot / t.th, row = slot - li * t.th;
    uint4* yo = y + c0 / 8 + o;
    while (slot < t.slots) {
      const int n = n0 + li, oh = oh0 + row, ow = ow0 + col;
      if (n < s.N && oh < s.OH && ow < s.OW)
        yo[((static_cast<size_t>(n) * s.OH + oh) * s.OW + ow) * vecs] =
            *reinterpret_cast<const uint4*>(ostage + (slot * tw + col) * ps + 4 * o);
      col += dcol;
      int carry = dslot;
      if (col >= tw) col -= tw, ++carry;
      slot += carry;
      row += carry;
      while (row >= t.th) row -= t.th, ++li;
    }
  }
}

size_t mma_smem_bytes(const MmaTile& t, int K) {
  return 4 * (static_cast<size_t>(mma_planes_words(t)) + static_cast<size_t>(t.cg) * K * kWeightPairs +
              static_cast<size_t>(t.slots) * 8 * t.nb * mma_pixel_words(t));
}

// The tile: of the shapes whose shared memory lets 3 blocks share an SM (2 if none fits), the one with the fewest
// estimated lane instructions per output and channel: the copy in (every element of the tile's rows, halo, padding
// and the pitch's spare columns: about 1.75 per element, plus 32 / cg for the memory requests of a narrow group),
// the products (K mma, K ldmatrix and 2K weight loads per 16 x 8 block of a channel, a block counted whole where the
// image does not fill it, and its share of the epilogue) and the copy out (about 1.5 per element of the tile).
// Every shape the dispatch sends has a tile under the first budget: 8 channels, 8 columns and 8 rows (or one image
// of at most 32 rows) take under 30 KB.
MmaTile plan_mma_tile(const ConvShape& s, int K) {
  MmaTile best{};
  double best_cost = 0;
  for (size_t budget : {size_t(72) * 1024, size_t(kMaxSmem)}) {
    for (int cg : {32, 16, 8}) {
      if (s.C % cg) continue;
      const int max_nb = ceil_div(s.OW, 8) < 8 ? ceil_div(s.OW, 8) : 8;
      for (int nb = 1; nb <= max_nb; ++nb) {
        const int u = (nb + 1) % 2 ? nb + 1 : nb + 2;  // 16-byte units per row, odd
        const int pitch = 8 * u;
        if ((cg / 8) * (pitch / 2) > kThreads) continue;  // the copy's lanes of one tile row
        // (img, th): several whole images when they are short, else one image's rows in tiles of 8 to 64
        int shapes[12][2];
        int n_shapes = 0;
        if (s.OH <= 32)
          for (int img = 1; img <= 16 && img <= s.N; img *= 2) shapes[n_shapes][0] = img, shapes[n_shapes++][1] = s.OH;
        for (int th : {8, 16, 24, 32, 48, 64})
          if (th < s.OH) shapes[n_shapes][0] = 1, shapes[n_shapes++][1] = th;
        for (int i = 0; i < n_shapes; ++i) {
          MmaTile t{};
          t.cg = cg;
          t.groups = s.C / cg;
          t.img = shapes[i][0];
          t.tiles_h = ceil_div(s.OH, shapes[i][1]);
          t.th = ceil_div(s.OH, t.tiles_h);  // equal tiles
          t.ir = t.th + K - 1;
          t.nb = nb;
          t.pitch = pitch;
          t.plane = t.img * t.ir * pitch;
          t.slots = t.img * t.th;
          t.mblocks = ceil_div(t.slots, 16);
          t.tiles_w = ceil_div(s.OW, 8 * nb);
          t.img_blocks = ceil_div(s.N, t.img);
          t.smem = mma_smem_bytes(t, K);
          if (t.smem > budget) continue;
          const double tiles = static_cast<double>(t.tiles_h) * t.tiles_w * t.img_blocks;
          const double copy_in = tiles * t.plane * (1.75 + 32.0 / cg);
          const double products = tiles * t.mblocks * nb * (4.0 * K + 10.0) * 32.0;
          const double copy_out = tiles * t.slots * 8.0 * nb * 1.5;
          const double cost = (copy_in + products + copy_out) / (static_cast<double>(s.N) * s.OH * s.OW);
          if (best.cg == 0 || cost < best_cost) best_cost = cost, best = t;
        }
      }
    }
    if (best.cg != 0) break;
  }
  return best;
}

template <class TT, int K, bool FLIP>
void launch_mma(const ConvShape& s, const void* x, const void* w, const void* bias, void* y, cudaStream_t stream) {
  const MmaTile t = plan_mma_tile(s, K);
  TORCH_CHECK(t.cg != 0, "depthwise FWD_MMA: the planner found no tile for this shape; the smallest (8 channels, 8 "
              "rows or one short image, 8 columns) always fits, so this is a bug");
  // The largest tile the planner may pick.
  static std::atomic<uint64_t> opted_in{0};
  opt_in_shared_memory(fwd_nhwc_mma_kernel<TT, K, FLIP>, kMaxSmem, opted_in);
  const long long blocks = static_cast<long long>(t.groups) * t.tiles_w * t.tiles_h * t.img_blocks;
  fwd_nhwc_mma_kernel<TT, K, FLIP><<<static_cast<unsigned>(blocks), kThreads, t.smem, stream>>>(
      static_cast<const uint4*>(x), static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(bias),
      static_cast<uint4*>(y), s, t);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class TT, bool FLIP>
void mma_by_kernel(const ConvShape& s, const void* x, const void* w, const void* bias, void* y, cudaStream_t stream) {
  if (s.KH == 3) launch_mma<TT, 3, FLIP>(s, x, w, bias, y, stream);
  else if (s.KH == 5) launch_mma<TT, 5, FLIP>(s, x, w, bias, y, stream);
  else launch_mma<TT, 7, FLIP>(s, x, w, bias, y, stream);
}

template <bool FLIP>
void mma_by_dtype(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                  cudaStream_t stream) {
  if (dt == DType::F16) mma_by_kernel<F16T, FLIP>(s, x, w, bias, y, stream);
  else mma_by_kernel<BF16T, FLIP>(s, x, w, bias, y, stream);  // mma_fits admits only the 16-bit types
}

}  // namespace

void forward_nhwc_mma(const ConvShape& s, DType dt, const void* x, const void* w, const void* bias, void* y,
                      cudaStream_t stream) {
  mma_by_dtype<false>(s, dt, x, w, bias, y, stream);
}

// The forward tile on input_grad_as_forward(s), whose input is grad_out; stride 1 only.
void input_grad_nhwc_mma(const ConvShape& s, DType dt, const void* go, const void* w, void* gx, cudaStream_t stream) {
  mma_by_dtype<true>(input_grad_as_forward(s), dt, go, w, nullptr, gx, stream);
}

}  // namespace mdw
