"""Retrieval: four signals, each ranking causes, fused by reciprocal rank.

signature  the KB's regexes over the cleaned log; exact, so it weighs most,
           and a match in the root error counts three times
lexical    SQLite FTS5 (bm25) over CJK-aware tokens of every chunk
dense      sentence-transformers + FAISS over the same chunks
classifier a ridge classifier over the same query vector, fitted on the KB's
           embedded chunks as labelled examples (classifier.py)

Each signal scores chunks; a cause takes the best score of its chunks
(weighted by chunk kind), so the ranking is over causes, not text pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from assistant.clean import CleanLog
from assistant import config
from assistant.i18n import detect_lang
from assistant.knowledge.bridges import Bridge, load_bridge
from assistant.knowledge.classifier import CauseClassifier
from assistant.knowledge.index import KIND_WEIGHTS, LoadedIndex
from assistant.knowledge.patterns import PatternSet
from assistant.knowledge.textsearch import fts_query

SIGNALS = ("signature", "lexical", "dense", "classifier")
# The classifier weighs less than dense: it generalises over phrasings but is
# sure of itself on texts far from every example (0.5..1.5 tried on the tuning sets).
# Signature at 3 (was 2 with three signals): dense and classifier read the same
# embedding, and together they must not outvote an exact KB match in the log's
# body (3/4 > (1 + 1 + 0.75)/4). 2..4 measured the same on every eval set.
SIGNAL_WEIGHTS = {"signature": 3.0, "lexical": 1.0, "dense": 1.0, "classifier": 0.75}
EMBEDDED_SIGNALS = ("dense", "classifier")  # both need the query embedding
RRF_K = 3  # small: there are tens of causes, and the top few must stand apart
CHUNK_HITS = 80
DENSE_FLOOR = 0.2  # cosine below this is noise for MiniLM
SIGNATURE_TEXT_LIMIT = 400_000  # characters of a huge log the regexes scan
CONTEXT_WEIGHT = 0.35  # how much a follow-up's earlier turns pull the dense query
LARGE_INDEX = 20_000  # chunks
LEXICAL_TERMS_SMALL, LEXICAL_TERMS_LARGE = 24, 16
COMMON_TERM_SHARE = 0.02  # on a large index, a term in more chunks than this is noise
DENSE_TEXT_LIMIT = 800  # characters: more than the model's 128 tokens never reach it


@dataclass
class RankedCause:
    """A cause as fused from the signals; `ranks` holds its rank per signal."""

    id: str
    score: float
    ranks: dict[str, int] = field(default_factory=dict)


class Retriever:
    """Ranks the causes of one loaded index for a cleaned query."""

    def __init__(self, index: LoadedIndex, embedder, bridge: Bridge | None = None):
        self.index = index
        self.embedder = embedder
        # Chinese questions also search with the English of their DDP terms (bridges.py).
        self.bridge = bridge if bridge is not None else load_bridge(config.kb_layers())
        # Linear-time matching (patterns.py): no KB signature can make a query slow.
        self.signatures = {
            cid: PatternSet.from_patterns(data.get("signatures", []), skip_invalid=True)
            for cid, data in index.causes.items()
        }
        # A synthetic index (benchmarks) may have no database: no classifier then.
        db = getattr(index, "db", None)
        self.classifier = CauseClassifier.from_index(db, set(index.causes)) if db else None

    # -- the three signals -------------------------------------------------

    def signature_scores(self, clean: CleanLog) -> dict[str, float]:
        root = clean.root_error
        root_text = f"{root.type}: {root.message}" if root else ""
        body = clean.text[:SIGNATURE_TEXT_LIMIT]
        scores: dict[str, float] = {}
        for cid, patterns in self.signatures.items():
            score = 0.0
            for pattern in patterns.signatures:
                if root_text and pattern.search(root_text):
                    score += 3.0
                elif pattern.search(body):
                    score += 1.0
            if score:
                scores[cid] = score
        return scores

    def lexical_scores(self, text: str) -> dict[str, float]:
        # On a large index every extra OR-ed term costs bm25 over many rows.
        chunks = len(self.index.chunk_kinds)
        if chunks <= LARGE_INDEX:
            query = fts_query(text, self.index.token_df, limit=LEXICAL_TERMS_SMALL)
        else:
            max_df = int(COMMON_TERM_SHARE * chunks)
            query = fts_query(text, self.index.token_df, limit=LEXICAL_TERMS_LARGE, max_df=max_df)
        if query is None:
            return {}
        rows = self.index.db.execute(
            "select rowid, bm25(chunks_fts) from chunks_fts where chunks_fts match ? "
            "order by bm25(chunks_fts) limit ?",
            (query, CHUNK_HITS),
        ).fetchall()
        return self._by_cause((rowid, -score) for rowid, score in rows)

    def query_vector(self, text: str, context: str | None = None):
        """The query's embedding (1 x dimension), pulled towards earlier turns' context."""
        vector = self.embedder.encode([text[:DENSE_TEXT_LIMIT]])
        if context:
            vector = vector + CONTEXT_WEIGHT * self.embedder.encode([context[:DENSE_TEXT_LIMIT]])
            vector /= float((vector**2).sum()) ** 0.5
        return vector

    def dense_scores(self, vector) -> dict[str, float]:
        sims, ids = self.index.faiss_index.search(vector, CHUNK_HITS)
        hits = ((int(i), float(s)) for i, s in zip(ids[0], sims[0]) if i >= 0 and s >= DENSE_FLOOR)
        return self._by_cause(hits)

    def classifier_scores(self, vector, query: str) -> dict[str, float]:
        """The KB-trained classifier's causes; none for a Chinese question.

        The classifier learned from English examples through an English
        embedding model: on Chinese questions it extrapolates, and on the
        tuning set's Chinese questions it cost 7 points of top-1 (0.935 ->
        0.871) while changing nothing on the tuning sets' Chinese real reports.
        """
        if self.classifier is None or detect_lang(query[:2000]) == "zh":
            return {}
        return self.classifier.scores(vector)

    def _by_cause(self, hits) -> dict[str, float]:
        """Best weighted chunk score per cause."""
        scores: dict[str, float] = {}
        for chunk_id, score in hits:
            kind_weight = KIND_WEIGHTS.get(self.index.chunk_kinds[chunk_id], 1.0)
            for cid, strength in self.index.chunk_causes[chunk_id].items():
                weight = kind_weight * strength
                if weight <= 0:
                    continue
                value = score * weight if score > 0 else score / weight
                if cid in self.index.causes and value > scores.get(cid, float("-inf")):
                    scores[cid] = value
        return scores

    # -- fusion --------------------------------------------------------------

    def rank(
        self,
        clean: CleanLog,
        context: str | None = None,
        signals: tuple[str, ...] = SIGNALS,
    ) -> list[RankedCause]:
        """Causes best first, fused over `signals` by weighted reciprocal rank."""
        return fuse(self.signal_scores(clean, context, signals))

    def signal_scores(
        self,
        clean: CleanLog,
        context: str | None = None,
        signals: tuple[str, ...] = SIGNALS,
        shortcut: bool = True,
    ) -> dict[str, dict[str, float]]:
        """Each signal's cause scores, before fusion.

        With `shortcut`, the embedded signals (dense, classifier) are skipped
        when a signature already matched the root error (see `needs_dense`).
        """
        query = clean.focus or clean.text[:2000]
        # The English of its Chinese terms: the KB and the model are mostly English.
        # Appended, so it reaches the model only when the question is short.
        bridged = self.bridge.expand(query)
        per_signal: dict[str, dict[str, float]] = {}
        if "signature" in signals:
            per_signal["signature"] = self.signature_scores(clean)
        if "lexical" in signals:
            lexical_text = f"{bridged}\n{context}" if context else bridged
            per_signal["lexical"] = self.lexical_scores(lexical_text)
        wanted = [name for name in EMBEDDED_SIGNALS if name in signals]
        if wanted and (not shortcut or needs_dense(per_signal)):
            vector = self.query_vector(bridged, context)  # embedded once for both
            if "dense" in wanted:
                per_signal["dense"] = self.dense_scores(vector)
            if "classifier" in wanted:
                per_signal["classifier"] = self.classifier_scores(vector, query)
        return per_signal


ROOT_HIT = 3.0  # the signature score of a match in the root error


def needs_dense(per_signal: dict[str, dict[str, float]]) -> bool:
    """Whether the dense signal can still change the answer.

    Dense search finds paraphrases and questions. When an exact signature has
    matched the root error the cause is known, and the query embedding (most
    of a warm query's time on a small CPU) is skipped; on the labelled set
    this changed no metric while skipping 62 of 149 embeddings.
    """
    return max(per_signal.get("signature", {}).values(), default=0.0) < ROOT_HIT


def with_shortcut(per_signal: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The signals the product fuses, given all three were computed."""
    if "signature" in per_signal and not needs_dense(per_signal):
        return {
            name: scores for name, scores in per_signal.items() if name not in EMBEDDED_SIGNALS
        }
    return per_signal


def fuse(per_signal: dict[str, dict[str, float]]) -> list[RankedCause]:
    """Weighted reciprocal rank fusion, scores scaled to 0..1."""
    fused: dict[str, RankedCause] = {}
    for signal, scores in per_signal.items():
        ordered = sorted(scores.items(), key=lambda item: (-item[1], item[0]))
        for rank, (cid, _) in enumerate(ordered, start=1):
            entry = fused.setdefault(cid, RankedCause(cid, 0.0))
            entry.ranks[signal] = rank
            entry.score += SIGNAL_WEIGHTS[signal] / (RRF_K + rank)
    best_possible = sum(SIGNAL_WEIGHTS[s] / (RRF_K + 1) for s in per_signal) or 1.0
    for entry in fused.values():
        entry.score /= best_possible
    return sorted(fused.values(), key=lambda e: (-e.score, e.id))
