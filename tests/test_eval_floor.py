"""Retrieval quality on the labelled set must stay above an honest floor.

The floors sit a little under what the current KB measures (see the issue
notes), so a change that makes ranking worse fails CI, while noise does not.
"""

from __future__ import annotations

import pytest

from assistant.config import eval_dir
from assistant.evaluate import evaluate, load_queries

pytestmark = pytest.mark.slow

FLOORS = {"top1": 0.88, "recall3": 0.95, "mrr": 0.92}
# Real user reports from public issue threads (data/eval/real_reports.jsonl):
# harder, wordier, often without the decisive line; they guard generality.
REAL_FLOORS = {"top1": 0.74, "recall3": 0.90, "mrr": 0.84}


@pytest.fixture(scope="module")
def report(engine):
    return evaluate(engine, load_queries(eval_dir() / "queries.jsonl"))


@pytest.mark.parametrize("metric", sorted(FLOORS))
def test_fused_ranking_meets_floor(report, metric):
    assert report["fused"][metric] >= FLOORS[metric], report["misses"][:10]


def test_fusion_beats_every_single_signal(report):
    for signal in ("signature", "lexical", "dense"):
        assert report["fused"]["mrr"] >= report[signal]["mrr"], (signal, report[signal])


@pytest.fixture(scope="module")
def real_report(engine):
    return evaluate(engine, load_queries(eval_dir() / "real_reports.jsonl"))


@pytest.mark.parametrize("metric", sorted(REAL_FLOORS))
def test_real_user_reports_meet_floor(real_report, metric):
    assert real_report["fused"][metric] >= REAL_FLOORS[metric], real_report["misses"][:10]
