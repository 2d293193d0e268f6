"""Custom depthwise-convolution CUDA kernels (the `backend=custom` depthwise implementation).

The kernels are compiled on first use (JIT, torch.utils.cpp_extension) and cached under
~/.cache/mobilenet-fast/kernels/<torch version>-sm<arch>/, so `pip install` needs no nvcc. `load()`
builds (if needed) and registers the ops `torch.ops.mobilenet_dw.depthwise_fwd/_bwd`; `build()` compiles without
a GPU (CI) and, as cpp_extension.load does, registers the ops in the calling process too. With
MOBILENET_KERNELS_PREBUILT=DIR, `load()` builds nothing: it loads DIR's library (scripts/build_kernels.py --export),
after checking that it was built from these sources for this torch and this GPU. Python-side
registrations (fake tensors, autograd, autocast) and the public `depthwise_conv2d` live in kernels/ops.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from pathlib import Path

import torch

from kernels import cxx_runtime

__all__ = ["KernelUnavailable", "load", "build", "build_dir", "export", "check_prebuilt", "sources_digest",
           "loaded_from", "kernel_layout", "in_weight_strides", "CSRC", "PREBUILT_ENV"]

CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = ["depthwise_ops.cpp", "depthwise_autograd.cpp", "depthwise_dispatch.cpp", "launch_plan.cpp",
            "depthwise_forward.cu", "depthwise_input_grad.cu", "depthwise_weight_grad.cu", "depthwise_k57.cu",
            "depthwise_smem.cu", "depthwise_mma.cu", "depthwise_mma_walk.cu", "depthwise_ring.cu",
            "batchnorm_ops.cpp", "batchnorm_relu.cu",  # the fused BatchNorm+ReLU ops (mobilenet_bn)
            "stem_ops.cpp", "stem_weight_grad.cu"]  # the stem convolution's weight gradient (mobilenet_stem)
_EXT_NAME = "mobilenet_dw_kernels"
_DEFAULT_ARCH = "9.0"  # H100/H200: the GPUs this project is tuned for
_EXTRA_CFLAGS = ["-O3"]
_EXTRA_CUDA_CFLAGS = ["-O3"]
BUILD_INFO = "build_info.json"  # written beside the library: what it was built from, read by check_prebuilt()
PREBUILT_ENV = "MOBILENET_KERNELS_PREBUILT"

_lock = threading.Lock()
_loaded = False
_registered_from: Path | None = None  # the build directory whose library this process loaded
_prebuilt: bool = False  # whether that library came from MOBILENET_KERNELS_PREBUILT rather than a build here
_refusal: KernelUnavailable | None = None  # why the library loaded by the build may not be used (then every call)


class KernelUnavailable(RuntimeError):
    """The custom depthwise kernels cannot be built or run here (no CUDA GPU, no nvcc, build failure)."""


def kernel_layout(x: torch.Tensor) -> torch.memory_format:
    """The layout the custom ops compute in and return: the two standard layouts as they are; any other strides (a
    slice, a permutation) are copied once into the suggested layout. Mirrors layout_of() in csrc/op_layout.h."""
    if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return torch.channels_last
    if x.is_contiguous():
        return torch.contiguous_format
    from torch._prims_common import suggest_memory_format

    return suggest_memory_format(x)


def in_weight_strides(grad_w: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor | None:
    """A depthwise weight gradient (made contiguous) in the weight's own strides. A [C, 1, kh, kw] weight in
    channels_last is the same memory as a contiguous one, with another stride for its size-1 dimension; DDP's
    gradient buckets compare every stride and copy the gradient (with a warning) each step where they differ."""
    if grad_w is None or grad_w.stride() == w.stride() or not (grad_w.is_contiguous() and w.is_contiguous()):
        return grad_w
    return grad_w.as_strided(w.shape, w.stride())


def _is_toolkit(home: str | Path | None) -> bool:
    return bool(home) and Path(home, "bin", "nvcc").exists() and Path(home, "include", "cuda_runtime_api.h").exists()


def _check_toolchain() -> None:
    """Make sure cpp_extension will find a CUDA toolkit (nvcc + headers), or say what to install/set."""
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        raise KernelUnavailable(
            f"this PyTorch build ({torch.__version__}) has no CUDA support; the custom depthwise kernels need a "
            "CUDA build of PyTorch (pip install torch from the CUDA wheel index)"
        )
    home = cpp_extension.CUDA_HOME
    if _is_toolkit(home):
        return
    # cpp_extension guesses CUDA_HOME from `which nvcc`; a wrapper script in /usr/local/bin makes that
    # /usr/local, which has no CUDA headers. Fall back to the usual install locations.
    if not os.environ.get("CUDA_HOME") and not os.environ.get("CUDA_PATH"):
        for candidate in (f"/usr/local/cuda-{torch.version.cuda}", "/usr/local/cuda"):
            if _is_toolkit(candidate):
                cpp_extension.CUDA_HOME = candidate
                os.environ["CUDA_HOME"] = candidate
                return
    found = shutil.which("nvcc")
    hint = f" (nvcc on PATH: {found})" if found else ""
    raise KernelUnavailable(
        "building the custom depthwise kernels needs the CUDA toolkit (nvcc and its headers), but CUDA_HOME "
        f"{'is not set' if not home else f'({home}) has no bin/nvcc or include/cuda_runtime_api.h'}{hint}. "
        f"Install the CUDA toolkit matching torch.version.cuda={torch.version.cuda} and set CUDA_HOME, e.g. "
        f"export CUDA_HOME=/usr/local/cuda-{torch.version.cuda}"
    )


def _arch_list() -> str:
    """Target architectures: the current GPU's, else TORCH_CUDA_ARCH_LIST, else 9.0."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}"
    return os.environ.get("TORCH_CUDA_ARCH_LIST") or _DEFAULT_ARCH


def _arch_entries(arch_list: str) -> list[str]:
    """The entries of a TORCH_CUDA_ARCH_LIST-style list ("8.0;9.0+PTX", commas or spaces also separate)."""
    return [a for a in arch_list.replace(",", ";").replace(" ", ";").split(";") if a]


def build_dir(arch_list: str | None = None) -> Path:
    arch = arch_list or _arch_list()
    tag = "_".join("sm" + a.replace(".", "").replace("+PTX", "ptx") for a in _arch_entries(arch))
    root = Path(os.environ.get("MOBILENET_KERNELS_CACHE", Path.home() / ".cache" / "mobilenet-fast" / "kernels"))
    return root / f"{torch.__version__}-{tag}"


def _refuse_second_library(what: str, hint: str = "") -> None:
    # A second library of the mobilenet_dw namespace is refused by a C++ exception thrown while it is loaded,
    # which on some builds ends the process instead of raising.
    if _registered_from is not None:
        raise KernelUnavailable(f"the custom kernels are already loaded in this process from {_registered_from}; "
                                f"{what} cannot be loaded beside them{'. ' + hint if hint else ''}")


def _compile(verbose: bool) -> None:
    global _registered_from, _refusal
    from torch.utils import cpp_extension

    if _refusal is not None:
        raise _refusal
    arch = _arch_list()
    directory = build_dir(arch)
    if _registered_from == directory:
        return  # loaded already: cpp_extension.load would only check the build and open the same library again
    _refuse_second_library(f"a build into {directory} (MOBILENET_KERNELS_CACHE or the GPU changed)",
                           "Build into another directory from a new process.")
    directory.mkdir(parents=True, exist_ok=True)
    old_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch  # read by cpp_extension to pick -gencode flags
    if not _is_built(directory):
        print("building depthwise CUDA kernels (first use, ~1 min)...", flush=True)
    try:
        cpp_extension.load(
            name=_EXT_NAME,
            sources=[str(CSRC / s) for s in _SOURCES],
            extra_cflags=_EXTRA_CFLAGS,
            extra_cuda_cflags=_EXTRA_CUDA_CFLAGS
            + (["-Xptxas=-v"] if os.environ.get("MOBILENET_KERNELS_PTXAS_VERBOSE") else []),
            extra_include_paths=[str(CSRC)],
            extra_ldflags=cxx_runtime.link_flags(),
            build_directory=str(directory),
            is_python_module=False,  # the .so only registers ops (TORCH_LIBRARY), no PYBIND11_MODULE
            with_cuda=True,
            verbose=verbose,
        )
        _registered_from = directory
    except Exception as e:  # compiler errors, missing headers, ...
        raise KernelUnavailable(f"building the custom depthwise kernels failed in {directory}: {e}") from e
    finally:
        if old_arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old_arch
    # cpp_extension has loaded it already: refused, it stays refused in this process, and it gets no
    # build_info.json, so it is neither exported nor taken for a finished build.
    library = _newest_library(directory)
    try:
        _refuse_carried_runtime(library, built=True)
    except KernelUnavailable as e:
        _refusal = e
        raise
    _write_build_info(directory, arch, library)


def _newest_library(directory: Path) -> Path:
    # a rebuild inside one process gets a versioned name (_v1.so, ...): the newest library is the one just built
    return max(directory.glob(f"{_EXT_NAME}*.so"), key=lambda p: p.stat().st_mtime)


def _refuse_carried_runtime(library: Path, built: bool) -> None:
    """KernelUnavailable if `library` brings its own copy of libstdc++ (kernels/cxx_runtime.py says why that
    crashes), naming the compiler to change."""
    try:
        why = cxx_runtime.carried_runtime(library)
    except ValueError as e:
        raise KernelUnavailable(f"{library} is not a shared library of this machine: {e}") from None
    if why is None:
        return
    compiler = f"CXX={os.environ['CXX']}" if os.environ.get("CXX") else "c++ on PATH"
    remedy = (f"The compiler ({compiler}) links libstdc++ statically. Build with one that links it shared, e.g. "
              f"CXX=/usr/bin/g++, after deleting {library.parent}" if built else
              "Export a library built with a compiler that links libstdc++ shared (scripts/build_kernels.py "
              "--export DIR on such a machine)")
    raise KernelUnavailable(
        f"the custom kernels' library {library} carries its own C++ runtime: {why}. Beside torch's libstdc++ "
        f"({cxx_runtime.process_libstdcxx() or 'the shared one'}) a second copy breaks the formatting of numbers: "
        f"the first error message that names a shape crashes the process or comes out garbled. {remedy}")


def sources_digest(csrc: Path = CSRC) -> str:
    """sha256 of the extension's sources (every C++/CUDA file in csrc, by name and content) and its compiler
    flags: two libraries with the same digest compiled the same code."""
    h = hashlib.sha256(json.dumps([_EXTRA_CFLAGS, _EXTRA_CUDA_CFLAGS]).encode())
    for f in sorted(p for p in csrc.iterdir() if p.suffix in {".cpp", ".cu", ".h", ".cuh"}):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _write_build_info(directory: Path, arch: str, library: Path) -> None:
    info = {"sources_sha256": sources_digest(), "torch": torch.__version__, "cuda": torch.version.cuda, "arch": arch,
            "library": library.name}
    text = json.dumps(info, indent=1) + "\n"
    target = directory / BUILD_INFO
    if target.is_file() and target.read_text() == text:
        return  # every load of a cached build passes here; DDP ranks load at once and another may be reading it
    # written whole under another name, then renamed: a reader never sees half a file
    partial = directory / f"{BUILD_INFO}.{os.getpid()}"
    partial.write_text(text)
    os.replace(partial, target)


def _read_build_info(directory: Path) -> dict:
    info_file = directory / BUILD_INFO
    if not info_file.is_file():
        raise KernelUnavailable(f"{directory} has no {BUILD_INFO}, so what its library was built from is unknown; "
                                "export one with `python scripts/build_kernels.py --export DIR`")
    try:
        info = json.loads(info_file.read_text())
        for key in ("sources_sha256", "torch", "arch", "library"):
            info[key]  # noqa: B018  (each must be there)
    except (ValueError, KeyError, TypeError) as e:
        raise KernelUnavailable(f"{info_file} cannot be read ({e!r}); export the directory again") from e
    if not (directory / info["library"]).is_file():
        raise KernelUnavailable(f"{directory} lacks {info['library']}, the library its {BUILD_INFO} describes; "
                                "export the directory again")
    return info


def _arch_covers(arch_list: str, capability: str) -> bool:
    """Whether a library built for arch_list runs on a GPU of this compute capability ("9.0"): its own machine code,
    or PTX of an earlier architecture that the driver compiles."""
    cap = tuple(int(v) for v in capability.split("."))
    for entry in _arch_entries(arch_list):
        parsed = re.fullmatch(r"(\d+)\.(\d+)([a-z]?)(\+PTX)?", entry)
        if parsed is None:
            continue
        version = (int(parsed[1]), int(parsed[2]))
        if version == cap or (parsed[4] and not parsed[3] and version <= cap):
            return True
    return False


def check_prebuilt(directory: str | Path, capability: str) -> Path:
    """The library in a prebuilt kernels directory, if it was built from these sources, for this torch and for a GPU
    of this compute capability ("9.0"), linked to the shared C++ runtime; otherwise KernelUnavailable saying what
    differs."""
    directory = Path(directory)
    where = f"{PREBUILT_ENV}={directory}"
    if not directory.is_dir():
        raise KernelUnavailable(f"{where} is not a directory; it should be one written by "
                                "`python scripts/build_kernels.py --export DIR`")
    try:
        info = _read_build_info(directory)
    except KernelUnavailable as e:
        raise KernelUnavailable(f"{PREBUILT_ENV}: {e}") from None
    built_from, built_torch, built_arch = info["sources_sha256"], info["torch"], info["arch"]
    here = sources_digest()
    if built_from != here:
        raise KernelUnavailable(
            f"{where}: its library was built from other sources (sha256 {built_from[:12]}) than kernels/csrc here "
            f"({here[:12]}); running it would run other kernels than this tree's. Rebuild with "
            "`python scripts/build_kernels.py --export DIR`, or unset the variable to build here")
    if built_torch != torch.__version__:
        raise KernelUnavailable(f"{where}: its library was built against torch {built_torch}, this is torch "
                                f"{torch.__version__}; the C++ ABI is not kept across versions. Rebuild it with this torch")
    if not _arch_covers(built_arch, capability):
        raise KernelUnavailable(f"{where}: its library was built for compute capability {built_arch}, this GPU is "
                                f"{capability}. Rebuild with TORCH_CUDA_ARCH_LIST={capability}")
    library = directory / info["library"]
    try:
        _refuse_carried_runtime(library, built=False)
    except KernelUnavailable as e:
        raise KernelUnavailable(f"{where}: {e}") from None
    return library


def export(directory: str | Path) -> Path:
    """Copy the library and its build_info.json into `directory`, for MOBILENET_KERNELS_PREBUILT elsewhere: the one
    this process loaded, else the build for this machine's architecture."""
    source = _registered_from or build_dir()
    info = _read_build_info(source)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f"{_EXT_NAME}*.so"):
        stale.unlink()
    for name in (info["library"], BUILD_INFO):
        shutil.copy2(source / name, directory / name)
    return directory


def loaded_from() -> str | None:
    """Where this process's custom kernels came from, for a run's summary; None if they are not loaded."""
    if _registered_from is None:
        return None
    return f"{'prebuilt' if _prebuilt else 'built'} in {_registered_from}"


def _is_built(directory: Path) -> bool:
    # cpp_extension itself rebuilds when a source changed; this only decides whether to announce it.
    return any(directory.glob(f"{_EXT_NAME}*.so"))


def build(verbose: bool = False) -> Path:
    """Compile the extension (no GPU needed) and return its build directory."""
    _check_toolchain()
    with _lock:
        _compile(verbose)
    return build_dir()


def load(verbose: bool = False) -> None:
    """Build if needed and register torch.ops.mobilenet_dw.*; raises KernelUnavailable when impossible."""
    global _loaded
    if _loaded:
        return
    if not torch.cuda.is_available():
        raise KernelUnavailable(
            "the custom depthwise kernels need a CUDA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); install an NVIDIA driver and a CUDA "
            "build of PyTorch, or use backend=torch"
        )
    prebuilt = os.environ.get(PREBUILT_ENV)
    if prebuilt:
        _load_prebuilt(Path(prebuilt).absolute())
        _loaded = True
        return
    _check_toolchain()
    with _lock:
        if not _loaded:
            _compile(verbose)
            _loaded = True


def _load_prebuilt(directory: Path) -> None:
    global _registered_from, _prebuilt
    major, minor = torch.cuda.get_device_capability()
    library = check_prebuilt(directory, f"{major}.{minor}")
    with _lock:
        if _registered_from == directory:
            return
        _refuse_second_library(f"{PREBUILT_ENV}={directory}")
        torch.ops.load_library(str(library))
        _registered_from, _prebuilt = directory, True
