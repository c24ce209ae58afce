"""The same embeddings, 2-3x faster: the sentence-transformers model exported to ONNX.

On a small CPU a MiniLM forward through PyTorch costs ~15-20 ms even for a
few tokens (module dispatch, and every call reads the fp32 weights anew);
ONNX Runtime runs the exported graph in a third of that. The graph is the
loaded sentence-transformers model's transformer plus mean pooling and
normalisation, exported once per model into the build folder and used only
after it reproduces the model's own vectors on probe texts (a model with
another pooling simply keeps the PyTorch path). Anything missing or failing
(no onnxruntime, an export error, a mismatch) means: use sentence-transformers.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

# Texts the exported graph must reproduce before it is trusted.
PROBE_TEXTS = (
    "RuntimeError: Default process group has not been initialized",
    "多卡训练两个进程都跑到0号卡上了",
    "DDP hangs at the first all_reduce when I train on two nodes; each node alone works fine",
)
MIN_COSINE = 0.9999


class OnnxEncoder:
    """Tokenizer + ONNX Runtime session; encode() returns unit float32 rows."""

    def __init__(self, session, tokenizer, max_tokens: int):
        self.session = session
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens

    def encode(self, texts: list[str]):
        batch = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="np"
        )
        feeds = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        return self.session.run(None, feeds)[0]


def onnx_encoder(
    model, graph_path: Path, threads: int, on_export: Callable[[], None] | None = None
) -> OnnxEncoder | None:
    """An encoder equivalent to `model` (a loaded SentenceTransformer), or None.

    Exports the graph to `graph_path` first when it is not there, calling
    `on_export` before that one-time cost.
    """
    try:
        import onnxruntime
    except ImportError:
        return None
    try:
        if not graph_path.exists():
            if on_export is not None:
                on_export()
            _export(model, graph_path)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3  # errors only: warnings would land in the answer
        session = onnxruntime.InferenceSession(
            str(graph_path), options, providers=["CPUExecutionProvider"]
        )
        encoder = OnnxEncoder(session, model.tokenizer, model.max_seq_length)
        return encoder if _reproduces(model, encoder) else None
    except Exception:  # noqa: BLE001 - any failure keeps the PyTorch path
        return None


def _export(model, graph_path: Path) -> None:
    """Export transformer + mean pooling + normalisation, atomically."""
    import torch

    graph = _pooled_encoder(model[0].auto_model).eval()
    # Two lengths, so the traced graph takes the padded-batch path of the mask.
    sample = model.tokenizer(["a b", "a b c d e"], padding=True, return_tensors="pt")
    graph_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".export-", suffix=".onnx", dir=graph_path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                graph,
                (sample["input_ids"], sample["attention_mask"]),
                str(tmp),
                input_names=["input_ids", "attention_mask"],
                output_names=["embedding"],
                dynamic_axes={name: {0: "batch", 1: "tokens"} for name in graph.inputs},
                opset_version=17,
                dynamo=False,
            )
        os.replace(tmp, graph_path)
    finally:
        tmp.unlink(missing_ok=True)


def _reproduces(model, encoder: OnnxEncoder) -> bool:
    """The graph gives the model's own vectors (the same pooling, the same weights)."""
    texts = list(PROBE_TEXTS)
    reference = model.encode(texts, normalize_embeddings=True, show_progress_bar=False)
    exported = encoder.encode(texts)
    if exported.shape != reference.shape:
        return False
    return float((exported * reference).sum(axis=1).min()) >= MIN_COSINE


def _pooled_encoder(transformer):
    """The transformer, mean pooling over real tokens, unit length: one module."""
    import torch

    class PooledEncoder(torch.nn.Module):
        inputs = ("input_ids", "attention_mask")

        def __init__(self):
            super().__init__()
            self.transformer = transformer

        def forward(self, input_ids, attention_mask):
            hidden = self.transformer(
                input_ids=input_ids, attention_mask=attention_mask
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1)

    return PooledEncoder()
