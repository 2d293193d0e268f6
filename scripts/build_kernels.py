#!/usr/bin/env python
"""Prebuild the custom depthwise CUDA kernels (kernels/csrc) into the JIT cache.

Needs nvcc (CUDA_HOME) but no GPU: without one it targets TORCH_CUDA_ARCH_LIST, default 9.0 (H100/H200).
CI runs this to check that the extension compiles. --export DIR also copies the library and its build_info.json
into DIR, for machines without nvcc: there MOBILENET_KERNELS_PREBUILT=DIR loads it instead of building, after checking
that it was built from the same kernels/csrc, for the same torch version and for that GPU's architecture.

  python scripts/build_kernels.py [--verbose]
  TORCH_CUDA_ARCH_LIST=9.0 python scripts/build_kernels.py --export /shared/mobilenet-kernels
  MOBILENET_KERNELS_PREBUILT=/shared/mobilenet-kernels python train.py backend=custom norm=custom
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verbose", action="store_true", help="show the compiler command lines")
    ap.add_argument("--export", metavar="DIR", type=Path,
                    help="copy the library and build_info.json into DIR (for MOBILENET_KERNELS_PREBUILT=DIR)")
    args = ap.parse_args()
    start = time.time()
    try:
        directory = kernels.build(verbose=args.verbose)
    except kernels.KernelUnavailable as e:
        print(f"build_kernels: {e}", file=sys.stderr)
        return 1
    print(f"depthwise kernels built in {time.time() - start:.0f} s: {directory}")
    if args.export is not None:
        print(f"exported to {kernels.export(args.export)}: {kernels.PREBUILT_ENV}={args.export.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
