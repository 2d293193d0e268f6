// Which kernel runs each depthwise case: one table per pass. The rows of a table are tried from the top and the
// first that takes the case runs it; the launchers are declared in depthwise_launchers.h and defined in the pass's
// file (the 5x5/7x7 walks' in depthwise_k57.cu). Later rows are the more general kernels, so the order is the
// preference.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <climits>
#include <cstddef>

#include "depthwise.h"
#include "depthwise_launchers.h"
#include "launch_plan.h"

namespace mdw {
namespace {

// The tiled kernels cover square odd kernels 3/5/7, equal strides 1 or 2, dilation 1, 16/32-bit types; NHWC also
// needs whole vectors of `vec` channels, with both tensors aligned to a vector.
bool tiled_fits(const ConvShape& s, DType dt, const void* in, const void* out, int vec) {
  const bool fast = dt != DType::F64 && s.KH == s.KW && (s.KH == 3 || s.KH == 5 || s.KH == 7) && s.SH == s.SW &&
                    (s.SH == 1 || s.SH == 2) && s.DH == 1 && s.DW == 1;
  if (!fast || !s.channels_last) return fast;
  const size_t bytes = static_cast<size_t>(vec) * elem_size(dt);
  return s.C % vec == 0 && aligned(in, bytes) && aligned(out, bytes);
}

// What every NHWC kernel that moves 32-bit words of channels needs (the column walks, the shared-memory tile): a
// square kernel, equal strides 1 or 2, dilation 1, 16/32-bit data in whole words (C even for 16-bit data) and 4-byte
// pointers.
bool nhwc_words_fit(const ConvShape& s, DType dt, const void* in, const void* out) {
  return dt != DType::F64 && s.channels_last && s.KH == s.KW && s.SH == s.SW && (s.SH == 1 || s.SH == 2) &&
         s.DH == 1 && s.DW == 1 && (s.C * elem_size(dt)) % 4 == 0 && aligned(in, 4) && aligned(out, 4);
}

// The stride-1 input gradient runs as a forward kernel on input_grad_as_forward(s), whose padding K - 1 - P must not
// be negative.
bool input_grad_as_forward_fits(const ConvShape& s) {
  return s.SH == 1 && s.SW == 1 && s.PH <= s.KH - 1 && s.PW <= s.KW - 1;
}

// The column walk needs a 3x3 kernel (and nhwc_words_fit), and its word offsets within one image (rows
// -PH .. H + PH + 1 (the last two only with R = 2), columns -PW .. 2 * OW + 12) must fit an int. s is the shape the
// kernel runs (for the input gradient: input_grad_as_forward's; for the weight gradient: the convolution's).
bool column_fits(const ConvShape& s, DType dt, const void* in, const void* out) {
  return nhwc_words_fit(s, dt, in, out) && s.KH == 3 &&
         static_cast<long long>(s.H + (s.PH > 0 ? s.PH : 0) + 2) * (s.W + 2 * s.OW + 12) * (s.C * elem_size(dt) / 4) <=
             INT_MAX;
}

bool input_grad_column_fits(const ConvShape& s, DType dt, const void* grad_out, const void* grad_input) {
  return input_grad_as_forward_fits(s) && column_fits(s, dt, grad_out, grad_input) &&
         column_fits(input_grad_as_forward(s), dt, grad_out, grad_input);
}

// The 5x5/7x7 column walk (stencil_column_k57.cuh): 5x5 or 7x7 (and nhwc_words_fit); it needs no 16-byte vectors,
// so C need not be a multiple of the tiled kernels' vector. Its word offsets within one image (rows -PH .. H + PH - 1,
// columns -PW - 1 .. 2 * OW + 6 - PW) must fit an int.
bool column_k57_fits(const ConvShape& s, DType dt, const void* in, const void* out) {
  return nhwc_words_fit(s, dt, in, out) && (s.KH == 5 || s.KH == 7) &&
         static_cast<long long>(s.H + (s.PH > 0 ? s.PH : 0) + 2) * (s.W + 2 * s.OW + s.PW + 16) *
                 (s.C * elem_size(dt) / 4) <=
             INT_MAX;
}

bool input_grad_column_k57_fits(const ConvShape& s, DType dt, const void* grad_out, const void* grad_input) {
  return input_grad_as_forward_fits(s) && column_k57_fits(s, dt, grad_out, grad_input) &&
         column_k57_fits(input_grad_as_forward(s), dt, grad_out, grad_input);
}

// The NCHW 5x5/7x7 weight-gradient kernel (depthwise_k57.cu): square 5x5 or 7x7, equal strides 1 or 2, dilation 1,
// 16/32-bit; it loads 32-bit words, so 16-bit rows of x and grad_out must hold whole words (W and OW even).
bool wgrad_nchw_k57_fits(const ConvShape& s, DType dt, const void* go, const void* x) {
  return dt != DType::F64 && !s.channels_last && s.KH == s.KW && (s.KH == 5 || s.KH == 7) && s.SH == s.SW &&
         (s.SH == 1 || s.SH == 2) && s.DH == 1 && s.DW == 1 &&
         (dt == DType::F32 || (s.W % 2 == 0 && s.OW % 2 == 0)) && aligned(go, 4) && aligned(x, 4);
}

// The shared-memory tile (depthwise_smem.cu): 3x3, 5x5 or 7x7 (and nhwc_words_fit). Its offsets are 64-bit, its
// tile coordinates within one image.
bool smem_fits(const ConvShape& s, DType dt, const void* in, const void* out) {
  return nhwc_words_fit(s, dt, in, out) && (s.KH == 3 || s.KH == 5 || s.KH == 7);
}

// The tile on input_grad_as_forward(s) takes what it takes on s: the same channels and pointers.
bool input_grad_smem_fits(const ConvShape& s, DType dt, const void* grad_out, const void* grad_input) {
  return input_grad_as_forward_fits(s) && smem_fits(s, dt, grad_out, grad_input);
}

// FWD_SMEM at -1 (its default) chooses by shape, as the H200 suites measured the tile against the walks and tiled
// kernels (docs/kernels.md, "The NHWC shared-memory tile"): 16-bit 5x5 at stride 1, the forward on inputs of 14 to
// 28 rows (0.79-0.95x the time there, slower on 7 rows) and the input gradient up to 28 rows. Everywhere else it
// was as fast or slower (3x3: 1.03-1.74x the column walks' time). The tensor-core tile, tried first, now takes the
// 16-bit 5x5 layers of 14 to 28 rows (mma_wanted), which leaves this tile the input gradient on fewer rows.
bool smem_wanted(const ConvShape& s, DType dt, int level) {
  const int v = knob(Knob::kFwdSmem, dt);
  if (v >= 0) return v >= level;
  const bool k5_16bit = (dt == DType::F16 || dt == DType::BF16) && s.KH == 5 && s.SH == 1;
  return k5_16bit && s.H <= 28 && (level == 2 || s.H >= 14);
}

// The tensor-core kernels (the walk, depthwise_mma_walk.cu, and the tile, depthwise_mma.cu): the NHWC tiled kernels'
// cases (square 3x3/5x5/7x7, equal strides 1 or 2, dilation 1, whole 16-byte vectors of channels, both tensors
// aligned to one) in 16-bit. The walk takes them all, the tile stride 1 only (mma_fits).
bool tensor_core_fits(const ConvShape& s, DType dt, const void* in, const void* out) {
  return (dt == DType::F16 || dt == DType::BF16) && s.channels_last && tiled_fits(s, dt, in, out, 8);
}

bool mma_fits(const ConvShape& s, DType dt, const void* in, const void* out) {
  return s.SH == 1 && tensor_core_fits(s, dt, in, out);
}

// Either on input_grad_as_forward(s), a stride-1 shape.
bool input_grad_tensor_core_fits(const ConvShape& s, DType dt, const void* grad_out, const void* grad_input) {
  return input_grad_as_forward_fits(s) && tensor_core_fits(input_grad_as_forward(s), dt, grad_out, grad_input);
}

// FWD_MMA: 1 the forward, 2 the stride-1 input gradient too, 0 neither; -1 (the default) by shape, as the H200
// suites measured the tile against the shared-memory tile and the walks (docs/kernels.md, "The tensor-core tile"):
// 5x5 on inputs of 14 to 28 rows, forward and input gradient alike (0.89-0.99x the time there); on 7 rows and on
// every 3x3 layer it was slower (1.4-2.4x).
bool mma_wanted(const ConvShape& s, DType dt, int level) {
  const int v = knob(Knob::kFwdMma, dt);
  if (v >= 0) return v >= level;
  return s.KH == 5 && s.H >= 14 && s.H <= 28;
}

// FWD_MMA_WALK: 1 the forward, 2 the stride-1 input gradient too, 0 neither; -1 (the default) by shape: the forward
// of 5x5 and 7x7, where the CUDA-core kernels are bound by their instruction issue.
bool mma_walk_wanted(const ConvShape& s, DType dt, int level) {
  const int v = knob(Knob::kFwdMmaWalk, dt);
  if (v >= 0) return v >= level;
  return level == 1 && s.KH >= 5;
}

// Whether a layer's channel words fill at least 7/8 of a ring block's kRingLanes lanes (a lane per word and row group;
// at most kRingLanes words). On MobileNetV3's 184- and 200-channel 14x14 layers, whose words fill 72-78% of them, the
// forward ring was slower than the column walk.
bool ring_fills_lanes(const ConvShape& s, DType dt) {
  const int words = s.C * elem_size(dt) / 4;
  return words > 0 && words <= kRingLanes && (kRingLanes / words) * words * 8 >= kRingLanes * 7;
}

// FWD_RING: 1 the ring wherever it fits, 0 never, -1 (the default) by shape, as the H200 suites measured it against
// the column walk (docs/kernels.md, "The forward from a ring of input rows"): at stride 1 where the channel words fill
// the lanes (ring_fills_lanes). At stride 2 the ring rarely fits two blocks per SM.
bool ring_wanted(const ConvShape& s, DType dt) {
  const int v = knob(Knob::kFwdRing, dt);
  if (v >= 0) return v == 1;
  return s.SH == 1 && ring_fills_lanes(s, dt);
}

// BWD_RING: 1 the backward from rings wherever it fits, 0 never, -1 (the default) by shape, as the H200's MobileNetV1
// suite measured it against the input-row walk (docs/kernels.md, "The backward from rings of rows"): the forward's 7/8
// rule on the lanes, and at least 32 channel words (a 128-byte pixel): on 32 fp16 channels (16 words, 16 row groups
// per block) it was slower than the walk.
bool bwd_ring_wanted(const ConvShape& s, DType dt) {
  const int v = knob(Knob::kBwdRing, dt);
  if (v >= 0) return v == 1;
  return s.C * elem_size(dt) / 4 >= 32 && ring_fills_lanes(s, dt);
}

enum class WgradTechnique { kColumn, kColumnK57, kTiled, kGeneric };

// Weight gradient: the technique both the workspace size and the launch follow.
//   NHWC 3x3 s1/s2, whole 32-bit words of channels, WGRAD_COLUMN on     column walk
//   NHWC 5x5/7x7 s1/s2, whole 32-bit words, WGRAD_COLUMN_K57 bit 0       column walk, a kernel row per lane
//   NCHW 5x5/7x7 s1/s2, 16-bit rows of whole words, WGRAD_COLUMN_K57 bit 1   strips, a kernel row per lane
//   (WGRAD_COLUMN_K57 = -1, the default: NHWC always; NCHW 7x7 from 14 output columns, 5x5 from 28, where the H200
//   suites measured it faster than tiled: on shorter rows the 5x5's 20 products per tile do not pay for its set-up)
//   3/5/7 square, s1/s2, dilation 1, 16/32-bit (NHWC: C % WgradVec)     tiled
//   anything else                                                        generic
WgradTechnique weight_grad_technique(const ConvShape& s, DType dt, const void* go, const void* x) {
  if (knob(Knob::kWgradColumn, dt) != 0 && column_fits(s, dt, go, x)) return WgradTechnique::kColumn;
  const int k57 = knob(Knob::kWgradColumnK57, dt);
  const bool nhwc_walk = k57 < 0 || (k57 & 1);
  const bool nchw_walk = k57 < 0 ? s.OW >= (s.KH == 7 ? 14 : 28) : (k57 & 2) != 0;
  if (nhwc_walk && column_k57_fits(s, dt, go, x)) return WgradTechnique::kColumnK57;
  if (nchw_walk && wgrad_nchw_k57_fits(s, dt, go, x)) return WgradTechnique::kColumnK57;
  if (tiled_fits(s, dt, go, x, wgrad_vec(s.KH))) return WgradTechnique::kTiled;
  return WgradTechnique::kGeneric;
}

// The domain the op accepted before the generic kernels took every case F.conv2d(groups=C) runs: one filter per
// channel, odd kernels 1-7, stride 1 or 2, dilation 1 or 2, padding up to 2^20, at most 65535 channels, input and
// output below 2^31 elements. Inside it the tables below are the ones the specialised kernels were tuned under, as
// they were; outside it every pass runs its generic kernel. Fills *s with the 32-bit shape when inside.
bool narrow_shape(const DepthwiseShape& g, ConvShape* s) {
  auto odd_1_7 = [](int64_t k) { return k >= 1 && k <= 7 && k % 2 == 1; };
  auto one_or_two = [](int64_t v) { return v == 1 || v == 2; };
  const int64_t lim = int64_t(1) << 31;
  if (g.M != 1 || !odd_1_7(g.KH) || !odd_1_7(g.KW) || !one_or_two(g.SH) || !one_or_two(g.SW) || !one_or_two(g.DH) ||
      !one_or_two(g.DW) || g.PH > (1 << 20) || g.PW > (1 << 20) || g.C > 65535 || g.N * g.C * g.H * g.W >= lim ||
      g.N * g.C * g.OH * g.OW >= lim)
    return false;
  *s = ConvShape{static_cast<int>(g.N),  static_cast<int>(g.C),  static_cast<int>(g.H),  static_cast<int>(g.W),
                 static_cast<int>(g.OH), static_cast<int>(g.OW), static_cast<int>(g.KH), static_cast<int>(g.KW),
                 static_cast<int>(g.SH), static_cast<int>(g.SW), static_cast<int>(g.PH), static_cast<int>(g.PW),
                 static_cast<int>(g.DH), static_cast<int>(g.DW), g.channels_last,         g.act};
  return true;
}

// The 5x5/7x7 walks' knobs at -1 (their default) choose by shape, as the H200 suites measured them
// (docs/results/depthwise_{convnext_t,mobilenet_v3}_h200_walks_forced.md): in NHWC the walk is faster from 28x28
// inputs up and slower below; in NCHW it is faster everywhere but 5x5 on 7x7 inputs.
bool k57_nhwc_walk(const ConvShape& s, DType dt, int level) {
  const int v = knob(Knob::kFwdColumnK57, dt);
  return v < 0 ? s.H >= 28 : v >= level;
}

// The stride-1 input gradient (level 2) takes the forward's rule on its shape as a forward
// (input_grad_as_forward): on ConvNeXt-T's NCHW 7x7 layers it ran 2.2x faster than the tiled kernel
// (docs/results/depthwise_convnext_t_h200_nchw_dgrad_walk.md).
bool k57_nchw_walk(const ConvShape& s, DType dt, int level) {
  const int v = knob(Knob::kNchwColumnK57, dt);
  return v < 0 ? !(s.KH == 5 && s.H <= 7) : v >= level;
}

}  // namespace

// Forward (depthwise_forward.cu):
//   outside narrow_shape's domain                                       generic
//   NHWC 16-bit 3x3/5x5/7x7 s1/s2, whole 16-byte vectors, FWD_MMA_WALK >= 1   tensor-core walk down the rows
//     (-1, the default: 5x5 and 7x7)
//   NHWC 16-bit 3x3/5x5/7x7 s1, whole 16-byte vectors of channels, FWD_MMA >= 1   tensor-core tile
//     (-1, the default: 5x5 on inputs of 14 to 28 rows)
//   NHWC 3x3/5x5/7x7 s1/s2, whole 32-bit words of channels, FWD_SMEM >= 1     shared-memory tile
//     (-1, the default: 16-bit 5x5 stride 1 on inputs of 14 to 28 rows)
//   NHWC 5x5/7x7 s1/s2, whole 32-bit words of channels, FWD_COLUMN_K57 >= 1   column walk, partial sums (K = 5, 7)
//     (-1, the default: inputs of 28 rows or more)
//   outside the tiled kernels' cases (see tiled_fits)                   generic
//   NHWC 3x3 s1/s2, channels in 16-byte units, sm_90+, FWD_RING >= 1   ring of input rows (the launcher checks)
//     (-1, the default: stride 1, channel words that fill 7/8 of the block's lanes)
//   NHWC 3x3 s1/s2, whole 32-bit words of channels, FWD_COLUMN >= 1     column walk
//   NCHW 5x5/7x7 s1/s2, NCHW_COLUMN_K57 >= 1                            walk down the columns, partial sums
//     (-1, the default: all but 5x5 on inputs of 7 rows or fewer)
//   NCHW 3x3 s1 p1, 16-bit, rows of whole aligned 16-byte vectors       vector loads (the launcher checks)
//   the rest of the tiled cases                                          tiled
void launch_forward(const DepthwiseShape& g, DType dt, const void* x, const void* w, const void* bias, void* y,
                    cudaStream_t stream) {
  ConvShape s;
  if (!narrow_shape(g, &s)) return forward_generic(g, dt, x, w, bias, y, stream);
  if (mma_walk_wanted(s, dt, 1) && tensor_core_fits(s, dt, x, y))
    return forward_nhwc_mma_walk(s, dt, x, w, bias, y, stream);
  if (mma_wanted(s, dt, 1) && mma_fits(s, dt, x, y)) return forward_nhwc_mma(s, dt, x, w, bias, y, stream);
  if (smem_wanted(s, dt, 1) && smem_fits(s, dt, x, y)) return forward_nhwc_smem(s, dt, x, w, bias, y, stream);
  if (k57_nhwc_walk(s, dt, 1) && column_k57_fits(s, dt, x, y))
    return forward_nhwc_column_k57(s, dt, x, w, bias, y, stream);
  if (!tiled_fits(s, dt, x, y, nhwc_vec(dt))) return forward_generic(g, dt, x, w, bias, y, stream);
  if (ring_wanted(s, dt) && column_fits(s, dt, x, y) && forward_nhwc_ring(s, dt, x, w, bias, y, stream)) return;
  if (knob(Knob::kFwdColumn, dt) >= 1 && column_fits(s, dt, x, y))
    return forward_nhwc_column(s, dt, x, w, bias, y, stream);
  if (!s.channels_last && s.KH >= 5 && k57_nchw_walk(s, dt, 1))
    return forward_nchw_column_k57(s, dt, x, w, bias, y, stream);
  if (forward_nchw_vec3x3(s, dt, x, w, bias, y, stream)) return;
  forward_tiled(s, dt, x, w, bias, y, stream);
}

// The forward with statistics (depthwise_forward.cu): the column walk only, with no fallback, so that its partials
// always have one layout; the op refuses other cases (kernels/ops.py checks first).
bool forward_stats_fits(const DepthwiseShape& g, DType dt, const void* x, const void* y) {
  ConvShape s;
  return g.act == kActNone && narrow_shape(g, &s) && column_fits(s, dt, x, y);
}

int forward_stats_bands(const DepthwiseShape& g, DType dt) {
  ConvShape s;
  return narrow_shape(g, &s) ? forward_nhwc_column_stats_bands(s, dt) : 0;
}

void launch_forward_stats(const DepthwiseShape& g, DType dt, const void* x, const void* w, void* y, double* partial,
                          cudaStream_t stream) {
  ConvShape s;
  if (narrow_shape(g, &s)) forward_nhwc_column_stats(s, dt, x, w, y, partial, stream);
}

// The forward and weight gradient of norm.apply_in_depthwise: the NHWC 3x3 walks only (the only kernels that apply an
// InputNorm), so there is no fallback; the op refuses other cases (kernels/norm_depthwise.py checks first).
bool normed_fits(const DepthwiseShape& g, DType dt, const void* y, const void* out) {
  ConvShape s;
  return g.act == kActNone && g.M == 1 && narrow_shape(g, &s) && column_fits(s, dt, y, out);
}

void launch_forward_normed(const DepthwiseShape& g, DType dt, const void* y, const void* w, const InputNorm& norm,
                           void* out, cudaStream_t stream) {
  ConvShape s;
  if (!narrow_shape(g, &s)) return;
  // FWD_RING_NORM = 1 (the 16-bit default; launch_plan.cpp): the ring where the plain forward would take it.
  if (knob(Knob::kFwdRingNorm, dt) == 1 && ring_wanted(s, dt) &&
      forward_nhwc_ring_normed(s, dt, y, w, norm, out, stream))
    return;
  forward_nhwc_column_normed(s, dt, y, w, norm, out, stream);
}

size_t wgrad_normed_workspace_elems(const DepthwiseShape& g, DType dt) {
  ConvShape s;
  if (!narrow_shape(g, &s)) return 0;
  return static_cast<size_t>(weight_grad_column_normed_chunks(s, dt)) * g.C * (g.KH * g.KW + 1);
}

void launch_wgrad_normed(const DepthwiseShape& g, DType dt, const void* go, const void* y, const InputNorm& norm,
                         void* ws, void* gw, cudaStream_t stream) {
  ConvShape s;
  if (!narrow_shape(g, &s)) return;
  const int chunks = weight_grad_column_normed(s, dt, go, y, norm, ws, stream);
  weight_grad_finalize(s, dt, ws, chunks, gw, nullptr, stream);
}

// The backward of norm.apply_in_depthwise's convolution. Stride 1 and padding 1 (H == OH, W == OW): the input-row walk
// gives both gradients from one read of grad_out, and the sums where asked; stride 2 and padding 1 with the sums: the
// stride-2 input-row walk (without the sums that layer keeps the two kernels, whose input gradient the walk does not
// reproduce bit for bit); otherwise the input gradient's kernels, then the weight gradient's.
bool bwd_normed_one_walk(const DepthwiseShape& g) {
  return g.SH == 1 && g.SW == 1 && g.PH == 1 && g.PW == 1 && g.OH == g.H && g.OW == g.W;
}

static bool bwd_normed_s2_walk(const DepthwiseShape& g) {
  return g.SH == 2 && g.SW == 2 && g.PH == 1 && g.PW == 1 && g.KH == 3 && g.KW == 3;
}

// The weight-gradient partials of the input-row walks, plain or normalizing: [chunks][C][KH * KW + 1] floats.
static size_t input_row_workspace_elems(const ConvShape& s, DType dt) {
  return static_cast<size_t>(backward_input_row_normed_chunks(s, dt)) * s.C * (s.KH * s.KW + 1);
}

// BWD_RING_NORM = 1: the stride-1 backward with the sums from the backward's rings where BWD_RING would take the plain
// backward there (its launcher checks the pointers and the device, else the walk runs).
static bool bwd_normed_ring_wanted(const DepthwiseShape& g, const ConvShape& s, DType dt, bool sums) {
  return sums && bwd_normed_one_walk(g) && knob(Knob::kBwdRingNorm, dt) == 1 && bwd_ring_wanted(s, dt);
}

size_t bwd_normed_workspace_elems(const DepthwiseShape& g, DType dt, bool sums) {
  ConvShape s;
  if (!narrow_shape(g, &s)) return 0;
  if (!bwd_normed_one_walk(g) && !(sums && bwd_normed_s2_walk(g))) return wgrad_normed_workspace_elems(g, dt);
  const size_t walk = input_row_workspace_elems(s, dt);
  if (!bwd_normed_ring_wanted(g, s, dt, sums)) return walk;
  const size_t ring = static_cast<size_t>(backward_nhwc_ring_chunks(s, dt, true)) * s.C * (s.KH * s.KW + 1);
  return ring > walk ? ring : walk;
}

// Rows of the sums: the walk's chunks, or where the ring is wanted the larger of its blocks and the walk's chunks (the
// technique that runs writes its rows and the rest are zeroed, so that the size depends on the shape alone).
int bwd_normed_sums_chunks(const DepthwiseShape& g, DType dt) {
  ConvShape s;
  const bool walk = bwd_normed_one_walk(g) || bwd_normed_s2_walk(g);
  if (!walk || !narrow_shape(g, &s)) return 0;
  const int chunks = backward_input_row_normed_chunks(s, dt);
  if (!bwd_normed_ring_wanted(g, s, dt, true)) return chunks;
  const int ring = backward_nhwc_ring_chunks(s, dt, true);
  return ring > chunks ? ring : chunks;
}

bool bwd_normed_ring_runs(const DepthwiseShape& g, DType dt) {
  ConvShape s;
  return narrow_shape(g, &s) && bwd_normed_ring_wanted(g, s, dt, true) && compute_capability_major() >= 9 &&
         backward_nhwc_ring_chunks(s, dt, true) > 0;
}

void launch_bwd_normed(const DepthwiseShape& g, DType dt, const void* go, const void* y, const void* w,
                       const InputNorm& norm, void* gx, void* ws, void* gw, float* sums,
                       const OutputGradNorm* out_norm, cudaStream_t stream) {
  ConvShape s;
  if (!narrow_shape(g, &s)) return;
  if (bwd_normed_one_walk(g) || (sums != nullptr && bwd_normed_s2_walk(g))) {
    // gx null (the sums and the weight gradient only): the walks, which skip their stores; the rings always store.
    int chunks = gx != nullptr && bwd_normed_ring_wanted(g, s, dt, sums != nullptr)
                     ? backward_nhwc_ring_normed(s, dt, go, y, w, norm, gx, ws, sums, out_norm, stream)
                     : 0;
    if (chunks == 0) chunks = backward_input_row_normed(s, dt, go, y, w, norm, gx, ws, sums, out_norm, stream);
    const int rows = sums != nullptr ? bwd_normed_sums_chunks(g, dt) : 0;
    if (rows > chunks) {  // the rows the other technique would have written: zeros, which add nothing
      const size_t row = 2 * static_cast<size_t>(s.C);
      C10_CUDA_CHECK(cudaMemsetAsync(sums + chunks * row, 0, (rows - chunks) * row * sizeof(float), stream));
    }
    return weight_grad_finalize(s, dt, ws, chunks, gw, nullptr, stream);
  }
  launch_dgrad(g, dt, go, w, gx, stream);
  launch_wgrad_normed(g, dt, go, y, norm, ws, gw, stream);
}

// Both gradients of the NHWC 3x3 convolution with padding 1 in one walk: the normalizing backward's input-row walks on
// x itself (backward_input_row, depthwise_weight_grad.cu), at stride 1 (BWD_WALK >= 1) and stride 2 (BWD_WALK >= 2).
// They read grad_out once for both gradients where the two kernels below read it twice. The stride-1 walk's input
// gradient has the rotated column walk's bits; the stride-2 walk sums its taps in an order of its own. Whole 32-bit
// words of channels, 4-byte pointers, no depth multiplier; the weight gradient's partials then take the finalize of
// every technique.
bool bwd_walk_fits(const DepthwiseShape& g, DType dt, const void* go, const void* x, const void* gx) {
  ConvShape s;
  const int level = knob(Knob::kBwdWalk, dt);
  const bool walk = (level >= 1 && bwd_normed_one_walk(g)) || (level >= 2 && bwd_normed_s2_walk(g));
  return walk && narrow_shape(g, &s) && column_fits(s, dt, go, x) && aligned(gx, 4);
}

// Where bwd_ring_wanted, the stride-1 walk's rows come from rings that bulk copies fill (depthwise_ring.cu) if that
// fits (its launcher checks the pointers and the device); the workspace covers either technique.
size_t bwd_walk_workspace_elems(const DepthwiseShape& g, DType dt) {
  ConvShape s;
  if (!narrow_shape(g, &s)) return 0;
  const size_t walk = input_row_workspace_elems(s, dt);
  if (!bwd_ring_wanted(s, dt)) return walk;
  const size_t ring = static_cast<size_t>(backward_nhwc_ring_chunks(s, dt)) * s.C * (s.KH * s.KW + 1);
  return ring > walk ? ring : walk;
}

void launch_bwd_walk(const DepthwiseShape& g, DType dt, const void* go, const void* x, const void* w, void* gx,
                     void* ws, void* gw, void* gb, cudaStream_t stream) {
  ConvShape s;
  if (!narrow_shape(g, &s)) return;
  int chunks = bwd_ring_wanted(s, dt) ? backward_nhwc_ring(s, dt, go, x, w, gx, ws, stream) : 0;
  if (chunks == 0) chunks = backward_input_row(s, dt, go, x, w, gx, ws, stream);
  weight_grad_finalize(s, dt, ws, chunks, gw, gb, stream);
}

// Input gradient (depthwise_input_grad.cu):
//   outside narrow_shape's domain                                       generic
//   NHWC 16-bit 3x3/5x5/7x7 s1, whole 16-byte vectors, FWD_MMA_WALK >= 2   tensor-core walk, kernel rotated
//     (-1, the default: never)
//   NHWC 16-bit 3x3/5x5/7x7 s1, whole 16-byte vectors, FWD_MMA >= 2     tensor-core tile, kernel rotated
//     (-1, the default: 5x5 on inputs of 14 to 28 rows)
//   NHWC 3x3/5x5/7x7 s1, whole 32-bit words of channels, FWD_SMEM >= 2  shared-memory tile, kernel rotated
//     (-1, the default: 16-bit 5x5 on inputs of 28 rows or fewer)
//   NHWC 5x5/7x7 s1, whole 32-bit words of channels, FWD_COLUMN_K57 >= 2   column walk, partial sums, kernel rotated
//     (-1, the default: inputs of 28 rows or more)
//   outside the tiled kernels' cases (see tiled_fits)                   generic
//   NHWC 3x3 s1, whole 32-bit words of channels, FWD_COLUMN >= 2        column walk, kernel rotated
//   NCHW 5x5/7x7 s1, NCHW_COLUMN_K57 >= 2                               walk down the columns, kernel rotated
//     (-1, the default: the forward's rule on the rotated shape: all but 5x5 on grad_out of 7 rows or fewer)
//   NCHW 3x3 s1 p1, 16-bit, rows of whole aligned 16-byte vectors       vector loads, kernel rotated (the launcher checks)
//   the rest of the tiled cases                                          tiled
void launch_dgrad(const DepthwiseShape& g, DType dt, const void* go, const void* w, void* gx, cudaStream_t stream) {
  ConvShape s;
  if (!narrow_shape(g, &s)) return input_grad_generic(g, dt, go, w, gx, stream);
  if (mma_walk_wanted(s, dt, 2) && input_grad_tensor_core_fits(s, dt, go, gx))
    return input_grad_nhwc_mma_walk(s, dt, go, w, gx, stream);
  if (mma_wanted(s, dt, 2) && input_grad_tensor_core_fits(s, dt, go, gx))
    return input_grad_nhwc_mma(s, dt, go, w, gx, stream);
  if (smem_wanted(s, dt, 2) && input_grad_smem_fits(s, dt, go, gx))
    return input_grad_nhwc_smem(s, dt, go, w, gx, stream);
  if (k57_nhwc_walk(s, dt, 2) && input_grad_column_k57_fits(s, dt, go, gx))
    return input_grad_nhwc_column_k57(s, dt, go, w, gx, stream);
  if (!tiled_fits(s, dt, go, gx, nhwc_vec(dt))) return input_grad_generic(g, dt, go, w, gx, stream);
  if (knob(Knob::kFwdColumn, dt) >= 2 && input_grad_column_fits(s, dt, go, gx))
    return input_grad_nhwc_column(s, dt, go, w, gx, stream);
  if (!s.channels_last && s.KH >= 5 && input_grad_as_forward_fits(s) &&
      k57_nchw_walk(input_grad_as_forward(s), dt, 2))
    return input_grad_nchw_column_k57(s, dt, go, w, gx, stream);
  if (input_grad_nchw_vec3x3(s, dt, go, w, gx, stream)) return;
  input_grad_tiled(s, dt, go, w, gx, stream);
}

bool dgrad_normed_fits(const DepthwiseShape& g, DType dt, const void* go, const void* y, const void* gy) {
  ConvShape s;
  return narrow_shape(g, &s) && s.channels_last && s.KH == 3 && s.KW == 3 && s.PH == 1 && s.PW == 1 &&
         tiled_fits(s, dt, go, gy, nhwc_vec(dt)) && aligned(y, static_cast<size_t>(nhwc_vec(dt)) * elem_size(dt));
}

void launch_dgrad_normed(const DepthwiseShape& g, DType dt, const void* go, const void* w, const InputGradNorm& bn,
                         void* gy, cudaStream_t stream) {
  ConvShape s;
  if (!narrow_shape(g, &s)) return;
  input_grad_tiled_normed(s, dt, go, w, bn, gy, stream);
}

// Weight gradient (depthwise_weight_grad.cu): outside narrow_shape's domain the generic technique (which runs its
// own stage 2), else weight_grad_technique's table above, then the fixed-order sum of the partials.
size_t wgrad_workspace_elems(const DepthwiseShape& g, DType dt, const void* go, const void* x) {
  ConvShape s;
  const WgradTechnique tech = narrow_shape(g, &s) ? weight_grad_technique(s, dt, go, x) : WgradTechnique::kGeneric;
  long long chunks = 0;
  switch (tech) {
    case WgradTechnique::kColumn: chunks = weight_grad_column_chunks(s, dt); break;
    case WgradTechnique::kColumnK57: chunks = weight_grad_column_k57_chunks(s, dt); break;
    case WgradTechnique::kTiled: chunks = weight_grad_tiled_chunks(s, dt); break;
    case WgradTechnique::kGeneric: chunks = weight_grad_generic_chunks(g); break;
  }
  return static_cast<size_t>(chunks) * g.C * g.M * (g.KH * g.KW + 1);
}

void launch_wgrad(const DepthwiseShape& g, DType dt, const void* go, const void* x, void* ws, void* gw, void* gb,
                  cudaStream_t stream) {
  ConvShape s;
  const WgradTechnique tech = narrow_shape(g, &s) ? weight_grad_technique(s, dt, go, x) : WgradTechnique::kGeneric;
  int chunks = 0;
  switch (tech) {
    case WgradTechnique::kColumn: chunks = weight_grad_column(s, dt, go, x, ws, stream); break;
    case WgradTechnique::kColumnK57: chunks = weight_grad_column_k57(s, dt, go, x, ws, stream); break;
    case WgradTechnique::kTiled: chunks = weight_grad_tiled(s, dt, go, x, ws, stream); break;
    case WgradTechnique::kGeneric: return weight_grad_generic(g, dt, go, x, ws, gw, gb, stream);
  }
  weight_grad_finalize(s, dt, ws, chunks, gw, gb, stream);
}

}  // namespace mdw
