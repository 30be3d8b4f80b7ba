"""kvcanary/runtime/ points one way (STYLE.md 7): each module imports only the modules below it in
:data:`ORDER`, so a reader of one file knows what it may use, and no import circle exists.

Every import counts: module level, inside a function (a lazy import is still a dependency, only a
later one), and under ``if TYPE_CHECKING:`` (an annotation names what a module works with as much
as a call does, and ``typing.get_type_hints`` makes it a real import; none is needed to keep the
order, so none is exempt). Read with ``ast``, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvcanary"
RUNTIME = PACKAGE / "runtime"

# Bottom to top. The driver side: the cuda.bindings driver, init, check and each device's primary
# context; the compile side: the cubin cache, one NVRTC program, its parallel compile, the kernel
# families' build. Above both: a device's kernel library, the device runtime that launches, the
# packed launches, device memory, the choice of a stream.
ORDER = ("driver", "cubin_cache", "nvrtc_program", "parallel_compile", "nvrtc_build", "kernel_library",
         "devices", "launch", "memory", "streams")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """Every kvcanary module ``path`` imports (anywhere in the file), with the first line doing so.
    ``from pkg import name`` is the submodule pkg.name when one exists, else pkg itself."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        if target in modules and target != name:
            found.setdefault(target, line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:  # import a.b.c: a.b.c (its packages' __init__ are not counted)
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in modules else base, node.lineno)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and getattr(node.func, "attr", getattr(node.func, "id", "")) \
                in ("import_module", "__import__"):
            add(node.args[0].value, node.lineno)
    return found


def _graph() -> tuple[dict[str, Path], dict[str, dict[str, int]]]:
    modules = _modules()
    return modules, {m: _imports(p, modules) for m, p in modules.items()}


def _cycles(graph: dict[str, dict[str, int]], within: set[str]) -> list[list[str]]:
    """The strongly connected components of ``graph`` (modules that import each other, directly
    or not) with more than one module, one of them in ``within`` (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 and within & set(component):
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [sorted(c) for c in components]


def _path_around(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest import path from the component's first module back to itself."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return paths[v] + [start]
                if w in members and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return component


def _describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    """A shortest circle of ``component``, then every import between its modules."""
    members = set(component)
    steps = [f"{a} (line {line}) imports {b}" for a in sorted(members) for b, line in sorted(graph[a].items())
             if b in members]
    return "import circle: " + " -> ".join(_path_around(graph, component)) + "\n    " + "\n    ".join(steps)


def test_every_runtime_module_has_a_place_in_the_order():
    files = sorted(p.stem for p in RUNTIME.glob("*.py") if p.stem != "__init__")
    assert sorted(ORDER) == files, ("expected ORDER to name every module of kvcanary/runtime/ once, got "
                                    f"ORDER={sorted(ORDER)} for the files {files}. Fix: place a new module in ORDER "
                                    f"(tests/test_layering.py) below everything that imports it")


def test_the_runtime_package_file_imports_no_runtime_module():
    modules, graph = _graph()
    inside = sorted(m for m in graph["kvcanary.runtime"] if m.startswith("kvcanary.runtime."))
    assert inside == [], f"expected kvcanary/runtime/__init__.py to import nothing of the runtime, got {inside}"


def test_no_import_circle_goes_through_the_runtime():
    """Catches driver -> kernel_library -> driver and nvrtc_build -> parallel_compile -> nvrtc_build
    (issue 45), also when a circle leaves the runtime and comes back (through ops, interop, ...)."""
    modules, graph = _graph()
    runtime = {m for m in modules if m.startswith("kvcanary.runtime")}
    cycles = _cycles(graph, runtime)
    assert not cycles, "expected no import circle through kvcanary/runtime/, got:\n" + "\n".join(
        _describe(c, graph) for c in cycles)


def test_each_runtime_module_imports_only_modules_below_it():
    modules, graph = _graph()
    rank = {f"kvcanary.runtime.{m}": i for i, m in enumerate(ORDER)}
    upward = []
    for m in sorted(rank):
        for target, line in sorted(graph.get(m, {}).items()):
            if target in rank and rank[target] >= rank[m]:
                upward.append(f"{m.rpartition('.')[2]} (line {line}) imports {target.rpartition('.')[2]}, "
                              f"which is not below it")
    assert not upward, (f"expected each module of kvcanary/runtime/ to import only modules below it in "
                        f"{' < '.join(ORDER)}, got:\n    " + "\n    ".join(upward)
                        + "\nFix: move what both need into the lower module, or hand it in from above")


def test_the_runtime_imports_nothing_above_it_in_kvcanary():
    """The runtime sits under the ops, the adapters and the manager: outside itself it may use only
    the ABI, the errors, the version and the array interop (which import no runtime module)."""
    allowed = {"kvcanary.abi", "kvcanary.errors", "kvcanary._version", "kvcanary.interop.arrays",
               "kvcanary.interop.dlpack"}
    modules, graph = _graph()
    got = sorted(f"{m} (line {line}) imports {t}" for m in graph if m.startswith("kvcanary.runtime")
                 for t, line in graph[m].items() if not t.startswith("kvcanary.runtime") and t not in allowed)
    assert not got, "expected the runtime to import only " + ", ".join(sorted(allowed)) + " outside itself, got:\n    " \
        + "\n    ".join(got)
