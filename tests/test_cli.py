"""The command line as a new user meets it: the name it was started by, --version, and bad flags
that end in one kv-canary line on stderr (exit 2), never a traceback or a reported success."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import kvcanary
from kvcanary.__main__ import main, prog_name
from kvcanary.runtime import driver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=ENV)


def test_help_names_the_command_the_user_typed(tmp_path):
    p = _run("-m", "kvcanary", "--help")
    assert p.returncode == 0 and p.stdout.startswith("usage: python -m kvcanary "), p.stdout + p.stderr
    # what pip's console-script wrapper does: a file named kvcanary that calls main()
    script = tmp_path / "kvcanary"
    script.write_text("import sys\nfrom kvcanary.__main__ import main\nsys.exit(main())\n")
    p = _run(str(script), "demo", "--help")
    assert p.returncode == 0 and p.stdout.startswith("usage: kvcanary demo "), p.stdout + p.stderr
    assert "python -m" not in p.stdout


@pytest.mark.parametrize("argv0,prog", [("/venv/bin/kvcanary", "kvcanary"), (r"C:\venv\Scripts\kvcanary.exe", "kvcanary"),
                                        ("/src/kvcanary/__main__.py", "python -m kvcanary"), ("-c", "python -m kvcanary")])
def test_prog_name(argv0, prog):
    if "\\" in argv0 and os.sep != "\\":
        argv0 = argv0.replace("\\", "/")
    assert prog_name(argv0) == prog


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"], prog="kvcanary")
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvcanary {kvcanary.__version__} (canary format v1)"


@pytest.mark.parametrize("flags,needle", [
    (["--injections", "0"], "--injections must be >= 1, got 0"),
    (["--injections", "-1"], "--injections must be >= 1, got -1"),
    (["--clean-slots", "-5"], "--clean-slots must be >= 0, got -5"),
    (["--modes", "al"], "--modes takes a comma-separated list of none, partial, all"),
    (["--modes", ""], "--modes takes"),
    (["--classes", "K1,K99"], "unknown 'K99'"),
    (["--jobs", "-1"], "--jobs expects a worker count >= 0, got -1"),
    (["--jobs", "lots"], "--jobs expects auto or a worker count"),
])
def test_bad_demo_flags_are_one_kv_canary_line(capsys, flags, needle):
    assert main(["demo", "--backend", "cpu", *flags], prog="kvcanary") == 2
    out, err = capsys.readouterr()
    assert out == ""                                   # nothing ran, nothing was reported
    (line,) = err.splitlines()
    assert line.startswith("kvcanary demo: error: kv-canary: ") and needle in line and "Fix: " in line, line


@pytest.mark.parametrize("argv,start", [(["demo", "--bogus"], "kvcanary demo: error: kv-canary: expected the commands "
                                         "and flags --help lists, got: unrecognized arguments: --bogus. Fix: run "
                                         "`kvcanary demo --help`"),
                                         (["bogus"], "kvcanary: error: kv-canary: expected the commands and flags "
                                                     "--help lists, got: argument")])
def test_an_unknown_flag_or_command_is_one_line_that_names_it_once(capsys, argv, start):
    """Catches "kvcanary: error: kv-canary: kvcanary needs valid arguments" (the program named twice,
    the complaint named last)."""
    assert main(argv, prog="kvcanary") == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(start) and "needs valid arguments" not in line, line


def test_every_demo_flag_has_help_and_the_readme_lists_it(capsys):
    """Catches --progress without help text and docs/demo.md flags that drifted from the parser."""
    from pathlib import Path
    with pytest.raises(SystemExit):
        main(["demo", "--help"], prog="kvcanary")
    text = capsys.readouterr().out
    readme = (Path(__file__).resolve().parents[1] / "docs" / "demo.md").read_text()
    flags = sorted({f for f in re.findall(r"(--[a-z][a-z-]+)", text) if f != "--help"})
    assert "--progress" in flags and "--report" in flags
    for flag in flags:
        entry = text[text.index("  " + flag):].split("\n  --")[0]
        assert len(entry.split(maxsplit=2)) == 3, f"{flag} has no help text: {entry!r}"
        assert f"`{flag}" in readme, f"docs/demo.md lacks the demo flag {flag}"


@pytest.mark.skipif(driver.unavailable_reason() is None, reason="a GPU answers here")
def test_backend_gpu_without_a_gpu_is_one_line_not_a_traceback():
    p = _run("-m", "kvcanary", "demo", "--backend", "gpu", "--injections", "1", "--classes", "K3",
             "--clean-slots", "0")
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    (line,) = p.stderr.splitlines()
    assert line.startswith("python -m kvcanary demo: error: kv-canary: --backend gpu needs a CUDA GPU, got none")
    assert line.endswith("or --backend auto to use a GPU when one answers")


def test_backend_gpu_with_a_driver_but_no_device(monkeypatch, capsys):
    monkeypatch.setattr(driver, "device_count", lambda: 0)
    assert main(["demo", "--backend", "gpu", "--clean-slots", "0"], prog="kvcanary") == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "--backend gpu needs a CUDA GPU, got none: the CUDA driver reports 0 devices. Fix: --backend cpu" in line
