#!/usr/bin/env python
"""Prebuild the custom depthwise CUDA kernels (kernels/csrc) into the JIT cache.

Needs nvcc (CUDA_HOME) but no GPU: without one it targets TORCH_CUDA_ARCH_LIST, default 9.0 (H100/H200).
CI runs this to check that the extension compiles.

  python scripts/build_kernels.py [--verbose]
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
    args = ap.parse_args()
    start = time.time()
    try:
        directory = kernels.build(verbose=args.verbose)
    except kernels.KernelUnavailable as e:
        print(f"build_kernels: {e}", file=sys.stderr)
        return 1
    print(f"depthwise kernels built in {time.time() - start:.0f} s: {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
