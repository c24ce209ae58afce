"""The ONNX Runtime path gives the model's own vectors, or is not used at all."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from assistant.knowledge.embed import Embedder
from assistant.knowledge.onnxembed import onnx_encoder

pytestmark = pytest.mark.slow

TEXTS = [
    "RuntimeError: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000",
    "为什么两个进程都跑到 0 号卡上了",
    "hang",
    # Longer than the 128 tokens the model sees: truncated the same way on both paths.
    "NCCL WARN socketPollConnect: Connect to 10.0.0.4<56849> returned 113 " * 30,
]


@pytest.fixture(scope="module")
def reference(build_dir):
    """The plain sentence-transformers path, never accelerated."""
    plain = Embedder(accelerate=False)
    plain.load()
    return plain


def test_queries_run_on_onnxruntime_with_the_models_vectors(embedder, reference):
    embedder.accelerate_queries()
    assert embedder.backend == "onnxruntime"
    assert reference.backend == "sentence-transformers"
    for text in TEXTS:  # one at a time, as queries are
        cosine = float((embedder.encode([text]) * reference.encode([text])).sum())
        assert cosine > 0.9999, text
    # A padded batch (texts of different lengths), as a build encodes them.
    batch = (embedder.encode(TEXTS * 5) * reference.encode(TEXTS * 5)).sum(axis=1)
    assert batch.min() > 0.9999


def test_a_graph_that_does_not_reproduce_the_model_is_not_used(reference, tmp_path):
    graph = tmp_path / "model.onnx"
    exports: list[str] = []
    announce = lambda: exports.append(graph.name)
    assert onnx_encoder(reference.load(), graph, 1, on_export=announce) is not None
    assert exports == ["model.onnx"]  # exported (and said so) once, then checked
    other = Embedder(accelerate=False).load()
    other.encode = lambda texts, **kw: np.ones((len(texts), 384), np.float32) / np.sqrt(384)
    assert onnx_encoder(other, graph, 1, on_export=announce) is None
    assert exports == ["model.onnx"]  # the graph existed: no second export


def test_a_damaged_graph_or_missing_onnxruntime_keeps_sentence_transformers(
    reference, tmp_path, monkeypatch
):
    damaged = tmp_path / "damaged.onnx"
    damaged.write_bytes(b"not an onnx graph")
    assert onnx_encoder(reference.load(), damaged, threads=1) is None
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails
    assert onnx_encoder(reference.load(), tmp_path / "fresh.onnx", threads=1) is None
