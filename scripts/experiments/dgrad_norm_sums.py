#!/usr/bin/env python
"""Can cuDNN's input-gradient convolution also produce the BatchNorm backward's gradient sums? For each of
MobileNetV1's 13 pointwise layers (batch 256, channels_last, fp16), the backward of norm.apply_in_pointwise's pair
(BatchNorm + ReLU of the depthwise output y, then the 1x1 conv) is run as the training step runs it today and with
the sums taken in cuDNN's dgrad epilogue (through cudnn-frontend's graph API, `pip install nvidia-cudnn-frontend`):

    separate:  dx = dgrad(grad_out, w) (aten.convolution_backward, cuDNN), then bn_relu_bwd(dx, y, ...): a pass over
               dx and y for the sums of g and g * (y - mean), g = dx where relu's input was > 0, and a pass that
               writes grad_y
    fused:     one cuDNN graph: dx = dgrad(grad_out, w), written, and in its epilogue g = relu_backward(dx,
               y * scale + shift) and the per-channel reductions of g and g * (y - pivot) (pivot = the batch mean in
               the operand dtype; the exact mean is put back afterwards, so nothing cancels), then bn_relu_input_grad
               (the pass that writes grad_y) from those sums

    python scripts/experiments/dgrad_norm_sums.py [--batch 256] [--rounds 7] [--iters 20] [--layers 0,6]

Graph forms are tried in order (per-channel operands in fp32, then in fp16) until cuDNN builds one; each is autotuned
over the heuristics' first plans as pointwise_norm_fusion.py does. Each variant's --iters calls are captured in one
CUDA graph and the replays alternate for --rounds rounds (CUDA events). Prints per layer the median microseconds per
call, the relative difference of the fused grad_y, grad_weight and grad_bias from the separate path's, and of the
fused sums from float64 sums; then the sums over the layers.
"""

from __future__ import annotations

import torch

from pointwise_norm_fusion import (LAYERS, CudnnGraph, _nhwc_strides, layer_inputs, open_cudnn, picked_layers,
                                   probe_arguments, time_alternating)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main() -> None:
    args = probe_arguments(__doc__)
    cudnn, handle = open_cudnn(args.batch, "fp16")
    bn = torch.ops.mobilenet_bn
    half, f32 = cudnn.data_type.HALF, cudnn.data_type.FLOAT
    picked = picked_layers(args)
    totals: dict[str, float] = {}
    rows = []
    for index in picked:
        cin, cout, size = LAYERS[index]
        n = args.batch
        y, w, bw, bb = layer_inputs(n, cin, cout, size, torch.float16)
        grad_out = torch.randn(n, cout, size, size, device="cuda").half().contiguous(memory_format=torch.channels_last)
        mean, invstd, _ = bn.bn_stats(y, bw, bb, 1e-5)
        scale32 = bw * invstd
        shift32 = bb - mean * scale32
        count = n * size * size

        def dgrad():
            return torch.ops.aten.convolution_backward(grad_out, y, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0],
                                                       1, [True, False, False])[0]

        dx_ref = dgrad()
        ref_gy, ref_gw, ref_gb = bn.bn_relu_bwd(dx_ref, y, bw, bb, mean, invstd)
        # float64 sums from the same dx (the mask from the fp32 formula bn_relu_bwd uses)
        mask = (y.double() * scale32.double().view(1, -1, 1, 1) + shift32.double().view(1, -1, 1, 1)) > 0
        g64 = dx_ref.double() * mask
        ref_sa = g64.sum((0, 2, 3))
        ref_sb = (g64 * (y.double() - mean.double().view(1, -1, 1, 1))).sum((0, 2, 3))

        dx = torch.empty_like(y).fill_(float("nan"))
        r1 = torch.full((1, cin, 1, 1), float("nan"), device="cuda")
        r2 = torch.full((1, cin, 1, 1), float("nan"), device="cuda")

        def graph_form(op_type):
            def build(g):
                t = {"DO": g.tensor(name="DO", dim=list(grad_out.shape), stride=_nhwc_strides(grad_out.shape),
                                    data_type=half),
                     "W": g.tensor(name="W", dim=list(w.shape), stride=_nhwc_strides(w.shape), data_type=half),
                     "Y": g.tensor(name="Y", dim=list(y.shape), stride=_nhwc_strides(y.shape), data_type=half)}
                for k in ("S", "B", "P"):
                    t[k] = g.tensor(name=k, dim=[1, cin, 1, 1], stride=[cin, 1, cin, cin], data_type=op_type)
                t["DX"] = g.conv_dgrad(loss=t["DO"], filter=t["W"], padding=[0, 0], stride=[1, 1], dilation=[1, 1])
                t["DX"].set_output(True).set_dim(list(y.shape)).set_stride(_nhwc_strides(y.shape)).set_data_type(half)
                z = g.bias(name="shift", input=g.scale(name="scale", input=t["Y"], scale=t["S"]), bias=t["B"])
                gm = g.relu_backward(name="drelu", loss=t["DX"], input=z)
                t["R1"] = g.reduction(name="sum_g", input=gm, mode=cudnn.reduction_mode.ADD, compute_data_type=f32)
                centred = g.mul(name="g_centred", a=gm, b=g.sub(name="centre", a=t["Y"], b=t["P"]))
                t["R2"] = g.reduction(name="sum_gy", input=centred, mode=cudnn.reduction_mode.ADD,
                                      compute_data_type=f32)
                for k in ("R1", "R2"):
                    t[k].set_output(True).set_dim([1, cin, 1, 1]).set_stride([cin, 1, cin, cin]).set_data_type(f32)
                return t
            return build

        fused, notes, operands = None, [], None
        for op_type, torch_type, label in ((f32, torch.float32, "fp32"), (half, torch.float16, "fp16")):
            ops = {k: v.to(torch_type).view(1, cin, 1, 1) for k, v in (("S", scale32), ("B", shift32), ("P", mean))}
            try:
                fused = CudnnGraph(cudnn, handle, graph_form(op_type),
                                   {"DO": grad_out, "W": w, "Y": y, **ops, "DX": dx, "R1": r1, "R2": r2},
                                   f"dgrad+sums {label}")
                operands = (label, ops)
                notes.append(f"dgrad+sums with {label} operands: plan {fused.plan} of {fused.plans} built")
                break
            except Exception as e:  # noqa: BLE001 - an unsupported graph is a finding, not a crash
                notes.append(f"dgrad+sums with {label} operands: {type(e).__name__}: {str(e)[:200]}")

        def fused_bwd():
            r1.zero_(), r2.zero_()  # in case the reductions add into their outputs
            fused.run()
            sa = r1.view(-1).double()
            pivot = operands[1]["P"].view(-1).double()
            sb = r2.view(-1).double() - (mean.double() - pivot) * sa
            grad_means = (torch.stack((sa, sb)) / count).float()
            gy = bn.bn_relu_input_grad(dx, y, bw, bb, mean, invstd, grad_means)
            return gy, (sb * invstd.double()).float(), sa.float()

        variants = {"separate": lambda: bn.bn_relu_bwd(dgrad(), y, bw, bb, mean, invstd)}
        checks = []
        if fused is not None:
            variants["fused"] = fused_bwd
            gy, gw, gb = fused_bwd()
            torch.cuda.synchronize()
            checks += [("dx", _rel(dx, dx_ref)), ("sum g", _rel(r1.view(-1), ref_sa)),
                       ("sum g(y-mean)", _rel(r2.view(-1).double() - (mean.double() - operands[1]["P"].view(-1).double())
                                              * r1.view(-1).double(), ref_sb)),
                       ("grad_y", _rel(gy, ref_gy)), ("grad_w", _rel(gw, ref_gw)), ("grad_b", _rel(gb, ref_gb))]
            sep_sa = ref_gb.double()
            checks.append(("separate sum g vs f64", _rel(sep_sa, ref_sa)))
        med = time_alternating(variants, args.iters, args.rounds)
        for k, v in med.items():
            totals[k] = totals.get(k, 0.0) + v
        label = f"{cin}->{cout} {size}x{size}"
        rows.append((label, med))
        print(f"\n{label}: " + ", ".join(f"{k} {v:.1f} us" for k, v in med.items()), flush=True)
        print("  checks (relative L2): " + ", ".join(f"{k} {v:.2e}" for k, v in checks), flush=True)
        for note in notes:
            print("  " + note, flush=True)
        torch.cuda.empty_cache()
    keys = list(totals)
    print("\n| layer | " + " | ".join(keys) + " |")
    print("|---|" + "--:|" * len(keys))
    for label, med in rows:
        print(f"| {label} | " + " | ".join(f"{med.get(k, float('nan')):.1f}" for k in keys) + " |")
    print("| **sum** | " + " | ".join(f"**{totals[k]:.1f}**" for k in keys) + " |")


if __name__ == "__main__":
    main()
