"""Just enough ELF reading for ``failslow doctor``: dynamic symbols, NEEDED, RPATH/RUNPATH.

The doctor must say which NCCL torch would load and what it exports without loading it (a
real libnccl pulls in CUDA state; a broken one could crash the doctor), and without binutils
(``nm``/``readelf`` are often absent from training images). This reads the section headers
of a 64-bit little-endian shared object (x86-64, aarch64) and decodes ``.dynsym`` and
``.dynamic``.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from failslow.errors import FailslowError

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_DYN = struct.Struct("<qQ")
SHT_DYNSYM = 11
SHT_DYNAMIC = 6
DT_NEEDED, DT_SONAME, DT_RPATH, DT_RUNPATH = 1, 14, 15, 29
BINDINGS = {0: "local", 1: "global", 2: "weak", 10: "unique"}


@dataclass(frozen=True, slots=True)
class Symbol:
    name: str
    binding: str  # global | weak | local | unique
    defined: bool  # False for an undefined reference (imported from another library)
    is_function: bool


@dataclass(slots=True)
class ElfInfo:
    path: Path
    soname: str = ""
    needed: list[str] = field(default_factory=list)
    rpath: list[str] = field(default_factory=list)  # DT_RUNPATH, else DT_RPATH, $ORIGIN expanded
    symbols: dict[str, Symbol] = field(default_factory=dict)

    def exports(self, name: str) -> Symbol | None:
        """The defined, non-local dynamic symbol ``name``, if this object exports it."""
        sym = self.symbols.get(name)
        return sym if sym is not None and sym.defined and sym.binding != "local" else None


def _cstr(data: mmap.mmap, start: int, end: int) -> str:
    stop = data.find(b"\0", start, end)
    return data[start : stop if stop >= 0 else end].decode("utf-8", "replace")


def read_elf(path: str | os.PathLike[str]) -> ElfInfo:
    """Decode the dynamic symbols and dynamic section of a shared object."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise FailslowError(f"{path}: cannot read ({exc})") from None
    try:
        return _decode(path, data)
    except struct.error:
        raise FailslowError(f"{path}: truncated or malformed ELF file") from None
    finally:
        data.close()


def _decode(path: Path, data: mmap.mmap) -> ElfInfo:
    if len(data) < _EHDR.size or data[:4] != b"\x7fELF":
        raise FailslowError(f"{path}: not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise FailslowError(f"{path}: not a 64-bit little-endian ELF file")
    ehdr = _EHDR.unpack_from(data, 0)
    shoff, shentsize, shnum = ehdr[6], ehdr[11], ehdr[12]
    if not shoff or not shnum:
        raise FailslowError(f"{path}: no section headers (stripped with sstrip?)")
    sections = [_SHDR.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
    info = ElfInfo(path)

    def strtab(index: int) -> tuple[int, int]:
        sh = sections[index]
        return sh[4], sh[4] + sh[5]

    for sh in sections:
        sh_type, offset, size, link, entsize = sh[1], sh[4], sh[5], sh[6], sh[9]
        if sh_type == SHT_DYNSYM:
            s0, s1 = strtab(link)
            for i in range(1, size // (entsize or _SYM.size)):
                st_name, st_info, _other, shndx, _value, _size = _SYM.unpack_from(
                    data, offset + i * (entsize or _SYM.size)
                )
                name = _cstr(data, s0 + st_name, s1)
                if name:
                    info.symbols[name] = Symbol(
                        name,
                        BINDINGS.get(st_info >> 4, str(st_info >> 4)),
                        shndx != 0,
                        (st_info & 0xF) == 2,
                    )
        elif sh_type == SHT_DYNAMIC:
            s0, s1 = strtab(link)
            rpath: list[str] = []
            runpath: list[str] = []
            for i in range(size // (entsize or _DYN.size)):
                tag, val = _DYN.unpack_from(data, offset + i * (entsize or _DYN.size))
                if tag == 0:
                    break
                if tag == DT_NEEDED:
                    info.needed.append(_cstr(data, s0 + val, s1))
                elif tag == DT_SONAME:
                    info.soname = _cstr(data, s0 + val, s1)
                elif tag in (DT_RPATH, DT_RUNPATH):
                    origin = str(path.resolve().parent)
                    dirs = [
                        d.replace("$ORIGIN", origin).replace("${ORIGIN}", origin)
                        for d in _cstr(data, s0 + val, s1).split(":")
                        if d
                    ]
                    (runpath if tag == DT_RUNPATH else rpath).extend(dirs)
            info.rpath = runpath or rpath
    return info
