#!/usr/bin/env python
"""Can cuDNN's fused convolutions take the BatchNorm + ReLU before each pointwise conv? For each of MobileNetV1's 13
pointwise layers (batch 256, channels_last, 16-bit), the BatchNorm + ReLU after the depthwise conv and the pointwise
conv that reads its output, run as the training step runs them today and as cuDNN's graph API can fuse them
(through cudnn-frontend, `pip install nvidia-cudnn-frontend`):

    forward   separate:  bn_relu_fwd (statistics, then x = relu(batch_norm(y)) written) + F.conv2d(x, w)
              fused:     bn_stats (statistics only) + one cuDNN graph: conv(relu(y * scale + shift), w), the
                         scale-shift-ReLU applied as the convolution loads y (scale = weight * invstd,
                         shift = bias - mean * scale, per channel)
              fused+st:  the same graph with genstats: the per-channel sum and sum of squares of its output, which
                         the next BatchNorm's statistics pass would otherwise read the output again for
    wgrad     separate:  the weight gradient from the stored x (aten.convolution_backward, cuDNN)
              fused:     one cuDNN graph: the weight gradient with relu(y * scale + shift) recomputed as it loads y
    plain     cudnn-frontend's own plain convolution of x, autotuned the same way: whether a difference comes
              from the fusion or from the engine chosen

    python scripts/experiments/pointwise_norm_fusion.py [--batch 256] [--dtype fp16] [--rounds 7] [--iters 20]

Every cuDNN graph is autotuned: the heuristics' first CANDIDATES execution plans are built and the fastest on this
layer kept (cudnn.benchmark is on for the torch side). Each variant's --iters calls are captured in one CUDA graph;
the replays alternate over the variants for --rounds rounds, timed with CUDA events. Prints the median time per
call of each (layer, variant) in microseconds, the sums over the layers, and each fused output's relative difference
from the separate one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as `python scripts/experiments/...`

from mobilenet.bench.dtypes import DTYPES as ALL_DTYPES  # noqa: E402

CANDIDATES = 4
DTYPES = {k: ALL_DTYPES[k] for k in ("fp16", "bf16")}  # cuDNN's fused convolutions are 16-bit
# (input channels, output channels, size) of the 13 pointwise convs at width 1.0, input 224 (Howard et al. 2017,
# Table 1): each reads its block's depthwise output.
LAYERS = [(32, 64, 112), (64, 128, 56), (128, 128, 56), (128, 256, 28), (256, 256, 28), (256, 512, 14),
          (512, 512, 14), (512, 512, 14), (512, 512, 14), (512, 512, 14), (512, 512, 14), (512, 1024, 7),
          (1024, 1024, 7)]


def _nhwc_strides(shape) -> list[int]:
    n, c, h, w = shape
    return [h * w * c, 1, w * c, c]


class CudnnGraph:
    """One cuDNN operation graph, autotuned over all its execution plans; run() executes the fastest on the current
    torch stream (so that CUDA-graph capture records it)."""

    def __init__(self, cudnn, handle, build, feeds: dict, label: str):
        self.cudnn, self.handle, self.label = cudnn, handle, label
        self.graph = cudnn.pygraph(io_data_type=cudnn.data_type.HALF, intermediate_data_type=cudnn.data_type.FLOAT,
                                   compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        self.tensors = build(self.graph)  # name -> graph tensor
        self.graph.validate()
        self.graph.build_operation_graph()
        self.graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        self.graph.check_support()
        self.feeds = {self.tensors[k]: v for k, v in feeds.items()}
        self.built = []
        for i in range(min(self.graph.get_execution_plan_count(), CANDIDATES)):
            try:
                self.graph.build_plan_at_index(i)
                self.built.append(i)
            except Exception:  # noqa: BLE001
                pass
        size = max(self.graph.get_workspace_size_plan_at_index(i) for i in self.built)
        self.workspace = torch.empty(max(size, 1), dtype=torch.uint8, device="cuda")
        self.plans = len(self.built)
        self.plan = self._autotune()

    def _run_plan(self, index: int) -> None:
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        self.graph.execute_plan_at_index(self.feeds, self.workspace, index, handle=self.handle)

    def _autotune(self) -> int:
        from mobilenet.bench.timing import events_elapsed_s

        best, best_s = 0, float("inf")
        self.first_ms = None
        for i in self.built:
            try:
                self._run_plan(i)
                torch.cuda.synchronize()
                seconds = min(events_elapsed_s(lambda: self._run_plan(i), 5) for _ in range(3))
            except Exception:  # noqa: BLE001 - a plan that fails to run is not a candidate
                continue
            if self.first_ms is None:
                self.first_ms = seconds * 1e3 / 5
            if seconds < best_s:
                best, best_s = i, seconds
        return best

    def run(self) -> None:
        self._run_plan(self.plan)


def time_alternating(variants: dict, iters: int, rounds: int) -> dict[str, float]:
    """Median microseconds per call of each variant: its `iters` calls captured once in a CUDA graph (after 3 warm-up
    calls on the capture stream), the replays alternating over the variants for `rounds` rounds (CUDA events)."""
    from mobilenet.bench.timing import events_elapsed_s

    captured = {}
    stream = torch.cuda.Stream()
    for key, fn in variants.items():
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(iters):
                fn()
        captured[key] = graph
    times: dict[str, list[float]] = {k: [] for k in captured}
    for _ in range(rounds):
        for key, graph in captured.items():
            times[key].append(events_elapsed_s(graph.replay) * 1e6 / iters)
    return {k: statistics.median(v) for k, v in times.items()}


def _sbr(cudnn, g, t: dict, y: torch.Tensor, scale_type):
    c = y.shape[1]
    t["Y"] = g.tensor(name="Y", dim=list(y.shape), stride=_nhwc_strides(y.shape), data_type=cudnn.data_type.HALF
                      if y.dtype == torch.float16 else cudnn.data_type.BFLOAT16)
    t["S"] = g.tensor(name="S", dim=[1, c, 1, 1], stride=[c, 1, c, c], data_type=scale_type)
    t["B"] = g.tensor(name="B", dim=[1, c, 1, 1], stride=[c, 1, c, c], data_type=scale_type)
    return g.relu(name="relu", input=g.bias(name="shift", input=g.scale(name="scale", input=t["Y"], scale=t["S"]),
                                            bias=t["B"]))


def _dtype(cudnn, dtype):
    return cudnn.data_type.HALF if dtype == torch.float16 else cudnn.data_type.BFLOAT16


def probe_arguments(doc: str, dtypes: dict | None = None) -> argparse.Namespace:
    """The cuDNN probes' command line: --batch, --rounds, --iters and --layers, and --dtype (of `dtypes`) if given."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    if dtypes:
        ap.add_argument("--dtype", choices=sorted(dtypes), default="fp16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--layers", default="", help="comma-separated layer indices (0-12); all by default")
    return ap.parse_args()


def open_cudnn(batch: int, dtype_name: str):
    """(the cudnn module, a handle): cudnn-frontend and the project's kernels loaded, cudnn.benchmark on for the torch
    side, and the versions printed."""
    import cudnn

    import kernels.norm_depthwise  # noqa: F401  (loads the kernels, registers the ops)

    torch.backends.cudnn.benchmark = True
    handle = cudnn.create_handle()
    print(f"cuDNN {cudnn.backend_version_string()}, cudnn-frontend {cudnn.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}, batch {batch}, {dtype_name}", flush=True)
    return cudnn, handle


def picked_layers(args: argparse.Namespace):
    """The indices into LAYERS that --layers names (all by default)."""
    return [int(i) for i in args.layers.split(",")] if args.layers else range(len(LAYERS))


def layer_inputs(batch: int, cin: int, cout: int, size: int, dtype: torch.dtype):
    """A layer's random operands, channels_last in dtype: the BatchNorm's input y (mean 0.3), the 1x1 weight w, and
    the BatchNorm's fp32 weight and bias."""
    cl = torch.channels_last
    y = torch.randn(batch, cin, size, size, device="cuda").add_(0.3).to(dtype).contiguous(memory_format=cl)
    w = (torch.randn(cout, cin, 1, 1, device="cuda") / cin ** 0.5).to(dtype).contiguous(memory_format=cl)
    bw, bb = torch.rand(cin, device="cuda") + 0.5, torch.randn(cin, device="cuda") * 0.5
    return y, w, bw, bb


def main() -> None:
    args = probe_arguments(__doc__, DTYPES)
    cudnn, handle = open_cudnn(args.batch, args.dtype)
    bn = torch.ops.mobilenet_bn
    dtype = DTYPES[args.dtype]
    picked = picked_layers(args)
    totals: dict[str, float] = {}
    rows = []
    for index in picked:
        cin, cout, size = LAYERS[index]
        y, w, bw, bb = layer_inputs(args.batch, cin, cout, size, dtype)
        x, mean, invstd, _ = bn.bn_relu_fwd(y, bw, bb, 1e-5)
        out = F.conv2d(x, w)
        grad = torch.randn_like(out)
        scale32 = bw * invstd
        shift32 = bb - mean * scale32

        def fwd_graph(genstats: bool, scale_type):
            def build(g):
                t = {}
                a = _sbr(cudnn, g, t, y, scale_type)
                t["W"] = g.tensor(name="W", dim=list(w.shape), stride=_nhwc_strides(w.shape), data_type=_dtype(cudnn, dtype))
                t["O"] = g.conv_fprop(image=a, weight=t["W"], padding=[0, 0], stride=[1, 1], dilation=[1, 1])
                t["O"].set_output(True).set_data_type(_dtype(cudnn, dtype))
                if genstats:
                    t["SUM"], t["SQ"] = g.genstats(name="genstats", input=t["O"])
                    t["SUM"].set_output(True).set_data_type(cudnn.data_type.FLOAT)
                    t["SQ"].set_output(True).set_data_type(cudnn.data_type.FLOAT)
                return t
            return build

        def wgrad_graph(scale_type):
            def build(g):
                t = {}
                a = _sbr(cudnn, g, t, y, scale_type)
                t["DO"] = g.tensor(name="DO", dim=list(grad.shape), stride=_nhwc_strides(grad.shape),
                                   data_type=_dtype(cudnn, dtype))
                t["DW"] = g.conv_wgrad(image=a, loss=t["DO"], padding=[0, 0], stride=[1, 1], dilation=[1, 1])
                t["DW"].set_output(True).set_dim(list(w.shape)).set_stride(_nhwc_strides(w.shape)).set_data_type(
                    _dtype(cudnn, dtype))
                return t
            return build

        def plain_graph(g):
            t = {"X": g.tensor(name="X", dim=list(x.shape), stride=_nhwc_strides(x.shape), data_type=_dtype(cudnn, dtype)),
                 "W": g.tensor(name="W", dim=list(w.shape), stride=_nhwc_strides(w.shape), data_type=_dtype(cudnn, dtype))}
            t["O"] = g.conv_fprop(image=t["X"], weight=t["W"], padding=[0, 0], stride=[1, 1], dilation=[1, 1])
            t["O"].set_output(True).set_data_type(_dtype(cudnn, dtype))
            return t

        o_fused, o_stats = torch.empty_like(out).fill_(float("nan")), torch.empty_like(out).fill_(float("nan"))
        s_sum, s_sq = torch.zeros(cout, device="cuda"), torch.zeros(cout, device="cuda")
        dw_fused = torch.empty_like(w).fill_(float("nan"))
        o_plain = torch.empty_like(out)
        graphs, notes = {}, []
        for name, scale_types in (("fused", None), ("fused+st", None), ("wgrad fused", None), ("plain", None)):
            for st in (cudnn.data_type.FLOAT, _dtype(cudnn, dtype)):
                s_in, b_in = (scale32, shift32) if st == cudnn.data_type.FLOAT else (scale32.to(dtype), shift32.to(dtype))
                s_in, b_in = s_in.view(1, cin, 1, 1), b_in.view(1, cin, 1, 1)
                try:
                    if name == "fused":
                        graphs[name] = CudnnGraph(cudnn, handle, fwd_graph(False, st),
                                                  {"Y": y, "S": s_in, "B": b_in, "W": w, "O": o_fused}, name)
                    elif name == "fused+st":
                        graphs[name] = CudnnGraph(cudnn, handle, fwd_graph(True, st),
                                                  {"Y": y, "S": s_in, "B": b_in, "W": w, "O": o_stats, "SUM": s_sum,
                                                   "SQ": s_sq}, name)
                    elif name == "wgrad fused":
                        graphs[name] = CudnnGraph(cudnn, handle, wgrad_graph(st),
                                                  {"Y": y, "S": s_in, "B": b_in, "DO": grad, "DW": dw_fused}, name)
                    else:
                        graphs[name] = CudnnGraph(cudnn, handle, plain_graph, {"X": x, "W": w, "O": o_plain}, name)
                    notes.append(f"{name}: scale/shift {'fp32' if st == cudnn.data_type.FLOAT else args.dtype}, "
                                 f"plan {graphs[name].plan} of {graphs[name].plans} built (the heuristics' first: "
                                 f"{(graphs[name].first_ms or float('nan')) * 1e3:.1f} us)")
                    break
                except Exception as e:  # noqa: BLE001 - an unsupported graph is a finding, not a crash
                    notes.append(f"{name} with scale/shift {st}: {type(e).__name__}: {str(e)[:160]}")
        variants = {
            "fwd separate": lambda: F.conv2d(bn.bn_relu_fwd(y, bw, bb, 1e-5)[0], w),
            "fwd sep+stats": lambda: bn.bn_stats(F.conv2d(bn.bn_relu_fwd(y, bw, bb, 1e-5)[0], w), bb.new_ones(cout),
                                                 bb.new_zeros(cout), 1e-5),
            "wgrad separate": lambda: torch.ops.aten.convolution_backward(grad, x, w, None, [1, 1], [0, 0], [1, 1],
                                                                          False, [0, 0], 1, [False, True, False]),
        }
        if "fused" in graphs:
            variants["fwd fused"] = lambda: (bn.bn_stats(y, bw, bb, 1e-5), graphs["fused"].run())
        if "fused+st" in graphs:
            # zeroed each call in case genstats accumulates into its outputs
            variants["fwd fused+st"] = lambda: (bn.bn_stats(y, bw, bb, 1e-5), s_sum.zero_(), s_sq.zero_(),
                                                graphs["fused+st"].run())
        if "wgrad fused" in graphs:
            variants["wgrad fused"] = graphs["wgrad fused"].run
        if "plain" in graphs:
            variants["fwd plain cf"] = graphs["plain"].run
        # Correctness: each fused result against the separate path's.
        checks = []
        torch.cuda.synchronize()
        if "fused" in graphs:
            graphs["fused"].run()
            torch.cuda.synchronize()
            checks.append(("fwd", ((o_fused.float() - out.float()).norm() / out.float().norm()).item()))
        if "fused+st" in graphs:
            s_sum.zero_(), s_sq.zero_()
            graphs["fused+st"].run()
            torch.cuda.synchronize()
            ref_sum, ref_sq = out.double().sum((0, 2, 3)), out.double().square().sum((0, 2, 3))
            checks.append(("sum", ((s_sum.double() - ref_sum).norm() / ref_sum.norm()).item()))
            checks.append(("sumsq", ((s_sq.double() - ref_sq).norm() / ref_sq.norm()).item()))
        if "wgrad fused" in graphs:
            graphs["wgrad fused"].run()
            torch.cuda.synchronize()
            ref_dw = torch.ops.aten.convolution_backward(grad, x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                                         [False, True, False])[1]
            checks.append(("dw", ((dw_fused.float() - ref_dw.float()).norm() / ref_dw.float().norm()).item()))
        med = time_alternating(variants, args.iters, args.rounds)
        for k, v in med.items():
            totals[k] = totals.get(k, 0.0) + v
        label = f"{cin}->{cout} {size}x{size}"
        rows.append((label, med, checks, notes))
        print(f"\n{label}: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()), flush=True)
        print("  checks (relative L2 difference from the separate path): "
              + ", ".join(f"{k} {v:.2e}" for k, v in checks), flush=True)
        for n in notes:
            print("  " + n, flush=True)
        torch.cuda.empty_cache()
    keys = list(totals)
    print("\n| layer | " + " | ".join(keys) + " |")
    print("|---|" + "--:|" * len(keys))
    for label, med, _, _ in rows:
        print(f"| {label} | " + " | ".join(f"{med.get(k, float('nan')):.1f}" for k in keys) + " |")
    print("| **sum** | " + " | ".join(f"**{totals[k]:.1f}**" for k in keys) + " |")


if __name__ == "__main__":
    main()
