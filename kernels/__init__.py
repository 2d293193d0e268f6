"""Custom depthwise-convolution CUDA kernels (the `backend=custom` depthwise implementation).

The kernels are compiled on first use (JIT, torch.utils.cpp_extension) and cached under
~/.cache/mobilenet-fast/kernels/<torch version>-sm<arch>/, so `pip install` needs no nvcc. `load()`
builds (if needed) and registers the ops `torch.ops.mobilenet_dw.depthwise_fwd/_bwd`; `build()` compiles without
a GPU (CI) and, as cpp_extension.load does, registers the ops in the calling process too. Python-side
registrations (fake tensors, autograd, autocast) and the public `depthwise_conv2d` live in kernels/ops.py.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import torch

__all__ = ["KernelUnavailable", "load", "build", "build_dir", "kernel_layout", "in_weight_strides", "CSRC"]

CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = ["depthwise_ops.cpp", "depthwise_autograd.cpp", "depthwise_dispatch.cpp", "launch_plan.cpp",
            "depthwise_forward.cu", "depthwise_input_grad.cu", "depthwise_weight_grad.cu", "depthwise_k57.cu",
            "depthwise_smem.cu", "depthwise_mma.cu", "depthwise_mma_walk.cu", "depthwise_ring.cu",
            "batchnorm_ops.cpp", "batchnorm_relu.cu"]  # the fused BatchNorm+ReLU ops (mobilenet_bn)
_EXT_NAME = "mobilenet_dw_kernels"
_DEFAULT_ARCH = "9.0"  # H100/H200: the GPUs this project is tuned for

_lock = threading.Lock()
_loaded = False
_registered_from: Path | None = None  # the build directory whose library this process loaded


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


def build_dir(arch_list: str | None = None) -> Path:
    arch = arch_list or _arch_list()
    tag = "_".join("sm" + a.replace(".", "").replace("+PTX", "ptx") for a in arch.replace(",", ";").replace(" ", ";").split(";") if a)
    root = Path(os.environ.get("MOBILENET_KERNELS_CACHE", Path.home() / ".cache" / "mobilenet-fast" / "kernels"))
    return root / f"{torch.__version__}-{tag}"


def _compile(verbose: bool) -> None:
    global _registered_from
    from torch.utils import cpp_extension

    arch = _arch_list()
    directory = build_dir(arch)
    if _registered_from == directory:
        return  # loaded already: cpp_extension.load would only check the build and open the same library again
    if _registered_from is not None:
        # A second library of the mobilenet_dw namespace is refused by a C++ exception thrown while it is loaded,
        # which on some builds ends the process instead of raising.
        raise KernelUnavailable(
            f"the custom kernels are already loaded in this process from {_registered_from}; a build into "
            f"{directory} (MOBILENET_KERNELS_CACHE or the GPU changed) cannot be loaded beside them. "
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
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3"]
            + (["-Xptxas=-v"] if os.environ.get("MOBILENET_KERNELS_PTXAS_VERBOSE") else []),
            extra_include_paths=[str(CSRC)],
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
    _check_toolchain()
    with _lock:
        if not _loaded:
            _compile(verbose)
            _loaded = True
