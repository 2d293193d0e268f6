"""The kernels' library runs on torch's shared libstdc++, never on a copy of its own (kernels/cxx_runtime.py).

A small real library formats a number with std::ostringstream, as TORCH_CHECK does, linked three ways by the
machine's C++ compiler: as usual, with -static-libstdc++ (what a toolchain with only libstdc++.a does), and
with -static-libstdc++ plus kernels.cxx_runtime.link_flags() (the build's remedy).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cxx_runtime  # imports torch, whose libstdc++ this process then has, as the kernels' users do

_SOURCE = r"""
#include <cstring>
#include <sstream>
extern "C" void format_number(long v, char* out) {
  std::ostringstream s;
  s << "n=" << v;
  std::strcpy(out, s.str().c_str());
}
"""


def _compiler() -> str:
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("needs a C++ compiler")
    archive = subprocess.run([cxx, "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    if not Path(archive).is_absolute():
        pytest.skip(f"{cxx} has no libstdc++.a to link statically")
    return cxx


def build_number_library(directory: Path, how: str) -> Path:
    """The library above, linked `how`: "shared", "static" or "static+remedy"."""
    cxx = _compiler()
    source = directory / "format_number.cpp"
    source.write_text(_SOURCE)
    out = directory / f"format_number_{how.replace('+', '_')}.so"
    flags = {"shared": [], "static": ["-static-libstdc++"],
             "static+remedy": ["-static-libstdc++", *cxx_runtime.link_flags()]}[how]
    subprocess.run([cxx, "-shared", "-fPIC", "-O2", str(source), *flags, "-o", str(out)], check=True)
    return out


def _format_beside_torch(library: Path) -> subprocess.CompletedProcess:
    code = ("import ctypes, torch\n"
            f"lib = ctypes.CDLL({str(library)!r})\n"
            "buf = ctypes.create_string_buffer(64)\n"
            "lib.format_number(ctypes.c_long(12345), buf)\n"
            "print(buf.value.decode())\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cxx_runtime")
    return {how: build_number_library(directory, how) for how in ("shared", "static", "static+remedy")}


def test_torchs_process_has_a_shared_libstdcxx():
    runtime = cxx_runtime.process_libstdcxx()
    assert runtime is not None and runtime.name.startswith("libstdc++.so.6") and runtime.is_file()
    assert cxx_runtime.link_flags() == [str(runtime)]


def test_a_second_runtime_breaks_number_formatting_beside_torchs(libraries):
    # the fault the check exists for: the copy's facets are not the process's (garbled here, a crash elsewhere)
    broken = _format_beside_torch(libraries["static"])
    assert not (broken.returncode == 0 and broken.stdout.strip() == "n=12345"), broken.stdout
    for how in ("shared", "static+remedy"):
        ok = _format_beside_torch(libraries[how])
        assert ok.returncode == 0 and ok.stdout.strip() == "n=12345", (how, ok.stdout, ok.stderr[-2000:])


def test_a_library_with_its_own_runtime_is_named(libraries):
    why = cxx_runtime.carried_runtime(libraries["static"])
    assert why is not None
    assert "defines libstdc++'s own _ZNSt6locale" in why
    assert "does not link libstdc++.so.6" in why and "statically" in why
    assert cxx_runtime.carried_runtime(libraries["shared"]) is None
    # the remedy: the static archive is left unused once torch's libstdc++ is on the link line
    assert cxx_runtime.carried_runtime(libraries["static+remedy"]) is None


def test_the_runtime_is_read_from_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f10 r--p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f20-7f30 rw-p 00000000 00:00 0 \n"
        "7f40-7f50 r-xp 00000000 08:01 2 /opt/lib/libstdc++.so.6.0.33\n")
    assert cxx_runtime.process_libstdcxx(maps) == Path("/opt/lib/libstdc++.so.6.0.33")
    maps.write_text("7f00-7f10 r--p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert cxx_runtime.process_libstdcxx(maps) is None
    assert cxx_runtime.process_libstdcxx(tmp_path / "absent") is None


def test_a_file_that_is_not_a_library_is_refused_clearly(tmp_path):
    import kernels

    fake = tmp_path / "mobilenet_dw_kernels.so"
    fake.write_bytes(b"not an ELF file at all")
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF file"):
        cxx_runtime.carried_runtime(fake)
    with pytest.raises(kernels.KernelUnavailable, match=r"is not a shared library of this machine"):
        kernels._refuse_carried_runtime(fake, built=False)


def test_a_refused_build_names_the_compiler_and_the_remedy(libraries, monkeypatch):
    import kernels

    monkeypatch.setenv("CXX", "/opt/gcc/bin/g++")
    with pytest.raises(kernels.KernelUnavailable) as refused:
        kernels._refuse_carried_runtime(libraries["static"], built=True)
    message = str(refused.value)
    assert "carries its own C++ runtime" in message
    assert "The compiler (CXX=/opt/gcc/bin/g++) links libstdc++ statically" in message
    assert f"after deleting {libraries['static'].parent}" in message
    monkeypatch.delenv("CXX")
    with pytest.raises(kernels.KernelUnavailable, match=r"The compiler \(c\+\+ on PATH\) links"):
        kernels._refuse_carried_runtime(libraries["static"], built=True)
    kernels._refuse_carried_runtime(libraries["static+remedy"], built=True)  # accepted: no exception
