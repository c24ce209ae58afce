"""The KB-trained cause classifier: fitted from stored chunk vectors, used on the real index."""

from __future__ import annotations

import json
import sqlite3
from types import SimpleNamespace

import numpy as np
import pytest

from assistant.clean import clean_log
from assistant.knowledge.classifier import CauseClassifier


def chunk_index(rows: list[tuple[dict, np.ndarray]], causes: set[str]) -> SimpleNamespace:
    """What the classifier reads of a LoadedIndex: its causes, chunks' causes, stored vectors."""
    db = sqlite3.connect(":memory:")
    db.execute("create table chunks (id integer primary key, causes text, embedding blob)")
    for chunk_id, (chunk_causes, vector) in enumerate(rows):
        db.execute(
            "insert into chunks (id, causes, embedding) values (?, ?, ?)",
            (
                chunk_id,
                json.dumps(chunk_causes),
                None if vector is None else vector.astype(np.float32).tobytes(),
            ),
        )
    return SimpleNamespace(
        db=db, causes={cid: {} for cid in causes}, chunk_causes=[c for c, _ in rows]
    )


def test_it_learns_which_cause_each_region_of_the_space_belongs_to():
    rng = np.random.default_rng(0)
    centres = {"oom": np.eye(8)[0], "hang": np.eye(8)[1], "port": np.eye(8)[2]}
    rows = [
        ({cause: 1.0}, centre + 0.1 * rng.standard_normal(8))
        for cause, centre in centres.items()
        for _ in range(5)
    ]
    rows.append(({"hang": 0.5}, centres["port"]))  # a weak link is not an example
    rows.append(({"unknown": 1.0}, centres["oom"]))  # neither is a cause the KB lacks
    rows.append(({"oom": 1.0}, None))  # nor a chunk without a vector
    classifier = CauseClassifier.from_index(chunk_index(rows, {"oom", "hang", "port"}))
    assert classifier.causes == ["hang", "oom", "port"]
    for cause, centre in centres.items():
        scores = classifier.scores(centre)
        assert max(scores, key=scores.get) == cause


def test_too_few_causes_give_no_classifier():
    rows = [({"oom": 1.0}, np.ones(4))]
    assert CauseClassifier.from_index(chunk_index(rows, {"oom"})) is None
    assert CauseClassifier.from_index(chunk_index([], {"oom"})) is None


@pytest.mark.slow
def test_the_classifier_adds_to_the_dense_signal_of_an_english_symptom(engine):
    retriever = engine._retriever
    assert retriever.classifier is not None and len(retriever.classifier.causes) >= 40
    text = "GPU 0 holds much more memory than the others and shows extra processes"
    question = clean_log(text)
    assert retriever.classifier_applies(question)
    plain = retriever.dense_scores(text)
    voted = retriever.dense_scores(text, clean=question)
    assert set(plain) <= set(voted) <= set(engine.cause_ids())
    assert any(voted[cid] > plain.get(cid, 0.0) for cid in voted)


@pytest.mark.slow
def test_no_classifier_vote_on_chinese_or_on_a_log_with_a_root_error(engine):
    retriever = engine._retriever
    assert not retriever.classifier_applies(clean_log("多卡训练两个进程都跑到0号卡上了"))
    log = clean_log(
        'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n'
        "RuntimeError: Connection closed by peer [127.0.0.1]:58803"
    )
    assert log.root_error is not None and not retriever.classifier_applies(log)
