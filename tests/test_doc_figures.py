"""The measured figures of the README and the guides cannot drift from the committed results: every
figures region is what perf/doc_figures.py writes from perf/results-h200.json and the committed
campaign, and no measured figure (µs, ms, %, a ratio) is typed by hand outside a region."""

from __future__ import annotations

import copy
import re

from perf import doc_figures
from tests.support.docblocks import GUIDES, ROOT

# a number with a unit of time, a percentage or a ratio ("1.03x", "0.98-1.02×")
FIGURE = re.compile(r"\d(?:\.\d+)?\s?(?:µs|ms|%)|\d\.\d+\s?[x×](?![\w])")


def test_every_region_is_what_the_committed_results_give():
    assert doc_figures.stale() == [], "run: python perf/doc_figures.py"


def test_every_region_has_a_writer_and_the_guides_use_them():
    rows, campaign = doc_figures.sources()
    names = [m.group(2) for p in doc_figures.documents() for m in doc_figures.REGION.finditer(p.read_text())]
    assert set(names) <= set(doc_figures.FIGURES) and {"model-step", "transformers"} <= set(names), names
    for name in names:
        assert doc_figures.FIGURES[name](rows, campaign), name


def test_a_changed_result_changes_the_text():
    """The check can fail: a committed row that measured otherwise gives other text."""
    rows, campaign = doc_figures.sources()
    readme = (ROOT / "README.md").read_text()
    changed = copy.deepcopy(rows)
    row = next(r for r in changed if r["name"].endswith("bs1x4096, no canary"))
    row["measured"] *= 1.5
    assert doc_figures.render(readme, changed, campaign) != readme
    assert doc_figures.render(readme, rows, campaign) == readme


def test_no_measured_figure_is_typed_by_hand():
    """Catches a hand-typed cost in the README or a guide (the README once said +63 µs where the
    committed run measured 32.8): figures live in generated regions, code blocks aside."""
    typed = []
    for doc in GUIDES:
        text = doc_figures.REGION.sub("", doc.read_text())
        text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        typed += [f"{doc.relative_to(ROOT)}: {line.strip()}" for line in text.splitlines() if FIGURE.search(line)]
    assert typed == []
