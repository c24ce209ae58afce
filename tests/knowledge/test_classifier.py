"""The KB-trained cause classifier: fitted from stored chunk vectors, used on the real index."""

from __future__ import annotations

import json
import sqlite3

import numpy as np
import pytest

from assistant.clean import clean_log
from assistant.knowledge.classifier import CauseClassifier


def chunk_db(rows: list[tuple[dict, np.ndarray]]) -> sqlite3.Connection:
    db = sqlite3.connect(":memory:")
    db.execute("create table chunks (id integer primary key, causes text, embedding blob)")
    for causes, vector in rows:
        db.execute(
            "insert into chunks (causes, embedding) values (?, ?)",
            (json.dumps(causes), None if vector is None else vector.astype(np.float32).tobytes()),
        )
    return db


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
    classifier = CauseClassifier.from_index(chunk_db(rows), {"oom", "hang", "port"})
    assert classifier.causes == ["hang", "oom", "port"]
    for cause, centre in centres.items():
        scores = classifier.scores(centre)
        assert max(scores, key=scores.get) == cause


def test_too_few_causes_give_no_classifier():
    rows = [({"oom": 1.0}, np.ones(4))]
    assert CauseClassifier.from_index(chunk_db(rows), {"oom"}) is None
    assert CauseClassifier.from_index(chunk_db([]), {"oom"}) is None


@pytest.mark.slow
def test_the_real_index_classifier_ranks_an_unsignatured_symptom(engine):
    retriever = engine._retriever
    assert retriever.classifier is not None and len(retriever.classifier.causes) >= 40
    question = clean_log("GPU 0 holds much more memory than the others and shows extra processes")
    scores = retriever.signal_scores(question)
    assert scores["classifier"] and set(scores["classifier"]) <= set(engine.cause_ids())


@pytest.mark.slow
def test_a_chinese_question_gets_no_classifier_vote(engine):
    scores = engine._retriever.signal_scores(clean_log("多卡训练两个进程都跑到0号卡上了"))
    assert scores["dense"] and scores["classifier"] == {}
