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


# --- stored in the index at build time -------------------------------------------------


def stored(index: SimpleNamespace, centroids: CauseCentroids | None, data: bytes | None = None):
    """The index with a blobs table holding `centroids` (or raw `data`)."""
    index.db.execute("create table if not exists blobs (name text primary key, data blob)")
    payload = data if data is not None else centroids.to_json().encode("utf-8")
    index.db.execute("insert or replace into blobs values ('centroids', ?)", (payload,))
    return index


SLOW_IDLE = [
    ({"slow": 1.0}, "two GPUs are no faster than one"),
    ({"idle": 1.0, "slow": 0.5}, "only one GPU is used, the others idle"),
    ({"idle": 1.0}, "多卡训练只用了一张卡"),
]


def test_stored_centroids_are_the_fitted_ones_and_are_read_not_refitted():
    index = token_index(SLOW_IDLE, {"slow", "idle"})
    fitted = CauseCentroids.from_index(index)
    stored(index, fitted)
    index.db.execute("delete from chunks")  # a refit now would find no tokens
    read = CauseCentroids.from_index(index)
    assert read.idf == fitted.idf and read.postings == fitted.postings


def test_stored_centroids_of_another_format_or_damaged_are_fitted_again():
    index = token_index(SLOW_IDLE, {"slow", "idle"})
    fitted = CauseCentroids.from_index(index)
    for damaged in (
        b'{"format": 0, "causes": [], "idf": {}, "postings": {}}',  # another version
        b"{not json",
        b'{"format": 1, "causes": ["slow"], "idf": {}, "postings": {"gpu": [7, 0.5]}}',
        b'{"format": 1, "causes": ["slow"], "idf": {}, "postings": {"gpu": [0, "x"]}}',
        b'{"format": 1, "causes": [3], "idf": {}, "postings": {}}',
        b"[1, 2]",
    ):
        refitted = CauseCentroids.from_index(stored(index, None, damaged))
        assert refitted.postings == fitted.postings, damaged


def test_the_built_index_stores_the_centroids_its_tokens_give(engine):
    from assistant.knowledge.centroids import CauseCentroids as Centroids

    index = engine._index
    read = Centroids.stored_in(index.db)
    assert read is not None
    rows = index.db.execute("select tokens from chunks order by id").fetchall()
    fitted = Centroids.fit(
        [row[0].split() for row in rows], index.chunk_causes, index.token_df, set(index.causes)
    )
    assert read.idf == fitted.idf and read.postings == fitted.postings
