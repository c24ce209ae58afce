"""The vectors shipped with the checkout (data/eval/vectors.npz, shipped.py): a fresh
clone reads them instead of embedding every KB chunk and labelled report again."""

from __future__ import annotations

import numpy as np
from click.testing import CliRunner
from test_neighbours import REPORTS, Counting

from assistant.cli import main
from assistant.knowledge.index import build_index
from assistant.knowledge.kb import load_valid_kb
from assistant.knowledge.neighbours import ReportNeighbours
from assistant.knowledge.shipped import (
    indexed_vectors,
    read_shipped,
    shipped_path,
    text_hash,
    write_shipped,
)


def test_the_shipped_vectors_are_the_models_own(engine):
    """Every 50th text of the index, embedded again by the model of this checkout,
    gives the vector the file holds: the file is this model's, not a stale one."""
    shipped = read_shipped(shipped_path(), str(engine.embedder.fingerprint))
    assert len(shipped) > 4000, "data/eval/vectors.npz is missing or another model's"
    texts = {text_hash(text): text for text in every_embedded_text(engine)}
    sample = sorted(set(texts) & set(shipped))[::50]
    assert len(sample) > 30
    fresh = engine.embedder.encode([texts[h] for h in sample])
    saved = np.stack([shipped[h] for h in sample])
    assert np.min(np.sum(fresh * saved, axis=1)) > 0.99999


def every_embedded_text(engine) -> list[str]:
    """The texts the session's build embedded: its chunks, its reports and symptoms."""
    engine.load()
    import sqlite3

    db = sqlite3.connect(engine.index_path)
    try:
        texts = [t for (t,) in db.execute("select text from chunks where embedding is not null")]
    finally:
        db.close()
    return texts


class CountingBuilder(Counting):
    """Counting, and the rest of the embedder a build asks for (its graph check)."""

    def __getattr__(self, name):
        return getattr(self.embedder, name)


def test_a_build_embeds_only_the_chunks_the_shipped_file_lacks(engine, mini_kb, tmp_path):
    kb = load_valid_kb(mini_kb, require_contract=False)
    first = tmp_path / "first" / "index.sqlite"
    counting = CountingBuilder(engine.embedder)
    build_index(kb, counting, first)
    every = indexed_vectors(first)
    kept = dict(list(every.items())[::2])  # half of them shipped
    counting.embedded.clear()
    second = tmp_path / "second" / "index.sqlite"
    report = build_index(kb, counting, second, shipped=lambda: kept)
    assert len(counting.embedded) == len(every) - len(kept) == report.embedded
    assert not {text_hash(t) for t in counting.embedded} & set(kept)
    rebuilt = indexed_vectors(second)
    assert all(np.array_equal(rebuilt[h], v) for h, v in kept.items())


def test_the_neighbours_embed_only_the_reports_the_shipped_file_lacks(engine, tmp_path):
    counting = Counting(engine.embedder)
    first = text_hash(REPORTS[0][0])
    vector = engine.embedder.encode([REPORTS[0][0]])[0]
    neighbours = ReportNeighbours.load_or_embed(
        "set", lambda: REPORTS, counting, [tmp_path / "cache.npz"], shipped=lambda: {first: vector}
    )
    assert counting.embedded == [REPORTS[1][0]]
    assert np.array_equal(neighbours.vector_of(REPORTS[0][0])[0], vector)


def test_a_damaged_or_foreign_file_ships_nothing(tmp_path):
    path = tmp_path / "vectors.npz"
    assert read_shipped(path, "model:a") == {}  # missing
    assert write_shipped(path, "model:a", {"h1": np.ones(3, dtype=np.float32)})
    assert set(read_shipped(path, "model:a")) == {"h1"}
    assert read_shipped(path, "model:b") == {}  # another model's vectors
    path.write_bytes(path.read_bytes()[:100])
    assert read_shipped(path, "model:a") == {}


def test_kb_build_ship_vectors_writes_every_embedded_text(
    engine, private_engine, tmp_path, monkeypatch
):
    target = tmp_path / "eval" / "vectors.npz"
    monkeypatch.setattr("assistant.knowledge.shipped.shipped_path", lambda: target)
    result = CliRunner().invoke(main, ["kb", "build", "--ship-vectors"])
    assert result.exit_code == 0, result.output
    assert f"vectors to {target}" in result.output
    shipped = read_shipped(target, str(engine.embedder.fingerprint))
    texts = every_embedded_text(engine)
    assert {text_hash(t) for t in texts} <= set(shipped)
    assert len(shipped) > len(texts)  # the labelled reports too


def test_an_unwritable_target_is_one_line(private_engine, tmp_path, monkeypatch):
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    monkeypatch.setattr("assistant.knowledge.shipped.shipped_path", lambda: blocked / "v.npz")
    result = CliRunner().invoke(main, ["kb", "build", "--ship-vectors"])
    assert result.exit_code != 0
    assert "cannot write the shipped vectors" in result.output.strip().splitlines()[-1]
    assert "Traceback" not in result.output
