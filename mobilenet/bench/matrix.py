"""The throughput matrix behind `python scripts/benchmark.py` (its docstring describes the options, the outputs and
the exit status): the combinations asked for, the reasons some cannot run here, one subprocess per combination
with its benchmark.json record, and the child's measurement itself (`python -m mobilenet.bench.matrix RUN_DIR`)."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..subprocesses import ROOT, exit_on_sigterm, run_logged

AXES = {
    "backends": ("torch", "cudnn", "custom"),
    "amp": ("off", "fp16", "bf16"),
    "channels_last": ("false", "true"),
    "compile": ("false", "true"),
    "data": ("synthetic", "dali"),
    "cuda_graph": ("false", "true"),
    "norms": ("torch", "custom", "apex"),
}
# Axes whose default is one value, not all of them: the captured training step and the fused norms are opt-in axes.
AXIS_DEFAULTS = {"cuda_graph": ["false"], "norms": ["torch"]}
# Hydra-style spellings of the axes (`backend=torch,cudnn`) -> their AXES key (also the argparse destination).
HYDRA_AXES = {"backend": "backends", "amp": "amp", "channels_last": "channels_last", "compile": "compile", "data": "data",
              "cuda_graph": "cuda_graph", "norm": "norms"}
PEER_BACKEND = "timm"
PEER_MODEL = "mobilenetv1_100"
TIMM_MISSING = "timm not installed (pip install timm)"
SPEC_FILE = "benchmark.json"
RESULT_FILE = "result.json"
LOG_FILE = "benchmark.log"
CHILD_MODULE = "mobilenet.bench.matrix"  # run_one, in a process of its own (run_logged starts it in the repository root)


@dataclass(frozen=True)
class Combo:
    backend: str
    amp: str  # off | fp16 | bf16
    channels_last: bool
    compile: bool
    data: str
    cuda_graph: bool = False
    norm: str = "torch"
    env: str = ""  # "NAME=VALUE ..." set in the run's process (--env), "" for the invocation's own environment

    @property
    def name(self) -> str:
        """The run directory's name, Hydra-style (the opt-in axes only where they are not their default)."""
        return (f"backend={self.backend},amp={self.amp},channels_last={str(self.channels_last).lower()},"
                f"compile={str(self.compile).lower()},data={self.data}" + (",cuda_graph=true" if self.cuda_graph else "")
                + (f",norm={self.norm}" if self.norm != "torch" else "")
                + (f",env={self.env.replace(' ', '+')}" if self.env else ""))

    def environment(self) -> dict[str, str] | None:
        """The run's process environment: the invocation's with --env's settings on top (None: the invocation's)."""
        if not self.env:
            return None
        return {**os.environ, **dict(setting.split("=", 1) for setting in self.env.split())}

    @property
    def peer(self) -> bool:
        return self.backend == PEER_BACKEND


def _choices(text: str, axis: str) -> list[str]:
    allowed = AXES[axis]
    values = [v.strip().lower() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"--{axis.replace('_', '-')}: {bad or text!r} not in {', '.join(allowed)}")
    return list(dict.fromkeys(values))  # keep the user's order, drop repeats


def _parser(description: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", type=lambda s: _choices(s, "backends"), default=list(AXES["backends"]),
                   help="comma-separated subset of torch,cudnn,custom (default: all)")
    p.add_argument("--amp", type=lambda s: _choices(s, "amp"), default=list(AXES["amp"]),
                   help="comma-separated subset of off,fp16,bf16 (default: all)")
    p.add_argument("--channels-last", type=lambda s: _choices(s, "channels_last"), default=list(AXES["channels_last"]),
                   help="comma-separated subset of false,true (default: both)")
    p.add_argument("--compile", type=lambda s: _choices(s, "compile"), default=list(AXES["compile"]),
                   help="comma-separated subset of false,true (default: both); torch.compile's default mode")
    p.add_argument("--data", type=lambda s: _choices(s, "data"), default=list(AXES["data"]),
                   help="comma-separated subset of synthetic,dali (default: both)")
    p.add_argument("--cuda-graph", type=lambda s: _choices(s, "cuda_graph"), default=AXIS_DEFAULTS["cuda_graph"],
                   help="comma-separated subset of false,true (default: false): train with the step captured as a "
                        "CUDA graph (cuda_graph=true); combinations that cannot be captured are skipped with the reason")
    p.add_argument("--norms", type=lambda s: _choices(s, "norms"), default=AXIS_DEFAULTS["norms"],
                   help="comma-separated subset of torch,custom,apex (default: torch): the BatchNorm+ReLU "
                        "implementation (norm=...); the timm peer always runs its own nn.BatchNorm2d")
    p.add_argument("--env", action="append", default=[], metavar="'NAME=VALUE ...'",
                   help="an environment variant: every combination also runs with these variables set in its process "
                        "(e.g. a kernel knob, --env MDW_BWD_RING=0); repeat --env for more variants. The invocation's "
                        "own environment is always the first; --repeats alternates them in every round")
    p.add_argument("--peer", choices=("yes", "no", "only"), default="yes",
                   help=f"timm's {PEER_MODEL} rows (synthetic data only): yes (default), no, or only them")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--resolution", type=int, default=224)
    p.add_argument("--width-mult", type=float, default=1.0, help="model.width_mult of the project's model")
    p.add_argument("--warmup", type=int, default=20, help="untimed training steps (default 20)")
    p.add_argument("--steps", type=int, default=100, help="timed training steps (default 100)")
    p.add_argument("--infer-warmup", type=int, default=20, help="untimed inference steps (default 20)")
    p.add_argument("--infer-steps", type=int, default=100, help="timed inference steps (default 100)")
    p.add_argument("--repeats", type=int, default=1,
                   help="measure every combination this many times, in rounds, each in its own process (default 1)")
    p.add_argument("--data-root", help="ImageFolder (DIR/train, DIR/val) for data=dali; without it dali rows are skipped")
    p.add_argument("--out", help="the matrix's runs directory (default runs/matrix-<time>); reused: finished runs are kept")
    p.add_argument("--force", action="store_true", help="measure again the runs --out already holds as ok")
    p.add_argument("--timeout", type=float, default=600, help="seconds one combination may take (default 600)")
    p.add_argument("--time-budget", type=float,
                   help="seconds for the whole invocation: no combination starts (or runs) past it, nor a comparison "
                        "(one setting's backends, norms and variants) whose runs are unlikely all to fit; run the same "
                        "command again to continue")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the skip reasons, measure nothing")
    p.add_argument("overrides", nargs="*",
                   help="Hydra-style axis selections (backend=torch,cudnn amp=off,fp16 channels_last=true compile=false "
                        "data=synthetic), and Hydra overrides for every run (e.g. data.num_classes=100); put them after `--`")
    return p


def parse_args(argv: list[str], description: str | None = None) -> argparse.Namespace:
    """scripts/benchmark.py's options (description: its --help text); Hydra-style axis selections among the
    trailing overrides replace the flag of their axis, the rest go to every run."""
    p = _parser(description)
    args = p.parse_args(argv)
    passthrough = []
    for override in args.overrides:
        key, _, value = override.partition("=")
        axis = HYDRA_AXES.get(key)
        if axis is None:
            passthrough.append(override)
            continue
        try:
            setattr(args, axis, _choices(value, axis))
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
    args.overrides = passthrough
    for name in ("batch_size", "resolution", "steps", "infer_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.infer_warmup < 0:
        p.error("--warmup and --infer-warmup must be >= 0")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        p.error(f"Hydra overrides look like key=value, got {bad}")
    _check_shared_overrides(p, args.overrides)
    variants = [""]
    for text in args.env:
        settings = text.split()
        wrong = [s for s in settings if not _ENV_SETTING.fullmatch(s)]
        if wrong or not settings:
            p.error(f"--env takes space-separated NAME=VALUE settings (e.g. --env 'MDW_BWD_RING=0 MDW_FWD_RING=0'), "
                    f"got {text!r}")
        variants.append(" ".join(settings))
    args.env = list(dict.fromkeys(variants))
    return args


_ENV_SETTING = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=\S*")


def plan(args: argparse.Namespace) -> list[Combo]:
    """Every combination asked for, grouped so that all runs of one data kind and compile setting are adjacent, and
    within them the backends, norms and environment variants of one precision and layout back to back: the runs a
    comparison reads are close in time (clock and thermal drift hit them alike), and a matrix that --time-budget or
    an interruption cuts short leaves whole comparisons, not one backend's rows."""
    combos = []
    for data, compile_, graph in itertools.product(args.data, args.compile, args.cuda_graph):
        backends = [] if args.peer == "only" else list(args.backends)
        if args.peer != "no" and data == "synthetic":
            backends.append(PEER_BACKEND)
        for amp, cl, backend in itertools.product(args.amp, args.channels_last, backends):
            for norm in (["torch"] if backend == PEER_BACKEND else args.norms):
                # The environment variants of one setting run back to back (the peer's: its own environment only).
                for env in ([""] if backend == PEER_BACKEND else args.env):
                    combos.append(Combo(backend, amp, cl == "true", compile_ == "true", data, graph == "true", norm, env))
    return combos


def _check_shared_overrides(p: argparse.ArgumentParser, overrides: list[str]) -> None:
    """The overrides every run gets, composed once: a misspelled key or a value outside its range would make every
    combination fail alike, so it is an error now rather than a matrix of skipped rows."""
    from ..config import compose
    from ..errors import ConfigError

    try:
        compose(["experiment=benchmark", *overrides])
    except ConfigError as e:
        p.error(str(e))


def hydra_overrides(combo: Combo, args: argparse.Namespace) -> list[str]:
    amp = ["amp=false"] if combo.amp == "off" else ["amp=true", f"amp_dtype={combo.amp}"]
    data = []
    if combo.data == "dali":
        data = ["data=dali"] + ([f"data.root={args.data_root}"] if args.data_root else [])
    return [
        "experiment=benchmark", *data,
        # The peer runs the same config (for its loader, optimizer and checks) with the plain torch backend.
        f"backend={'torch' if combo.peer else combo.backend}", f"norm={combo.norm}", *amp,
        f"channels_last={str(combo.channels_last).lower()}", f"compile={str(combo.compile).lower()}",
        f"cuda_graph={str(combo.cuda_graph).lower()}",
        f"data.batch_size={args.batch_size}", f"data.resolution={args.resolution}",
        f"data.steps_per_epoch={args.warmup + args.steps}", "data.val_steps=1", f"perf.warmup_steps={args.warmup}",
        f"model.width_mult={args.width_mult}", "epochs=1", "evaluate=false", "save_checkpoints=false",
        "progress=false", *args.overrides,
    ]


# --------------------------------------------------------------------------------------- the parent: plan, skip, run


def _error_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip().splitlines()[0]


class Prechecks:
    """Why a combination cannot run here, found cheaply before any subprocess starts (None if it can)."""

    def __init__(self):
        self._cache: dict[tuple, str | None] = {}

    def _once(self, key: tuple, check) -> str | None:
        if key not in self._cache:
            try:
                check()
                self._cache[key] = None
            except Exception as e:  # any failure here is the reason this combination is skipped
                self._cache[key] = _error_line(e)
        return self._cache[key]

    def reason(self, combo: Combo, overrides: list[str]) -> str | None:
        if combo.peer:
            if importlib.util.find_spec("timm") is None:
                return TIMM_MISSING
        if combo.data == "dali":
            from ..data.dali import import_dali

            why = self._once(("dali",), import_dali)
            if why:
                return why
            if not any(o.startswith(("data.root=", "data.builtin=")) for o in overrides):
                return "data=dali reads JPEGs: pass --data-root DIR (an ImageFolder with DIR/train and DIR/val)"
        return self._once(tuple(overrides), lambda: _validate(overrides))


def _validate(overrides: list[str]) -> None:
    """The engine's own up-front checks (backend availability, fp16 without CUDA, a step that cannot be captured,
    ...) on the composed config."""
    from .. import cuda_graph
    from ..config import compose
    from ..engine import resolve_device, validate

    cfg = compose(overrides)
    device = resolve_device(cfg.device)
    validate(cfg, device)
    cuda_graph.resolve(cfg, device, distributed=False)


def last_error_line(log_text: str) -> str:
    """The exception line of the last traceback in a log, else its last non-empty line."""
    lines = [line.rstrip() for line in log_text.splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if starts:
        tail = [line for line in lines[starts[-1] + 1:] if not line.startswith((" ", "\t"))]
        if tail:
            return tail[-1]
    return lines[-1] if lines else "no output"


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _record(combo: Combo, overrides: list[str], status: str, reason: str = "", **extra) -> dict:
    """A combination's benchmark.json: what it is, how it was (or would be) run, and how that went."""
    return {**asdict(combo), "name": combo.name, "overrides": overrides, "status": status, "reason": reason, **extra}


def _leave_record(run_dir: Path, record: dict) -> None:
    """A run directory holding only the combination's benchmark.json (skipped, or not started), so that compare.py
    lists it with its reason instead of leaving it out."""
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_json(run_dir / SPEC_FILE, record)


def run_combo(combo: Combo, run_dir: Path, overrides: list[str], args: argparse.Namespace, timeout: float) -> dict:
    """Measure one combination in a subprocess; returns its record (also written to run_dir/benchmark.json)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob("events.out.tfevents.*"):  # a re-measured run must not mix with an earlier attempt
        stale.unlink()
    (run_dir / RESULT_FILE).unlink(missing_ok=True)
    record = _record(combo, overrides, "running", infer_warmup=args.infer_warmup, infer_steps=args.infer_steps)
    _write_json(run_dir / SPEC_FILE, record)
    started = time.perf_counter()
    # A timeout also ends the compile workers torch.compile forks.
    rc = run_logged([sys.executable, "-m", CHILD_MODULE, str(run_dir)], run_dir / LOG_FILE, timeout,
                    env=combo.environment())
    record["seconds"] = round(time.perf_counter() - started, 1)
    result_path = run_dir / RESULT_FILE
    if rc == 0 and result_path.is_file():
        record.update(status="ok", **json.loads(result_path.read_text()))
    elif rc is None:
        record.update(status="failed", reason=f"timed out after {timeout:.0f} s (--timeout / --time-budget)")
    else:
        record.update(status="failed", reason=f"exit {rc}: {last_error_line((run_dir / LOG_FILE).read_text(errors='replace'))}")
    _write_json(run_dir / SPEC_FILE, record)
    return record


def _setting(combo: Combo) -> tuple:
    """What the runs of one comparison share: everything but the backend, the norm and the environment variant."""
    return combo.data, combo.compile, combo.cuda_graph, combo.amp, combo.channels_last


def runs_left_in_comparison(rounds: list[tuple[int, Combo]]) -> list[int]:
    """For each run of the plan (round, combination), how many runs of its comparison (the same round and setting,
    back to back in the plan) are left, itself included."""
    left = [1] * len(rounds)
    for i in range(len(rounds) - 2, -1, -1):
        (k, combo), (k_next, combo_next) = rounds[i], rounds[i + 1]
        if k == k_next and _setting(combo) == _setting(combo_next):
            left[i] = left[i + 1] + 1
    return left


_NOT_STARTED = "--time-budget spent; run the same command again to continue"


class _Matrix:
    """One invocation's state across its combinations: the deadline, what runs took so far, the comparisons the
    deadline cut, the prechecks."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.deadline = time.monotonic() + args.time_budget if args.time_budget else None
        self.longest: dict[bool, float] = {}  # the longest run so far, eager and compiled: what the next one may need
        self.cut: set[tuple] = set()  # (round, setting) of comparisons whose runs are left for the next invocation
        self.prechecks = Prechecks()

    def _took(self, combo: Combo, seconds: float) -> None:
        self.longest[combo.compile] = max(self.longest.get(combo.compile, 0.0), seconds)

    def _kept(self, combo: Combo, overrides: list[str], run_dir: Path) -> dict | None:
        """The earlier record of run_dir if it finished with exactly these settings (then it is not measured again)."""
        previous = run_dir / SPEC_FILE
        earlier = json.loads(previous.read_text()) if previous.is_file() else {}
        args = self.args
        if not args.force and earlier.get("status") == "ok" and earlier.get("overrides") == overrides \
                and earlier.get("env", "") == combo.env \
                and (earlier.get("infer_warmup"), earlier.get("infer_steps")) == (args.infer_warmup, args.infer_steps):
            return earlier
        return None

    def record(self, combo: Combo, run_dir: Path, first_round: bool, round_: int = 1, runs_left: int = 1) -> dict | None:
        """The combination's record after keeping, skipping, planning or measuring it (None: a skip said already).
        runs_left: the runs of its comparison still to come, itself included (runs_left_in_comparison): under
        --time-budget a comparison starts only if all of them are likely to fit, so that no backend's row is measured
        without the rows it is compared with."""
        args = self.args
        overrides = hydra_overrides(combo, args)
        if (earlier := self._kept(combo, overrides, run_dir)) is not None:
            self._took(combo, earlier.get("seconds", 0.0))
            return {**earlier, "note": "kept from an earlier invocation"}
        if reason := self.prechecks.reason(combo, overrides):
            if not first_round:
                return None  # said once, in the first round
            record = _record(combo, overrides, "skipped", reason)
            if not args.dry_run:
                _leave_record(run_dir, record)
            return record
        if args.dry_run:
            return _record(combo, overrides, "planned", " ".join(overrides))
        timeout = args.timeout
        if self.deadline is not None:
            timeout = min(timeout, self.deadline - time.monotonic())
            # Not worth starting if it, or the rest of its comparison, would likely be cut off: leave the comparison
            # for the next invocation.
            if (round_, _setting(combo)) in self.cut \
                    or timeout < max(10.0, 1.1 * self.longest.get(combo.compile, 0.0) * runs_left):
                self.cut.add((round_, _setting(combo)))
                record = _record(combo, overrides, "not started", _NOT_STARTED)
                _leave_record(run_dir, record)
                return record
        record = run_combo(combo, run_dir, overrides, args, timeout)
        self._took(combo, record["seconds"])
        return record


def run_matrix(args: argparse.Namespace) -> int:
    """Every combination of the plan, round by round, then the table; the exit status of scripts/benchmark.py."""
    exit_on_sigterm()
    out = Path(args.out or ROOT / "runs" / f"matrix-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    combos = plan(args)
    if not combos:
        print("nothing to run: the selection is empty (e.g. --peer only without synthetic data)", file=sys.stderr)
        return 2
    matrix = _Matrix(args)
    records: list[dict] = []
    rounds = [(k, combo) for k in range(1, args.repeats + 1) for combo in combos]
    runs_left = runs_left_in_comparison(rounds)
    print(f"{len(combos)} combinations" + (f" x {args.repeats} rounds" if args.repeats > 1 else "") + f" -> {out}", flush=True)
    for i, (k, combo) in enumerate(rounds, 1):
        run_dir = out / (combo.name if k == 1 else f"{combo.name},repeat={k}")
        record = matrix.record(combo, run_dir, first_round=k == 1, round_=k, runs_left=runs_left[i - 1])
        if record is None:
            continue
        records.append({**record, "round": k})
        print(f"[{i}/{len(rounds)}] {run_dir.name}: {_one_line(record)}", flush=True)
    print_table(records, out)
    if any(r["status"] == "not started" for r in records):
        print("some combinations did not start within --time-budget: run the same command again to continue "
              "(finished runs are kept)")
    return 1 if any(r["status"] in ("failed", "not started") for r in records) else 0


def _one_line(record: dict) -> str:
    if record["status"] != "ok":
        return f"{record['status']}: {record['reason']}"
    return (f"ok, train {record['train_img_s']:,.0f} img/s, infer {record['infer_img_s']:,.0f} img/s"
            + (f" ({record['note']})" if record.get("note") else f" ({record['seconds']:.0f} s)"))


def print_table(records: list[dict], out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    from .compare import with_env

    table = Table(title=f"throughput matrix: {out}")
    rounds = any(r.get("round", 1) > 1 for r in records)  # --repeats: which round each row is
    for col in ("backend", "norm", "amp", "channels_last", "compile", "cuda_graph", "data", *(["round"] if rounds else []),
                "status", "train img/s", "infer img/s", "reason"):
        table.add_column(col, justify="right" if "img/s" in col else "left", overflow="fold")
    for r in records:
        ok = r["status"] == "ok"
        table.add_row(with_env(r["backend"], r.get("env", "")), r.get("norm", "torch"), r["amp"], str(r["channels_last"]),
                      str(r["compile"]), str(r.get("cuda_graph", False)), r["data"],
                      *([str(r.get("round", 1))] if rounds else []), r["status"],
                      f"{r['train_img_s']:,.0f}" if ok else "", f"{r['infer_img_s']:,.0f}" if ok else "", r.get("reason", ""))
    Console(width=max(160, Console().width)).print(table)
    print(f"compare: python scripts/compare.py {out}")


# ------------------------------------------------------------------------------------- the child: one measurement


def run_project(cfg, run_dir: Path, spec: dict, model=None, backend_label: str | None = None) -> dict:
    """One row: inference measured on the run's model first, then training through the project's one loop.

    The project's model is measured on infer.py's path (fold_bn, fused epilogues, and replay and compile as the row
    sets them); a peer model, which cannot be folded, on its training graph in eval mode."""
    from .. import streams
    from ..engine import Trainer
    from ..inference import build_path, measure

    trainer = Trainer(cfg, run_dir=run_dir, overrides=spec["name"], model=model, backend_label=backend_label)
    with streams.issued_on(trainer.stream):  # the same stream as the row's training (perf.stream)
        if model is None:
            path = build_path(trainer.model, cfg, trainer.device)
            infer = measure(path.forward, path.model, cfg, trainer.device, spec["infer_warmup"], spec["infer_steps"],
                            amp_dtype=path.amp_dtype)
            trainer.model.train()
        else:
            infer = measure(trainer.forward, trainer.model, cfg, trainer.device, spec["infer_warmup"],
                            spec["infer_steps"])
    result = trainer.fit(extra_metrics={"infer_img_s": infer.img_s, "infer_step_ms": infer.step_ms})
    return {"train_img_s": result.train.img_s, "infer_img_s": infer.img_s}


def run_peer(cfg, run_dir: Path, spec: dict) -> dict:
    """timm's mobilenetv1_100 under the same settings, measured by the same loop and meter as the project."""
    import timm

    print(f"peer: timm {timm.__version__} {PEER_MODEL}")
    model = timm.create_model(PEER_MODEL, num_classes=cfg.data.num_classes)
    return run_project(cfg, run_dir, spec, model=model, backend_label=PEER_BACKEND)


def run_one(run_dir: Path) -> int:
    """The child process of run_combo: measure the combination that run_dir/benchmark.json describes."""
    from omegaconf import OmegaConf

    from ..config import compose

    spec = json.loads((run_dir / SPEC_FILE).read_text())
    cfg = compose(spec["overrides"])
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    result = (run_peer if spec["backend"] == PEER_BACKEND else run_project)(cfg, run_dir, spec)
    _write_json(run_dir / RESULT_FILE, result)
    return 0


if __name__ == "__main__":
    sys.exit(run_one(Path(sys.argv[1])))
