"""The built index: real SQLite + FAISS + model; stale and damaged ones are refused."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from assistant.knowledge.engine import Engine
from assistant.knowledge.files import content_hash
from assistant.knowledge.index import IndexProblem, open_index

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _share_model(embedder, monkeypatch):
    monkeypatch.setattr("assistant.knowledge.embed.Embedder", lambda setting=None: embedder)


def make_engine(kb: Path, tmp_path: Path, messages: list[str]) -> Engine:
    return Engine(
        kb_root=kb,
        index_path=tmp_path / "build" / "index.sqlite",
        log=messages.append,
        require_contract=False,
    )


def test_build_then_reuse_embeddings(mini_kb, tmp_path, monkeypatch):
    monkeypatch.setattr(  # as a checkout without the shipped vectors (shipped.py)
        "assistant.knowledge.shipped.shipped_path", lambda: tmp_path / "none.npz"
    )
    engine = make_engine(mini_kb, tmp_path, [])
    first = engine.build()
    assert first.chunks > first.dense == first.embedded > 5  # why/fix texts: lexical only
    again = engine.build()
    assert again.embedded == 0 and (again.chunks, again.dense) == (first.chunks, first.dense)
    thread = mini_kb / "threads/mini.yaml"
    thread.write_text(thread.read_text().replace("own GPU.", "own GPU, always."))
    changed = engine.build()
    assert changed.embedded == 1


def test_a_fresh_folder_embeds_only_what_the_shipped_vectors_lack(mini_kb, tmp_path):
    first = make_engine(mini_kb, tmp_path, []).build()
    # The real KB's cause file is shipped; the mini thread's texts are not.
    assert first.dense > first.embedded > 0


def test_index_records_kb_hash_and_model(mini_kb, tmp_path):
    engine = make_engine(mini_kb, tmp_path, [])
    engine.build()
    db = sqlite3.connect(engine.index_path)
    meta = dict(db.execute("select key, value from meta"))
    assert meta["kb_hash"] == content_hash(mini_kb)
    assert meta["model"] == engine.embedder.fingerprint
    assert (
        db.execute(
            'select count(*) from chunks_fts where chunks_fts match \'"设备" OR "卡"\''
        ).fetchone()[0]
        >= 1
    )


def test_stale_index_is_rebuilt_and_said_on_log(mini_kb, tmp_path):
    messages: list[str] = []
    engine = make_engine(mini_kb, tmp_path, messages)
    engine.build()
    (mini_kb / "threads/mini.yaml").write_text(
        (mini_kb / "threads/mini.yaml").read_text().replace("gpu 0?", "GPU zero?")
    )
    with pytest.raises(IndexProblem, match="knowledge base changed"):
        open_index(engine.index_path, content_hash(mini_kb), engine.embedder.fingerprint)
    engine.load()
    assert any("rebuilding" in m for m in messages)
    assert engine.ask("both processes use GPU zero").causes[0].id == "duplicate-gpu-per-rank"


@pytest.mark.parametrize("damage", ["truncate", "garbage", "drop_faiss"])
def test_damaged_index_is_detected_and_rebuilt(mini_kb, tmp_path, damage):
    messages: list[str] = []
    engine = make_engine(mini_kb, tmp_path, messages)
    engine.build()
    path = engine.index_path
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:4096])
    elif damage == "garbage":
        path.write_bytes(b"not a database" * 100)
    else:
        db = sqlite3.connect(path)
        db.execute("delete from blobs")
        db.commit()
        db.close()
    with pytest.raises(IndexProblem, match="damaged|another version"):
        open_index(path, content_hash(mini_kb), engine.embedder.fingerprint)
    engine.load()
    assert any("rebuilding" in m for m in messages)
    assert engine.ready


def test_failed_build_keeps_the_previous_index(mini_kb, tmp_path):
    engine = make_engine(mini_kb, tmp_path, [])
    engine.build()
    before = engine.index_path.read_bytes()
    (mini_kb / "causes/broken.yaml").write_text("id: broken\n")
    from assistant.errors import UserError

    with pytest.raises(UserError, match="knowledge base is invalid"):
        engine.build()
    assert engine.index_path.read_bytes() == before
    assert not list(engine.index_path.parent.glob(".index-*"))


def test_concurrent_builds_leave_one_valid_index(mini_kb, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    engine = make_engine(mini_kb, tmp_path, [])
    engine.embedder.load()
    with ThreadPoolExecutor(3) as pool:
        reports = list(pool.map(lambda _: engine.build(), range(3)))
    assert all(r.chunks == reports[0].chunks for r in reports)
    open_index(engine.index_path, content_hash(mini_kb), engine.embedder.fingerprint)
    assert not list(engine.index_path.parent.glob(".index-*"))


def test_an_unwritable_build_folder_is_a_clear_error(mini_kb, tmp_path):
    from assistant.errors import UserError

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the build folder should be\n")
    engine = Engine(
        kb_root=mini_kb,
        index_path=blocker / "build" / "index.sqlite",
        log=lambda message: None,
        require_contract=False,
    )
    with pytest.raises(UserError, match="cannot write the index .*ASSISTANT_BUILD"):
        engine.build()
    assert blocker.read_text() == "a file where the build folder should be\n"


def test_the_index_records_the_graph_check_and_notices_a_model_change(mini_kb, tmp_path):
    engine = make_engine(mini_kb, tmp_path, [])
    report = engine.build()
    assert "queries run on onnxruntime (reproduces the model" in report.summary()
    loaded = open_index(engine.index_path, content_hash(mini_kb), engine.embedder.fingerprint)
    assert loaded.graph_check is not None and loaded.graph_check.ok
    assert loaded.graph_check.texts and loaded.graph_check.dimension == 384
    with pytest.raises(IndexProblem, match="another embedding model"):
        open_index(engine.index_path, content_hash(mini_kb), "other-model:0123456789abcdef:t128")


def test_a_kb_edit_is_rebuilt_and_answered_without_torch(mini_kb, tmp_path):
    # The rebuild a query triggers reuses the recorded check (the graph still
    # reproduces the model's vectors) and embeds the changed text on ONNX Runtime.
    import json
    import subprocess
    import sys

    engine = make_engine(mini_kb, tmp_path, [])
    engine.build()
    thread = mini_kb / "threads/mini.yaml"
    thread.write_text(thread.read_text().replace("gpu 0?", "GPU zero?"))
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from assistant.knowledge.engine import Engine\n"
        "said = []\n"
        f"engine = Engine(kb_root=Path({str(mini_kb)!r}), index_path=Path({str(engine.index_path)!r}),"
        " log=said.append, require_contract=False)\n"
        "top = engine.ask('both processes use GPU zero').causes[0].id\n"
        "heavy = [m for m in ('torch', 'sentence_transformers') if m in sys.modules]\n"
        "print(json.dumps([top, engine.embedder.backend, heavy, said]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    top, backend, heavy, said = json.loads(done.stdout.strip().splitlines()[-1])
    assert (top, backend, heavy) == ("duplicate-gpu-per-rank", "onnxruntime", [])
    assert len(said) == 1 and "rebuilding" in said[0], said
