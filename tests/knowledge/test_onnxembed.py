"""The torch-free query path gives the model's own vectors, or is not used at all.

The session `engine` was built by the real `kb build` path: it exported the
graph, checked it against sentence-transformers and recorded the check.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from assistant.clean import clean_log
from assistant.knowledge import embed
from assistant.knowledge.embed import MAX_TOKENS, Embedder
from assistant.knowledge.index import open_index
from assistant.knowledge.onnxembed import (
    CHECK_TEXTS,
    MIN_COSINE,
    GraphCheck,
    GraphUnusable,
    OnnxEncoder,
    TokenizerSettings,
)
from assistant.knowledge.retrieve import DENSE_TEXT_LIMIT

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
LONG = "NCCL WARN socketPollConnect: Connect to 10.0.0.4<56849> returned 113 " * 30
TEXTS = [
    "RuntimeError: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000",
    "为什么两个进程都跑到 0 号卡上了",
    "  hang  ",  # sentence-transformers strips: so must the fast path
    LONG,  # longer than the 128 tokens the model sees: cut at the same token
    "DDP 一直报错找不到设备 CUDA error: invalid device ordinal",
]


@pytest.fixture(scope="module")
def reference(build_dir):
    """The plain sentence-transformers path, never accelerated."""
    plain = Embedder(accelerate=False)
    plain.load()
    return plain


@pytest.fixture(scope="module")
def fast(engine):
    """The engine's embedder, on the graph its build exported and checked."""
    assert engine.embedder.backend == "onnxruntime"
    return engine.embedder


@pytest.fixture(scope="module")
def recorded(engine) -> GraphCheck:
    check = open_index(engine.index_path, None, None).graph_check
    assert check is not None and check.ok, check
    return check


def eval_texts() -> list[str]:
    """Every eval query, raw and as the dense signal embeds it (the cleaned focus)."""
    path = REPO / "data" / "eval" / "queries.jsonl"
    queries = [json.loads(line)["query"] for line in path.read_text().splitlines() if line.strip()]
    focus = [clean_log(q).focus[:DENSE_TEXT_LIMIT] for q in queries]
    return queries + [f for f in focus if f.strip()]


def test_the_build_records_a_checked_graph(engine, recorded, build_dir):
    assert "reproduces the model" in recorded.detail
    assert recorded.texts and recorded.reference_vectors().shape == (len(recorded.texts), 384)
    assert (build_dir / "onnx" / engine.embedder.graph_name).is_file()


def test_fast_vectors_equal_the_models_on_every_eval_query(fast, reference):
    # In batches: one text at a time on sentence-transformers costs minutes on
    # a busy 2-core machine; that a batch gives each text its own vector is
    # the next test.
    texts = eval_texts()
    assert len(texts) > 149
    cosines = (fast.encode(texts) * reference.encode(texts)).sum(axis=1)
    worst = int(np.argmin(cosines))
    assert cosines[worst] >= MIN_COSINE, texts[worst][:200]


def test_a_padded_batch_gives_each_texts_own_vector(fast, reference):
    # Mean pooling must count only real tokens: padding a short text to the
    # longest in the batch cannot move its vector.
    batch = fast.encode(TEXTS * 4)
    alone = np.vstack([fast.encode([t]) for t in TEXTS * 4])
    assert (batch * alone).sum(axis=1).min() >= 0.99999
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    assert (batch * reference.encode(TEXTS * 4)).sum(axis=1).min() >= MIN_COSINE


def test_the_tokenizer_matches_sentence_transformers(fast, reference, build_dir):
    model = reference.load()
    settings = TokenizerSettings.of_model(fast.model_dir, MAX_TOKENS)
    assert settings.max_tokens == model.max_seq_length == 128
    encoder = OnnxEncoder.open(build_dir / "onnx" / fast.graph_name, settings)
    ids, mask = encoder.tokenize(TEXTS)
    expected = model.preprocess(TEXTS)
    assert ids.shape == (len(TEXTS), 128)  # the long text is cut at 128, the rest padded to it
    assert np.array_equal(ids, expected["input_ids"].numpy())
    assert np.array_equal(mask, expected["attention_mask"].numpy())
    assert encoder.token_counts(TEXTS) == expected["attention_mask"].sum(dim=1).tolist()


def test_a_query_process_verifies_the_graph_without_torch(engine, recorded, tmp_path):
    statement = (
        "import sys\n"
        "from assistant.knowledge.embed import Embedder\n"
        "from assistant.knowledge.index import open_index\n"
        f"check = open_index(__import__('pathlib').Path({str(engine.index_path)!r}), None, None)"
        ".graph_check\n"
        "e = Embedder()\n"
        "e.use_recorded(check, log=print)\n"
        "v = e.encode(['hang'])\n"
        "print(e.backend, round(float((v * v).sum()), 4),"
        " [m for m in ('torch', 'sentence_transformers') if m in sys.modules])\n"
    )
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", statement], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == ["onnxruntime 1.0 []"]


def unwritable(tmp_path: Path, name: str) -> Path:
    """A folder path that cannot be created, even by root: its parent is a file."""
    blocker = tmp_path / f"{name}-is-a-file"
    blocker.write_text("not a folder\n")
    return blocker / name


def test_a_damaged_graph_that_cannot_be_kept_is_said_once(recorded, tmp_path, monkeypatch):
    build = tmp_path / "readonly-build"
    (build / "onnx").mkdir(parents=True)
    monkeypatch.setenv("ASSISTANT_BUILD", str(build))
    monkeypatch.setenv("XDG_CACHE_HOME", str(unwritable(tmp_path, "cache")))
    monkeypatch.setattr(embed, "writable_graph_dir", lambda dirs: None)  # a read-only mount
    plain = Embedder()
    (build / "onnx" / plain.graph_name).write_bytes(b"not an onnx graph")
    said: list[str] = []
    plain.use_recorded(recorded, log=said.append)
    plain.use_recorded(recorded, log=said.append)  # a second question: nothing new
    assert plain.backend == "sentence-transformers"
    assert len(said) == 1 and "unusable" in said[0] and "cannot be kept" in said[0], said
    assert plain.encode(["hang"]).shape == (1, 384)


def test_a_missing_graph_is_exported_once_to_the_writable_cache(recorded, tmp_path, monkeypatch):
    # The tester's case: a read-only build folder (here: one that cannot be
    # created) with the index but no graph. The graph goes to the user's cache.
    monkeypatch.setenv("ASSISTANT_BUILD", str(unwritable(tmp_path, "build")))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = Embedder()
    said: list[str] = []
    first.use_recorded(recorded, log=said.append)
    assert len(said) == 1 and "missing; re-exporting it to" in said[0], said
    assert first.backend == "onnxruntime"
    kept = tmp_path / "cache" / "ddp-assistant" / "onnx" / first.graph_name
    assert kept.is_file()
    again = Embedder()  # the next process, or a second engine in this one
    again.use_recorded(recorded, log=said.append)
    assert again.backend == "onnxruntime" and len(said) == 1


def test_a_model_that_cannot_be_exported_keeps_sentence_transformers(tmp_path, monkeypatch):
    # A user model with CLS pooling: the exported (mean-pooling) graph cannot
    # reproduce it, so the build records that and queries stay on the model.
    model_dir = tmp_path / "cls-model"
    source = Embedder(accelerate=False).model_dir
    shutil.copytree(source, model_dir, ignore=shutil.ignore_patterns("model.safetensors"))
    (model_dir / "model.safetensors").symlink_to(source / "model.safetensors")
    pooling = json.loads((model_dir / "1_Pooling/config.json").read_text())
    pooling.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    (model_dir / "1_Pooling/config.json").write_text(json.dumps(pooling))
    monkeypatch.setenv("ASSISTANT_BUILD", str(tmp_path / "build"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    user = Embedder(str(model_dir))
    assert user.fingerprint != Embedder().fingerprint  # the index notices the change
    said: list[str] = []
    check = user.check_graph(None, log=said.append)
    assert not check.ok and "does not reproduce" in check.detail, check
    assert user.backend == "sentence-transformers" and len(said) == 1
    stored = GraphCheck.from_json(check.to_json())
    later = Embedder(str(model_dir))
    later.use_recorded(stored, log=said.append)
    assert later.backend == "sentence-transformers"
    assert len(said) == 2 and "no usable ONNX graph" in said[1]
    vector = later.encode(["hang"])
    cls_vector = later.load().encode(["hang"], normalize_embeddings=True)
    assert float((vector * cls_vector).sum()) > 0.9999


def test_missing_onnxruntime_or_a_garbage_graph_is_unusable(fast, tmp_path, monkeypatch):
    settings = TokenizerSettings.of_model(fast.model_dir, MAX_TOKENS)
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not an onnx graph")
    with pytest.raises(GraphUnusable, match="cannot load garbage.onnx"):
        OnnxEncoder.open(garbage, settings)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails
    with pytest.raises(GraphUnusable, match="onnxruntime is not installed"):
        OnnxEncoder.open(garbage, settings)


def test_the_recorded_check_round_trips_and_bad_records_are_none(recorded):
    again = GraphCheck.from_json(recorded.to_json())
    assert again == recorded
    assert GraphCheck.from_json("") is None and GraphCheck.from_json("{not json") is None
    assert len(CHECK_TEXTS) > len(recorded.texts)  # the long text is checked at build only


def test_a_repeated_query_is_embedded_once(fast, monkeypatch):
    calls: list[list[str]] = []
    real = OnnxEncoder.encode
    monkeypatch.setattr(
        OnnxEncoder, "encode", lambda self, texts: calls.append(texts) or real(self, texts)
    )
    text = "a question asked twice: why does my DDP job hang at barrier?"
    first, again = fast.encode([text]), fast.encode([text])
    assert np.array_equal(first, again) and calls == [[text]]
    again[0, 0] += 1  # callers may change what they get
    assert np.array_equal(fast.encode([text]), first)


def test_without_onnxruntime_a_build_records_why_and_exports_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("ASSISTANT_BUILD", str(tmp_path / "build"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails
    said: list[str] = []
    plain = Embedder()
    check = plain.check_graph(None, log=said.append)
    assert (check.ok, check.detail, said) == (False, "onnxruntime is not installed", [])
    assert plain.backend == "sentence-transformers"
    assert not (tmp_path / "build").exists() and not (tmp_path / "cache").exists()


def test_a_model_without_tokenizer_json_records_why_and_exports_nothing(tmp_path, monkeypatch):
    model_dir = tmp_path / "no-tokenizer-json"
    source = Embedder(accelerate=False).model_dir
    shutil.copytree(
        source, model_dir, ignore=shutil.ignore_patterns("*.safetensors", "tokenizer.json")
    )
    monkeypatch.setenv("ASSISTANT_BUILD", str(tmp_path / "build"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    said: list[str] = []
    check = Embedder(str(model_dir)).check_graph(None, log=said.append)
    assert not check.ok and "no tokenizer.json" in check.detail and said == []
    assert not (tmp_path / "build").exists()
