// The depthwise ops' autocast kernels and depthwise_fwd's autograd, in C++. An eager training step calls them for
// every depthwise layer, forward and backward: as Python kernels (torch.library.register_autograd and a Python
// AutocastCUDA kernel) they cost the host about 0.3 ms a layer and step on the H200 machine, which made eager
// custom training host-bound and slower than cuDNN (docs/kernel_notes.md, "The custom op's autograd and autocast
// wrappers"). The fake kernels, and the autograd of the rarely used depthwise_fwd_stats, stay in kernels/ops.py.
#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

namespace mdw {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

using FwdSig = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::IntArrayRef,
                          at::IntArrayRef, at::IntArrayRef, int64_t);
using BwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              at::IntArrayRef, at::IntArrayRef, at::IntArrayRef,
                                                              std::array<bool, 3>);
using FwdStatsSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, at::IntArrayRef,
                                                       at::IntArrayRef);

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

const c10::TypedOperatorHandle<FwdSig>& fwd_op() {
  static const auto h = op<FwdSig>("mobilenet_dw::depthwise_fwd");
  return h;
}

const c10::TypedOperatorHandle<BwdSig>& bwd_op() {
  static const auto h = op<BwdSig>("mobilenet_dw::depthwise_bwd");
  return h;
}

const c10::TypedOperatorHandle<FwdStatsSig>& fwd_stats_op() {
  static const auto h = op<FwdStatsSig>("mobilenet_dw::depthwise_fwd_stats");
  return h;
}

// --- autocast: every floating CUDA argument but fp64 to the autocast dtype, as F.conv2d's autocast rule does --------

// at::autocast::cached_cast casts only what autocast would (floating, not fp64, on the device) and reuses the cast
// of an fp32 leaf weight within one autocast region, as autocast's own ops do.
at::Tensor cast(const at::Tensor& t) {
  return at::autocast::cached_cast(at::autocast::get_autocast_dtype(at::kCUDA), t, c10::DeviceType::CUDA);
}

struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::DispatchKey::AutocastCUDA};
};

at::Tensor fwd_autocast(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                        at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t activation) {
  NoAutocast off;
  const std::optional<at::Tensor> b = bias.has_value() ? std::optional<at::Tensor>(cast(*bias)) : std::nullopt;
  return fwd_op().call(cast(x), cast(w), b, stride, padding, dilation, activation);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_autocast(const at::Tensor& grad_out, const at::Tensor& x,
                                                            const at::Tensor& w, at::IntArrayRef stride,
                                                            at::IntArrayRef padding, at::IntArrayRef dilation,
                                                            std::array<bool, 3> output_mask) {
  NoAutocast off;
  return bwd_op().call(cast(grad_out), cast(x), cast(w), stride, padding, dilation, output_mask);
}

std::tuple<at::Tensor, at::Tensor> fwd_stats_autocast(const at::Tensor& x, const at::Tensor& w, at::IntArrayRef stride,
                                                      at::IntArrayRef padding) {
  NoAutocast off;
  return fwd_stats_op().call(cast(x), cast(w), stride, padding);
}

// --- autograd of depthwise_fwd ---------------------------------------------------------------------------------

// A depthwise weight gradient (contiguous) in the weight's own strides. A [C, 1, kh, kw] weight in channels_last is
// the same memory as a contiguous one with another stride for its size-1 dimension; DDP's gradient buckets compare
// every stride and copy the gradient (with a warning) each step where they differ. The Python twin is
// kernels.in_weight_strides.
at::Tensor in_weight_strides(const at::Tensor& gw, const at::Tensor& w) {
  if (!gw.defined() || gw.strides() == w.strides() || !(gw.is_contiguous() && w.is_contiguous())) return gw;
  return gw.as_strided(w.sizes(), w.strides());
}

class DepthwiseFwd : public torch::autograd::Function<DepthwiseFwd> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding,
                            at::IntArrayRef dilation, int64_t activation) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor y = fwd_op().call(x, w, bias, stride, padding, dilation, activation);
    // With an activation the output is needed for its gradient mask (y > 0, and y < 6 for ReLU6).
    ctx->save_for_backward({x, w, activation != 0 ? y : at::Tensor()});
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["dilation"] = dilation;
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["has_bias"] = bias.has_value();
    return y;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const tensor_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const std::array<bool, 3> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                   ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)};
    tensor_list out(7);  // one per forward argument; undefined where no gradient
    if (!mask[0] && !mask[1] && !mask[2]) return out;
    at::Tensor grad = grads[0];
    const int64_t activation = ctx->saved_data["activation"].toInt();
    if (activation == 1) {
      grad = grad * saved[2].gt(0);
    } else if (activation == 2) {
      grad = grad * saved[2].gt(0).logical_and(saved[2].lt(6));
    }
    // One op for all three gradients: grad_out is consumed by dgrad and wgrad in the same call.
    auto [gx, gw, gb] = bwd_op().call(grad.to(x.scalar_type()), x, w, ctx->saved_data["stride"].toIntVector(),
                                      ctx->saved_data["padding"].toIntVector(),
                                      ctx->saved_data["dilation"].toIntVector(), mask);
    if (mask[0]) out[0] = gx;
    if (mask[1]) out[1] = in_weight_strides(gw, w);
    if (mask[2]) out[2] = gb;
    return out;
  }
};

at::Tensor fwd_autograd(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                        at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t activation) {
  return DepthwiseFwd::apply(x, w, bias, stride, padding, dilation, activation);
}

}  // namespace
}  // namespace mdw

TORCH_LIBRARY_IMPL(mobilenet_dw, AutocastCUDA, m) {
  m.impl("depthwise_fwd", &mdw::fwd_autocast);
  m.impl("depthwise_bwd", &mdw::bwd_autocast);
  m.impl("depthwise_fwd_stats", &mdw::fwd_stats_autocast);
}

TORCH_LIBRARY_IMPL(mobilenet_dw, Autograd, m) { m.impl("depthwise_fwd", &mdw::fwd_autograd); }
