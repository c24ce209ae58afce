"""Confidence a person can trust, measured on the real user reports in data/eval/.

"high" must be right at least 9 times in 10, and at least 4 reports in 10 must
get it. The sets were collected from public issue threads in the users' own
words (data/eval/README.md); the levels' rules (assistant/confidence.py) were
set on queries.jsonl and the first two real sets before later sets existed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from assistant.knowledge.evaluate import confidence_report, load_queries

EVAL = Path(__file__).resolve().parents[2] / "data" / "eval"
REAL_SETS = sorted(EVAL.glob("real_reports*.jsonl"))

pytestmark = pytest.mark.slow


def test_there_are_real_report_sets():
    assert len(REAL_SETS) >= 4


@pytest.mark.parametrize("path", REAL_SETS, ids=lambda p: p.stem)
def test_high_confidence_is_right_nine_times_in_ten(engine, path):
    report = confidence_report(engine, load_queries(path))
    high = report["high"]
    assert high["top1"] >= 0.9, report
    assert high["share"] >= 0.4, report
    ordered = [report[level]["top1"] for level in ("high", "low") if level in report]
    assert ordered == sorted(ordered, reverse=True), "high must be more often right than low"
