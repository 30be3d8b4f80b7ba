"""The documentation keeps working when copied: README.md and docs/*.md code blocks marked
``<!-- runnable -->`` run as written (CPU, numpy only); links resolve; docs/format.md names every
ABI enum value, fail-reason bit, launch tag and stats() key the code has; docs/faults.md follows
the campaign's coverage table; every "docs/format.md §N" / "format.md §N" cited in the code is a section."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from pathlib import Path

import pytest

from kvcanary import abi
from kvcanary.cli import demo
from kvcanary.reporting.violations import Violation
from kvcanary.sim.faults import CLASSES, MODES, TITLES, coverage
from tests.support import docblocks

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FORMAT = (ROOT / "docs" / "format.md").read_text()
FAULTS = (ROOT / "docs" / "faults.md").read_text()
# a block marked runnable, and optionally the output the text says it prints
RUNNABLE = re.compile(r"<!-- runnable -->\s*\n```python\n(.*?)\n```(?:\s*\nprints\s*\n```\n(.*?)\n```)?", re.S)


def _blocks() -> list:
    return [pytest.param(m.group(1), m.group(2), id=f"{doc.relative_to(ROOT)}#{k}")
            for doc in DOCS for k, m in enumerate(RUNNABLE.finditer(doc.read_text()))]


def _section(text: str, heading: str) -> str:
    """The body of the section whose heading line starts with ``heading``."""
    start = text.index("\n" + heading) + 1
    level = heading.split(" ")[0]
    end = text.find("\n" + level + " ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_there_are_runnable_blocks():
    ids = [p.id for p in _blocks()]
    assert any(i.startswith("README.md") for i in ids) and any(i.startswith("docs/format.md") for i in ids), ids


@pytest.mark.parametrize("code,prints", _blocks())
def test_runnable_block_runs_as_written(code, prints, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<doc block>", "exec"), {"__name__": "__doc_block__"})
    if prints is not None:
        assert out.getvalue().strip() == prints.strip()


def test_readme_example_stats_keys_are_documented(tmp_path, monkeypatch):
    readme_example = next(m.group(1) for m in RUNNABLE.finditer((ROOT / "README.md").read_text())
                          if "KvCanary(" in m.group(1))  # the first: "Using it from a serving engine"
    scope: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(readme_example, "<README example>", "exec"), scope)
    table = _section(FORMAT, "### 10.5")
    documented = set(re.findall(r"^\| `(\w+)` \|", table, re.M))
    assert set(scope["canary"].stats()) <= documented, set(scope["canary"].stats()) - documented
    contract = {"step", "protected_tokens", "verified_slots", "violations", "violations_recorded", "ring_overflow",
                "skipped_verifies", "unattributed", "export_errors", "steps_behind", "snapshots_skipped"}
    assert contract <= documented, contract - documented


def test_links_resolve():
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name}: broken link {target}"
        assert "FAULTS.md" not in doc.read_text() and "SPEC.md" not in doc.read_text(), doc.name


def test_format_sections_are_numbered_like_the_spec():
    numbers = [int(n) for n in re.findall(r"^## (\d+)\. ", FORMAT, re.M)]
    # §1-§10 follow the spec's sections; kvcanary's own (§11 self-test) come after them, in order
    assert numbers[:10] == list(range(1, 11)) and numbers == list(range(1, len(numbers) + 1)), numbers


def test_every_section_the_code_cites_exists():
    headings = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)[. ]", FORMAT, re.M))
    cited = {}
    for folder, pattern in (("kvcanary", "*.py"), ("kernels_src", "*"), ("tests", "*.py"), ("perf", "*.py")):
        for path in (ROOT / folder).rglob(pattern):
            if path.is_file():
                for n in re.findall(r"(?:SPEC|format\.md) §(\d+(?:\.\d+)?)", path.read_text(errors="replace")):
                    cited.setdefault(n, path.relative_to(ROOT))
    assert cited, "no citations found"
    missing = {n: str(p) for n, p in cited.items() if n not in headings}
    assert not missing, missing


def test_every_fail_reason_bit_is_documented():
    table = _section(FORMAT, "### 5.3")
    for bit in abi.FailReason:
        label = bit.name.lower().removesuffix("_mismatch")
        assert re.search(rf"^\| {int(bit)} \| `{bit.name}` \(`{label}`\) \|", table, re.M), bit.name
    documented = {int(b) for b in re.findall(r"^\| (\d+) \| `", table, re.M)}
    # the extension bits of the contract being implemented (128, 256) may be documented first
    assert documented <= {int(b) for b in abi.FailReason} | {128, 256}, documented


def test_every_batch_field_code_is_documented():
    fields = getattr(abi, "BatchField", None)  # the field codes of BATCH_INDEX_OUT_OF_RANGE rows
    table = _section(FORMAT, "### 5.4")
    if fields is None:
        pytest.skip("kvcanary.abi has no BatchField yet")
    for f in fields:
        assert re.search(rf"^\| {int(f)} \| `{f.name}` \|", table, re.M), f.name


def test_every_launch_tag_and_ring_column_is_documented():
    tags = _section(FORMAT, "### 5.5")
    for tag in abi.LaunchTag:
        assert f"`{tag.name} {int(tag)}`" in tags, tag.name
    cols = _section(FORMAT, "### 5.2")
    for name in ("KERNEL_KIND", "SLOT_IDX", "POSITION", "STORED_TOKEN", "EXPECTED_TOKEN", "STORED_CHAIN_HASH",
                 "EXPECTED_AUX", "FAIL_REASON_BITS"):
        assert f"| {getattr(abi, 'COL_' + name)} | `{name}` |" in cols, name
    fields = _section(FORMAT, "## 2.")
    for name in ("TOKEN", "POSITION", "PREV_HASH", "REAL_KV_HASH"):
        assert f"| `{name}` | {getattr(abi, 'FIELD_' + name)} |" in fields, name


@pytest.mark.parametrize("where", ["format.md", "operators.md"])
def test_the_documented_log_line_is_what_kvcanary_prints(where):
    text = _section(FORMAT, "### 10.2") if where == "format.md" else docblocks.block("log-line").code
    (line,) = re.findall(r"^kv_canary violation: .*$", text, re.M)
    f = dict(kv.split("=", 1) for kv in line.removeprefix("kv_canary violation: ").split(" "))
    labels = {b.name.lower().removesuffix("_mismatch"): int(b) for b in abi.FailReason}
    bits = sum(labels[x] for x in f["fail_reason"].split("+"))
    row = [abi.LaunchTag[f["launch_tag"]], int(f["slot_idx"]), int(f["position"]), int(f["stored_token"]),
           int(f["expected_token"]), int(f["stored_chain_hash"], 16), int(f["expected_aux"], 16), bits]
    assert str(Violation.from_row(row)) == line


def test_faults_doc_follows_the_coverage_table():
    for c in CLASSES:
        assert f"### {c} — " in FAULTS, c
    rows = dict(re.findall(r"^\| (K\d+b?) [^|]+\|(.*)\|$", _section(FAULTS, "## Coverage"), re.M))
    assert list(rows) == list(CLASSES)
    for c in CLASSES:
        cells = [x.strip() for x in rows[c].split("|")]
        assert len(cells) == len(MODES)
        for m, cell in zip(MODES, cells):
            assert (cell == "not covered") == (not coverage(c, m)[0]), (c, m, cell)
        assert f"| {c} {TITLES[c]} |" in FAULTS, c


def test_readme_demo_flags_exist():
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    options = {o for a in parser._actions for o in a.option_strings}
    text = (ROOT / "docs" / "demo.md").read_text() + FAULTS
    named = set(re.findall(r"(--[a-z][a-z-]+)", text))
    assert named - {"--help", "--version"} <= options, named - options
    for flag in ("--injections", "--classes", "--modes", "--backend", "--out", "--clean-slots", "--jobs"):
        assert flag in named, flag


@pytest.mark.skipif(not (ROOT / "docs" / "pypi.md").exists(), reason="no PyPI description")
def test_pypi_description_has_no_developer_setup():
    text = (ROOT / "docs" / "pypi.md").read_text()
    assert "pip install kvcanary" in text
    assert "pip install -e" not in text and ".venv" not in text and ".ci/" not in text
    assert "](docs/" not in text and "](../" not in text     # relative links break on PyPI


def test_every_code_block_of_the_guides_is_run_by_a_test():
    """Catches a code block in the README or a guide that no test runs: each carries a marker naming
    how it is run (tests/support/docblocks.py), and a named block is read by a test that names it."""
    sources = "\n".join(p.read_text() for p in [*(ROOT / "tests").rglob("test_*.py")])
    unmarked, unknown, unread = [], [], []
    for b in docblocks.all_blocks():
        if b.output:
            continue
        if b.runnable is None and b.name is None:
            unmarked.append(b.where)
        elif b.runnable and b.runnable not in docblocks.KINDS:
            unknown.append(f"{b.where} ({b.runnable})")
        elif b.name is not None and f'block("{b.name}")' not in sources:
            unread.append(f"{b.where} ({b.name})")
    assert not unmarked and not unknown and not unread, dict(unmarked=unmarked, unknown=unknown, unread=unread)
    for kind, test in docblocks.KINDS.items():
        assert f'runnable("{kind}")' in (ROOT / test).read_text(), (kind, test)


def test_the_readme_is_a_front_door():
    """README.md stays a map: at most 250 lines, and it links every guide."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for guide in docblocks.GUIDES[1:]:
        assert f"]({guide.relative_to(ROOT)})" in readme, guide.name


def test_the_readmes_commands_are_what_ci_and_a_new_user_run():
    """The test command is .ci/run's, and the set-up command makes the same venv, installs the
    package and runs the demo, whose command line the CLI accepts."""
    ci = (ROOT / ".ci" / "run").read_text()
    tests = docblocks.block("tests").code
    assert tests in ci.splitlines(), "the README's test command is not the line .ci/run runs"
    setup = docblocks.block("setup").code
    venv = "python3 -m venv .venv && . .venv/bin/activate && "
    assert setup == venv + "pip install -e . && python -m kvcanary demo" and tests.startswith(venv)


def test_the_readmes_main_job_runs(tmp_path):
    """The set-up command's job, as a new user runs it after the install: the default demo exits 0
    (every exercised injection caught, no false positive). The install half is .ci/run's."""
    import subprocess
    import sys
    job = docblocks.block("setup").code.rsplit(" && ", 1)[1]
    assert job == "python -m kvcanary demo"
    done = subprocess.run([sys.executable, *job.split()[1:]], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-2000:])
    assert "result: every exercised injection of a covered class was caught; no false positives" in done.stdout


def test_the_demo_guides_commands_run(tmp_path):
    """docs/demo.md's example commands run as written and exit 0 (every injection caught)."""
    import subprocess
    import sys
    lines = [line.split("#")[0].strip() for line in docblocks.block("demo-examples").code.splitlines()]
    for line in filter(None, lines):
        argv = line.split()
        assert argv[:3] == ["python", "-m", "kvcanary"], line
        done = subprocess.run([sys.executable, *argv[1:], "--backend", "cpu", "--progress", "off"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (line, done.stdout[-2000:], done.stderr[-2000:])
    assert list((tmp_path / "demo-out").glob("*.json")), "the --out example wrote no JSON"


def test_the_install_extra_is_the_range_the_adapter_supports():
    """docs/engines/transformers.md's install line names an extra whose transformers range is the
    adapter's own."""
    import tomllib

    from kvcanary.adapters import transformers_layout
    line = docblocks.block("transformers-install").code
    extra = re.fullmatch(r"pip install 'kvcanary\[(\w+)\]'", line).group(1)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][extra]
    spec = next(d for d in deps if d.startswith("transformers"))
    assert spec == "transformers" + transformers_layout.SUPPORTED_TRANSFORMERS, spec


def test_no_text_cites_the_old_spec_name():
    """Catches references to the old spec name: the behaviour contract is docs/format.md, cited as
    "docs/format.md §N"."""
    old = "SPEC" + " §"
    stale = [f"{p.relative_to(ROOT)}:{i}" for p in [*DOCS, ROOT / "CHANGELOG.md", *ROOT.glob("kvcanary/**/*.py"),
                                                    *ROOT.glob("tests/**/*.py"), *ROOT.glob("kernels_src/*")]
             for i, line in enumerate(p.read_text().splitlines(), 1) if old in line]
    assert stale == []
