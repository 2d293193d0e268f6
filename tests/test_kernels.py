"""Tests of the custom depthwise CUDA op (kernels/).

CPU (CI): the extension compiles; its C++ autograd gives float64 gradients over F.conv2d-based CPU kernels of the
two ops; without CUDA, load() and `import kernels.ops` raise KernelUnavailable with a clear message.
GPU (`pytest -m gpu`): opcheck, gradcheck in fp64, forward and both gradients against a float64 reference over a
sample of the whole coverage grid with poisoned outputs, bitwise determinism, autocast, torch.compile(fullgraph=True),
and the profiler showing our kernels and no cuDNN.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import KernelUnavailable

ROOT = Path(__file__).resolve().parents[1]

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _have_nvcc() -> bool:
    from torch.utils import cpp_extension

    return torch.version.cuda is not None and (cpp_extension.CUDA_HOME is not None or shutil.which("nvcc") is not None)


# ---------------------------------------------------------------------------------------------- CPU tests


@pytest.fixture(scope="module")
def fresh_build(tmp_path_factory):
    """(cache root, build directory) of the extension compiled into a fresh directory: CI must compile the sources,
    not find an earlier build in the cache. Compiled in a child process, since compiling also loads the library and
    this process may load the cached one (a second library of the namespace cannot load beside it)."""
    if not _have_nvcc():
        pytest.skip("needs nvcc (set CUDA_HOME) and a CUDA build of torch")
    root = tmp_path_factory.mktemp("kernels")
    proc = subprocess.run([sys.executable, "-c", "import kernels; print(kernels.build())"], cwd=ROOT,
                          env={**os.environ, "MOBILENET_KERNELS_CACHE": str(root)}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return root, Path(proc.stdout.strip().splitlines()[-1])


def _load_fresh_build(fresh_build) -> None:
    """On a machine without CUDA (where kernels.load() refuses): the fresh build's ops registered in this process."""
    torch.ops.load_library(str(next(fresh_build[1].glob("mobilenet_dw_kernels*.so"))))


def test_extension_compiles(fresh_build):
    from kernels import cxx_runtime

    root, directory = fresh_build
    assert directory.is_relative_to(root)
    library = next(directory.glob("mobilenet_dw_kernels*.so"))
    assert cxx_runtime.carried_runtime(library) is None  # linked to torch's libstdc++, no copy of its own


@pytest.fixture(scope="module")
def cpu_reference_ops(fresh_build):
    """The extension's ops with F.conv2d-based CPU kernels registered beside its CUDA ones, so that its C++ autograd
    (csrc/depthwise_autograd.cpp) runs on the CPU; yields the backward masks the autograd asked for."""
    if torch.cuda.is_available():
        kernels.load()  # the process's one copy of the ops (a second library of the namespace would be refused)
    else:
        _load_fresh_build(fresh_build)
    masks = []

    def fwd(x, w, bias, stride, padding, dilation, activation=0):
        y = F.conv2d(x, w, bias, stride, padding, dilation, groups=x.shape[1])
        return y.clamp_min(0) if activation == 1 else y.clamp(0, 6) if activation == 2 else y

    def bwd(grad_out, x, w, stride, padding, dilation, output_mask):
        masks.append(list(output_mask))
        groups = x.shape[1]
        gx = torch.nn.grad.conv2d_input(x.shape, w, grad_out, stride, padding, dilation, groups) \
            if output_mask[0] else x.new_empty(0)
        gw = torch.nn.grad.conv2d_weight(x, w.shape, grad_out, stride, padding, dilation, groups).contiguous() \
            if output_mask[1] else w.new_empty(0)
        gb = grad_out.sum((0, 2, 3)) if output_mask[2] else w.new_empty(0)
        return gx, gw, gb

    lib = torch.library.Library("mobilenet_dw", "IMPL")
    lib.impl("depthwise_fwd", fwd, "CPU")
    lib.impl("depthwise_bwd", bwd, "CPU")
    yield masks
    lib._destroy()


@pytest.mark.parametrize("activation", [0, 1, 2])
def test_the_cpp_autograd_gives_float64_gradients_on_reference_kernels(cpu_reference_ops, activation):
    # The C++ autograd's own work: which gradients it asks the backward op for, the activation's mask from the saved
    # output, the saved stride, padding and dilation, and the weight gradient in the weight's strides.
    op = torch.ops.mobilenet_dw.depthwise_fwd
    for stride, padding, dilation, bias in (([1, 1], [1, 1], [1, 1], True), ([2, 1], [2, 0], [2, 1], False)):
        x = (torch.randn(2, 3, 9, 8, dtype=torch.float64) * 3).requires_grad_()
        w = torch.randn(3, 1, 3, 3, dtype=torch.float64, requires_grad=True)
        b = torch.randn(3, dtype=torch.float64, requires_grad=True) if bias else None
        inputs = (x, w, b) if bias else (x, w)
        assert torch.autograd.gradcheck(
            lambda *t: op(t[0], t[1], t[2] if bias else None, stride, padding, dilation, activation), inputs)
    cpu_reference_ops.clear()
    # A [C, 1, 3, 3] weight in channels_last strides, as model.to(memory_format=torch.channels_last) leaves it
    w_cl = torch.empty_strided((4, 1, 3, 3), (9, 1, 3, 1), dtype=torch.float64).normal_().requires_grad_()
    y = op(torch.randn(2, 4, 6, 6, dtype=torch.float64), w_cl, None, [1, 1], [1, 1], [1, 1], activation)
    (grad_w,) = torch.autograd.grad(y.sum(), w_cl)  # as the autograd returns it (.grad would be restrided anyway)
    assert cpu_reference_ops == [[False, True, False]]  # no input or bias gradient asked for
    assert grad_w.stride() == w_cl.stride()


def test_load_without_cuda_raises_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(kernels, "_loaded", False)
    with pytest.raises(KernelUnavailable, match=r"need a CUDA GPU.*torch\.cuda\.is_available\(\) is False"):
        kernels.load()


def test_build_without_nvcc_says_what_to_set(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/nonexistent-cuda")
    monkeypatch.setenv("CUDA_HOME", "/nonexistent-cuda")
    with pytest.raises(KernelUnavailable, match="CUDA_HOME|CUDA build"):
        kernels.build()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_importing_ops_without_cuda_raises_kernel_unavailable():
    sys.modules.pop("kernels.ops", None)
    with pytest.raises(KernelUnavailable, match="CUDA GPU"):
        importlib.import_module("kernels.ops")


def test_kernel_unavailable_is_a_runtime_error():
    assert issubclass(KernelUnavailable, RuntimeError)


# ------------------------------------------------------------------ a prebuilt library (MOBILENET_KERNELS_PREBUILT)

BUILD_KERNELS = ROOT / "scripts" / "build_kernels.py"


@pytest.fixture(scope="module")
def exported(fresh_build, tmp_path_factory) -> Path:
    """The fresh build exported by scripts/build_kernels.py --export (the build itself is up to date: no compile)."""
    out = tmp_path_factory.mktemp("prebuilt") / "kernels"
    proc = subprocess.run([sys.executable, str(BUILD_KERNELS), "--export", str(out)], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "MOBILENET_KERNELS_CACHE": str(fresh_build[0])})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"MOBILENET_KERNELS_PREBUILT={out}" in proc.stdout
    return out


def _arch_of(directory: Path) -> str:
    return json.loads((directory / kernels.BUILD_INFO).read_text())["arch"]


def test_a_build_records_the_sources_torch_and_arch_it_was_built_for(fresh_build):
    info = json.loads((fresh_build[1] / kernels.BUILD_INFO).read_text())
    assert info["sources_sha256"] == kernels.sources_digest()
    assert info["torch"] == torch.__version__
    assert (fresh_build[1] / info["library"]).is_file()
    assert fresh_build[1].name.endswith("sm" + info["arch"].replace(".", ""))


def test_loading_an_up_to_date_build_leaves_its_build_info_alone(fresh_build):
    # every load of a cached build passes the writer: DDP ranks load at once, and one may be reading the file
    info_file = fresh_build[1] / kernels.BUILD_INFO
    before = info_file.stat().st_mtime_ns
    proc = subprocess.run([sys.executable, str(BUILD_KERNELS)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "MOBILENET_KERNELS_CACHE": str(fresh_build[0])})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert info_file.stat().st_mtime_ns == before
    assert sorted(p.name for p in fresh_build[1].glob(kernels.BUILD_INFO + "*")) == [kernels.BUILD_INFO]


def test_an_exported_library_is_accepted_for_its_gpu(exported, fresh_build):
    assert sorted(p.name for p in exported.iterdir()) == sorted([kernels.BUILD_INFO, "mobilenet_dw_kernels.so"])
    library = kernels.check_prebuilt(exported, _arch_of(exported))
    assert library.read_bytes() == next(fresh_build[1].glob("mobilenet_dw_kernels*.so")).read_bytes()


def test_the_digest_follows_every_source_byte(tmp_path):
    copy = shutil.copytree(kernels.CSRC, tmp_path / "csrc")
    assert kernels.sources_digest(copy) == kernels.sources_digest()
    header = copy / "device_common.h"
    header.write_bytes(header.read_bytes() + b" ")
    assert kernels.sources_digest(copy) != kernels.sources_digest()


def _edited_copy(exported: Path, tmp_path: Path, **info) -> Path:
    copy = shutil.copytree(exported, tmp_path / "edited")
    info_file = copy / kernels.BUILD_INFO
    info_file.write_text(json.dumps({**json.loads(info_file.read_text()), **info}))
    return copy


def test_a_library_of_other_sources_is_refused(exported, tmp_path):
    copy = _edited_copy(exported, tmp_path, sources_sha256="0" * 64)
    with pytest.raises(KernelUnavailable, match=r"built from other sources \(sha256 000000000000\) than kernels/csrc"):
        kernels.check_prebuilt(copy, _arch_of(exported))


def test_a_library_of_another_torch_is_refused(exported, tmp_path):
    copy = _edited_copy(exported, tmp_path, torch="2.0.0")
    with pytest.raises(KernelUnavailable, match=rf"built against torch 2\.0\.0, this is torch {re.escape(torch.__version__)}"):
        kernels.check_prebuilt(copy, _arch_of(exported))


def test_a_library_for_another_gpu_is_refused(exported):
    with pytest.raises(KernelUnavailable, match=r"compute capability 9\.0, this GPU is 8\.0.*TORCH_CUDA_ARCH_LIST=8\.0"):
        kernels.check_prebuilt(_edited_copy(exported, exported.parent / "arch", arch="9.0"), "8.0")


@pytest.mark.parametrize("arch_list, capability, runs", [
    ("9.0", "9.0", True), ("8.0;9.0", "9.0", True), ("9.0a", "9.0", True), ("8.6", "9.0", False),
    ("8.0+PTX", "9.0", True), ("10.0+PTX", "9.0", False), ("9.0a+PTX", "10.0", False), ("9.0", "10.0", False)])
def test_which_gpus_a_build_runs_on(arch_list, capability, runs):
    assert kernels._arch_covers(arch_list, capability) is runs


def test_a_library_with_its_own_cpp_runtime_is_refused(exported, tmp_path):
    from test_cxx_runtime import build_number_library

    copy = _edited_copy(exported, tmp_path)
    (copy / "mobilenet_dw_kernels.so").write_bytes(build_number_library(tmp_path, "static").read_bytes())
    with pytest.raises(KernelUnavailable, match=r"MOBILENET_KERNELS_PREBUILT=.*carries its own C\+\+ runtime.*"
                                                r"statically.*--export DIR on such a machine"):
        kernels.check_prebuilt(copy, _arch_of(exported))


def test_a_directory_that_is_not_an_export_is_refused(exported, tmp_path):
    with pytest.raises(KernelUnavailable, match=r"is not a directory.*--export DIR"):
        kernels.check_prebuilt(tmp_path / "missing", "9.0")
    bare = tmp_path / "bare"
    shutil.copytree(exported, bare, ignore=shutil.ignore_patterns(kernels.BUILD_INFO))
    with pytest.raises(KernelUnavailable, match=r"has no build_info\.json"):
        kernels.check_prebuilt(bare, "9.0")
    renamed = shutil.copytree(exported, tmp_path / "renamed")
    (renamed / "mobilenet_dw_kernels.so").rename(renamed / "mobilenet_dw_kernels_v1.so")
    with pytest.raises(KernelUnavailable, match=r"lacks mobilenet_dw_kernels\.so, the library its build_info\.json"):
        kernels.check_prebuilt(renamed, _arch_of(exported))
    unreadable = shutil.copytree(exported, tmp_path / "unreadable")
    (unreadable / kernels.BUILD_INFO).write_text('{"torch": "2.11.0"}')
    with pytest.raises(KernelUnavailable, match=r"build_info\.json cannot be read \(KeyError\('sources_sha256'\)\)"):
        kernels.check_prebuilt(unreadable, _arch_of(exported))


def test_a_run_summary_names_where_the_kernels_came_from(monkeypatch, tmp_path):
    from mobilenet.config import compose
    from mobilenet.reporting import environment
    from mobilenet.run_record import config_rows

    cfg = compose(["data=synthetic"])
    assert "custom kernels" not in config_rows(cfg, torch.device("cpu"), environment())
    monkeypatch.setattr(kernels, "_registered_from", tmp_path)
    monkeypatch.setattr(kernels, "_prebuilt", True)
    assert config_rows(cfg, torch.device("cpu"), environment())["custom kernels"] == f"prebuilt in {tmp_path}"


# ---------------------------------------------------------------------------------------------- GPU tests

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float64: 1e-12}


@pytest.fixture(scope="module")
def dw():
    from kernels.ops import depthwise_conv2d

    return depthwise_conv2d


def _rel(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@cuda
def test_a_prebuilt_library_runs_without_a_build(tmp_path):
    """MOBILENET_KERNELS_PREBUILT: the ops run from the exported library in a process whose cache is empty and whose
    CUDA_HOME has no compiler (a build would fail), and the process says where its kernels came from."""
    kernels.load()
    prebuilt = kernels.export(tmp_path / "prebuilt")
    cache = tmp_path / "cache"
    code = (
        "import torch, torch.nn.functional as F, kernels\n"
        "from kernels.ops import depthwise_conv2d\n"
        "x = torch.randn(4, 32, 17, 17, device='cuda').contiguous(memory_format=torch.channels_last)\n"
        "w = torch.randn(32, 1, 3, 3, device='cuda')\n"
        "y = depthwise_conv2d(x, w, None, 1, 1)\n"
        "ref = F.conv2d(x.double(), w.double(), None, 1, 1, 1, 32)\n"
        "print(((y.double() - ref).norm() / ref.norm()).item())\n"
        "print(kernels.loaded_from())\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "MOBILENET_KERNELS_PREBUILT": str(prebuilt),
                               "MOBILENET_KERNELS_CACHE": str(cache), "CUDA_HOME": str(tmp_path / "no-toolkit")})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rel, origin = proc.stdout.strip().splitlines()[-2:]
    assert float(rel) < TOL[torch.float32]
    assert origin == f"prebuilt in {prebuilt}"
    assert not cache.exists() or not any(cache.iterdir())


def _profiled(fn):
    """fn()'s result, and the names of the CUDA kernels it launched as the profiler reports them (device synchronized
    before the profile closes)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _poison_allocator(nbytes: int):
    """Fill freed allocator blocks with NaN bytes so that an output element the kernels never write
    shows up as NaN (every output of the op comes from the caching allocator)."""
    big = torch.empty(max(nbytes, 1 << 20) * 2, dtype=torch.uint8, device="cuda").fill_(0xFF)
    small = [torch.empty(1 << 19, dtype=torch.uint8, device="cuda").fill_(0xFF) for _ in range(8)]
    del big, small


def _make_input(n, c, h, w, dtype, layout, gen):
    if layout == "noncontig":  # neither layout: a strided slice of a wider tensor
        base = torch.randn(n, c, h, 2 * w + 1, device="cuda", dtype=dtype, generator=gen)
        return base[..., 1::2]
    x = torch.randn(n, c, h, w, device="cuda", dtype=dtype, generator=gen)
    return x.contiguous(memory_format=torch.channels_last) if layout == "nhwc" else x


def _padding_value(padding, k, d):
    if padding == "same":
        return (d * (k - 1) // 2,) * 2
    return (padding, padding)


def _check_case(dw, dtype, layout, k, stride, dilation, padding, bias, n, c, h, w, gen):
    if padding == "same" and stride != 1:
        return
    pad = _padding_value(padding, k, dilation)
    if (h + 2 * pad[0] - dilation * (k - 1) - 1) < 0 or (w + 2 * pad[1] - dilation * (k - 1) - 1) < 0:
        return  # no output
    x = _make_input(n, c, h, w, dtype, layout, gen).requires_grad_()
    wt = (torch.randn(c, 1, k, k, device="cuda", dtype=dtype, generator=gen) / k).requires_grad_()
    b = torch.randn(c, device="cuda", dtype=dtype, generator=gen).requires_grad_() if bias else None
    ref = F.conv2d(x.double(), wt.double(), None if b is None else b.double(), stride, pad, dilation, c)
    go = torch.randn(ref.shape, device="cuda", dtype=dtype, generator=gen)
    if layout == "nhwc":
        go = go.contiguous(memory_format=torch.channels_last)
    ref_grads = torch.autograd.grad(ref, [x, wt] + ([b] if bias else []), go.double())

    _poison_allocator(2 * x.numel() * x.element_size())
    y = dw(x, wt, b, stride, padding, dilation)
    grads = torch.autograd.grad(y, [x, wt] + ([b] if bias else []), go)
    what = f"{dtype} {layout} k={k} s={stride} d={dilation} p={padding} bias={bias} x={tuple(x.shape)}"
    assert y.dtype == dtype and y.shape == ref.shape, what
    want_cl = layout == "nhwc" and not x.is_contiguous()
    assert y.is_contiguous(memory_format=torch.channels_last if want_cl else torch.contiguous_format), what
    tol = TOL[dtype]
    for name, out, r in [("forward", y, ref)] + list(zip(["grad_input", "grad_weight", "grad_bias"], grads, ref_grads)):
        assert torch.isfinite(out).all(), f"{name} has unwritten (NaN) elements: {what}"
        err = _rel(out, r)
        assert err <= tol, f"{name} rel. error {err:.2e} > {tol}: {what}"
    # bitwise identical on a rerun (deterministic weight gradient: fixed-order reduction, no atomics)
    y2 = dw(x, wt, b, stride, padding, dilation)
    grads2 = torch.autograd.grad(y2, [x, wt] + ([b] if bias else []), go)
    assert torch.equal(y, y2), what
    for g1, g2 in zip(grads, grads2):
        assert torch.equal(g1, g2), f"gradients differ between runs: {what}"


@pytest.mark.gpu
@cuda
def test_coverage_grid_against_float64(dw):
    grid = list(itertools.product(
        DTYPES + [torch.float64], ["nchw", "nhwc", "noncontig"], [1, 3, 5, 7], [1, 2], [1, 2], [0, 1, 2, "same"],
        [False, True]))
    rng = random.Random(0)  # which grid points: fixed; the data: fresh each run
    sample = rng.sample(grid, 260)
    # every dtype x layout x fast kernel size at stride 1 and 2 (MobileNet-like, C a multiple of 8) too
    sample += [(dt, lay, k, s, 1, k // 2, bias) for dt in DTYPES for lay in ["nchw", "nhwc"] for k in (3, 5, 7)
               for s in (1, 2) for bias in (False,)]
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    # (1, 16, 6, 70): a row wider than one NHWC block's strips (several column tiles)
    sizes = [(1, 3, 5, 7), (2, 8, 9, 9), (3, 13, 11, 6), (2, 16, 15, 15), (1, 24, 8, 13), (2, 40, 7, 7), (3, 32, 12, 17),
             (1, 16, 6, 70)]
    for i, (dtype, layout, k, stride, dilation, padding, bias) in enumerate(sample):
        n, c, h, w = sizes[i % len(sizes)]
        _check_case(dw, dtype, layout, k, stride, dilation, padding, bias, n, c, h, w, gen)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_mobilenet_shapes(dw, dtype, layout):
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    # 56/60/61 wide: several row and column tiles per image, odd sizes with stride 2
    for c, h, stride in [(32, 28, 1), (64, 28, 2), (512, 14, 1), (512, 14, 2), (1024, 7, 1), (64, 56, 1), (64, 56, 2),
                         (32, 60, 1), (32, 61, 2)]:
        _check_case(dw, dtype, layout, 3, stride, 1, 1, False, 4, c, h, h, gen)


def _run_with_knobs(knobs: str, tests: list[str], expected: str, **env) -> None:
    """Runs this file's `tests` (GPU) in a pytest process of their own with `env` and then the knobs ("MDW_A=1 MDW_B=0")
    in its environment, since the kernels read their knobs once per process; asserts it passed with `expected`
    ("6 passed") in its summary."""
    env = {**os.environ, **env, **dict(kv.split("=") for kv in knobs.split())}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
                          + [f"{__file__}::{t}" for t in tests], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{knobs}:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
    assert expected in proc.stdout, proc.stdout[-1000:]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("knobs", ["MDW_FWD_RING=0 MDW_FWD_COLUMN_ROWS=1", "MDW_FWD_RING=0 MDW_FWD_COLUMN_ROWS=2",
                                   "MDW_FWD_RING=0 MDW_FWD_COLUMN_DEEP=0 MDW_FWD_COLUMN_ROWS=1",
                                   "MDW_FWD_RING=0 MDW_COLUMN_REVERSE=0", "MDW_FWD_RING=0 MDW_FWD_COLUMN=1",
                                   "MDW_FWD_RING=0 MDW_FWD_COLUMN=0 MDW_WGRAD_COLUMN=0",
                                   "MDW_FWD_RING=1 MDW_RING_ROWS=1"])
def test_launch_knobs_keep_results(knobs):
    # The launch knobs (kernels/csrc/launch_plan.h) pick other kernels or launch shapes and are read once per
    # process, so each setting runs the MobileNet-shape checks in a process of its own. FWD_RING=0 gives the
    # stride-1 forward back to the column walk whose launch shapes the other knobs set.
    _run_with_knobs(knobs, ["test_mobilenet_shapes"], "6 passed")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_large_kernel_shapes(dw, dtype, layout):
    # 5x5 and 7x7 at stride 1 and 2: H and W not multiples of any tile or unroll, W wide enough for the NHWC walk's
    # unchecked steps, H for several NCHW segments, padding from 0 to past K - 1 (there the input gradient is not
    # the rotated walk's), C a multiple of 8 and, where the 32-bit-word NHWC walk takes it, not (fp32: any C;
    # 16-bit: even C).
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    channels = [32, 6, 10] + ([3, 13] if dtype == torch.float32 else [])
    sizes = [(2, 13, 11), (1, 9, 17), (2, 23, 30), (1, 8, 41)]
    for i, (k, stride) in enumerate(itertools.product((5, 7), (1, 2))):
        for j, (n, h, w) in enumerate(sizes):
            c = channels[(i + j) % len(channels)]
            for padding in (k // 2, 0, k - 1, k + 1):
                _check_case(dw, dtype, layout, k, stride, 1, padding, (i + j) % 2 == 0, n, c, h, w, gen)
    # Many rows of few channels: more bands of rows than the NHWC weight-gradient walk has blocks at
    # WGRAD_K57_BLOCKS_PER_SM=1, so that each block walks several (test_large_kernel_column_walks_keep_results);
    # in NCHW, rows of whole 16-bit words, which its weight-gradient kernel takes.
    for k, stride in ((5, 1), (7, 2)):
        _check_case(dw, dtype, layout, k, stride, 1, k // 2, True, 32, 8, 64, 64, gen)


# The NCHW 5x5/7x7 walk's FLIP argument, its last, in a kernel name demangled or not: the input gradient's walk.
_NCHW_WALK_ROTATED = re.compile(r", (?:true|false), true>|Lb[01]ELb1EE")


def _kernels_of_passes(dw, cases, size: int = 20, weight_grad: bool = True) -> list[str]:
    """The CUDA kernels a forward and both gradients (the input's alone without `weight_grad`) run, for each
    (dtype, k, layout) on a 2 x 16 x size x size input with 'same' padding at stride 1, by name as the profiler
    reports them."""

    def passes():
        for dtype, k, layout in cases:
            x = _make_input(2, 16, size, size, dtype, layout, None).requires_grad_()
            w = torch.randn(16, 1, k, k, device="cuda", dtype=dtype, requires_grad=weight_grad)
            y = dw(x, w, None, 1, k // 2, 1)
            torch.autograd.grad(y, (x, w) if weight_grad else (x,), torch.ones_like(y))

    return _profiled(passes)[1]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_nhwc_channel_groups_and_wide_rows(dw, dtype):
    # NHWC cases that the shared-memory tile (FWD_SMEM, csrc/depthwise_smem.cu) splits in different ways: channel
    # groups of 8, 16, 24 and 32 words and a partial last group, with 16-byte copies (words a multiple of 4) and
    # without, rows wider than one tile, a few rows, padding 0 to past K - 1; then the epilogue's activations.
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    channels = [16, 32, 144, 240, 34, 6]
    sizes = [(2, 15, 57), (1, 30, 30), (3, 7, 7), (2, 14, 14)]
    for i, (k, stride) in enumerate(itertools.product((3, 5, 7), (1, 2))):
        for j, (n, h, w) in enumerate(sizes):
            c = channels[(i + j) % len(channels)]
            padding = (k // 2, 0, k - 1, k + 1)[(i + j) % 4]
            _check_case(dw, dtype, "nhwc", k, stride, 1, padding, (i + j) % 2 == 0, n, c, h, w, gen)
    for k, activation in ((3, "relu"), (5, "relu6"), (7, "relu")):
        x = _make_input(2, 48, 19, 23, dtype, "nhwc", gen)
        wt = torch.randn(48, 1, k, k, device="cuda", dtype=dtype, generator=gen)
        b = torch.randn(48, device="cuda", dtype=dtype, generator=gen)
        ref = F.conv2d(x.double(), wt.double(), b.double(), 1, k // 2, 1, 48)
        ref = ref.clamp(0, 6) if activation == "relu6" else ref.clamp_min(0)
        _poison_allocator(2 * x.numel() * x.element_size())
        y = dw(x, wt, b, 1, k // 2, 1, activation=activation)
        assert torch.isfinite(y).all() and _rel(y, ref) <= TOL[dtype], (dtype, k, activation)


@pytest.mark.gpu
@cuda
@pytest.mark.skipif("MDW_FWD_SMEM" not in os.environ, reason="run by test_smem_tile_keeps_results")
def test_smem_tile_runs_where_the_knob_sends_it(dw):
    # FWD_SMEM >= 1: every NHWC 3x3/5x5/7x7 forward of whole 32-bit words of channels runs the tile; >= 2 the
    # stride-1 input gradient too (the FLIP instantiation, its template's last argument). The input gradient alone:
    # with the weight's too, the 3x3 cases take the one-walk backward (BWD_WALK).
    setting = int(os.environ["MDW_FWD_SMEM"])
    names = _kernels_of_passes(dw, itertools.product(DTYPES, (3, 5, 7), ("nhwc",)), weight_grad=False)
    tiles = [n for n in names if "fwd_nhwc_smem_kernel" in n]
    rotated = [n for n in tiles if ", true>(" in n or "Lb1EEEv" in n]  # demangled or not
    assert len(tiles) == (18 if setting >= 2 else 9 if setting >= 1 else 0), names
    assert len(rotated) == (9 if setting >= 2 else 0), tiles


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("knobs", ["MDW_FWD_SMEM=1", "MDW_FWD_SMEM=2"])
def test_smem_tile_keeps_results(knobs):
    # The shared-memory tile on every case it takes (knobs are read once per process, hence the subprocess).
    _run_with_knobs(knobs, ["test_mobilenet_shapes", "test_large_kernel_shapes",
                            "test_nhwc_channel_groups_and_wide_rows", "test_smem_tile_runs_where_the_knob_sends_it",
                            "test_coverage_grid_against_float64"], "17 passed", MDW_FWD_MMA="0",
                    MDW_FWD_MMA_WALK="0")


@pytest.mark.gpu
@cuda
def test_input_gradient_walk_follows_its_knob(dw):
    # DGRAD_COLUMN_ROWS = 0 (the default): the 3x3 stride-1 input gradient walks as the forward's rule picks (on these
    # 20-wide rows two output rows per lane, with FWD_COLUMN_DEEP 4 steps of them); 1: one row per lane. The walk's
    # template arguments <TT, S, U, FLIP, R, ...> appear in its name, demangled or not.
    # The input gradient alone: with the weight's too, these cases take the one-walk backward (BWD_WALK).
    setting = int(os.environ.get("MDW_DGRAD_COLUMN_ROWS", "0"))
    names = _kernels_of_passes(dw, itertools.product(DTYPES, (3,), ("nhwc",)), weight_grad=False)
    rotated = [n for n in names if "fwd_nhwc_column_kernel" in n and (", true, " in n or "ELb1E" in n)]
    two_rows = [n for n in rotated if re.search(r"true, 2,|ELb1ELi2E", n)]
    assert len(rotated) == 3, names
    assert len(two_rows) == (3 if setting == 0 else 0), rotated


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("knobs", ["MDW_COLUMN_SECTORS=0", "MDW_DGRAD_COLUMN_ROWS=1",
                                   "MDW_FWD_COLUMN_DEEP=0", "MDW_FWD_COLUMN_PREFETCH=1"])
def test_column_walk_knobs_keep_results(knobs):
    # The column walks' settings other than the defaults: balanced channel groups instead of whole sectors (every
    # column walk, 3x3 and 5x5/7x7, forward and input gradient), the input gradient's one-row walk, the shallower
    # 16-bit walks, the 3x3 walks' prefetch (forward and input gradient); knobs are read once per process.
    _run_with_knobs(knobs, ["test_mobilenet_shapes", "test_large_kernel_shapes",
                            "test_nhwc_channel_groups_and_wide_rows", "test_input_gradient_walk_follows_its_knob"],
                    "16 passed")


@pytest.mark.gpu
@cuda
@pytest.mark.skipif(not {"MDW_FWD_COLUMN_K57", "MDW_NCHW_COLUMN_K57", "MDW_WGRAD_COLUMN_K57"} & set(os.environ),
                    reason="run by test_large_kernel_column_walks_keep_results")
def test_large_kernel_passes_run_the_kernels_the_column_knobs_pick(dw):
    # unset is -1, by shape: on these 20x20 inputs the NHWC passes do not walk and the NCHW forward and stride-1 input
    # gradient (rotated) do (NCHW_COLUMN_K57 = 1: the forward only); the weight
    # gradient takes a kernel row per lane in NHWC (WGRAD_COLUMN_K57 bit 0) and NCHW (bit 1); by shape (-1) always in
    # NHWC and in NCHW for 7x7 from 14 output columns (so here the 3 NCHW 7x7 cases), 5x5 from 28
    nhwc_setting = int(os.environ.get("MDW_FWD_COLUMN_K57", "-1"))
    nchw_setting = int(os.environ.get("MDW_NCHW_COLUMN_K57", "-1"))
    wgrad_setting = int(os.environ.get("MDW_WGRAD_COLUMN_K57", "-1"))
    names = _kernels_of_passes(dw, itertools.product(DTYPES, (5, 7), ("nchw", "nhwc")))
    walks = [n for n in names if "fwd_nhwc_column_k_kernel" in n]
    # the template's FLIP argument tells the rotated walk (input gradient) from the forward one (demangled or not)
    rotated = [n for n in walks if ", true," in n or "Lb1E" in n]
    forward = [n for n in walks if n not in rotated]
    nchw = [n for n in names if "fwd_nchw_column_k_kernel" in n]
    nchw_rotated = [n for n in nchw if _NCHW_WALK_ROTATED.search(n)]
    wgrad = [n for n in names if "wgrad_nhwc_column_k_kernel" in n]
    wgrad_nchw = [n for n in names if "wgrad_nchw_column_k_kernel" in n]
    assert (len(forward) >= 6) if nhwc_setting >= 1 else not forward, names
    assert (len(rotated) >= 6) if nhwc_setting >= 2 else not rotated, names
    assert (len(nchw) - len(nchw_rotated) >= 6) if nchw_setting != 0 else not nchw, names
    assert (len(nchw_rotated) == 6) if nchw_setting >= 2 or nchw_setting < 0 else not nchw_rotated, names
    assert (len(wgrad) == 6) if wgrad_setting < 0 or wgrad_setting & 1 else not wgrad, names  # the 6 NHWC cases
    want_nchw = 3 if wgrad_setting < 0 else (6 if wgrad_setting & 2 else 0)
    assert len(wgrad_nchw) == want_nchw, names


@pytest.mark.gpu
@cuda
def test_reload_knobs_makes_the_kernels_read_a_changed_environment(dw, monkeypatch):
    # What bench_depthwise.py --ab relies on: knob() keeps what it read until reload_knobs.
    x = torch.randn(2, 16, 20, 20, device="cuda").contiguous(memory_format=torch.channels_last)
    w = torch.randn(16, 1, 7, 7, device="cuda")

    def walks_with(value):
        monkeypatch.setenv("MDW_FWD_COLUMN_K57", value)
        torch.ops.mobilenet_dw.reload_knobs()
        return any("fwd_nhwc_column_k_kernel" in n for n in _profiled(lambda: dw(x, w, None, 1, 3, 1))[1])

    try:
        assert walks_with("1") and not walks_with("0") and walks_with("1")
    finally:
        monkeypatch.undo()
        torch.ops.mobilenet_dw.reload_knobs()


@pytest.mark.gpu
@cuda
def test_large_kernel_walks_by_default_where_the_suites_measured_them_faster(dw, monkeypatch):
    # The knobs' default (-1) picks by shape (csrc/depthwise_dispatch.cpp mma_walk_wanted, k57_nhwc_walk,
    # k57_nchw_walk, mma_wanted, smem_wanted): the 16-bit NHWC forward of 5x5 and 7x7 takes the tensor-core walk at
    # every size; the NHWC input gradient walks from 28 input rows up, but 16-bit 5x5 at stride 1 takes the
    # tensor-core tile from 14 to 28 rows, and the shared-memory tile below 14; NCHW walks except 5x5 on 7 rows or
    # fewer, the forward and the stride-1 input gradient (rotated) alike.
    def kernels_of(layout, k, h):
        return _kernels_of_passes(dw, [(torch.float16, k, layout)], size=h)

    for name in ("MDW_FWD_COLUMN_K57", "MDW_NCHW_COLUMN_K57", "MDW_FWD_SMEM", "MDW_FWD_MMA", "MDW_FWD_MMA_WALK"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name + "_F16", raising=False)
    torch.ops.mobilenet_dw.reload_knobs()
    try:
        # (k, rows): the input gradient's NHWC walk (rotated), shared-memory and tensor-core tiles; the forward is the
        # tensor-core walk's in every case
        for k, h, walks, tiles, mmas in ((7, 32, 1, 0, 0), (5, 32, 1, 0, 0), (5, 28, 0, 0, 1), (5, 14, 0, 0, 1),
                                         (7, 16, 0, 0, 0), (5, 7, 0, 1, 0)):
            names = kernels_of("nhwc", k, h)
            walk = [n for n in names if "fwd_nhwc_column_k_kernel" in n]
            tile = [n for n in names if "fwd_nhwc_smem_kernel" in n]
            mma = [n for n in names if "fwd_nhwc_mma_kernel" in n]
            mma_walk = [n for n in names if "fwd_nhwc_mma_walk_kernel" in n]
            assert len(walk) == walks and len(tile) == tiles and len(mma) == mmas and len(mma_walk) == 1, (
                k, h, walk, tile, mma, mma_walk)
        for k, h, walks in ((7, 7, True), (5, 14, True), (5, 7, False)):
            walk = [n for n in kernels_of("nchw", k, h) if "fwd_nchw_column_k_kernel" in n]
            rotated = [n for n in walk if _NCHW_WALK_ROTATED.search(n)]  # the input gradient's walk
            assert bool(walk) == walks and len(rotated) == (1 if walks else 0), (k, h, walk)
    finally:
        monkeypatch.undo()
        torch.ops.mobilenet_dw.reload_knobs()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("knobs", ["MDW_FWD_COLUMN_K57=1", "MDW_FWD_COLUMN_K57=2 MDW_NCHW_COLUMN_K57=1",
                                   "MDW_FWD_COLUMN_K57=2 MDW_WGRAD_COLUMN_K57=0",
                                   "MDW_FWD_COLUMN_K57=0 MDW_WGRAD_K57_BLOCKS_PER_SM=1",
                                   "MDW_FWD_COLUMN_K57=1 MDW_WGRAD_COLUMN_K57=3",
                                   "MDW_NCHW_COLUMN_K57=1 MDW_NCHW_COLUMN_K57_PREFETCH=0",
                                   "MDW_NCHW_COLUMN_K57=2", "MDW_NCHW_COLUMN_K57=2 MDW_NCHW_COLUMN_K57_PREFETCH=0",
                                   "MDW_FWD_COLUMN_K57=2 MDW_FWD_COLUMN_K57_PREFETCH=0"])
def test_large_kernel_column_walks_keep_results(knobs):
    # FWD_COLUMN_K57 (by shape by default) routes every NHWC 5x5/7x7 case it fits to the column walk
    # (stencil_column_k57.cuh): the forward at 1, the stride-1 input gradient too at 2; NCHW_COLUMN_K57 = 1 the NCHW
    # forward to its walk down the columns, = 2 the stride-1 input gradient too (the walk with the kernel rotated). WGRAD_COLUMN_K57 = 0 sends the weight gradient of both layouts back to
    # the tiled kernel, = 3 sends NCHW cases of every size to its kernel; WGRAD_K57_BLOCKS_PER_SM = 1 gives the NHWC
    # walk's blocks several bands of rows each; the *_PREFETCH = 0 settings load the walks' input a step later.
    # Knobs are read once per process, hence the subprocess; the shared-memory tile, which the dispatch tries first,
    # and the tensor-core tile and walk are off there so that every 5x5/7x7 case reaches the walks these knobs pick.
    tests = ["test_large_kernel_shapes", "test_large_kernel_passes_run_the_kernels_the_column_knobs_pick",
             "test_coverage_grid_against_float64"]
    _run_with_knobs(knobs, tests, "8 passed", MDW_FWD_SMEM="0", MDW_FWD_MMA="0", MDW_FWD_MMA_WALK="0")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_walk_against_float64_and_the_two_kernels(dw, dtype, set_knobs):
    # BWD_WALK=2 (opt-in; the default 1 is stride 1 only): the NHWC 3x3 padding-1 backward as one
    # input-row walk at stride 1 and 2. Against float64 with poisoned outputs (bias too: its gradient is the walk's
    # bias slot), on channel counts of 1-72 words (odd ones, a partial last group), short and long rows, odd heights
    # and widths, one row, one image; then against the two kernels it replaces (BWD_WALK=0): at stride 1 grad_input
    # bit for bit (the same tap order), at stride 2 to its summation order, and the weight's and bias's gradients to
    # theirs.
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    shapes = [(4, 32, 28, 28), (2, 6, 15, 57), (3, 34, 7, 9), (1, 144, 14, 14), (2, 2, 1, 70), (1, 96, 30, 3)]
    set_knobs(BWD_WALK=2, BWD_RING=0)  # the walk itself, not the rings that replace it where they are wanted
    for i, (n, c, h, w) in enumerate(shapes):
        for stride in (1, 2):
            _check_case(dw, dtype, "nhwc", 3, stride, 1, 1, i % 2 == stride - 1, n, c, h, w, gen)
    x = _make_input(4, 64, 21, 20, dtype, "nhwc", gen).requires_grad_()
    wt = (torch.randn(64, 1, 3, 3, device="cuda", dtype=dtype, generator=gen) / 3).requires_grad_()
    b = torch.randn(64, device="cuda", dtype=dtype, generator=gen).requires_grad_()

    def grads():
        out, names = [], []
        for stride in (1, 2):
            y = dw(x, wt, b, stride, 1, 1)
            go = torch.randn(y.shape, device="cuda", dtype=dtype,
                             generator=torch.Generator(device="cuda").manual_seed(stride))
            g, kernels = _profiled(lambda: torch.autograd.grad(y, (x, wt, b), go.contiguous(
                memory_format=torch.channels_last)))
            out.append(g)
            names.append(kernels)
        return out, names

    walk, walk_names = grads()
    set_knobs(BWD_WALK=0)
    apart, apart_names = grads()
    for stride, kernel, names in ((1, "wgrad_nhwc_input_row_kernel", walk_names[0]),
                                  (2, "bwd_nhwc_input_row_s2_kernel", walk_names[1])):
        assert [n for n in names if kernel in n], (stride, names)
        assert not [n for n in names if "wgrad_nhwc_column_kernel" in n], (stride, names)
    for names in apart_names:
        assert [n for n in names if "wgrad_nhwc_column_kernel" in n], names
        assert not [n for n in names if "input_row" in n], names
    assert torch.equal(walk[0][0], apart[0][0])
    for stride in (1, 2):
        for name, a, r in zip(("grad_input", "grad_weight", "grad_bias"), walk[stride - 1], apart[stride - 1]):
            assert _rel(a, r) <= TOL[dtype], (stride, name)


# The ring kernels' shapes (N, 32-bit words of channels, H, W): 4-256 words (48 and 36: a block with idle lanes; 36:
# P = 7 lanes a word, split into 7 column segments where a band of 7 row groups does not fit), widths that are no
# multiple of the unroll or the segments, one row.
_RING_SHAPES = [(4, 16, 28, 28), (2, 32, 15, 57), (3, 8, 7, 9), (1, 64, 14, 14), (2, 4, 1, 70), (1, 48, 30, 3),
                (2, 256, 9, 5), (2, 36, 20, 23)]


def _ring_operands(dtype, gen, requires_grad=False):
    """For each of _RING_SHAPES in dtype: a channels_last x, a 3x3 weight and, for every other shape, a bias (else
    None). The rings' bulk copies need compute capability 9.0: without it the test is skipped."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the ring's bulk copies need compute capability 9.0")
    per_word = 1 if dtype == torch.float32 else 2
    out = []
    for i, (n, words, h, w) in enumerate(_RING_SHAPES):
        c = words * per_word
        x = _make_input(n, c, h, w, dtype, "nhwc", gen)
        wt = torch.randn(c, 1, 3, 3, device="cuda", dtype=dtype, generator=gen) / 3
        b = torch.randn(c, device="cuda", dtype=dtype, generator=gen) if i % 2 else None
        out.append(tuple(t.requires_grad_() if t is not None and requires_grad else t for t in (x, wt, b)))
    return out


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_ring_forward_against_float64_and_the_column_walk(dw, dtype, set_knobs):
    # FWD_RING=1: the NHWC 3x3 forward whose input rows bulk copies stream into a shared-memory ring. Against float64
    # with poisoned outputs, then bit for bit against the column walk (FWD_RING=0), whose FMA order it keeps: one and
    # two output rows per lane, blocks of 3 or 5 rows (halo rows read by two blocks of an image, a ring that wraps
    # many times), of whole images and by whole waves (the default), strides 1 and 2, padding 0-2, bias, 4-256 channel
    # words (48 and 36: a block with idle lanes; 36: 7 column segments), widths that are no multiple of the unroll or
    # the segments, one row.
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    cases = []
    for x, wt, b in _ring_operands(dtype, gen):
        h, w = x.shape[2:]
        for stride, padding in ((1, 1), (2, 1), (1, 0), (2, 2)):
            if (h + 2 * padding - 3) < 0 or (w + 2 * padding - 3) < 0:
                continue
            cases.append((x, wt, b, stride, padding))

    def forwards():
        out = []
        for x, wt, b, stride, padding in cases:
            _poison_allocator(2 * x.numel() * x.element_size())
            out.append(dw(x, wt, b, stride, padding, 1))
        return out

    ring = {}
    for rows, block_rows in ((1, 3), (2, 3), (1, 0), (2, 0), (2, 5), (2, -1)):
        set_knobs(FWD_RING=1, RING_ROWS=rows, RING_BLOCK_ROWS=block_rows)
        ring[rows, block_rows], names = _profiled(forwards)
        assert sum("fwd_nhwc_ring_kernel" in n for n in names) == len(cases), (rows, block_rows)
        assert not [n for n in names if "fwd_nhwc_column_kernel" in n], (rows, block_rows)
    set_knobs(FWD_RING=0)
    walk = forwards()
    for (x, wt, b, stride, padding), y_walk, *ys in zip(cases, walk, *ring.values()):
        what = f"{dtype} x={tuple(x.shape)} s={stride} p={padding} bias={b is not None}"
        ref = F.conv2d(x.double(), wt.double(), None if b is None else b.double(), stride, padding, 1, x.shape[1])
        for setting, y in zip(ring, ys):
            assert torch.isfinite(y).all(), f"unwritten (NaN) outputs, {setting}: {what}"
            assert _rel(y, ref) <= TOL[dtype], (setting, what)
            assert torch.equal(y, y_walk), (setting, what)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_ring_against_float64_and_the_walk(dw, dtype, set_knobs):
    # BWD_RING=1: both gradients of the NHWC 3x3 stride-1 padding-1 op from rings of grad_out and x rows. Against
    # float64 with poisoned outputs (bias too), then against the input-row walk it replaces (BWD_RING=0): grad_input
    # bit for bit (the same tap order), the weight's and bias's gradients to their summation order; blocks of 3 rows
    # (halo rows read by two blocks), of whole images and by whole waves (the default), 4-256 channel words (36: 7
    # column segments), widths no multiple of the unroll.
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    cases = [(x, wt, b, torch.randn(x.shape, device="cuda", dtype=dtype, generator=gen).contiguous(
        memory_format=torch.channels_last)) for x, wt, b in _ring_operands(dtype, gen, requires_grad=True)]

    def grads():
        out = []
        for x, wt, b, go in cases:
            _poison_allocator(4 * x.numel() * x.element_size())
            y = dw(x, wt, b, 1, 1, 1)
            out.append(torch.autograd.grad(y, (x, wt) + ((b,) if b is not None else ()), go))
        return out

    ring = {}
    for block_rows in (3, 0, -1):
        set_knobs(BWD_RING=1, RING_BLOCK_ROWS=block_rows)
        for x, _, b, _ in cases:
            _check_case(dw, dtype, "nhwc", 3, 1, 1, 1, b is not None, *x.shape, gen)
        ring[block_rows], names = _profiled(grads)
        assert sum("bwd_nhwc_ring_kernel" in n for n in names) == len(cases), (block_rows, names)
        assert not [n for n in names if "input_row" in n], (block_rows, names)
    set_knobs(BWD_RING=0)
    walk = grads()
    for block_rows, got in ring.items():
        for (x, _, b, _), g_ring, g_walk in zip(cases, got, walk):
            what = f"{dtype} x={tuple(x.shape)} bias={b is not None} block rows {block_rows}"
            assert torch.equal(g_ring[0], g_walk[0]), what
            for name, a, r in zip(("grad_weight", "grad_bias"), g_ring[1:], g_walk[1:]):
                assert _rel(a, r) <= TOL[dtype], (name, what)


@pytest.mark.gpu
@cuda
def test_backward_walk_off_keeps_results():
    # BWD_WALK=0 (read once per process): the MobileNet shapes and the coverage grid through the two kernels.
    _run_with_knobs("MDW_BWD_WALK=0", ["test_mobilenet_shapes", "test_coverage_grid_against_float64"], "7 passed")


@pytest.mark.gpu
@cuda
def test_gradcheck_fp64(dw):
    for layout, stride, dilation, k in [("nchw", 1, 1, 3), ("nhwc", 2, 1, 3), ("nchw", 2, 2, 5), ("nhwc", 1, 2, 1)]:
        x = _make_input(2, 3, 9, 8, torch.float64, layout, None).requires_grad_()  # >= the dilated 5x5 kernel
        w = torch.randn(3, 1, k, k, device="cuda", dtype=torch.float64, requires_grad=True)
        b = torch.randn(3, device="cuda", dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x, w, b: dw(x, w, b, stride, 1, dilation), (x, w, b))


@pytest.mark.gpu
@cuda
def test_opcheck(dw):
    ops = torch.ops.mobilenet_dw
    for dtype, fmt, bias in [(torch.float32, torch.contiguous_format, True), (torch.float16, torch.channels_last, False),
                             (torch.float64, torch.channels_last, True)]:
        x = torch.randn(2, 8, 9, 9, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
        w = torch.randn(8, 1, 3, 3, device="cuda", dtype=dtype)
        b = torch.randn(8, device="cuda", dtype=dtype) if bias else None
        torch.library.opcheck(ops.depthwise_fwd.default, (x, w, b, [2, 2], [1, 1], [1, 1]))
        torch.library.opcheck(ops.depthwise_fwd.default,
                              (x.requires_grad_(), w.requires_grad_(), b, [1, 1], [1, 1], [1, 1]))
        go = torch.randn(2, 8, 5, 5, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
        for mask in ([True, True, True], [True, False, False], [False, True, False]):
            torch.library.opcheck(ops.depthwise_bwd.default,
                                  (go, x.detach(), w.detach(), [2, 2], [1, 1], [1, 1], mask))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("amp_dtype", [torch.float16, torch.bfloat16])
def test_autocast(dw, amp_dtype):
    x = torch.randn(2, 16, 12, 12, device="cuda", requires_grad=True)
    w = torch.randn(16, 1, 3, 3, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=amp_dtype):
        y = dw(x, w, None, 1, 1, 1)
    assert y.dtype == amp_dtype
    ref = F.conv2d(x.double(), w.double(), None, 1, 1, 1, 16)
    assert _rel(y, ref) <= 1e-2
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    assert _rel(w.grad, torch.autograd.grad(ref.sum(), w)[0]) <= 1e-2


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("amp_dtype", [torch.float16, torch.bfloat16])
def test_the_ops_autocast_kernels_cast_as_autocast_does(amp_dtype):
    # Called as torch.ops under autocast (csrc/depthwise_autograd.cpp): every floating CUDA argument but fp64 cast to
    # the autocast dtype, then the op itself; bit for bit the op on arguments cast beforehand.
    ops = torch.ops.mobilenet_dw
    x = torch.randn(2, 16, 12, 12, device="cuda").contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(16, 1, 3, 3, device="cuda"), torch.randn(16, device="cuda")
    go = torch.randn(2, 16, 12, 12, device="cuda").contiguous(memory_format=torch.channels_last)
    args = ([1, 1], [1, 1], [1, 1])
    with torch.autocast("cuda", dtype=amp_dtype):
        y = ops.depthwise_fwd(x, w, b, *args, 1)
        grads = ops.depthwise_bwd(go, x, w, *args, [True, True, True])
        y64 = ops.depthwise_fwd(x.double(), w.double(), b.double(), *args, 0)
    lo = [t.to(amp_dtype) for t in (x, w, b, go)]
    assert y.dtype == amp_dtype and torch.equal(y, ops.depthwise_fwd(lo[0], lo[1], lo[2], *args, 1))
    want = ops.depthwise_bwd(lo[3], lo[0], lo[1], *args, [True, True, True])
    for got, ref in zip(grads, want):
        assert got.dtype == amp_dtype and torch.equal(got, ref)
    assert y64.dtype == torch.float64


@pytest.mark.gpu
@cuda
def test_checked_arguments_are_remembered_only_for_what_was_checked(dw):
    # depthwise_conv2d remembers arguments that passed its checks, by everything the checks read: the same shapes
    # with another weight dtype, outside autocast, are still refused, and pass under autocast.
    x = torch.randn(2, 8, 10, 10, device="cuda")
    w = torch.randn(8, 1, 3, 3, device="cuda")
    for _ in range(2):
        assert dw(x, w, None, 1, 1, 1).dtype == torch.float32
    with pytest.raises(ValueError, match="must match the input"):
        dw(x, w.half(), None, 1, 1, 1)
    with torch.autocast("cuda", dtype=torch.float16):
        assert dw(x, w.half(), None, 1, 1, 1).dtype == torch.float16
    with pytest.raises(ValueError, match="must match the input"):
        dw(x, w.half(), None, 1, 1, 1)
    with pytest.raises(ValueError, match="smaller than the dilated kernel"):
        dw(x[:, :, :2, :2], w, None, 1, 0, 1)


@pytest.mark.gpu
@cuda
def test_torch_compile_fullgraph(dw):
    def f(x, w, b):
        return torch.relu(dw(x, w, b, 2, "valid", 1) * 2)

    compiled = torch.compile(f, fullgraph=True)
    for fmt in (torch.contiguous_format, torch.channels_last):
        x = torch.randn(2, 16, 11, 11, device="cuda").contiguous(memory_format=fmt).requires_grad_()
        w = torch.randn(16, 1, 3, 3, device="cuda", requires_grad=True)
        b = torch.randn(16, device="cuda", requires_grad=True)
        y = compiled(x, w, b)
        y_eager = f(x, w, b)
        torch.testing.assert_close(y, y_eager)
        g = torch.autograd.grad(y.sum(), (x, w, b))
        g_eager = torch.autograd.grad(y_eager.sum(), (x, w, b))
        for a, e in zip(g, g_eager):
            torch.testing.assert_close(a, e)


@pytest.mark.gpu
@cuda
def test_profiler_shows_our_kernels_and_no_cudnn(dw):
    x = torch.randn(4, 32, 28, 28, device="cuda").contiguous(memory_format=torch.channels_last).requires_grad_()
    w = torch.randn(32, 1, 3, 3, device="cuda", requires_grad=True)
    dw(x, w, None, 1, 1, 1).sum().backward()  # warm-up
    torch.cuda.synchronize()

    def passes():
        for dtype in (torch.float32, torch.float16):
            xd = x.detach().to(dtype).requires_grad_()
            wd = w.detach().to(dtype).requires_grad_()
            y = dw(xd, wd, None, 1, 1, 1)
            torch.autograd.grad(y, (xd, wd), torch.ones_like(y))

    _, names = _profiled(passes)
    ours = [n for n in names if "mdw::" in n]
    # NHWC 3x3 stride 1 padding 1, in both dtypes: the forward from the ring of input rows (compute capability 9.0 and
    # later; the column walk before); both gradients in one kernel: fp32's 32 channel words from the rings of rows
    # (9.0 and later), fp16's 16 words (too few for them) in the input-row walk
    ring = torch.cuda.get_device_capability()[0] >= 9
    forward = "fwd_nhwc_ring_kernel" if ring else "fwd_nhwc_column_kernel"
    assert sum(forward in n for n in ours) == 2, names
    assert sum("bwd_nhwc_ring_kernel" in n for n in ours) == (1 if ring else 0), names
    assert sum("wgrad_nhwc_input_row_kernel" in n for n in ours) == (1 if ring else 2), names
    assert not [n for n in names if "cudnn" in n.lower() or "conv" in n.lower() and "mdw::" not in n], names


@pytest.mark.gpu
@cuda
def test_unsupported_parameters_raise_clear_errors(dw):
    # What F.conv2d refuses, as a ValueError from the Python checks (a RuntimeError would come from the op's own
    # C++ checks); what it runs (any kernel, stride, dilation, multiplier) is tests/test_depthwise_domain.py's.
    x = torch.randn(1, 4, 12, 12, device="cuda")
    with pytest.raises(ValueError, match=r"weight has 6 filters, which is not a multiple m >= 1"):
        dw(x, torch.randn(6, 1, 3, 3, device="cuda"), None, 1, 1, 1)
    with pytest.raises(ValueError, match=r"stride 0 is not supported \(must be >= 1\)"):
        dw(x, torch.randn(4, 1, 3, 3, device="cuda"), None, 0, 1, 1)
    with pytest.raises(ValueError, match=r"dilation 0 is not supported"):
        dw(x, torch.randn(4, 1, 3, 3, device="cuda"), None, 1, 1, 0)
    with pytest.raises(ValueError, match=r"padding -1 is not supported"):
        dw(x, torch.randn(4, 1, 3, 3, device="cuda"), None, 1, -1, 1)
    with pytest.raises(ValueError, match="smaller than the dilated kernel"):
        dw(x, torch.randn(4, 1, 13, 13, device="cuda"), None, 1, 0, 1)
    with pytest.raises(ValueError, match="dtype"):
        dw(x.to(torch.int32), torch.randn(4, 1, 3, 3, device="cuda").to(torch.int32), None, 1, 1, 1)
    with pytest.raises(ValueError, match="padding='same' is not supported for strided"):
        dw(x, torch.randn(4, 1, 3, 3, device="cuda"), None, 2, "same", 1)
    with pytest.raises(ValueError, match="CUDA tensors"):
        dw(x.cpu(), torch.randn(4, 1, 3, 3), None, 1, 1, 1)


def test_a_second_build_directory_in_one_process_is_refused_clearly(fresh_build, monkeypatch):
    # This process has the fresh build's library loaded (the reference-kernel tests load it, or this does); a build
    # into another directory would load a second library of the namespace, which ends the process on some builds.
    if not torch.cuda.is_available():
        _load_fresh_build(fresh_build)
        monkeypatch.setattr(kernels, "_registered_from", fresh_build[1])
    else:
        kernels.load()
    monkeypatch.setenv("MOBILENET_KERNELS_CACHE", str(fresh_build[0] / "elsewhere"))
    with pytest.raises(KernelUnavailable, match=r"already loaded in this process from .*cannot be loaded beside"):
        kernels.build()
