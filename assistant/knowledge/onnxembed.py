"""The same embeddings without torch: the model's own tokenizer + its graph on ONNX Runtime.

A query must not pay for importing torch and sentence-transformers (~6 s
cold on two cores): it needs only the model's `tokenizer.json` (the
`tokenizers` library), ONNX Runtime and the exported graph. The graph is
the sentence-transformers model's transformer plus mean pooling over the
attention mask and unit normalisation, exported once per model at
`kb build` and trusted only after it reproduces the model's own vectors on
CHECK_TEXTS. That check is recorded in the index (`GraphCheck`): every
later process re-embeds the same texts (one ONNX call) and compares them
with the recorded vectors before it uses the graph, so a damaged or foreign
graph is never used, and torch is never imported to find that out.

Importing this module imports neither torch nor numpy; `export_graph` and
`check_against_model` import torch when a build calls them.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

# Texts the graph must reproduce: English, Chinese, a single word, and one
# longer than MAX_TOKENS (truncation must cut at the same token).
CHECK_TEXTS = (
    "RuntimeError: Default process group has not been initialized",
    "多卡训练两个进程都跑到0号卡上了",
    "hang",
    "DDP hangs at the first all_reduce when I train on two nodes; each node alone works fine. "
    * 12,
)
# What a query process re-embeds to verify a graph: the short texts only (~10 ms;
# the long one costs ~90 ms and tests the tokenizer, which the build has checked).
VERIFY_TEXTS = CHECK_TEXTS[:3]
MIN_COSINE = 0.9999
# Threads for one query: more than a few only adds handoff cost on a 6-layer model.
MAX_THREADS = 4


class GraphUnusable(Exception):
    """The graph or the tokenizer cannot be used; the message says why, in one line."""


@dataclass(frozen=True)
class TokenizerSettings:
    """How the sentence-transformers model prepares text, read from its own files."""

    tokenizer_file: Path
    max_tokens: int
    lowercase: bool  # sentence_bert_config's do_lower_case: the model lowercases first

    @classmethod
    def of_model(cls, model_dir: Path, max_tokens: int) -> TokenizerSettings:
        """The settings of the model in `model_dir`, truncating at most at `max_tokens`."""
        transformer_dir = model_dir / _transformer_subdir(model_dir)
        config = _read_json(transformer_dir / "sentence_bert_config.json") or _read_json(
            model_dir / "sentence_bert_config.json"
        )
        tokenizer_file = transformer_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise GraphUnusable(f"the model has no tokenizer.json in {transformer_dir}")
        limit = int(config.get("max_seq_length") or max_tokens)
        return cls(tokenizer_file, min(limit, max_tokens), bool(config.get("do_lower_case")))


def _transformer_subdir(model_dir: Path) -> str:
    """Where modules.json puts the Transformer module ("" for the model folder itself)."""
    for module in _read_json(model_dir / "modules.json") or []:
        if str(module.get("type", "")).endswith("Transformer"):
            return module.get("path", "")
    return ""


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


class OnnxEncoder:
    """Tokenizer + ONNX Runtime session; encode() returns unit float32 rows."""

    def __init__(self, session, tokenizer, settings: TokenizerSettings):
        self.session = session
        self.tokenizer = tokenizer
        self.settings = settings

    @classmethod
    def open(cls, graph: Path, settings: TokenizerSettings, threads: int | None = None):
        """Load the tokenizer and the graph; GraphUnusable when either cannot be."""
        try:
            import onnxruntime
            import tokenizers
        except ImportError as exc:
            raise GraphUnusable(f"{exc.name} is not installed") from None
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(settings.tokenizer_file))
        except Exception as exc:  # noqa: BLE001 - a broken tokenizer.json, in any way
            raise GraphUnusable(f"cannot read {settings.tokenizer_file.name}: {exc}") from None
        # The file may carry its own padding and truncation (MiniLM's pads every
        # text to 128 tokens); sentence-transformers pads to the longest in a batch.
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=settings.max_tokens)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads or default_threads()
        # Idle workers would spin on the cores torch or the person's job needs.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3  # errors only: warnings would land in the answer
        try:
            session = onnxruntime.InferenceSession(
                str(graph), options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # noqa: BLE001 - ORT raises its own types for bad files
            raise GraphUnusable(
                f"ONNX Runtime cannot load {graph.name}: {_first_line(exc)}"
            ) from None
        return cls(session, tokenizer, settings)

    def tokenize(self, texts: list[str]):
        """input_ids and attention_mask, padded to the longest text, as int64 arrays."""
        import numpy as np

        prepared = [self._prepare(t) for t in texts]
        encodings = self.tokenizer.encode_batch(prepared)
        width = max(len(e.ids) for e in encodings)
        ids = np.zeros((len(texts), width), dtype=np.int64)
        mask = np.zeros((len(texts), width), dtype=np.int64)
        for row, encoding in enumerate(encodings):
            ids[row, : len(encoding.ids)] = encoding.ids
            mask[row, : len(encoding.ids)] = encoding.attention_mask
        return ids, mask

    def token_counts(self, texts: list[str]) -> list[int]:
        """Tokens per text after truncation (for batching texts of similar length)."""
        return [len(e.ids) for e in self.tokenizer.encode_batch([self._prepare(t) for t in texts])]

    def encode(self, texts: list[str]):
        """Unit-length float32 vectors, one row per text."""
        ids, mask = self.tokenize(texts)
        return self.session.run(None, {"input_ids": ids, "attention_mask": mask})[0]

    def _prepare(self, text: str) -> str:
        # sentence-transformers strips each text, and lowercases it when configured to.
        text = str(text).strip()
        return text.lower() if self.settings.lowercase else text


def runtime_missing() -> str | None:
    """Which package the fast path lacks ("onnxruntime", "tokenizers"), or None."""
    try:
        import onnxruntime  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as exc:
        return exc.name or "onnxruntime"
    return None


def default_threads() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_THREADS))


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


# -- the check recorded in the index ------------------------------------------------


@dataclass(frozen=True)
class GraphCheck:
    """Whether this model's graph reproduces it, as decided at build time.

    `reference` holds the model's own vectors of `texts` (float32 rows), so
    a later process can verify a graph without loading the model.
    """

    ok: bool
    detail: str  # one line: the cosine reached, or why there is no graph
    graph_name: str = ""
    texts: tuple[str, ...] = ()
    reference: bytes = field(default=b"", repr=False)
    dimension: int = 0

    def to_json(self) -> str:
        data = {
            "ok": self.ok,
            "detail": self.detail,
            "graph_name": self.graph_name,
            "texts": list(self.texts),
            "reference": base64.b64encode(self.reference).decode("ascii"),
            "dimension": self.dimension,
        }
        return json.dumps(data, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | None) -> GraphCheck | None:
        """The recorded check, or None when there is none (or it is unreadable)."""
        if not text:
            return None
        try:
            data = json.loads(text)
            return cls(
                ok=bool(data["ok"]),
                detail=str(data["detail"]),
                graph_name=str(data.get("graph_name", "")),
                texts=tuple(data.get("texts", ())),
                reference=base64.b64decode(data.get("reference", "")),
                dimension=int(data.get("dimension", 0)),
            )
        except (ValueError, KeyError, TypeError):
            return None

    def reference_vectors(self):
        import numpy as np

        return np.frombuffer(self.reference, dtype=np.float32).reshape(len(self.texts), -1)


def min_cosine(a, b) -> float:
    """The smallest row-wise cosine of two stacks of unit vectors (-1 if shapes differ)."""
    if a.shape != b.shape:
        return -1.0
    return float((a * b).sum(axis=1).min())


def verify(encoder: OnnxEncoder, check: GraphCheck) -> float:
    """Re-embed the recorded texts with `encoder`; the worst cosine with the model's vectors."""
    return min_cosine(encoder.encode(list(check.texts)), check.reference_vectors())


# -- at build time: export and check (torch is imported here only) -------------------


def check_against_model(model, encoder: OnnxEncoder, graph_name: str) -> GraphCheck:
    """Compare the encoder with the loaded SentenceTransformer on CHECK_TEXTS."""
    import numpy as np

    texts = list(CHECK_TEXTS)
    reference = np.ascontiguousarray(
        model.encode(texts, normalize_embeddings=True, show_progress_bar=False), dtype=np.float32
    )
    cosine = min_cosine(encoder.encode(texts), reference)
    kept = len(VERIFY_TEXTS)
    common = {"graph_name": graph_name, "texts": VERIFY_TEXTS, "dimension": reference.shape[1]}
    if cosine < MIN_COSINE:
        detail = f"the exported graph does not reproduce the model (cosine {cosine:.6f})"
        return GraphCheck(False, detail, **common)
    detail = f"reproduces the model: min cosine {cosine:.6f} on {len(texts)} texts"
    return GraphCheck(True, detail, reference=reference[:kept].tobytes(), **common)


def export_graph(model, graph_path: Path) -> None:
    """Export transformer + mean pooling + normalisation of a SentenceTransformer, atomically."""
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
        tmp.chmod(0o644)  # mkstemp's 0600 would hide a shared build folder's graph from others
        os.replace(tmp, graph_path)
    finally:
        tmp.unlink(missing_ok=True)


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
