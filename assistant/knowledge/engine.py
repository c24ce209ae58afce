"""The headless core behind `assistant ask` and the chat: index + model + retrieval.

    engine = Engine()
    engine.load()                       # checks/rebuilds the index, loads the model
    result = engine.ask("Duplicate GPU detected : rank 1 and rank 0 both on CUDA device")

`ask` returns causes ranked by retrieval alone (verdicts "not_run"); probes
and verdicts are applied afterwards by assistant.verdicts.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import replace
from functools import cache
from pathlib import Path

from assistant import config
from assistant.clean import clean_log
from assistant.errors import ExitCode, UserError
from assistant.i18n import detect_lang
from assistant.knowledge.bridges import load_bridge
from assistant.knowledge.catalog import claiming_answers
from assistant.knowledge.files import as_layers, content_hash
from assistant.knowledge.index import (
    BuildReport,
    IndexProblem,
    LoadedIndex,
    build_index,
    open_index,
)
from assistant.knowledge.neighbours import VECTORS_FILE, ReportNeighbours
from assistant.knowledge.reports import (
    MODEL_FILE,
    REPORTS_FOLDER,
    LearnedReports,
    PoolVectors,
    example_key,
    text_key,
)
from assistant.knowledge.retrieve import SIGNALS, RankedCause, Retriever, embedded_text
from assistant.results import AnswerRef, CauseDoc, CauseResult, Result

MAX_ANSWERS_PER_CAUSE = 6
# The head of a long log is enough to tell which thread asked the same thing.
QUERY_CHARS_FOR_ANSWERS = 4_000
REBUILD_ATTEMPTS = 2  # a KB saved during a build gets one more build
MAX_TOP = 50


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


class Engine:
    """Loads the index and the embedding model once; answers many questions."""

    def __init__(
        self,
        model: str | None = None,
        kb_root: Path | list[Path] | None = None,
        index_path: Path | None = None,
        log: Callable[[str], None] | None = None,
        require_contract: bool = True,
        embedder=None,
    ):
        self.model_setting = model
        self.kb_root = kb_root or config.kb_layers()  # one folder, or the layers
        self.index_path = index_path or config.index_path()
        self.log = log or _stderr
        self.require_contract = require_contract  # False only for small test KBs
        self._lock = threading.RLock()
        self._embedder = embedder  # shareable: loading the model is the slow part
        self._index: LoadedIndex | None = None
        self._retriever: Retriever | None = None

    # -- loading -------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._retriever is not None

    @property
    def embedder(self):
        if self._embedder is None:
            from assistant.knowledge.embed import Embedder

            self._embedder = Embedder(self.model_setting)
        return self._embedder

    def load(self) -> None:
        """Open the index (rebuilding it when missing, stale or damaged) and the model."""
        with self._lock:
            if self._retriever is not None:
                return
            index = self._open_or_rebuild()
            # The graph checked at build time, verified without torch; else one line, and
            # sentence-transformers.
            self.embedder.use_recorded(
                index.graph_check, log=self.log, index_dir=self.index_path.parent
            )
            bridge = load_bridge(self.kb_root)  # this engine's KB layers, not the global ones
            reports = self.learned_reports(
                {cid: list(data.get("symptoms", [])) for cid, data in index.causes.items()}
            )
            neighbours = self.with_vectors(reports, bridge, index.kb_hash)
            self._index = index
            self._retriever = Retriever(index, self.embedder, bridge, reports, neighbours)

    def learned_reports(self, symptoms: dict[str, list[str]]) -> LearnedReports:
        """The reports signal for these causes (id -> its symptoms), saved beside
        the index (reports.py); `with_vectors` gives it its texts' vectors."""
        # The labelled sets, and each team layer's reports/ (e.g. `assistant kb
        # feedback --export <layer>/reports/tickets.jsonl`: the answers users confirmed).
        teams = [layer / REPORTS_FOLDER for layer in as_layers(self.kb_root)]
        return LearnedReports(
            [config.eval_dir(), *teams],
            [self.index_path.parent / MODEL_FILE, config.user_cache_dir() / MODEL_FILE],
            symptoms,
            prepare=lambda text: clean_log(text).text,
        )

    def with_vectors(
        self, learned: LearnedReports, bridge, kb_hash: str
    ) -> Callable[[], ReportNeighbours | None]:
        """Give `learned` its texts' vectors; returns their loader, which the
        neighbours signal shares (one load for both signals that read them)."""
        neighbours = cache(lambda: self.report_neighbours(learned, bridge, kb_hash))
        learned.vectors = PoolVectors(key=lambda: self.vectors_key(bridge), load=neighbours)
        return neighbours

    def report_neighbours(
        self, learned: LearnedReports, bridge, kb_hash: str
    ) -> ReportNeighbours | None:
        """The vectors of the labelled reports and the KB's symptoms (neighbours.py),
        saved where the reports model is (the build folder, the user's cache);
        None without labelled reports."""
        key = self.texts_key(learned, kb_hash)
        if key is None:
            return None

        def texts() -> list[tuple[str, tuple[str, ...], str]]:
            reports = [
                (embedded_text(clean_log(text), bridge), causes, report_key)
                for text, causes, report_key in learned.labelled()
            ]
            examples = [
                (embedded_text(clean_log(text), bridge), (cause,), example_key(text))
                for text, cause in learned.symptoms
            ]
            return reports + examples

        caches = [path.with_name(VECTORS_FILE) for path in learned.caches]
        return ReportNeighbours.load_or_embed(
            key, texts, self.embedder, caches, shipped=self.shipped_vectors
        )

    def shipped_vectors(self) -> dict:
        """The vectors shipped with the checkout for this engine's model (shipped.py)."""
        from assistant.knowledge.shipped import read_shipped, shipped_path

        return read_shipped(shipped_path(), str(self.embedder.fingerprint))

    @staticmethod
    def texts_key(learned: LearnedReports, kb_hash: str) -> str | None:
        """What decides the texts embedded: the bridge (a KB file), the report
        files and the code that prepares a text for the model
        (retrieve.embedded_text, the bridge's expansion). A changed text is
        embedded again, the others are reused."""
        files = learned.files_key()
        if files is None:
            return None
        return hashlib.sha256(f"{kb_hash}\0{files}\0{text_preparation()}".encode()).hexdigest()

    def vectors_key(self, bridge) -> str:
        """What the pooled texts' vectors depend on beyond the texts (which the
        reports model's own key holds): the embedding model, the bridge that
        expands a Chinese text and the code that prepares one. Not the whole
        KB's hash: an edit of a thread changes no vector and refits nothing."""
        terms = json.dumps(sorted(bridge.terms.items()), ensure_ascii=False)
        prepared = hashlib.sha256(f"{terms}\0{text_preparation()}".encode()).hexdigest()
        return f"{self.embedder.fingerprint} {prepared}"

    def _open_or_rebuild(self) -> LoadedIndex:
        kb_hash = content_hash(self.kb_root)
        try:
            return open_index(self.index_path, kb_hash, self.embedder.fingerprint)
        except IndexProblem as problem:
            self.log(f"assistant: {problem}; rebuilding the index")
        # The KB may change while it is being built (an editor saving, another
        # process building too): open what was built for the KB as it is now,
        # building once more if it moved on meanwhile.
        for attempt in range(REBUILD_ATTEMPTS):
            if attempt:
                self.log("assistant: the knowledge base changed during the build; building again")
            self.build()
            try:
                return open_index(
                    self.index_path, content_hash(self.kb_root), self.embedder.fingerprint
                )
            except IndexProblem as exc:
                problem = exc
        raise UserError(
            f"the knowledge base keeps changing while its index is built ({problem});"
            " run the command again once it is saved",
            ExitCode.FAILED,
        ) from None

    def build(self) -> BuildReport:
        """Validate the KB and compile it into the index file."""
        from assistant.knowledge.kb import load_valid_kb

        kb = load_valid_kb(self.kb_root, require_contract=self.require_contract)
        try:
            report = build_index(
                kb, self.embedder, self.index_path, log=self.log, shipped=self.shipped_vectors
            )
        except OSError as exc:  # an unwritable or missing build folder, a full disk
            raise UserError(
                f"cannot write the index {self.index_path}: {exc.strerror or exc}; "
                "set ASSISTANT_BUILD to a writable folder",
                ExitCode.FAILED,
            ) from None
        # Fitted and embedded now, so the first question does not wait for them.
        learned = self.learned_reports({cid: list(c.symptoms) for cid, c in kb.causes.items()})
        self.with_vectors(learned, load_bridge(self.kb_root), kb.content_hash)()
        return replace(report, learned=learned.describe(learned.model()))

    def ship_vectors(self) -> tuple[Path, int]:
        """Write the vectors of every text this engine embedded (the KB's chunks,
        the labelled reports, the symptoms) where a fresh clone reads them
        (shipped.py); returns the file and how many it holds."""
        from assistant.knowledge.shipped import (
            indexed_vectors,
            neighbour_vectors,
            shipped_path,
            write_shipped,
        )

        self.load()
        assert self._retriever is not None
        vectors = {
            **indexed_vectors(self.index_path),
            **neighbour_vectors(self._retriever.neighbours),
        }
        path = shipped_path()
        if not vectors or not write_shipped(path, str(self.embedder.fingerprint), vectors):
            raise UserError(f"cannot write the shipped vectors to {path}", ExitCode.FAILED)
        return path, len(vectors)

    def rebuild(self) -> str:
        """Force a rebuild and reload; returns a one-line summary."""
        with self._lock:
            report = self.build()
            if self._index is not None:
                self._index.close()
            self._index = self._retriever = None
        self.load()
        return report.summary()

    # -- answering -----------------------------------------------------------

    def ask(
        self,
        query: str,
        top: int = 5,
        context: str | None = None,
        signals: tuple[str, ...] = SIGNALS,
    ) -> Result:
        """Rank the causes of `query` (retrieval only; verdicts stay "not_run")."""
        if not query or not query.strip():
            raise UserError("the question is empty: paste an error message or a log")
        if not 1 <= top <= MAX_TOP:
            raise UserError(f"--top must be between 1 and {MAX_TOP}")
        self.load()
        clean = clean_log(query)
        ranked = self._retriever.rank(clean, context=context, signals=signals)[:top]
        lang = detect_lang(query[:20_000])
        return Result(
            query=query,
            root_error=clean.root_error,
            causes=[self._cause_result(r, lang, query) for r in ranked],
            lang=lang,
        )

    def rank_ids(self, query: str, signals: tuple[str, ...] = SIGNALS) -> list[str]:
        """Cause ids best first."""
        self.load()
        return [r.id for r in self._retriever.rank(clean_log(query), signals=signals)]

    @contextmanager
    def holding_out(self, queries: list[str]):
        """Within the block, the reports signal never learned from these texts:
        an evaluation scores each labelled set with a model fitted without it."""
        self.load()
        before = self._retriever.held_out
        self._retriever.held_out = frozenset(text_key(q) for q in queries)
        try:
            yield
        finally:
            self._retriever.held_out = before

    def signal_scores(self, query: str) -> dict[str, dict[str, float]]:
        """Every signal's cause scores for a query, unfused and all computed (for evaluation)."""
        self.load()
        return self._retriever.signal_scores(clean_log(query), shortcut=False)

    def cause(self, cause_id: str) -> dict:
        """The full KB entry of a cause (for detail views)."""
        self.load()
        try:
            return dict(self._index.causes[cause_id])
        except KeyError:
            raise UserError(f"unknown cause {cause_id!r}") from None

    def document(self, cause_id: str) -> CauseDoc:
        """A cause's whole document, typed (`assistant explain`, the detail screen)."""
        return CauseDoc.from_kb(self.cause(cause_id))

    def cause_ids(self) -> list[str]:
        self.load()
        return list(self._index.causes)

    def _cause_result(self, ranked: RankedCause, lang: str, query: str) -> CauseResult:
        data = self._index.causes[ranked.id]
        result = CauseResult.from_kb(
            data, ranked.score, self._answers_for(ranked.id, lang, query), ranked.ranks
        )
        return replace(result, root_hit=ranked.root_hit, leads=dict(ranked.leads))

    def signatures(self) -> dict[str, list[str]]:
        """Every cause's error signatures (regex sources), as the KB gives them."""
        self.load()
        return {cid: list(data.get("signatures", [])) for cid, data in self._index.causes.items()}

    def _answers_for(self, cause_id: str, lang: str, query: str) -> list[AnswerRef]:
        """Community answers that claim this cause, the best first for this question."""
        threads = self._index.threads.values()
        return claiming_answers(
            threads,
            cause_id,
            order="best",
            lang=lang,
            limit=MAX_ANSWERS_PER_CAUSE,
            query=query[:QUERY_CHARS_FOR_ANSWERS],
        )


def text_preparation() -> str:
    """The code that turns a labelled report into the text the model embeds, and
    its length limit: part of the neighbours' key, so a change re-embeds."""
    import inspect

    from assistant.knowledge import bridges, retrieve

    bridge = bridges.Bridge
    parts = (
        retrieve.question_text,
        retrieve.embedded_text,
        bridge.expand,
        bridge.english,
        bridge.found,
    )
    try:
        source = "".join(inspect.getsource(part) for part in parts)
    except (OSError, TypeError):  # installed without sources: the package's version keys it
        from importlib.metadata import PackageNotFoundError, version

        try:
            source = version("ddp-assistant")
        except PackageNotFoundError:
            source = "unknown"
    return source + str(retrieve.DENSE_TEXT_LIMIT)
