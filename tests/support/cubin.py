"""What a cubin (an ELF64 file) defines: its kernel entry points and its variables, read from the
symbol table."""

from __future__ import annotations

import struct

SHT_SYMTAB, STT_OBJECT, STT_FUNC, STB_GLOBAL = 2, 1, 2, 1
STO_CUDA_ENTRY = 0x10  # st_other of a __global__ function's symbol


def _symbols(cubin: bytes):
    """(name, type, binding, st_other) of every defined symbol."""
    assert cubin[:5] == b"\x7fELF\x02", "not an ELF64 file"
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != SHT_SYMTAB:
            continue
        strings = sections[link][4]
        for k in range(size // entsize):
            name, info, other, shndx, _, _ = struct.unpack_from("<IBBHQQ", cubin, offset + k * entsize)
            if shndx != 0:
                start = strings + name
                yield cubin[start:cubin.index(b"\0", start)].decode(), info & 0xF, info >> 4, other


def entry_points(cubin: bytes) -> set[str]:
    """Names of the defined global functions marked as CUDA entry points (the ``extern "C"`` kernels)."""
    return {name for name, kind, bind, other in _symbols(cubin)
            if kind == STT_FUNC and bind == STB_GLOBAL and other & STO_CUDA_ENTRY}


def variables(cubin: bytes) -> set[str]:
    """Names of the defined data objects (``__device__`` variables, which cuLibraryGetGlobal finds)."""
    return {name for name, kind, _, _ in _symbols(cubin) if kind == STT_OBJECT}
