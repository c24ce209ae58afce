"""Fusion and the exact-signature shortcut, on the real index."""

from __future__ import annotations

import pytest

from assistant.clean import clean_log
from assistant.knowledge.retrieve import (
    any_of,
    fuse,
    needs_dense,
    reports_text,
    soft_ranks,
    with_shortcut,
)

pytestmark = pytest.mark.slow


def test_fusion_scales_scores_and_orders_by_reciprocal_rank():
    ranked = fuse(
        {"signature": {"a": 3.0}, "lexical": {"b": 9.0, "a": 1.0}, "dense": {"a": 0.9, "b": 0.1}}
    )
    assert [r.id for r in ranked] == ["a", "b"]
    assert ranked[0].ranks == {"signature": 1, "lexical": 2, "dense": 1}
    assert 0 < ranked[1].score < ranked[0].score <= 1
    # each signal's first cause carries how far it leads there (confidence reads it)
    assert ranked[0].leads == {"signature": 3.0, "dense": pytest.approx(0.8)}
    assert ranked[1].leads == {"lexical": 8.0}


def test_near_ties_share_a_rank_and_distant_scores_keep_theirs():
    ranks = soft_ranks({"a": 1.0, "b": 1.0, "c": 0.5, "d": 0.0})
    assert ranks["a"] == pytest.approx(ranks["b"]) == pytest.approx(1.5, abs=0.01)
    assert ranks["c"] == pytest.approx(3.0, abs=0.01) and ranks["d"] == pytest.approx(4.0, abs=0.01)
    close = soft_ranks({"a": 1.687, "b": 1.677})  # noise, not a whole rank apart
    assert 1.0 < close["a"] < close["b"] < 2.0 and close["b"] - close["a"] < 0.2
    assert soft_ranks({"only": -0.4}) == {"only": 1.0} and soft_ranks({}) == {}


def test_named_by_words_match_as_one_and_bad_words_are_left_out():
    words = any_of(["fsdp", r"fully.?shard"])
    assert len(words) == 1  # one alternation, one pass over the text
    assert words.search("FullyShardedDataParallel wraps it") and not words.search("plain DDP")
    spoiled = any_of(["fsdp", "(a+)+"])  # the second cannot be compiled safely
    assert spoiled.search("fsdp save hangs") and len(spoiled) == 1
    assert any_of(["(a+)+"]) is None and any_of([]) is None  # never lowered for nothing


def test_equal_scores_fuse_equally_whatever_the_alphabet():
    ranked = fuse({"lexical": {"zeta": 2.0, "alpha": 2.0}, "dense": {"zeta": 0.5, "alpha": 0.5}})
    assert ranked[0].score == pytest.approx(ranked[1].score)


def test_a_root_error_signature_hit_skips_the_dense_signal(engine):
    retriever = engine._retriever
    exact = clean_log(
        "RuntimeError: Default process group has not been initialized, please make sure to call init_process_group."
    )
    question = clean_log("why do both my processes use gpu 0")
    assert not needs_dense(retriever.signal_scores(exact, shortcut=False))
    assert "dense" not in retriever.signal_scores(exact)
    assert "dense" in retriever.signal_scores(question)
    full = retriever.signal_scores(exact, shortcut=False)
    assert set(with_shortcut(full)) == {"signature", "lexical", "reports"}


def test_asking_after_scoring_every_signal_reuses_the_scores_and_ranks_the_same(
    engine, monkeypatch
):
    # kb eval scores every signal of a query, then asks it through the pipeline.
    retriever = engine._retriever
    queries = [
        "RuntimeError: Default process group has not been initialized",  # shortcut: no dense
        "why do both my processes use gpu 0",  # dense kept
    ]
    fresh = {q: [c.id for c in engine.ask(q).causes] for q in queries}
    calls: list[str] = []
    real = retriever.lexical_scores
    monkeypatch.setattr(retriever, "lexical_scores", lambda text: calls.append(text) or real(text))
    for query in queries:
        calls.clear()
        engine.signal_scores(query)
        assert [c.id for c in engine.ask(query).causes] == fresh[query]
        assert len(calls) == 1  # the ask reused the scores
        with engine.holding_out([query]):  # another reports model: scored anew
            engine.ask(query)
        assert len(calls) == 2


def test_chinese_question_matches_through_fts_bigrams(engine):
    lexical = engine._retriever.lexical_scores("多卡训练两个进程都跑到0号卡上了")
    assert lexical, "CJK bigrams found nothing"


# A GPU count asked for beyond what the machine shows, as two kinds of output say it:
# torch.cuda.get_device_properties, which nn.DataParallel calls for each of its
# device_ids, and a training script's own guard quoted by its traceback.
TOO_MANY_GPUS = [
    (
        'File ".../torch/cuda/__init__.py", in get_device_properties\n'
        '    raise AssertionError("Invalid device id")\nAssertionError: Invalid device id'
    ),
    (
        'Traceback (most recent call last):\n  File "tools/train.py", line 112, in <module>\n'
        "    assert num_gpu <= torch.cuda.device_count()\nAssertionError"
    ),
]


@pytest.mark.parametrize("log", TOO_MANY_GPUS)
def test_asking_for_more_gpus_than_there_are_is_named_from_the_error_text(engine, log):
    # The signature signal alone: the labelled reports already hold such logs.
    scores = engine._retriever.signature_scores(clean_log(log))
    assert max(scores, key=scores.get) == "world-size-exceeds-devices"


GENERAL_ERROR = (
    "Traceback (most recent call last):\n"
    '  File "tools/train.py", line 120, in main\n'
    "    model(images)\n"
    "RuntimeError: Default process group has not been initialized, "
    "please make sure to call init_process_group."
)


def test_a_report_that_names_the_special_case_gets_the_general_signature(engine):
    """kb refines: the error a missing process group prints is SyncBN's in a report
    that names SyncBN, and stays the general cause's in one that does not."""
    retriever = engine._retriever
    assert retriever.refines["syncbn-without-process-group"] == ("process-group-not-initialized",)
    named = f"Training the config with norm_cfg=dict(type='SyncBN') on one GPU:\n{GENERAL_ERROR}"
    scores = retriever.signature_scores(clean_log(named))
    assert scores.get("syncbn-without-process-group", 0) >= 3.0  # a root-error hit, handed over
    assert "process-group-not-initialized" not in scores
    assert engine.rank_ids(named)[:2] == [
        "syncbn-without-process-group",
        "process-group-not-initialized",
    ]
    plain = f"Training on one GPU:\n{GENERAL_ERROR}"
    assert engine.rank_ids(plain)[0] == "process-group-not-initialized"
    assert "syncbn-without-process-group" not in retriever.signature_scores(clean_log(plain))


def test_the_reports_model_reads_the_title_or_the_root_error_twice():
    """What the person (or the failing rank) says the failure is weighs more
    than the config and launch lines around it."""
    titled = (
        "Training hangs after the first epoch on 4 GPUs\n\n"
        "### System Info\n- `transformers` version: 4.37.2\n"
        "deepspeed --num_gpus 4 train.py --deepspeed ds_config.json\n"
    )
    text = reports_text(clean_log(titled))
    assert text.startswith("Training hangs after the first epoch on 4 GPUs\n")
    assert text.count("Training hangs after the first epoch") == 2
    assert "ds_config.json" in text  # the rest is all still read, once

    log = "[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: boom on rank one\n"
    first = reports_text(clean_log(log)).split("\n", 1)[0]
    assert first == "ValueError: boom on rank one"
