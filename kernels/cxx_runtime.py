"""The C++ runtime of the kernels' library: the shared libstdc++ torch itself runs on, never a private copy.

A compiler whose driver links libstdc++ statically (a toolchain installed under /opt with only libstdc++.a, or with
-static-libstdc++ in its specs, picked through CXX) puts a second C++ runtime into the process beside the one torch
loads. Most code still works, so the fault shows late: the two copies number std::locale's facets apart, and the
library's first formatted number (a TORCH_CHECK message naming a shape, say) reads a facet that is not there:
the number comes out empty, or the process crashes. So the build links torch's libstdc++ by path, which the linker
searches before the compiler's own, and a library that still defines libstdc++'s members, built here or brought in
prebuilt, is refused.
"""

from __future__ import annotations

import struct
from pathlib import Path

__all__ = ["process_libstdcxx", "link_flags", "carried_runtime", "CXX_RUNTIME_SONAME"]

CXX_RUNTIME_SONAME = "libstdc++.so.6"
# Members of std::locale are defined in libstdc++ alone; a library that defines one carries a copy of it.
_RUNTIME_SYMBOL_PREFIX = b"_ZNSt6locale"

_SHT_SYMTAB, _SHT_DYNAMIC, _SHT_DYNSYM = 2, 6, 11
_DT_NEEDED = 1


def process_libstdcxx(maps: Path = Path("/proc/self/maps")) -> Path | None:
    """The shared libstdc++ this process has loaded (torch's), or None where none is mapped or maps cannot be read."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
        if len(fields) == 6 and Path(fields[5]).name.startswith("libstdc++.so"):
            return Path(fields[5])
    return None


def link_flags() -> list[str]:
    """Linker arguments that bind the library to the process's libstdc++ (none where it is not found)."""
    runtime = process_libstdcxx()
    return [str(runtime)] if runtime is not None else []


def _sections(data: bytes) -> list[tuple[int, int, int, int, int]]:
    """(type, offset, size, link, entsize) of each section of a 64-bit little-endian ELF file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    out = []
    for i in range(shnum):
        sh_type, = struct.unpack_from("<I", data, shoff + i * shentsize + 4)
        offset, size, link, _, _, entsize = struct.unpack_from("<QQIIQQ", data, shoff + i * shentsize + 0x18)
        out.append((sh_type, offset, size, link, entsize))
    return out


def _string(data: bytes, table: tuple[int, int, int, int, int], index: int) -> bytes:
    start = table[1] + index
    return data[start:data.index(b"\0", start)]


def carried_runtime(library: Path) -> str | None:
    """Why `library` would run on a C++ runtime of its own, or None when it links the shared libstdc++ (or needs
    no C++ runtime at all)."""
    data = Path(library).read_bytes()
    sections = _sections(data)
    needed = []
    for sh_type, offset, size, link, _ in sections:
        if sh_type == _SHT_DYNAMIC:
            for tag, value in struct.iter_unpack("<qQ", data[offset:offset + size]):
                if tag == _DT_NEEDED:
                    needed.append(_string(data, sections[link], value).decode())
    for sh_type, offset, size, link, entsize in sections:
        if sh_type not in (_SHT_SYMTAB, _SHT_DYNSYM) or not entsize:
            continue
        names = sections[link]
        for at in range(offset, offset + size, entsize):
            name, _, _, shndx = struct.unpack_from("<IBBH", data, at)
            # defined (a section index) and named with the prefix, read in place: most symbols are not
            if shndx and name and data.startswith(_RUNTIME_SYMBOL_PREFIX, names[1] + name):
                symbol = _string(data, names, name).decode()
                if CXX_RUNTIME_SONAME in needed:
                    linked = f"links {CXX_RUNTIME_SONAME}"
                else:
                    linked = f"does not link {CXX_RUNTIME_SONAME} (it needs {', '.join(needed) or 'no shared library'})"
                return f"it defines libstdc++'s own {symbol} and {linked}: libstdc++ was linked into it statically"
    return None
