"""The ABI really once (issue 12.3): no kvcanary number is typed into a kernel source.

Every format, ABI or tuning value the device code uses (a sentinel, a field index, a tile or piece
size, a block count, a mask, a shift) is declared in kvcanary/abi.py and reaches the kernels as a
KVC_* name of the generated prelude kvcanary_abi.cuh. This test reads every file of kernels_src/
(*.cu, *.cuh), drops comments, string and character literals, and lists every integer literal left
in the code (hex like 0x7FFFFFFF, suffixes like 1ULL, a negative number such as -1 taken as its
value) whose value is not in the small allow-list below. A failure names file:line:literal; the fix
is a constant in abi.py (emitted by abi.constants()) used by its KVC_ name, not a new allow-list
entry.
"""

from __future__ import annotations

import re

from kvcanary.runtime import nvrtc_build as kc_compile

# ---- the allow-list ------------------------------------------------------------------------------
# Numbers that are not kvcanary's: arithmetic identities and CUDA's warp. The warp size is CUDA's
# constant (NVRTC's warpSize is not a constant expression), and the kernels use it, its lane mask and
# its log2 in some forty places (lanes of a warp, warps of a block, tile strides), so it is typed.
ALLOWED: dict[int, str] = {
    0: "zero: empty sums and counts, the first index, a null pointer, false",
    1: "one: increments, the neighbouring entry (e - 1, e + 1), a bit test, round-up (n + d - 1) / d",
    2: "two: halving and doubling, the two halves (.x, .y) of a 16-byte vector, the entry two back",
    31: "warp size - 1, a CUDA constant: the lane mask (threadIdx.x & 31), the last lane, round up to warps",
    32: "warp size, a CUDA constant: the lanes of a warp, a warp's share of a tile, warps per block (n / 32)",
}
# Allowed only as the right operand of >> (or >>=): nowhere else does it mean the warp.
ALLOWED_SHIFTS: dict[int, str] = {
    5: "log2 of the warp size, a CUDA constant: x >> 5 is x / 32 (the warp of thread x)",
}

# ---- write.cu: the write kernel's own layout ---------------------------------------------------------
# The write kernel's warp roles (warp 0 chains, warp 4 idles, six worker warps), its pipeline depth
# (three chunks in flight, two chain buffers) and its unrolls: numbers of this kernel's design that
# nothing outside it mirrors (no Python code, no other kernel, no format), so they stay beside the
# code they shape. Each entry is (file, the literal as written, the line's code with comments and
# strings blanked and whitespace collapsed): it allows every occurrence of that literal on that line,
# wherever the line is. An entry that no longer matches fails (test_write_cu_entries_are_not_stale).
WRITE_KERNEL_LAYOUT: dict[tuple[str, str, str], str] = {
    ("write.cu", "256", 'static_assert(KVC_BLOCK_THREADS == 256, );'):
        "the write kernel's block (8 warps): KVC_BLOCK_THREADS itself, or its warps",
    ("write.cu", "192", "#define KVC_WRITE_WORKERS 192"):
        "worker threads of a write block (6 warps): tuning, derive from the block's warps",
    ("write.cu", "-1", "return (warp == 0 || warp == 4) ? -1 : tid - (warp < 4 ? 32 : 64);"):
        "no worker index (the chain warp and the idle warp)",
    ("write.cu", "4", "return (warp == 0 || warp == 4) ? -1 : tid - (warp < 4 ? 32 : 64);"):
        "the idle warp (warp 4: it shares warp 0's scheduler)",
    ("write.cu", "64", "return (warp == 0 || warp == 4) ? -1 : tid - (warp < 4 ? 32 : 64);"):
        "threads of the two non-worker warps before warps 5-7",
    ("write.cu", "4", "#pragma unroll 4"):
        "unroll of the serial chain loop: tuning",
    ("write.cu", "8", "#pragma unroll 8"):
        "unroll of the repeated-slot scan: tuning",
    ("write.cu", "3", "KvcWriteStage stage[3];"):
        "chunks in flight (chained, stored, loaded): tuning",
    ("write.cu", "3", "kvc_write_chain(p, sh.stage[k % 3], n, sh.chain[k & 1], running, running_pos);"):
        "chunks in flight",
    ("write.cu", "3", "stamped += kvc_write_store(p, r, sh.stage[(k - 1) % 3], sh.chain[(k - 1) & 1], prev_base, n, worker,"):
        "chunks in flight",
    ("write.cu", "3", "if (k + 1 < chunks) kvc_write_load(p, sh.stage[(k + 1) % 3], base + KVC_WRITE_CHUNK, end, worker);"):
        "chunks in flight",
}

# ---- the scanner ----------------------------------------------------------------------------------
_PP_NUMBER = re.compile(r"(?<![\w.])\.?\d(?:[eEpP][+-]|[\w.])*")  # C's preprocessing-number
_INTEGER = re.compile(r"(0[xX][0-9a-fA-F]+|0[bB][01]+|\d+)(?:[uU](?:ll|LL|l|L)?|(?:ll|LL|l|L)[uU]?)?")
_TYPE_WORDS = {"const", "volatile", "unsigned", "signed", "long", "short", "int", "char", "bool", "float",
               "double", "size_t", "int8_t", "int16_t", "int32_t", "int64_t", "uint8_t", "uint16_t",
               "uint32_t", "uint64_t"}
_UNARY_AFTER_WORDS = {"return", "case"}


def strip_comments_and_strings(text: str) -> str:
    """``text`` with comments, string and character literals blanked (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif text[i] in "\"'":
            j = i + 1
            while j < n and text[j] != text[i] and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j += 1
        else:
            out.append(text[i])
            i += 1
            continue
        out.append(re.sub(r"[^\n]", " ", text[i:j]))
        i = j
    return "".join(out)


def _is_cast(code: str, close: int) -> bool:
    """Whether the ")" at ``close`` ends a cast to a C integer/float type, as in (long long)-1."""
    depth, j = 0, close
    while j >= 0:
        depth += {")": 1, "(": -1}.get(code[j], 0)
        if depth == 0:
            break
        j -= 1
    inner = code[j + 1:close]
    return j >= 0 and re.fullmatch(r"[\w\s*]+", inner) is not None and set(re.findall(r"\w+", inner)) <= _TYPE_WORDS


def _negated(code: str, start: int) -> bool:
    """Whether the number at ``start`` is the operand of a unary minus."""
    j = start - 1
    while j >= 0 and code[j] in " \t":
        j -= 1
    if j < 0 or code[j] != "-" or (j > 0 and code[j - 1] in "-+"):
        return False
    k = j - 1
    while k >= 0 and code[k].isspace():
        k -= 1
    if k < 0:
        return True
    if code[k].isalnum() or code[k] == "_":
        word = re.search(r"\w+$", code[:k + 1]).group(0)
        return word in _UNARY_AFTER_WORDS
    if code[k] == ")":
        return _is_cast(code, k)
    return code[k] != "]"


def literals(text: str) -> list[tuple[int, str, int | float | str, str, int]]:
    """(line, spelling, value, the line's code, column) of every number in the code of ``text``."""
    code = strip_comments_and_strings(text)
    starts = [0] + [m.end() for m in re.finditer("\n", code)]
    lines = code.split("\n")
    found = []
    for m in _PP_NUMBER.finditer(code):
        spelling, start = m.group(0), m.start()
        integer = _INTEGER.fullmatch(spelling)
        if integer:
            digits = integer.group(1)
            value: int | float | str = int(digits, 8) if re.fullmatch(r"0\d+", digits) else int(digits, 0)
        else:  # a floating literal (the kernels have none) or a malformed number: never allowed
            try:
                value = float(spelling.rstrip("fFlL"))
            except ValueError:
                value = spelling
        if isinstance(value, int) and _negated(code, start):
            minus = code.rindex("-", 0, start)
            spelling, value, start = code[minus:m.end()].replace(" ", ""), -value, minus
        line = next(i for i in range(len(starts) - 1, -1, -1) if starts[i] <= start)
        found.append((line + 1, spelling, value, lines[line], start - starts[line]))
    return found


def _shift_operand(code_line: str, column: int) -> bool:
    return re.search(r">>=?\s*$", code_line[:column]) is not None


def _normal(code_line: str) -> str:
    return " ".join(code_line.split())


def offenders(sources: dict[str, str]) -> tuple[list[str], set[tuple[str, str, str]]]:
    """``file:line:literal`` of every literal not allowed, and the WRITE_KERNEL_LAYOUT keys used."""
    bad, used = [], set()
    for name, text in sources.items():
        for line, spelling, value, code_line, column in literals(text):
            if isinstance(value, int) and value in ALLOWED:
                continue
            if isinstance(value, int) and value in ALLOWED_SHIFTS and _shift_operand(code_line, column):
                continue
            key = (name, spelling, _normal(code_line))
            if key in WRITE_KERNEL_LAYOUT:
                used.add(key)
                continue
            bad.append(f"kernels_src/{name}:{line}:{spelling}")
    return bad, used


# ---- the tests ------------------------------------------------------------------------------------
def test_no_number_is_typed_into_a_kernel_source():
    bad, _ = offenders(kc_compile.read_sources())
    assert not bad, (
        "kv-canary: integer literals in kernels_src that are not arithmetic identities or the warp "
        "size; declare each in kvcanary/abi.py (abi.constants() emits it into kvcanary_abi.cuh) and "
        "use its KVC_ name:\n  " + "\n  ".join(bad))


def test_write_cu_entries_are_not_stale():
    _, used = offenders(kc_compile.read_sources())
    stale = sorted(set(WRITE_KERNEL_LAYOUT) - used)
    assert not stale, "kv-canary: WRITE_KERNEL_LAYOUT entries that match no literal (moved? delete them):\n  " + \
        "\n  ".join(f"{f}: {lit!r} in {line!r}" for f, lit, line in stale)


def test_every_scanned_file_is_a_kernel_source():
    sources = kc_compile.read_sources()
    assert {"common.cuh", "fingerprint.cuh", "verify.cu", "write.cu", "plan.cu"} <= set(sources)
    assert all(name.endswith((".cu", ".cuh")) for name in sources)


def test_int_constants_are_emitted_as_int():
    """The constants the kernels use in int arithmetic are ints in the prelude (32-bit code)."""
    from kvcanary import abi
    text = abi.render_prelude()
    assert abi.INT_CONSTANTS <= set(abi.constants())
    for name in abi.INT_CONSTANTS:
        assert f"#define {name} ((int){abi.constants()[name]}LL)" in text, name
    assert "#define KVC_SOURCE_BATCH ((long long)8LL)" in text  # the others stay long long


def test_scanner_reads_literals_as_c_does():
    text = "\n".join([
        '#include "kvcanary_abi.cuh"  // 11 in a comment',
        "x = 0x7FFFFFFF + 1ULL; /* 12",
        "   13 */ y = -1; z = a - 3; w = f(-4, (long long)-5, (n)-6, v[7]-8);",
        'const char* s = "14 and \\" 15"; c = \'9\'; k = sm_80 + i0 + ulonglong2 + KVC_SM_SHIFT1;',
        "return -16; t = x >> 5; u = x * 5; q = 017 + 0b11 + 2.5f;",
    ])
    got = [(line, spelling, value) for line, spelling, value, _, _ in literals(text)]
    assert got == [
        (2, "0x7FFFFFFF", 0x7FFFFFFF), (2, "1ULL", 1),
        (3, "-1", -1), (3, "3", 3), (3, "-4", -4), (3, "-5", -5), (3, "6", 6), (3, "7", 7), (3, "8", 8),
        (5, "-16", -16), (5, "5", 5), (5, "5", 5), (5, "017", 15), (5, "0b11", 3), (5, "2.5f", 2.5),
    ]
    bad, _ = offenders({"x.cu": text})
    assert bad == ["kernels_src/x.cu:2:0x7FFFFFFF", "kernels_src/x.cu:3:-1", "kernels_src/x.cu:3:3",
                   "kernels_src/x.cu:3:-4", "kernels_src/x.cu:3:-5", "kernels_src/x.cu:3:6",
                   "kernels_src/x.cu:3:7", "kernels_src/x.cu:3:8", "kernels_src/x.cu:5:-16",
                   "kernels_src/x.cu:5:5", "kernels_src/x.cu:5:017", "kernels_src/x.cu:5:0b11",
                   "kernels_src/x.cu:5:2.5f"]  # the 5 of x >> 5 is the warp's shift; the 5 of x * 5 is not


def test_a_stray_literal_in_a_kernel_is_reported():
    sources = dict(kc_compile.read_sources())
    lines = sources["verify.cu"].count("\n")
    sources["verify.cu"] += "__device__ const int kvc_stray = 96;  // a tile size typed in\n"
    sources["common.cuh"] = sources["common.cuh"].replace("KVC_CHAIN_HEAD;", "-1;", 1)
    bad, _ = offenders(sources)
    assert f"kernels_src/verify.cu:{lines + 1}:96" in bad
    assert any(b.startswith("kernels_src/common.cuh:") and b.endswith(":-1") for b in bad)
    assert len(bad) == 2
