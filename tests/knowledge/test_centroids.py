"""Per-cause TF-IDF centroids: fitted from the index's chunk tokens, added to the lexical signal."""

from __future__ import annotations

import sqlite3
from types import SimpleNamespace

from assistant.clean import clean_log
from assistant.knowledge.centroids import CauseCentroids
from assistant.knowledge.retrieve import summed_shares
from assistant.knowledge.textsearch import search_tokens


def token_index(chunks: list[tuple[dict, str]], causes: set[str]) -> SimpleNamespace:
    """What the centroids read of a LoadedIndex: chunk tokens, chunks' causes, token_df."""
    db = sqlite3.connect(":memory:")
    db.execute("create table chunks (id integer primary key, tokens text)")
    token_df: dict[str, int] = {}
    for chunk_id, (_, text) in enumerate(chunks):
        tokens = search_tokens(text)
        db.execute("insert into chunks values (?, ?)", (chunk_id, " ".join(tokens)))
        for token in set(tokens):
            token_df[token] = token_df.get(token, 0) + 1
    return SimpleNamespace(
        db=db,
        causes={cid: {} for cid in causes},
        chunk_causes=[c for c, _ in chunks],
        token_df=token_df,
    )


def test_all_of_a_causes_text_counts_not_only_its_best_chunk():
    index = token_index(
        [
            ({"slow": 1.0}, "two GPUs are no faster than one"),
            ({"slow": 1.0}, "iterations slower on more cards, bandwidth between GPUs"),
            ({"idle": 1.0}, "only one GPU is used, the others idle"),
            ({"idle": 0.0}, "faster slower bandwidth"),  # speaks for no cause
            ({"gone": 1.0}, "unrelated words here"),
        ],
        {"slow", "idle"},
    )
    centroids = CauseCentroids.from_index(index)
    scores = centroids.scores("training on more GPUs is slower, bandwidth")
    assert max(scores, key=scores.get) == "slow"
    assert "gone" not in scores and "idle" not in scores  # not a KB cause / no shared word
    assert centroids.scores("nothing the index knows") == {}


def test_chinese_bigrams_find_the_cause_described_in_chinese():
    index = token_index(
        [
            ({"idle": 1.0}, "多卡训练只用了一张卡，其他卡都空着"),
            ({"slow": 1.0}, "双卡训练比单卡还慢"),
        ],
        {"idle", "slow"},
    )
    scores = CauseCentroids.from_index(index).scores("为什么只用了一张卡")
    assert max(scores, key=scores.get) == "idle"


def test_an_index_whose_tokens_do_not_match_its_chunks_gives_no_centroids():
    index = token_index([({"a": 1.0}, "words")], {"a"})
    index.chunk_causes.append({"a": 1.0})  # one more chunk than rows
    assert CauseCentroids.from_index(index) is None


def test_summed_shares_scale_each_part_by_its_best():
    assert summed_shares({"a": 10.0, "b": 5.0}, {"b": 2.0, "c": 1.0}) == {
        "a": 1.0,
        "b": 1.5,
        "c": 0.5,
    }
    assert summed_shares({}, {"a": -1.0}) == {}


def test_the_real_lexical_signal_uses_the_kb_centroids(engine):
    retriever = engine._retriever
    assert retriever.centroids is not None
    query = "GPU 0 holds far more memory than the other GPUs after loading a checkpoint"
    lexical = retriever.signal_scores(clean_log(query), shortcut=False)["lexical"]
    # best chunk and whole cause, each scaled to its best: 0..2, the leader near 2
    assert all(0 < score <= 2.0 for score in lexical.values())
    assert max(lexical.values()) > 1.5
    assert max(lexical, key=lexical.get) == "checkpoint-map-location", lexical
