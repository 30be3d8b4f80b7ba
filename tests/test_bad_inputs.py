"""Bad inputs over the whole public API, as a table (issue 11, host validation contract).

Each row names one thing an engine (or a person) could hand kvcanary, a zero-argument callable that
does it on host numpy arrays, and the outcome the contract gives it:

- ``ERR`` (:class:`ValidationError`, a ValueError: the right kind of value, out of range) or ``TYPE``
  (:class:`ValidationTypeError`, a TypeError: the wrong kind of value), whose text starts with
  ``kv-canary:``, says what was got and ends with a fix ("Fix: ...");
- ``Report(reason)``: a value the kernels read from the engine's memory, which the contract reports
  (mode "raise": one :class:`CanaryViolationError` whose rows carry that fail reason), never raises
  as a Python error or lets crash;
- ``OK``: a legal spelling, accepted.

No row may end in anything else: a raw TypeError, AttributeError, KeyError, ZeroDivisionError,
IndexError, MemoryError or OSError from deep inside is the bug this table exists to catch. The
shared fixtures are in tests/support/bad_inputs.py; the command line's rows are at the end of this file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from kvcanary.errors import CanaryViolationError, ValidationError, ValidationTypeError
from tests.support import bad_inputs_engines  # noqa: F401  (adds its rows to ROWS)
from tests.support.bad_inputs import ERR, OK, ROWS, TYPE, Report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
_TEXT = re.compile(r"^kv-canary: .*\bgot\b.*\b[Ff]ix: \S")


def _check_error(err: BaseException, expected) -> None:
    other = ValidationTypeError if expected is ERR else ValidationError
    assert isinstance(err, expected) and not isinstance(err, other), \
        f"expected {expected.__name__}, got {type(err).__name__}: {err}"
    text = str(err)
    assert "\n" not in text, text
    assert _TEXT.match(text), f"not the house format (kv-canary: ... got ... Fix: ...): {text}"
    assert text.index("got") < max(text.rfind("Fix:"), text.rfind("fix:")), text


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("action,expected", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_input(action, expected):
    if expected is OK:
        action()
        return
    with pytest.raises(Exception) as info:
        action()
    err = info.value
    if isinstance(expected, Report):
        assert type(err) is CanaryViolationError, f"expected a report, got {type(err).__name__}: {err}"
        assert str(err).startswith("kv-canary: ") and err.violations, str(err)
        reasons = {label for v in err.violations for label in v.to_dict()["fail_reason"]}
        assert reasons & expected.reasons, f"expected one of {expected.reasons}, got {reasons}"
        return
    _check_error(err, expected)


def test_the_table_covers_every_outcome_and_entry_point():
    outcomes = {r[2] if not isinstance(r[2], Report) else "report" for r in ROWS}
    assert outcomes >= {ERR, TYPE, OK, "report"}
    areas = {r[0].split(".")[0] for r in ROWS}
    assert areas >= {"KvCanary", "PoolGroup", "step", "sweep", "ops", "state", "sources", "arrays",
                     "adapters", "metrics", "distributed"}
    assert len(ROWS) >= 300 and len({r[0] for r in ROWS}) == len(ROWS)


def test_named_messages_say_which_argument():
    """The message names the argument the caller wrote, not a helper's (issue 11's examples)."""
    from tests.support.bad_inputs import canary, pages_pool
    import kvcanary as kc
    with pytest.raises(ValidationError, match=r"^kv-canary: sweep_capacity must be .* got 0 "):
        canary(sweep_capacity=0)
    with pytest.raises(ValidationTypeError, match=r"^kv-canary: RealKvSource.page_size must be an integer"):
        kc.RealKvSource(np.zeros((4, 64), np.uint8), 1.5, 16)
    with pytest.raises(ValidationError, match=r"^kv-canary: page_size must be an integer in \[1, \d+\], got 0 "):
        kc.sources_from_pages(pages_pool(), page_size=0)
    canary(hash_mode="PARTIAL")  # the name in any case, like everywhere else


# ---- the command line: one kv-canary line on stderr, exit code 2, nothing on stdout ----------------
CLI = [
    (["demo", "--injections", "0"], "--injections"), (["demo", "--injections", "-1"], "--injections"),
    (["demo", "--injections", "abc"], "--injections"), (["demo", "--injections", "1.5"], "--injections"),
    (["demo", "--injections"], "--injections"), (["demo", "--clean-slots", "-5"], "--clean-slots"),
    (["demo", "--clean-slots", "many"], "--clean-slots"), (["demo", "--seed", "x"], "--seed"),
    (["demo", "--modes", "al"], "--modes"), (["demo", "--modes", ""], "--modes"),
    (["demo", "--modes", "partial,PARTIAL,x"], "--modes"), (["demo", "--classes", "K1,K99"], "--classes"),
    (["demo", "--classes", ","], "--classes"), (["demo", "--jobs", "-1"], "--jobs"),
    (["demo", "--jobs", "lots"], "--jobs"), (["demo", "--backend", "tpu"], "--backend"),
    (["demo", "--report", "warn"], "--report"), (["demo", "--progress", "maybe"], "--progress"),
    (["demo", "--out", "/proc/kvcanary-demo"], "--out"), (["demo", "--out", "/dev/null/x"], "--out"),
    (["demo", "--bogus"], "--bogus"), (["demo", "extra"], "extra"), ([], "command"), (["frobnicate"], "frobnicate"),
    (["doctor", "--bogus"], "--bogus"),
]


@pytest.mark.parametrize("argv,needle", CLI, ids=[" ".join(a) or "(none)" for a, _ in CLI])
def test_bad_command_line_is_one_kv_canary_line(capsys, argv, needle):
    from kvcanary.__main__ import main
    assert main(argv if argv[:1] != ["demo"] else ["demo", "--backend", "cpu", *argv[1:]], prog="kvcanary") == 2
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()
    prefix = f"kvcanary {argv[0]}: error: " if argv[:1] in (["demo"], ["doctor"]) else "kvcanary: error: "
    assert line.startswith(prefix + "kv-canary: ") and needle in line, line
    assert _TEXT.match(line[len(prefix):]), line


def test_bad_command_line_in_a_process_has_no_traceback():
    for argv in (["demo", "--backend", "tpu"], ["demo", "--injections", "x"], ["demo", "--out", "/proc/x/y"]):
        p = subprocess.run([sys.executable, "-m", "kvcanary", *argv], capture_output=True, text=True, timeout=120,
                           cwd=ROOT, env=ENV)
        assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr, p.stderr
        (line,) = p.stderr.splitlines()
        assert line.startswith("python -m kvcanary demo: error: kv-canary: ") and "Fix: " in line, line
