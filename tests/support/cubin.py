"""What a cubin (an ELF64 file) defines: its kernel entry points, read from the symbol table."""

from __future__ import annotations

import struct

SHT_SYMTAB, STT_FUNC, STB_GLOBAL = 2, 2, 1
STO_CUDA_ENTRY = 0x10  # st_other of a __global__ function's symbol


def entry_points(cubin: bytes) -> set[str]:
    """Names of the defined global functions marked as CUDA entry points (the ``extern "C"`` kernels)."""
    assert cubin[:5] == b"\x7fELF\x02", "not an ELF64 file"
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    out = set()
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != SHT_SYMTAB:
            continue
        strings = sections[link][4]
        for k in range(size // entsize):
            name, info, other, shndx, _, _ = struct.unpack_from("<IBBHQQ", cubin, offset + k * entsize)
            if info & 0xF == STT_FUNC and info >> 4 == STB_GLOBAL and shndx != 0 and other & STO_CUDA_ENTRY:
                start = strings + name
                out.add(cubin[start:cubin.index(b"\0", start)].decode())
    return out
