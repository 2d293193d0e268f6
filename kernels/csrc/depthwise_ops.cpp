// Op schemas and their CUDA implementations: argument checks, layout handling, allocation; the
// kernels themselves live in the depthwise_<pass>.cu files behind depthwise.h.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>
#include <utility>

#include "depthwise.h"
#include "launch_plan.h"
#include "op_layout.h"

namespace mdw {
namespace {

DType to_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return DType::F32;
    case c10::ScalarType::Half: return DType::F16;
    case c10::ScalarType::BFloat16: return DType::BF16;
    case c10::ScalarType::Double: return DType::F64;
    default:
      TORCH_CHECK(false, "depthwise_conv2d: dtype ", t,
                  " is not supported (float32, float16, bfloat16, float64)");
  }
  return DType::F32;  // not reached
}

// The Python twin is conv_out_size() in kernels/conv_arith.py.
int64_t out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d) { return (in + 2 * p - d * (k - 1) - 1) / s + 1; }

// What F.conv2d(groups=C) itself refuses, refused here too; everything it runs, the kernels run (the generic ones
// outside the specialised kernels' cases). kernels/ops.py _check_supported() is the Python twin, which runs first.
DepthwiseShape check_and_shape(const at::Tensor& x, const at::Tensor& w, at::IntArrayRef stride,
                               at::IntArrayRef padding, at::IntArrayRef dilation, c10::MemoryFormat fmt) {
  TORCH_CHECK(x.dim() == 4, "depthwise_conv2d: input must be 4-D (N, C, H, W), got ", x.dim(), "-D");
  TORCH_CHECK(x.is_cuda(), "depthwise_conv2d: input must be a CUDA tensor, got ", x.device());
  TORCH_CHECK(w.device() == x.device(), "depthwise_conv2d: weight is on ", w.device(), " but input is on ", x.device());
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "depthwise_conv2d: weight dtype ", w.scalar_type(),
              " differs from input dtype ", x.scalar_type());
  to_dtype(x.scalar_type());
  TORCH_CHECK(w.dim() == 4 && w.size(1) == 1, "depthwise_conv2d: weight must have shape (C * m, 1, kh, kw), got ",
              w.sizes());
  const int64_t C = x.size(1);
  TORCH_CHECK(C > 0 ? w.size(0) >= C && w.size(0) % C == 0 : w.size(0) == 0, "depthwise_conv2d: weight has ",
              w.size(0), " filters, which is not a multiple m >= 1 of the input's ", C, " channels");
  TORCH_CHECK(stride.size() == 2 && padding.size() == 2 && dilation.size() == 2,
              "depthwise_conv2d: stride, padding and dilation must have two values each");
  const int64_t k[2] = {w.size(2), w.size(3)};
  for (int i = 0; i < 2; ++i) {
    TORCH_CHECK(k[i] >= 1, "depthwise_conv2d: kernel size ", k[i], " is not supported (must be >= 1)");
    TORCH_CHECK(stride[i] >= 1, "depthwise_conv2d: stride ", stride[i], " is not supported (must be >= 1)");
    TORCH_CHECK(dilation[i] >= 1, "depthwise_conv2d: dilation ", dilation[i], " is not supported (must be >= 1)");
    TORCH_CHECK(padding[i] >= 0, "depthwise_conv2d: padding ", padding[i], " is not supported (must be >= 0)");
  }
  const int64_t OH = out_size(x.size(2), k[0], stride[0], padding[0], dilation[0]);
  const int64_t OW = out_size(x.size(3), k[1], stride[1], padding[1], dilation[1]);
  TORCH_CHECK(OH >= 1 && OW >= 1, "depthwise_conv2d: input ", x.size(2), "x", x.size(3),
              " is smaller than the dilated kernel after padding (output would be ", OH, "x", OW, ")");
  DepthwiseShape s{};
  s.N = x.size(0);
  s.C = C;
  s.M = C > 0 ? w.size(0) / C : 1;
  s.H = x.size(2);
  s.W = x.size(3);
  s.OH = OH;
  s.OW = OW;
  s.KH = k[0];
  s.KW = k[1];
  s.SH = stride[0];
  s.SW = stride[1];
  s.PH = padding[0];
  s.PW = padding[1];
  s.DH = dilation[0];
  s.DW = dilation[1];
  s.channels_last = fmt == c10::MemoryFormat::ChannelsLast;
  return s;
}

at::Tensor depthwise_fwd(const at::Tensor& x_in, const at::Tensor& w_in, const std::optional<at::Tensor>& bias,
                         at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                         int64_t activation) {
  const c10::MemoryFormat fmt = layout_of(x_in);
  DepthwiseShape s = check_and_shape(x_in, w_in, stride, padding, dilation, fmt);
  TORCH_CHECK(activation == kActNone || activation == kActReLU || activation == kActReLU6,
              "depthwise_conv2d: activation ", activation, " is not supported (0: none, 1: ReLU, 2: ReLU6)");
  s.act = static_cast<int>(activation);
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = in_layout(x_in, fmt);
  const at::Tensor w = w_in.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == s.C * s.M, "depthwise_conv2d: bias must have shape (", s.C * s.M,
                ",), got ", bias->sizes());
    TORCH_CHECK(bias->device() == x.device() && bias->scalar_type() == x.scalar_type(),
                "depthwise_conv2d: bias must be on the input's device with the input's dtype");
    b = bias->contiguous();
  }
  at::Tensor y = at::empty({s.N, s.C * s.M, s.OH, s.OW}, x.options().memory_format(fmt));
  if (y.numel() == 0) return y;
  launch_forward(s, to_dtype(x.scalar_type()), x.const_data_ptr(), w.const_data_ptr(),
                 b.defined() ? b.const_data_ptr() : nullptr, y.mutable_data_ptr(),
                 c10::cuda::getCurrentCUDAStream().stream());
  return y;
}

// y = conv(x, w) (no bias, no activation) and the statistics of y per band of rows, partial [bands][3][C] fp64 =
// (count, mean, M2) per channel, for mobilenet_bn::bn_relu_fwd_from_partials. Only the NHWC column walk takes it
// (forward_stats_fits); kernels/ops.py depthwise_conv2d_stats checks the case first.
std::tuple<at::Tensor, at::Tensor> depthwise_fwd_stats(const at::Tensor& x_in, const at::Tensor& w_in,
                                                       at::IntArrayRef stride, at::IntArrayRef padding) {
  const c10::MemoryFormat fmt = layout_of(x_in);
  const int64_t dilation[2] = {1, 1};
  const DepthwiseShape s = check_and_shape(x_in, w_in, stride, padding, dilation, fmt);
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = in_layout(x_in, fmt);
  const at::Tensor w = w_in.contiguous();
  const DType dt = to_dtype(x.scalar_type());
  at::Tensor y = at::empty({s.N, s.C * s.M, s.OH, s.OW}, x.options().memory_format(fmt));
  TORCH_CHECK(s.M == 1 && y.numel() > 0 && forward_stats_fits(s, dt, x.const_data_ptr(), y.const_data_ptr()),
              "depthwise_fwd_stats: only NHWC 3x3 convolutions with stride 1 or 2, dilation 1 and whole 32-bit words "
              "of channels (float32, or an even number of 16-bit channels) are supported");
  const int bands = forward_stats_bands(s, dt);
  at::Tensor partial = at::empty({bands, 3, s.C}, x.options().dtype(at::kDouble));
  launch_forward_stats(s, dt, x.const_data_ptr(), w.const_data_ptr(), y.mutable_data_ptr(),
                       partial.mutable_data_ptr<double>(), c10::cuda::getCurrentCUDAStream().stream());
  return {y, partial};
}

// The per-channel BatchNorm vectors of an InputNorm: contiguous fp32 (C,) on y's device; `op` names the op in errors.
InputNorm input_norm_of(const char* op, const at::Tensor& y, const at::Tensor& mean, const at::Tensor& invstd,
                        const at::Tensor& weight, const at::Tensor& bias) {
  check_fp32_vectors(op, y.size(1), y.device(),
                        {{&mean, "mean"}, {&invstd, "invstd"}, {&weight, "norm_weight"}, {&bias, "norm_bias"}});
  InputNorm n;
  n.mean = mean.const_data_ptr<float>();
  n.invstd = invstd.const_data_ptr<float>();
  n.weight = weight.const_data_ptr<float>();
  n.bias = bias.const_data_ptr<float>();
  return n;
}

// A tensor shaped as the convolution's output (N, C * M, OH, OW) in y's dtype, on y's device; `op` and `name` name it.
void check_like_output(const char* op, const char* name, const at::Tensor& t, const DepthwiseShape& s,
                       const at::Tensor& y) {
  TORCH_CHECK(t.dim() == 4 && t.size(0) == s.N && t.size(1) == s.C * s.M && t.size(2) == s.OH && t.size(3) == s.OW &&
                  t.device() == y.device() && t.scalar_type() == y.scalar_type(),
              op, ": ", name, " must be a (", s.N, ", ", s.C * s.M, ", ", s.OH, ", ", s.OW, ") ", y.scalar_type(),
              " tensor on ", y.device(), ", got ", t.scalar_type(), " ", t.sizes());
}

// The per-channel constants of a BatchNorm's backward (mobilenet_bn::bn_relu_bwd_consts): a float32 (6, C) tensor on
// y's device.
void check_bn_consts(const char* op, const char* name, const at::Tensor& t, int64_t C, const at::Tensor& y) {
  const bool ok = t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == 6 && t.size(1) == C &&
                  t.device() == y.device();
  TORCH_CHECK(ok, op, ": ", name, " must be a float32 (6, ", C, ") tensor on ", y.device(), ", got ", t.scalar_type(),
              " ", t.sizes(), " on ", t.device());
}

constexpr const char* kNormedCases =
    "only channels_last 3x3 depthwise convolutions (one filter per channel) with stride 1 or 2, dilation 1 and whole "
    "32-bit words of channels (float32, or an even number of 16-bit channels) are supported";

// out = conv(relu(batch_norm(y)), w) (no bias, no activation) from y and the BatchNorm's batch statistics (mean,
// invstd) and affine parameters, without relu(batch_norm(y)) being written: the column walk applies it to every
// input word it loads (norm.apply_in_depthwise). kernels/norm_depthwise.py checks the case first.
at::Tensor depthwise_fwd_normed(const at::Tensor& y_in, const at::Tensor& w_in, const at::Tensor& mean,
                                const at::Tensor& invstd, const at::Tensor& norm_weight, const at::Tensor& norm_bias,
                                at::IntArrayRef stride, at::IntArrayRef padding) {
  const c10::MemoryFormat fmt = layout_of(y_in);
  const int64_t dilation[2] = {1, 1};
  const DepthwiseShape s = check_and_shape(y_in, w_in, stride, padding, dilation, fmt);
  c10::cuda::CUDAGuard guard(y_in.device());
  const at::Tensor y = in_layout(y_in, fmt);
  const at::Tensor w = w_in.contiguous();
  const InputNorm norm = input_norm_of("depthwise_fwd_normed", y, mean, invstd, norm_weight, norm_bias);
  const DType dt = to_dtype(y.scalar_type());
  at::Tensor out = at::empty({s.N, s.C * s.M, s.OH, s.OW}, y.options().memory_format(fmt));
  TORCH_CHECK(out.numel() > 0 && normed_fits(s, dt, y.const_data_ptr(), out.const_data_ptr()),
              "depthwise_fwd_normed: ", kNormedCases);
  launch_forward_normed(s, dt, y.const_data_ptr(), w.const_data_ptr(), norm, out.mutable_data_ptr(),
                        c10::cuda::getCurrentCUDAStream().stream());
  return out;
}

// grad_weight of depthwise_fwd_normed: the weight gradient with relu(batch_norm(y)) applied to y's words as the
// walk loads them. Its input gradient is the plain op's (depthwise_bwd), which does not read the input.
at::Tensor depthwise_wgrad_normed(const at::Tensor& grad_out, const at::Tensor& y_in, const at::Tensor& w_in,
                                  const at::Tensor& mean, const at::Tensor& invstd, const at::Tensor& norm_weight,
                                  const at::Tensor& norm_bias, at::IntArrayRef stride, at::IntArrayRef padding) {
  const c10::MemoryFormat fmt = layout_of(y_in);
  const int64_t dilation[2] = {1, 1};
  const DepthwiseShape s = check_and_shape(y_in, w_in, stride, padding, dilation, fmt);
  check_like_output("depthwise_wgrad_normed", "grad_out", grad_out, s, y_in);
  c10::cuda::CUDAGuard guard(y_in.device());
  const at::Tensor y = in_layout(y_in, fmt);
  const at::Tensor go = in_layout(grad_out, fmt);
  const at::Tensor w = w_in.contiguous();
  const InputNorm norm = input_norm_of("depthwise_wgrad_normed", y, mean, invstd, norm_weight, norm_bias);
  const DType dt = to_dtype(y.scalar_type());
  TORCH_CHECK(go.numel() > 0 && normed_fits(s, dt, go.const_data_ptr(), y.const_data_ptr()),
              "depthwise_wgrad_normed: ", kNormedCases);
  at::Tensor grad_weight = at::empty(w.sizes(), w.options());
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(wgrad_normed_workspace_elems(s, dt))}, y.options().dtype(at::kFloat));
  launch_wgrad_normed(s, dt, go.const_data_ptr(), y.const_data_ptr(), norm, workspace.mutable_data_ptr(),
                      grad_weight.mutable_data_ptr(), c10::cuda::getCurrentCUDAStream().stream());
  return grad_weight;
}

// Both gradients of depthwise_fwd_normed: (grad_input, grad_weight, sums), grad_input that of relu(batch_norm(y)) (the
// BatchNorm's own backward takes it from there). At stride 1 and padding 1 one walk reads grad_out once for both
// (launch_bwd_normed), and with grad_sums also gives that BatchNorm backward's sums as partials [chunks, 2, C] fp32
// (for mobilenet_bn::bn_relu_bwd_from_sums); at stride 2 and padding 1 grad_sums asks for the stride-2 walk, which
// gives all three; elsewhere, or without grad_sums, sums is empty.
// out_x and out_consts (both or neither; with grad_sums, where a walk gives the sums): grad_out is the gradient of
// the BatchNorm + ReLU after the convolution, out_x that BatchNorm's input (the convolution's output) and out_consts
// its backward's per-channel constants [6, C] fp32 (mobilenet_bn::bn_relu_bwd_consts); the walk computes the
// convolution's output gradient from them as it loads it, bitwise what mobilenet_bn::bn_relu_bwd would have written.
std::tuple<at::Tensor, at::Tensor, at::Tensor> depthwise_bwd_normed(
    const at::Tensor& grad_out, const at::Tensor& y_in, const at::Tensor& w_in, const at::Tensor& mean,
    const at::Tensor& invstd, const at::Tensor& norm_weight, const at::Tensor& norm_bias, at::IntArrayRef stride,
    at::IntArrayRef padding, bool grad_sums, const std::optional<at::Tensor>& out_x,
    const std::optional<at::Tensor>& out_consts) {
  const char* op = "depthwise_bwd_normed";
  const c10::MemoryFormat fmt = layout_of(y_in);
  const int64_t dilation[2] = {1, 1};
  const DepthwiseShape s = check_and_shape(y_in, w_in, stride, padding, dilation, fmt);
  check_like_output(op, "grad_out", grad_out, s, y_in);
  TORCH_CHECK(out_x.has_value() == out_consts.has_value(), op, ": out_x and out_consts come together (the BatchNorm "
              "after the convolution), got only ", out_x.has_value() ? "out_x" : "out_consts");
  if (out_x.has_value()) check_like_output(op, "out_x", *out_x, s, y_in);
  c10::cuda::CUDAGuard guard(y_in.device());
  const at::Tensor y = in_layout(y_in, fmt);
  const at::Tensor go = in_layout(grad_out, fmt);
  at::Tensor ox, oc;
  OutputGradNorm out_norm;
  if (out_x.has_value()) {
    TORCH_CHECK(grad_sums && bwd_normed_sums_chunks(s, to_dtype(y.scalar_type())) > 0, op,
                ": out_x (the BatchNorm after the convolution) is applied by the walks that give the sums: grad_sums "
                "and a 3x3 convolution of stride 1 or 2 with padding 1");
    check_bn_consts(op, "out_consts", *out_consts, s.C, y);
    ox = in_layout(*out_x, fmt);
    oc = out_consts->contiguous();
    out_norm.x = ox.const_data_ptr();
    out_norm.consts = oc.const_data_ptr<float>();
    out_norm.C = static_cast<int>(s.C);
  }
  const at::Tensor w = w_in.contiguous();
  const InputNorm norm = input_norm_of(op, y, mean, invstd, norm_weight, norm_bias);
  const DType dt = to_dtype(y.scalar_type());
  TORCH_CHECK(go.numel() > 0 && normed_fits(s, dt, go.const_data_ptr(), y.const_data_ptr()), op, ": ", kNormedCases);
  TORCH_CHECK(!ox.defined() || normed_fits(s, dt, ox.const_data_ptr(), y.const_data_ptr()), op, ": ", kNormedCases);
  at::Tensor grad_input = at::empty(y.sizes(), y.options().memory_format(fmt));
  at::Tensor grad_weight = at::empty(w.sizes(), w.options());
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(bwd_normed_workspace_elems(s, dt, grad_sums))}, y.options().dtype(at::kFloat));
  const int chunks = grad_sums ? bwd_normed_sums_chunks(s, dt) : 0;
  at::Tensor sums = at::empty({chunks, chunks > 0 ? 2 : 0, chunks > 0 ? s.C : 0}, y.options().dtype(at::kFloat));
  launch_bwd_normed(s, dt, go.const_data_ptr(), y.const_data_ptr(), w.const_data_ptr(), norm,
                    grad_input.mutable_data_ptr(), workspace.mutable_data_ptr(), grad_weight.mutable_data_ptr(),
                    chunks > 0 ? sums.mutable_data_ptr<float>() : nullptr, ox.defined() ? &out_norm : nullptr,
                    c10::cuda::getCurrentCUDAStream().stream());
  return {grad_input, grad_weight, sums};
}

// depthwise_bwd_normed with grad_sums, without its input gradient: (grad_weight, sums) from the walks, which then
// store nothing else (at stride 1 the input-row walk runs even where the rings would). The BatchNorm's input gradient
// is then depthwise_dgrad_normed's, from grad_out, once the sums are final.
std::tuple<at::Tensor, at::Tensor> depthwise_bwd_normed_sums(const at::Tensor& grad_out, const at::Tensor& y_in,
                                                             const at::Tensor& w_in, const at::Tensor& mean,
                                                             const at::Tensor& invstd, const at::Tensor& norm_weight,
                                                             const at::Tensor& norm_bias, at::IntArrayRef stride,
                                                             at::IntArrayRef padding) {
  const char* op = "depthwise_bwd_normed_sums";
  const c10::MemoryFormat fmt = layout_of(y_in);
  const int64_t dilation[2] = {1, 1};
  const DepthwiseShape s = check_and_shape(y_in, w_in, stride, padding, dilation, fmt);
  check_like_output(op, "grad_out", grad_out, s, y_in);
  c10::cuda::CUDAGuard guard(y_in.device());
  const at::Tensor y = in_layout(y_in, fmt);
  const at::Tensor go = in_layout(grad_out, fmt);
  const at::Tensor w = w_in.contiguous();
  const InputNorm norm = input_norm_of(op, y, mean, invstd, norm_weight, norm_bias);
  const DType dt = to_dtype(y.scalar_type());
  TORCH_CHECK(go.numel() > 0 && normed_fits(s, dt, go.const_data_ptr(), y.const_data_ptr()), op, ": ", kNormedCases);
  const int chunks = bwd_normed_sums_chunks(s, dt);
  TORCH_CHECK(chunks > 0, op, ": the sums come from the walks of 3x3 convolutions of stride 1 or 2 with padding 1");
  at::Tensor grad_weight = at::empty(w.sizes(), w.options());
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(bwd_normed_workspace_elems(s, dt, true))}, y.options().dtype(at::kFloat));
  at::Tensor sums = at::empty({chunks, 2, s.C}, y.options().dtype(at::kFloat));
  launch_bwd_normed(s, dt, go.const_data_ptr(), y.const_data_ptr(), w.const_data_ptr(), norm, nullptr,
                    workspace.mutable_data_ptr(), grad_weight.mutable_data_ptr(), sums.mutable_data_ptr<float>(),
                    nullptr, c10::cuda::getCurrentCUDAStream().stream());
  return {grad_weight, sums};
}

// The gradient of y, the input of the BatchNorm + ReLU before the convolution, from grad_out in one pass: the
// convolution's input gradient (rounded to y's dtype, as depthwise_bwd stores it) with that BatchNorm's input-gradient
// arithmetic applied to each value, consts its backward's per-channel constants [6, C] fp32
// (mobilenet_bn::bn_relu_bwd_consts_from_sums). NHWC 3x3, stride 1 or 2, padding 1, whole vectors of channels (8
// 16-bit or 4 fp32).
at::Tensor depthwise_dgrad_normed(const at::Tensor& grad_out, const at::Tensor& w_in, const at::Tensor& y_in,
                                  const at::Tensor& consts, at::IntArrayRef stride, at::IntArrayRef padding) {
  const char* op = "depthwise_dgrad_normed";
  const c10::MemoryFormat fmt = layout_of(y_in);
  const int64_t dilation[2] = {1, 1};
  const DepthwiseShape s = check_and_shape(y_in, w_in, stride, padding, dilation, fmt);
  check_like_output(op, "grad_out", grad_out, s, y_in);
  check_bn_consts(op, "consts", consts, s.C, y_in);
  c10::cuda::CUDAGuard guard(y_in.device());
  const at::Tensor y = in_layout(y_in, fmt);
  const at::Tensor go = in_layout(grad_out, fmt);
  const at::Tensor w = w_in.contiguous();
  const at::Tensor k = consts.contiguous();
  const DType dt = to_dtype(y.scalar_type());
  at::Tensor grad_y = at::empty(y.sizes(), y.options().memory_format(fmt));
  TORCH_CHECK(go.numel() > 0 && dgrad_normed_fits(s, dt, go.const_data_ptr(), y.const_data_ptr(),
                                                  grad_y.const_data_ptr()),
              op, ": only channels_last 3x3 depthwise convolutions (one filter per channel) with stride 1 or 2, "
              "padding 1 and whole vectors of channels (a multiple of 8 16-bit or 4 float32 channels) are supported");
  InputGradNorm bn;
  bn.y = y.const_data_ptr();
  bn.consts = k.const_data_ptr<float>();
  launch_dgrad_normed(s, dt, go.const_data_ptr(), w.const_data_ptr(), bn, grad_y.mutable_data_ptr(),
                      c10::cuda::getCurrentCUDAStream().stream());
  return grad_y;
}

// The NHWC 3x3 padding-1 convolution of an (n, c, h, w) input at this stride, as the normalizing backward's queries
// below describe it.
static DepthwiseShape padded_3x3_shape(int64_t n, int64_t c, int64_t h, int64_t w, int64_t stride) {
  DepthwiseShape s{};
  s.N = n, s.C = c, s.M = 1, s.H = h, s.W = w, s.OH = (h - 1) / stride + 1, s.OW = (w - 1) / stride + 1;
  s.KH = s.KW = 3, s.SH = s.SW = stride, s.PH = s.PW = 1, s.DH = s.DW = 1;
  s.channels_last = true;
  return s;
}

// The first dimension of depthwise_bwd_normed's sums for a 3x3 convolution with padding 1 and this stride of an
// (n, c, h, w) input on the current device (0 where no walk gives them): a function of the shape, dtype and GPU only,
// so that the op's fake kernel can size it.
int64_t bwd_normed_sums_rows(int64_t n, int64_t c, int64_t h, int64_t w, int64_t stride, c10::ScalarType dtype) {
  return bwd_normed_sums_chunks(padded_3x3_shape(n, c, h, w, stride), to_dtype(dtype));
}

// Whether depthwise_bwd_normed with grad_sums runs from the rings of rows (MDW_BWD_RING_NORM) for a 3x3 stride-1
// padding-1 convolution of an (n, c, h, w) input on the current device, its tensors 16-byte aligned.
bool bwd_normed_ring_runs_for(int64_t n, int64_t c, int64_t h, int64_t w, c10::ScalarType dtype) {
  return bwd_normed_ring_runs(padded_3x3_shape(n, c, h, w, 1), to_dtype(dtype));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> depthwise_bwd(const at::Tensor& grad_out, const at::Tensor& x_in,
                                                             const at::Tensor& w_in, at::IntArrayRef stride,
                                                             at::IntArrayRef padding, at::IntArrayRef dilation,
                                                             std::array<bool, 3> output_mask) {
  const c10::MemoryFormat fmt = layout_of(x_in);
  const DepthwiseShape s = check_and_shape(x_in, w_in, stride, padding, dilation, fmt);
  TORCH_CHECK(grad_out.dim() == 4 && grad_out.size(0) == s.N && grad_out.size(1) == s.C * s.M &&
                  grad_out.size(2) == s.OH && grad_out.size(3) == s.OW,
              "depthwise_conv2d backward: grad_out must have shape (", s.N, ", ", s.C * s.M, ", ", s.OH, ", ", s.OW,
              "), got ", grad_out.sizes());
  TORCH_CHECK(grad_out.device() == x_in.device() && grad_out.scalar_type() == x_in.scalar_type(),
              "depthwise_conv2d backward: grad_out must be on the input's device with the input's dtype");
  c10::cuda::CUDAGuard guard(x_in.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const DType dt = to_dtype(x_in.scalar_type());
  const at::Tensor x = in_layout(x_in, fmt);
  // grad_out normally arrives in the forward output's layout (= x's); anything else is copied once.
  const at::Tensor go = in_layout(grad_out, fmt);
  const at::Tensor w = w_in.contiguous();
  const bool empty = go.numel() == 0 || x.numel() == 0;

  auto alloc = [empty](at::IntArrayRef sizes, const at::TensorOptions& opt) {
    return empty ? at::zeros(sizes, opt) : at::empty(sizes, opt);
  };
  const at::Tensor grad_input =
      output_mask[0] ? alloc(x.sizes(), x.options().memory_format(fmt)) : at::empty({0}, x.options());
  const at::Tensor grad_weight = output_mask[1] ? alloc(w.sizes(), w.options()) : at::empty({0}, w.options());
  const at::Tensor grad_bias = output_mask[2] ? alloc({s.C * s.M}, w.options()) : at::empty({0}, w.options());
  if (empty) return {grad_input, grad_weight, grad_bias};
  void* gw = output_mask[1] ? grad_weight.mutable_data_ptr() : nullptr;
  void* gb = output_mask[2] ? grad_bias.mutable_data_ptr() : nullptr;
  const bool weight_or_bias = output_mask[1] || output_mask[2];
  if (output_mask[0] && weight_or_bias &&
      bwd_walk_fits(s, dt, go.const_data_ptr(), x.const_data_ptr(), grad_input.const_data_ptr())) {
    const at::Tensor workspace =
        at::empty({static_cast<int64_t>(bwd_walk_workspace_elems(s, dt))}, x.options().dtype(at::kFloat));
    launch_bwd_walk(s, dt, go.const_data_ptr(), x.const_data_ptr(), w.const_data_ptr(), grad_input.mutable_data_ptr(),
                    workspace.mutable_data_ptr(), gw, gb, stream);
    return {grad_input, grad_weight, grad_bias};
  }
  if (output_mask[0])
    launch_dgrad(s, dt, go.const_data_ptr(), w.const_data_ptr(), grad_input.mutable_data_ptr(), stream);
  if (weight_or_bias) {
    const size_t elems = wgrad_workspace_elems(s, dt, go.const_data_ptr(), x.const_data_ptr());
    const at::Tensor workspace = at::empty({static_cast<int64_t>(elems)},
                                           x.options().dtype(dt == DType::F64 ? at::kDouble : at::kFloat));
    launch_wgrad(s, dt, go.const_data_ptr(), x.const_data_ptr(), workspace.mutable_data_ptr(), gw, gb, stream);
  }
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace
}  // namespace mdw

TORCH_LIBRARY(mobilenet_dw, m) {
  // activation: the epilogue after the bias (0: none, 1: ReLU, 2: ReLU6), so that inference runs
  // conv + bias + activation in one pass over the output.
  m.def(
      "depthwise_fwd(Tensor x, Tensor w, Tensor? bias, int[2] stride, int[2] padding, int[2] dilation, "
      "int activation=0) -> Tensor");
  m.def(
      "depthwise_bwd(Tensor grad_out, Tensor x, Tensor w, int[2] stride, int[2] padding, int[2] dilation, "
      "bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  // The forward without bias or activation that also returns the statistics of y per band of rows (fp64
  // [bands, 3, C]: count, mean, M2), for the BatchNorm that follows (mobilenet_bn::bn_relu_fwd_from_partials).
  m.def("depthwise_fwd_stats(Tensor x, Tensor w, int[2] stride, int[2] padding) -> (Tensor, Tensor)");
  // norm.apply_in_depthwise: the forward (no bias, no activation) and weight gradient of conv(relu(batch_norm(y)))
  // from y and the BatchNorm's fp32 batch mean, invstd, weight and bias, without relu(batch_norm(y)) being written.
  m.def(
      "depthwise_fwd_normed(Tensor y, Tensor w, Tensor mean, Tensor invstd, Tensor norm_weight, Tensor norm_bias, "
      "int[2] stride, int[2] padding) -> Tensor");
  m.def(
      "depthwise_wgrad_normed(Tensor grad_out, Tensor y, Tensor w, Tensor mean, Tensor invstd, Tensor norm_weight, "
      "Tensor norm_bias, int[2] stride, int[2] padding) -> Tensor");
  // Both gradients of the normalizing forward (grad_input that of relu(batch_norm(y))), at stride 1 in one walk, which
  // with grad_sums also returns the BatchNorm backward's sums of grad_input, as the stride-2 walk does (else an empty
  // tensor). With out_x and out_consts grad_out is the gradient of the BatchNorm + ReLU after the convolution, whose
  // input gradient the walks apply as they load it.
  m.def(
      "depthwise_bwd_normed(Tensor grad_out, Tensor y, Tensor w, Tensor mean, Tensor invstd, Tensor norm_weight, "
      "Tensor norm_bias, int[2] stride, int[2] padding, bool grad_sums=False, Tensor? out_x=None, "
      "Tensor? out_consts=None) -> (Tensor, Tensor, Tensor)");
  // The BatchNorm's input gradient from grad_out, once its sums are final (MBN_NORM_INPUT_GRAD=dgrad): the walks'
  // weight gradient and sums without the convolution's input gradient, then that input gradient recomputed by the
  // tiled kernel with the BatchNorm's input-gradient arithmetic applied to each value.
  m.def(
      "depthwise_bwd_normed_sums(Tensor grad_out, Tensor y, Tensor w, Tensor mean, Tensor invstd, "
      "Tensor norm_weight, Tensor norm_bias, int[2] stride, int[2] padding) -> (Tensor, Tensor)");
  m.def(
      "depthwise_dgrad_normed(Tensor grad_out, Tensor w, Tensor y, Tensor consts, int[2] stride, int[2] padding) "
      "-> Tensor");
  m.def("bwd_normed_sums_rows(int n, int c, int h, int w, int stride, ScalarType dtype) -> int",
        &mdw::bwd_normed_sums_rows);
  m.def("bwd_normed_ring_runs(int n, int c, int h, int w, ScalarType dtype) -> bool", &mdw::bwd_normed_ring_runs_for);
  // The launch knobs (MDW_* environment, launch_plan.h) are read once and kept; this re-reads them.
  m.def("reload_knobs() -> ()", &mdw::reload_knobs);
}

TORCH_LIBRARY_IMPL(mobilenet_dw, CUDA, m) {
  m.impl("depthwise_fwd", &mdw::depthwise_fwd);
  m.impl("depthwise_bwd", &mdw::depthwise_bwd);
  m.impl("depthwise_fwd_stats", &mdw::depthwise_fwd_stats);
  m.impl("depthwise_fwd_normed", &mdw::depthwise_fwd_normed);
  m.impl("depthwise_wgrad_normed", &mdw::depthwise_wgrad_normed);
  m.impl("depthwise_bwd_normed", &mdw::depthwise_bwd_normed);
  m.impl("depthwise_bwd_normed_sums", &mdw::depthwise_bwd_normed_sums);
  m.impl("depthwise_dgrad_normed", &mdw::depthwise_dgrad_normed);
}
