"""Whether a shared object brings its own copy of the C++ runtime.

pyddp._C must use the ``libstdc++.so.6`` that torch already loaded. A
compiler that links ``libstdc++.a`` into it (a wrapper that adds
``-static-libstdc++``, or one whose ``-B`` directory holds ``libstdc++.a``
and no usable shared one, as the vendor CUDA image's g++ does) gives the
process two runtimes: the facets' template ids merge with the shared
library's while the explicit specialisations' ids stay private, so writing
an integer to a stream calls the wrong facet (a crash with g++ 13, an empty
string with g++ 12).

setup.py runs this check on what it built, and ``import pyddp`` on what it is
about to load, before loading it. Plain Python (no torch), so setup.py can
import this file alone. The module is read as ELF: its dynamic section's
``NEEDED`` entries and its symbol tables.
"""

from __future__ import annotations

import struct
from typing import BinaryIO, Iterator, List, Optional, Tuple

RUNTIME = "libstdc++.so.6"
# What setup.py links with: the shared runtime by its file name, before the
# libraries the compiler driver appends, so that it resolves every C++ symbol
# and no libstdc++.a is pulled in. A plain -lstdc++ would take the first
# libstdc++ on the library path, which a wrapper's -B directory may make the
# archive.
LINK_RUNTIME = f"-l:{RUNTIME}"
# std::locale::classic(): defined only by the runtime itself, and used by
# every stream, so a module that defines it carries a runtime of its own.
RUNTIME_SYMBOL = b"_ZNSt6locale7classicEv"

_SHT_SYMTAB, _SHT_DYNAMIC, _SHT_DYNSYM = 2, 6, 11
_DT_NEEDED = 1
_SHN_UNDEF = 0
_Section = Tuple[int, int, int, int]  # (type, offset, size, link)


def _sections(f: BinaryIO) -> Optional[List[_Section]]:
    """The section headers of a 64-bit little-endian ELF file, or None for anything else."""
    header = f.read(64)
    if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
        return None
    shoff, = struct.unpack_from("<Q", header, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", header, 0x3A)
    f.seek(shoff)
    table = f.read(shentsize * shnum)
    sections = []
    for i in range(shnum):
        kind, = struct.unpack_from("<I", table, i * shentsize + 4)
        offset, size, link = struct.unpack_from("<QQI", table, i * shentsize + 24)
        sections.append((kind, offset, size, link))
    return sections


def _read(f: BinaryIO, section: _Section) -> bytes:
    f.seek(section[1])
    return f.read(section[2])


def _string(strings: bytes, at: int) -> bytes:
    return strings[at:strings.index(b"\0", at)]


def _needed(f: BinaryIO, sections: List[_Section]) -> Iterator[str]:
    for s in sections:
        if s[0] != _SHT_DYNAMIC:
            continue
        strings, entries = _read(f, sections[s[3]]), _read(f, s)
        for tag, value in struct.iter_unpack("<qQ", entries[:len(entries) // 16 * 16]):
            if tag == _DT_NEEDED:
                yield _string(strings, value).decode()


def _defines(f: BinaryIO, sections: List[_Section], name: bytes) -> bool:
    for s in sections:
        if s[0] not in (_SHT_SYMTAB, _SHT_DYNSYM):
            continue
        strings = _read(f, sections[s[3]])
        if name + b"\0" not in strings:
            continue
        symbols = _read(f, s)
        for st_name, _, _, st_shndx, _, _ in struct.iter_unpack(
                "<IBBHQQ", symbols[:len(symbols) // 24 * 24]):
            if st_shndx != _SHN_UNDEF and _string(strings, st_name) == name:
                return True
    return False


def own_runtime(path: str) -> Optional[str]:
    """Why the shared object at ``path`` carries its own C++ runtime, or None if it uses
    the process's ``libstdc++.so.6`` (or is not a 64-bit little-endian ELF file)."""
    with open(path, "rb") as f:
        sections = _sections(f)
        if sections is None:
            return None
        why = []
        if RUNTIME not in set(_needed(f, sections)):
            why.append(f"it does not load {RUNTIME}")
        if _defines(f, sections, RUNTIME_SYMBOL):
            why.append("it defines std::locale::classic (libstdc++.a was linked into it)")
    if not why:
        return None
    return (f"{path} carries its own C++ runtime: {' and '.join(why)}. Its compiler links "
            "libstdc++ statically (-static-libstdc++, or a libstdc++.a first on its library "
            "path), which gives the process two C++ runtimes; rebuild pyddp with pyddp's "
            "setup.py, which links libstdc++ dynamically whatever the compiler adds, or with "
            "a compiler that does not add it")
