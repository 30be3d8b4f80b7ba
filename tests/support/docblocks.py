"""The code blocks of the README and the guides, and the tests that run them.

Every fenced block of a guide (:data:`GUIDES`) is preceded by a marker that says which test runs it:

- ``<!-- runnable -->`` (Python): executed as written on the CPU by ``tests/test_docs.py``; a
  ``prints`` block right after it is the stdout it must print;
- ``<!-- runnable: KIND -->`` (Python): executed in a namespace that ``KIND``'s test provides
  (``sglang``: stand-ins with SGLang's attribute names, ``tests/test_doc_engines.py``; ``gpu`` and
  ``sglang-gpu``: the GPU tier, ``tests/gpu/device/test_doc_blocks.py``);
- ``<!-- block: NAME -->`` (a command, a config, output): a test reads it with :func:`block` and
  checks it (``block("NAME")`` appears in that test's source).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDES = [ROOT / "README.md", ROOT / "docs" / "operators.md", ROOT / "docs" / "demo.md",
          *sorted((ROOT / "docs" / "engines").glob("*.md"))]
KINDS = {"sglang": "tests/test_doc_engines.py", "gpu": "tests/gpu/device/test_doc_blocks.py",
         "sglang-gpu": "tests/gpu/device/test_doc_blocks.py"}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
MARKER = re.compile(r"<!-- (runnable(?:: ([\w-]+))?|block: ([\w-]+)) -->\s*$")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int        # 1-based line of the opening fence
    lang: str
    code: str
    runnable: str | None   # "" for plain runnable, the KIND otherwise, None when not runnable
    name: str | None       # the NAME of a ``block:`` marker
    output: bool           # the "prints" block after a runnable one

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    """Every fenced block of ``doc`` with the marker on the line before it (if any)."""
    text = doc.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARKER.fullmatch(before.strip())
        prev_text = text[:m.start()].rstrip().rsplit("\n", 1)[-1].strip()
        out.append(Block(doc=doc, line=text.count("\n", 0, m.start()) + 1, lang=m.group(1), code=m.group(2).rstrip("\n"),
                         runnable=None if mark is None or not mark.group(1).startswith("runnable") else (mark.group(2) or ""),
                         name=None if mark is None else mark.group(3), output=prev_text == "prints"))
    return out


def all_blocks() -> list[Block]:
    return [b for doc in GUIDES for b in blocks(doc)]


def runnable(kind: str) -> list[Block]:
    """The Python blocks marked ``<!-- runnable: kind -->`` ("" for plain runnable), in guide order."""
    return [b for b in all_blocks() if b.runnable == kind]


def block(name: str) -> Block:
    """The block marked ``<!-- block: name -->`` (exactly one in the guides)."""
    found = [b for b in all_blocks() if b.name == name]
    assert len(found) == 1, f"expected one block named {name!r} in the guides, found {[b.where for b in found]}"
    return found[0]


def expected_output(b: Block) -> str | None:
    """The ``prints`` block right after runnable block ``b``, if any."""
    following = blocks(b.doc)
    i = following.index(b)
    return following[i + 1].code if i + 1 < len(following) and following[i + 1].output else None
