"""Findings: each states a measured fact of a Report and, where one applies, what to change.

A finding is one function from a Report to a Finding (or None where it does not apply), registered with
@finding; the report lists them in registration order. Adding one means writing the function and its test."""

from __future__ import annotations

from typing import Any, Callable

# The hardware work queues when nothing sets CUDA_DEVICE_MAX_CONNECTIONS, and the most it can set.
from ..streams import CUDA_DEFAULT_CONNECTIONS, MAX_CONNECTIONS
from .classify import SLOW_LAUNCH_US
from .report import Finding, Report
from .trace import UNPROFILED, UNPROFILED_COMPILED, UNPROFILED_EAGER, UNPROFILED_GRAPH
from .window import median

FindingRule = Callable[[Report], "Finding | None"]
FINDINGS: list[tuple[FindingRule, bool]] = []  # (rule, needs GPU rows), in report order


def finding(needs_gpu: bool = True) -> Callable[[FindingRule], FindingRule]:
    def register(rule: FindingRule) -> FindingRule:
        FINDINGS.append((rule, needs_gpu))
        return rule

    return register


def add_findings(r: Report) -> None:
    for rule, needs_gpu in FINDINGS:
        if needs_gpu and not r.gpu:
            continue
        found = rule(r)
        if found is not None:
            r.findings.append(found)


def _channels_last(env: dict) -> bool | None:
    fmt = next((env[k] for k in ("memory_format", "memory format") if k in env), None)
    if fmt is not None:
        return "last" in str(fmt).lower() or "nhwc" in str(fmt).lower()
    cl: Any = env.get("channels_last")
    return None if cl is None else bool(cl) and str(cl).lower() not in ("false", "0")


@finding(needs_gpu=False)
def first_call_effects(r: Report) -> Finding | None:
    timing, launches = r.timing, r.launches
    slow_first = timing.first_step_ratio is not None and timing.first_step_ratio > 1.5
    if not (slow_first or launches.first_step_extra_kernels > 0 or launches.slow_launches):
        return None
    parts = []
    if timing.first_step_ratio is not None:
        # The ratio compares host ranges (first-call costs are host-side), so the times quoted are host ranges too.
        parts.append(f"the first profiled step's host range took {timing.host_step_ms[0]:.2f} ms, "
                     f"{timing.first_step_ratio:.1f}x the later steps' median ({median(timing.host_step_ms[1:]):.2f} ms)")
    if launches.first_step_extra_kernels > 0:
        parts.append(f"it ran {launches.first_step_extra_kernels:.0f} more kernels than a later step (cuDNN autotune tries candidates)")
    if launches.slow_launches:
        n = sum(x["count"] for x in launches.slow_launches)
        top = launches.slow_launches[0]
        parts.append(f"{n} launch calls took over {SLOW_LAUNCH_US / 1000:.0f} ms (longest {top['max_ms']:.1f} ms, {top['call']} "
                     f"from {top['op']}: lazy module loading happens inside the first launch of a kernel)")
    return Finding("first-call effects in the window", "; ".join(parts),
                   "the figures below are not steady state: raise profiler.skip_first / profiler.warmup, or analyse "
                   "without the first step (scripts/diagnose.py TRACE --skip-steps 1); per-op 'CUDA time' of such "
                   "steps (and of any asynchronous run) is no measure of a kernel", "warn")


@finding(needs_gpu=False)
def profiler_overhead(r: Report) -> Finding | None:
    timing = r.timing
    if timing.profiler_overhead_pct is None:
        return None
    detail = (f"profiled steps: median {timing.step_ms_median:.2f} ms vs {timing.baseline_step_ms:.2f} ms without the profiler "
              f"({timing.profiler_overhead_pct:+.1f}%)")
    hint = ("the profiler inflates host-side times: the step time reported is the unprofiled one; in the profiled "
            "steps trust the GPU rows and the ratios more than the absolute times and the GPU-idle share"
            if timing.profiler_overhead_pct > 10 else "")
    return Finding("profiler overhead", detail, hint, "warn" if timing.profiler_overhead_pct > 10 else "info")


@finding(needs_gpu=False)
def no_gpu(r: Report) -> Finding | None:
    if r.gpu:
        return None
    if str(r.env.get("device", "")).startswith("cuda"):
        return Finding("no GPU rows", "the run was on CUDA but the trace has no kernel rows: CUPTI was unavailable or "
                       "CUDA activity was not traced, so only CPU ops were profiled", "check that CUPTI loads", "warn")
    return Finding("no GPU", "this trace has no GPU activity (a CPU run): only CPU ops were profiled")


def _fewer_launches(env: dict) -> str:
    """What removes per-kernel launches from this run, given how it launches them without the profiler."""
    how, inference = env.get(UNPROFILED), env.get("mode") == "infer"
    if how == UNPROFILED_GRAPH:
        return ("nothing to change for the run itself: without the profiler it replays one CUDA graph per step; the "
                "traced steps are eager so that each kernel is attributed to its op")
    if how == UNPROFILED_COMPILED and not inference:
        return ("the step is compiled already; capture it instead (cuda_graph=true with compile=false: training does "
                "not combine the two) or raise the batch")
    if how in (UNPROFILED_EAGER, UNPROFILED_COMPILED):
        if inference:
            return "replay the forward as a CUDA graph (cuda_graph=auto or true) or raise the batch"
        return ("capture the step (cuda_graph=true; the summary's CUDA graph row says why this run was not captured), "
                "compile it (compile=true) or raise the batch")
    return "torch.compile, CUDA graphs or a larger batch"  # a trace that does not record how its run launches


@finding()
def launch_bound(r: Report) -> Finding | None:
    launches = r.launches
    if not launches.launch_bound:
        return None
    return Finding("launch-bound",
                   f"{launches.short_kernels_per_step:.0f} of {launches.kernels_per_step:.0f} kernels per step ({launches.short_kernel_pct:.0f}%) are "
                   f"shorter than their launch (median kernel {launches.median_kernel_us:.1f} us, median launch {launches.median_launch_us:.1f} us)",
                   "launch-bound: " + _fewer_launches(r.env), "warn")


@finding()
def gpu_waits_for_host(r: Report) -> Finding | None:
    timing, util = r.timing, r.utilisation
    if util.idle_host_pct < 20:
        return None
    parts = []
    if util.idle_host_sync_pct >= 1:
        parts.append(f"{util.idle_host_sync_pct:.0f}% while the host sat in blocking calls")
    if util.idle_host_data_pct >= 1:
        parts.append(f"{util.idle_host_data_pct:.0f}% while the host was loading data")
    return Finding("GPU waits for the host",
                   f"the GPU is idle {util.idle_host_pct:.0f}% of the window with nothing queued"
                   + (f" ({'; '.join(parts)})" if parts else ""),
                   "the host is the bottleneck: remove syncs, feed data faster, or cut launches: " + _fewer_launches(r.env)
                   + (f"; part of this is the profiler's own host overhead ({timing.profiler_overhead_pct:+.0f}% step time)"
                      if timing.profiler_overhead_pct is not None and timing.profiler_overhead_pct > 10 else ""),
                   "warn")


@finding()
def depthwise_implementation(r: Report) -> Finding | None:
    gpu_time = r.gpu_time
    if not gpu_time.depthwise_implementation:
        return None
    dw = gpu_time.categories["depthwise"]
    mix = ", ".join(f"{impl} {pct:.0f}%" for impl, pct in gpu_time.depthwise_impls.items())
    backend = r.env.get("backend")
    detail = f"depthwise kernels are {dw.pct:.1f}% of GPU time ({dw.ms_per_step:.3f} ms/step), run by: {mix}"
    expected = {"cudnn": "cuDNN", "custom": "custom (kernels/)"}.get(str(backend))
    if expected and gpu_time.depthwise_implementation != expected:
        return Finding("depthwise implementation", detail,
                       f"backend={backend} was requested but {gpu_time.depthwise_implementation} kernels did most of the depthwise work", "warn")
    return Finding("depthwise implementation", detail, "", "info")


@finding()
def batchnorm_relu_share(r: Report) -> Finding | None:
    norm = r.gpu_time.categories.get("norm")
    if norm is None or norm.count_per_step <= 0:
        return None
    detail = (f"BatchNorm and ReLU kernels (forward and backward) are {norm.pct:.1f}% of GPU time "
              f"({norm.ms_per_step:.3f} ms/step)")
    if r.env.get("mode") == "infer":
        folded = str(r.env.get("fold_bn", "")).lower() == "true"
        hint = ("the BatchNorms are folded; what is left are separate ReLUs: backend=custom computes the depthwise ReLU "
                "in its epilogue" if folded else "fold_bn=true (infer.py's default) folds every BatchNorm into its "
                "convolution and fuses the ReLU")
    elif str(r.env.get("norm", "torch")) == "torch":
        hint = "norm=custom fuses BatchNorm and ReLU into one pass each way (docs/results/train_norm_h200.md)"
    else:
        hint = ""
    return Finding("BatchNorm + ReLU", detail, hint, "info")


@finding()
def layout_transposes(r: Report) -> Finding | None:
    gpu_time = r.gpu_time
    tr = gpu_time.categories["transpose"]
    if tr.count_per_step <= 0:
        return None
    where = ", ".join(f"{t['op']} in {t['phase']}" for t in gpu_time.transposes[:3])
    if _channels_last(r.env):
        hint = f"the model is channels_last, yet these ops transpose: check the layout of what reaches them ({where})"
    else:
        hint = f"channels_last=true would remove the {tr.ms_per_step:.3f} ms of transposes per step"
    return Finding("layout transposes",
                   f"{tr.count_per_step:.0f} transpose kernels per step, {tr.ms_per_step:.3f} ms ({tr.pct:.1f}% of GPU time), "
                   f"launched by {where}", hint, "warn" if tr.pct >= 2 else "info")


@finding()
def dtype_casts(r: Report) -> Finding | None:
    gpu_time = r.gpu_time
    ca = gpu_time.categories["cast"]
    if ca.count_per_step <= 0:
        return None
    where = ", ".join(f"{c['op']} in {c['phase']}" for c in gpu_time.casts[:3])
    return Finding("dtype casts",
                   f"{ca.count_per_step:.0f} cast kernels per step, {ca.ms_per_step:.3f} ms ({ca.pct:.1f}% of GPU time), launched by {where}",
                   "autocast casts every weight each step, two kernels per weight: train.py's perf.amp_weight_cast=auto "
                   "casts them all as one kernel each way (launched by _CastFlat), torch.compile fuses casts into "
                   "neighbouring kernels; cast the input batch once in the loader", "warn" if ca.pct >= 5 else "info")


@finding()
def pageable_host_copies(r: Report) -> Finding | None:
    pageable = [m for m in r.gpu_time.memcpys if m["pageable"]]
    if not pageable:
        return None
    desc = "; ".join(f"{m['kind']}: {m['count_per_step']:.0f}/step, {m['MB_per_step']:.1f} MB, {m['ms_per_step']:.3f} ms (from {m['ops']})"
                     for m in pageable)
    return Finding("pageable host copies", desc,
                   "this copy is pageable: pin it (pin_memory=True in the DataLoader) and copy with non_blocking=True", "warn")


@finding()
def loader_gpu_work(r: Report) -> Finding | None:
    loader = r.gpu_time.categories.get("loader")
    if loader is None or loader.pct < 1:
        return None
    return Finding("the data loader's GPU work",
                   f"threads that do not run the step (a data loader's: DALI's decode colour conversion, resize and "
                   f"normalisation, and its copies) launched {loader.pct:.1f}% of GPU time ({loader.ms_per_step:.3f} "
                   f"ms/step, {loader.count_per_step:.0f} kernels and copies per step); it runs on the SMs and copy "
                   "engines the step uses",
                   "compare with the same run on data=synthetic (scripts/check_loader.py): a step slower by about this "
                   "much is paying for it; less work per image (JPEGs stored at a shorter side, "
                   "scripts/resize_imagefolder.py) shrinks it",
                   "info")


@finding()
def copies_dominate(r: Report) -> Finding | None:
    mc = r.gpu_time.categories["memcpy"]
    if mc.pct < 10:
        return None
    return Finding("copies dominate",
                   f"copies are {mc.pct:.0f}% of GPU time ({mc.ms_per_step:.3f} ms/step) against {100 - mc.pct:.0f}% compute",
                   "keep the data on the GPU between steps, or overlap the copy with compute (pinned memory, a side stream)",
                   "warn")


def _sync_hints(syncs: list[dict]) -> str:
    hints = []
    for s in syncs[:3]:
        if "_local_scalar_dense" in s["op"] and s["phase"] == "optimizer":
            hints.append("GradScaler.step() reads found_inf back every step (fp16 loss scaling; bf16 needs no scaler)")
        elif "copy_" in s["op"] or "pageable" in s["call"]:
            hints.append(f"the copy in {s['phase']} touches pageable memory: pin it and pass non_blocking=True")
    hints.append("each sync stalls the host until the GPU drains: read values back less often (e.g. the loss every N steps)")
    return "; ".join(dict.fromkeys(hints))


@finding()
def blocking_synchronisations(r: Report) -> Finding | None:
    host_syncs = r.host_syncs
    if host_syncs.syncs_per_step <= 0:
        return None
    where = ", ".join(f"{s['call']} from {s['op']} in {s['phase']}" for s in host_syncs.syncs[:3])
    return Finding("blocking synchronisations",
                   f"{host_syncs.syncs_per_step:.0f} per step ({sum(s['ms_per_step'] for s in host_syncs.syncs):.3f} ms of host time): {where}",
                   _sync_hints(host_syncs.syncs), "warn" if host_syncs.syncs_per_step >= 1 else "info")


@finding()
def cuda_calls_from_other_threads(r: Report) -> Finding | None:
    host_syncs = r.host_syncs
    if host_syncs.other_thread_cuda_calls_per_step < 50:
        return None
    return Finding("CUDA calls from other threads",
                   f"other threads of the process (a data loader's workers, e.g. DALI's decoders) made "
                   f"{host_syncs.other_thread_cuda_calls_per_step:.0f} CUDA API calls per step, "
                   f"{host_syncs.other_thread_syncs_per_step:.0f} of them blocking; those syncs stall only their own thread, "
                   f"but every call shares the CUDA context with the step's launches (median launch "
                   f"{r.launches.median_launch_us:.1f} us here)",
                   "if the step is host-bound, compare the launch times with a run on synthetic data: contention "
                   "for the context slows the step's own launches; fewer loader threads or batched loader work help")


@finding()
def streams_share_work_queues(r: Report) -> Finding | None:
    host_syncs = r.host_syncs
    queues = host_syncs.work_queues if host_syncs.work_queues is not None else CUDA_DEFAULT_CONNECTIONS
    if host_syncs.streams_with_work <= queues:
        return None
    known = "" if host_syncs.work_queues is not None else " (CUDA's default; the trace does not record the setting)"
    others = host_syncs.streams_with_work - host_syncs.step_streams_with_work
    detail = (f"{host_syncs.streams_with_work} CUDA streams ran work in these steps ({host_syncs.step_streams_with_work} "
              f"of the step's threads, {others} of other threads), but the process had {queues} hardware work "
              f"queues{known}: streams beyond that share queues, and the work in one queue runs in order, so "
              "independent streams wait behind each other (a loader's copies and kernels behind the training kernels "
              "queued before them)")
    if queues < MAX_CONNECTIONS:
        return Finding("streams share hardware work queues", detail,
                       f"give the process {MAX_CONNECTIONS} queues: perf.max_connections={MAX_CONNECTIONS} (auto does it "
                       f"for data=dali), or CUDA_DEVICE_MAX_CONNECTIONS={MAX_CONNECTIONS} in the environment before the "
                       "process starts", "warn")
    # At CUDA's most there is no setting to raise, so it is no warning: what is left is fewer streams, a trade.
    return Finding("streams share hardware work queues", detail,
                   f"{MAX_CONNECTIONS} is the most CUDA gives a process, so no setting adds queues; fewer streams would "
                   "(each DALI pipeline's decoder brings streams of its own: data.dali.pipelines), at the cost of "
                   "what they overlap")


@finding()
def device_syncs_from_other_threads(r: Report) -> Finding | None:
    host_syncs = r.host_syncs
    if host_syncs.other_thread_device_syncs_per_step < 0.5:
        return None
    return Finding("device-wide syncs from other threads",
                   f"{host_syncs.other_thread_device_syncs_per_step:.1f} per step on threads other than the step's (median "
                   f"{host_syncs.other_thread_device_sync_ms_median:.2f} ms each): each waits for all work queued on the GPU, "
                   "the step's included, so whatever that thread does next waits for the training to drain",
                   "DALI takes each batch's buffer back only after such a sync (its DLTensorGraveyard); it stalls "
                   "DALI's buffer recycling, not the step, as long as the step does not wait for data (see the "
                   "data wait)",
                   "warn")


@finding()
def host_runs_ahead(r: Report) -> Finding | None:
    timing = r.timing
    if not (timing.gpu_span_ms_per_step and timing.gpu_span_ms_per_step > 1.2 * timing.host_step_ms_median):
        return None
    return Finding("host runs ahead",
                   f"the GPU work a step launches spans {timing.gpu_span_ms_per_step:.2f} ms, the host step "
                   f"{timing.host_step_ms_median:.2f} ms: GPU-bound; host-side step times (and per-op CPU times) understate "
                   f"the true step time, {timing.step_ms_median:.2f} ms from one step's completion to the next")
