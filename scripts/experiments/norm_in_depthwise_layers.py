#!/usr/bin/env python
"""norm.apply_in_depthwise layer by layer: for each of MobileNetV1's 13 depthwise layers (batch 256, channels_last),
the BatchNorm + ReLU before it and the depthwise kernels that read its output, run separately and fused:

    forward   separate: bn_relu_fwd (statistics, then relu(batch_norm(y)) written) + depthwise_fwd
              fused:    bn_stats (statistics only) + depthwise_fwd_normed (normalizes y as it loads it)
    wgrad     separate: depthwise_bwd's weight gradient from x = relu(batch_norm(y))
              fused:    depthwise_wgrad_normed from y
    backward  the pair's whole backward from y, the conv's two gradients and then the BatchNorm + ReLU's:
              separate: depthwise_bwd_normed without the sums (the stride-1 walk, or at stride 2 the input gradient's
                        and the weight gradient's kernels) + bn_relu_bwd (its reduce pass, then its input gradient)
              fused:    depthwise_bwd_normed with the sums (either walk) + bn_relu_bwd_from_sums (no reduce pass)

    python scripts/experiments/norm_in_depthwise_layers.py [--batch 256] [--dtype fp16] [--rounds 7] [--iters 20]
        [--strides 1,2]

CUDA events around --iters calls of each variant, the variants alternating for --rounds rounds after a warm-up.
Prints the median time per call of each (layer, pass, variant) in microseconds, and the sums over the layers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as `python scripts/experiments/...`

from mobilenet.bench.dtypes import DTYPES  # noqa: E402
from mobilenet.bench.timing import events_elapsed_s  # noqa: E402

# (channels, input size, stride) of the 13 depthwise layers at width 1.0, input 224 (Howard et al. 2017, Table 1)
LAYERS = [(32, 112, 1), (64, 112, 2), (128, 56, 1), (128, 56, 2), (256, 28, 1), (256, 28, 2), (512, 14, 1),
          (512, 14, 1), (512, 14, 1), (512, 14, 1), (512, 14, 1), (512, 14, 2), (1024, 7, 1)]


PASSES = ("forward", "wgrad", "backward")


def _bwd_from_sums(conv_grads, y, weight, bias, mean, invstd):
    """The BatchNorm + ReLU backward from depthwise_bwd_normed's (grad_x, grad_w, sums)."""
    grad_x, _, sums = conv_grads
    return torch.ops.mobilenet_bn.bn_relu_bwd_from_sums(grad_x, y, weight, bias, mean, invstd, sums)


def _time(fn, iters: int) -> float:
    """Microseconds per call of fn, over `iters` back-to-back calls."""
    return events_elapsed_s(fn, iters) * 1e6 / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--strides", default="1,2", help="the layers of these strides only (comma-separated)")
    args = ap.parse_args()
    try:
        strides = {int(v) for v in args.strides.split(",")}
    except ValueError:
        ap.error(f"--strides must be comma-separated integers, got {args.strides!r}")
    import kernels.norm_depthwise  # noqa: F401  (loads the kernels, registers the ops)

    dw, bn = torch.ops.mobilenet_dw, torch.ops.mobilenet_bn
    dtype = DTYPES[args.dtype]
    totals: dict[tuple[str, str], float] = {}
    print(f"{'layer':>16} {'pass':>8} {'separate us':>12} {'fused us':>9} {'fused/sep':>9}")
    for c, size, stride in (layer for layer in LAYERS if layer[2] in strides):
        y = torch.randn(args.batch, c, size, size, device="cuda").to(dtype).contiguous(memory_format=torch.channels_last)
        w = (torch.randn(c, 1, 3, 3, device="cuda") / 3).to(dtype)
        bw, bb = torch.rand(c, device="cuda") + 0.5, torch.randn(c, device="cuda")
        x, mean, invstd, _ = bn.bn_relu_fwd(y, bw, bb, 1e-5)
        out = dw.depthwise_fwd(x, w, None, [stride] * 2, [1, 1], [1, 1], 0)
        grad = torch.randn_like(out)
        variants = {
            ("forward", "separate"): lambda: dw.depthwise_fwd(bn.bn_relu_fwd(y, bw, bb, 1e-5)[0], w, None,
                                                              [stride] * 2, [1, 1], [1, 1], 0),
            ("forward", "fused"): lambda: dw.depthwise_fwd_normed(y, w, *bn.bn_stats(y, bw, bb, 1e-5)[:2], bw, bb,
                                                                  [stride] * 2, [1, 1]),
            ("wgrad", "separate"): lambda: dw.depthwise_bwd(grad, x, w, [stride] * 2, [1, 1], [1, 1],
                                                            [False, True, False]),
            ("wgrad", "fused"): lambda: dw.depthwise_wgrad_normed(grad, y, w, mean, invstd, bw, bb, [stride] * 2,
                                                                  [1, 1]),
            ("backward", "separate"): lambda: bn.bn_relu_bwd(
                dw.depthwise_bwd_normed(grad, y, w, mean, invstd, bw, bb, [stride] * 2, [1, 1])[0], y, bw, bb, mean,
                invstd),
            ("backward", "fused"): lambda: _bwd_from_sums(
                dw.depthwise_bwd_normed(grad, y, w, mean, invstd, bw, bb, [stride] * 2, [1, 1], True), y, bw, bb,
                mean, invstd),
        }
        for fn in variants.values():
            fn()
        times: dict[tuple[str, str], list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for key, fn in variants.items():
                times[key].append(_time(fn, args.iters))
        name = f"{c}x{size}s{stride}"
        for p in PASSES:
            sep, fused = (statistics.median(times[(p, v)]) for v in ("separate", "fused"))
            totals[(p, "separate")] = totals.get((p, "separate"), 0.0) + sep
            totals[(p, "fused")] = totals.get((p, "fused"), 0.0) + fused
            print(f"{name:>16} {p:>8} {sep:12.1f} {fused:9.1f} {fused / sep:9.3f}")
    for p in PASSES:
        sep, fused = totals[(p, "separate")], totals[(p, "fused")]
        print(f"{'sum':>16} {p:>8} {sep:12.1f} {fused:9.1f} {fused / sep:9.3f}")


if __name__ == "__main__":
    main()
