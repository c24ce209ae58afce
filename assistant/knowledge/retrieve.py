"""Retrieval: five signals, each ranking causes, fused by reciprocal rank.

signature  the KB's regexes over the cleaned log; exact, so it weighs most,
           and a match in the root error counts three times
lexical    SQLite FTS5 (bm25) over CJK-aware tokens of every chunk, plus each
           cause's TF-IDF centroid over the same tokens (centroids.py)
dense      sentence-transformers + FAISS over the same chunks, plus (for a
           question or report without a root error) a ridge classifier over
           the same query vector, fitted on the KB's chunks (classifier.py)
reports    a ridge model over the n-grams of labelled real user reports
           (data/eval), fitted leave-the-evaluated-set-out for `kb eval`
           (reports.py)
neighbours the causes of the labelled reports nearest the question's dense
           vector, for questions that are not Chinese (neighbours.py)

Each signal scores chunks; a cause takes the best score of its chunks
(weighted by chunk kind), so the ranking is over causes, not text pieces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from assistant import config
from assistant.clean import CleanLog
from assistant.i18n import detect_lang
from assistant.knowledge.bridges import Bridge, load_bridge
from assistant.knowledge.centroids import CauseCentroids
from assistant.knowledge.classifier import CauseClassifier
from assistant.knowledge.index import KIND_WEIGHTS, LoadedIndex
from assistant.knowledge.neighbours import ReportNeighbours
from assistant.knowledge.patterns import LINEAR_ENGINE, PatternSet
from assistant.knowledge.refines import taken_over
from assistant.knowledge.reportkind import (
    reports_failure,
    reports_hang_only,
    reports_launcher_only,
    reports_several_processes,
)
from assistant.knowledge.reports import LearnedReports
from assistant.knowledge.textsearch import fts_query

SIGNALS = ("signature", "lexical", "dense", "reports", "neighbours")
# The labelled reports weighed 1 until session 15; with 1416 of them in the pool
# they weigh 1.5: each labelled set scored by a reports model that never saw it,
# the traffic-like sets (holdout8-24, 925) went 0.589 -> 0.601 first, 11 sets
# gained and 3 lost one report each, queries.jsonl 0.953 -> 0.946 (one query;
# 0.953 again with holdout25 in the pool).
# With 801 reports (session 14) the same change gained half a point: the signal
# grows with its pool, and its weight may again when the pool has.
# The neighbours (session 27) weigh 0.5: each labelled file held out, the
# traffic-like sets (holdout8-40, 1,487 reports) went 0.658 / 0.808 -> 0.663 /
# 0.823 (0.3: 0.662 / 0.818; 1.0: 0.660 / 0.820); they vote with the reports
# signal more often than not, so a full weight counts the same evidence twice.
SIGNAL_WEIGHTS = {"signature": 2.0, "lexical": 1.0, "dense": 1.0, "reports": 1.5, "neighbours": 0.5}
# The signals that read the question's embedding: skipped together (needs_dense).
EMBEDDED = ("dense", "neighbours")
RRF_K = 3  # small: there are tens of causes, and the top few must stand apart
# A signal's near-ties are noise: one KB edit anywhere moves bm25's term weights
# and the classifier, and 1.687 against 1.677 became rank 2 against rank 3,
# worth more in fusion than most margins. Each cause's rank in a signal is
# therefore soft: 1 + the sum, over the other causes, of a logistic step in
# their score minus its own, with a width of this share of the signal's best.
# Equal scores share a rank (the alphabet used to split them); far apart, the
# plain rank. Over the 1151 labelled queries of session 10, widths 0.04-0.16
# all beat hard ranks; 0.08: 0.731 -> 0.737, with Chinese text 0.682 -> 0.711, the fresher
# holdout13-16 0.510 -> 0.547; top-1 answers that adding three unrelated
# causes flipped: 26 -> 22.
RANK_TIE_WIDTH = 0.08
# Ranks alone drop a signal's margins: a Chinese question whose lexical best
# scored five times its runner-up still lost to the dense signal's (English
# model's) first pick. Each cause also gets this share of how close it comes
# to each signal's best score; it breaks rank ties the same way (first in one
# signal and twelfth in the other, or the other way round), which the id's
# place in the alphabet used to decide. Over 813 labelled queries 0.788 ->
# 0.790 (zh 0.725 -> 0.733); the KB's own Chinese symptoms first 0.949 -> 0.975.
CLOSENESS_WEIGHT = 0.3
CHUNK_HITS = 80
DENSE_FLOOR = 0.2  # cosine below this is noise for MiniLM
SIGNATURE_TEXT_LIMIT = 400_000  # characters of a huge log the regexes scan
CONTEXT_WEIGHT = 0.35  # how much a follow-up's earlier turns pull the dense query
LARGE_INDEX = 20_000  # chunks
# The rarest query terms the lexical search ORs together. On a small index
# each extra term is cheap, and a cap of 24 kept only the rarest few of a
# report's words: a Chinese report gives a bigram per character, so 24 were
# its first dozen characters' oddest pairs (over 813 labelled queries, 64
# terms: lexical alone 0.611 -> 0.654, zh 0.551 -> 0.623; fused 0.775 -> 0.784;
# more than 64 changes nothing). A large index keeps few, for speed.
LEXICAL_TERMS_SMALL, LEXICAL_TERMS_LARGE = 64, 16
COMMON_TERM_SHARE = 0.02  # on a large index, a term in more chunks than this is noise
DENSE_TEXT_LIMIT = 800  # characters: more than the model's 128 tokens never reach it
# How much the classifier's cause score adds to the nearest chunk's cosine in
# the dense signal (0.5..3 tried on the tuning sets, data/eval/README.md).
# Folded into dense rather than fused as a signal of its own: it reads the
# same embedding and the same KB text, so its vote is not independent of
# dense's. (The `reports` signal is fused on its own: it learns from other
# evidence, the labelled reports.)
CLASSIFIER_WEIGHT = 0.5
# A cause whose premise the report contradicts (a cause that never fails a job,
# for a report of an error): its word scores count this much (reportkind.py).
CONTRADICTED_FACTOR = 0.5


@dataclass
class RankedCause:
    """A cause as fused from the signals; `ranks` holds its rank per signal."""

    id: str
    score: float
    ranks: dict[str, int] = field(default_factory=dict)
    # An exact KB signature matched the root error itself, not only a line of
    # the body: the evidence confidence may call "the error says so".
    root_hit: bool = False
    # Per signal that ranks it first: how far its score is ahead of the next
    # cause's there (how clear that signal is, for confidence).
    leads: dict[str, float] = field(default_factory=dict)


class Retriever:
    """Ranks the causes of one loaded index for a cleaned query."""

    def __init__(
        self,
        index: LoadedIndex,
        embedder,
        bridge: Bridge | None = None,
        reports: LearnedReports | None = None,
        neighbours: Callable[[], ReportNeighbours | None] | None = None,
    ):
        self.index = index
        self.embedder = embedder
        self.reports = reports
        # Loaded on the first question that embeds: a signature hit never waits for it.
        self._neighbours = neighbours
        # Texts (reports.text_key) an evaluation scores: never learned from.
        self.held_out: frozenset[str] = frozenset()
        # Chinese questions also search with the English of their DDP terms (bridges.py).
        self.bridge = bridge if bridge is not None else load_bridge(config.kb_layers())
        # Linear-time matching (patterns.py): no KB signature can make a query slow.
        self.signatures = {
            cid: PatternSet.from_patterns(data.get("signatures", []), skip_invalid=True)
            for cid, data in index.causes.items()
        }
        self._causes_where: dict[tuple[str, bool], frozenset[str]] = {}
        # The last query whose every signal was scored (no shortcut), and those
        # scores: `kb eval` scores each query so, then asks it through the
        # pipeline, which would compute the same signals again.
        self._last_full: tuple[tuple, dict[str, dict[str, float]]] | None = None
        self.named_by = {
            cid: words
            for cid, data in index.causes.items()
            if (words := any_of(data.get("named_by", []))) is not None
        }
        # cause -> the causes it is a special case of (kb.Cause.refines)
        self.refines = {
            cid: tuple(general)
            for cid, data in index.causes.items()
            if (general := data.get("refines")) and cid in self.named_by
        }

    @cached_property
    def neighbours(self) -> ReportNeighbours | None:
        return self._neighbours() if self._neighbours is not None else None

    @cached_property
    def classifier(self) -> CauseClassifier | None:
        """Fitted on first use (tens of ms): an exact-signature query never waits for it."""
        return CauseClassifier.from_index(self.index)

    @cached_property
    def centroids(self) -> CauseCentroids | None:
        """Read from the index (stored at build time) on first use; None on a large
        index, where bm25 alone ranks the words (centroids.FIT_LIMIT)."""
        return CauseCentroids.from_index(self.index)

    # -- the signals -------------------------------------------------------

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
        return self.refined(scores, body)

    def refined(self, scores: dict[str, float], body: str) -> dict[str, float]:
        """Signature scores with each general cause's match handed to a special
        case of it that the report names (kb.Cause.refines).

        "Default process group has not been initialized" is what a missing
        init_process_group prints, and also what a SyncBatchNorm layer prints
        with no process group: in a report that names SyncBN the error is the
        SyncBN cause's (5 of the 5 labelled reports with both, over four sets).
        The general cause keeps its words, so it stays a close second.
        """

        def names(cid: str) -> bool:
            return self.named_by[cid].search(body) is not None

        handed = taken_over(self.refines, scores, names)
        general_scores = dict(scores)  # read before any is handed over: two may share one
        for cid, general in handed.items():
            scores[cid] = max(scores.get(cid, 0.0), *(general_scores[g] for g in general))
        for general in handed.values():
            for g in general:
                scores.pop(g, None)
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
        best_chunks = self._by_cause((rowid, -score) for rowid, score in rows)
        if self.centroids is None:
            return best_chunks
        # Equal parts of the best chunk and the whole cause, each scaled by its best.
        return summed_shares(best_chunks, self.centroids.scores(text))

    def query_vector(self, text: str, context: str | None = None) -> np.ndarray:
        """The question's embedding (1 x dimensions), pulled toward a follow-up's earlier turns."""
        vector = self.embedded(text[:DENSE_TEXT_LIMIT])
        if context:
            vector = vector + CONTEXT_WEIGHT * self.embedded(context[:DENSE_TEXT_LIMIT])
            vector /= float((vector**2).sum()) ** 0.5
        return vector

    def embedded(self, text: str) -> np.ndarray:
        """The model's vector of `text`; read from the labelled reports' saved
        vectors when it is one of their texts and they are loaded already (`kb
        eval` asks every labelled report: ~20 ms of model time each on two
        cores), never loaded for this alone."""
        loaded = self.__dict__.get("neighbours")  # the cached_property, if it ran
        saved = loaded.vector_of(text) if loaded is not None else None
        return saved if saved is not None else self.embedder.encode([text])

    def dense_scores(
        self, text: str, context: str | None = None, clean: CleanLog | None = None
    ) -> dict[str, float]:
        """Nearest chunks per cause, plus the KB classifier's vote when `clean` allows it."""
        return self.dense_scores_of(self.query_vector(text, context), clean)

    def dense_scores_of(
        self, vector: np.ndarray, clean: CleanLog | None = None
    ) -> dict[str, float]:
        """`dense_scores` for a question already embedded."""
        sims, ids = self.index.faiss_index.search(vector, CHUNK_HITS)
        hits = ((int(i), float(s)) for i, s in zip(ids[0], sims[0]) if i >= 0 and s >= DENSE_FLOOR)
        scores = self._by_cause(hits)
        if clean is not None and self.classifier_applies(clean):
            for cid, value in self.classifier.scores(vector).items():
                scores[cid] = scores.get(cid, 0.0) + CLASSIFIER_WEIGHT * value
        return scores

    def classifier_applies(self, clean: CleanLog) -> bool:
        """Whether the classifier may vote: on English prose without a root error.

        It learned from the KB's symptoms and questions, through an English
        model. A log with a root error belongs to the signatures (on a gloo
        "Connection closed by peer" log it pushed network-interface up); on
        Chinese questions it extrapolates (queries.jsonl zh top-1 0.935 ->
        0.871 when it voted there).
        """
        if self.classifier is None or clean.root_error is not None:
            return False
        return detect_lang((clean.focus or clean.text)[:2000]) != "zh"

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

        With `shortcut`, the dense signal is skipped when a signature already
        matched the root error (see `needs_dense`).
        """
        key = (clean.text, clean.focus, repr(clean.root_error), context, signals, self.held_out)
        last = self._last_full
        if last is not None and last[0] == key:
            # The shortcut only leaves dense out, and word lowering never
            # touches the signatures that decide it: the same scores either way.
            return with_shortcut(dict(last[1])) if shortcut else dict(last[1])
        query = question_text(clean)
        bridged = self.bridge.expand(query)
        per_signal: dict[str, dict[str, float]] = {}
        if "signature" in signals:
            per_signal["signature"] = self.signature_scores(clean)
        if "lexical" in signals:
            lexical_text = f"{bridged}\n{context}" if context else bridged
            per_signal["lexical"] = self.lexical_scores(lexical_text)
        embedded = [name for name in EMBEDDED if name in signals]
        # The reports model has a block for the question's vector too, but not
        # for a reply's: the labelled reports are first reports, and the first
        # report's answer, merged with the reply's, already holds what they say
        # (as for the neighbours).
        reports_read_vector = "reports" in signals and self.reports is not None and not context
        vector = None
        if (embedded or reports_read_vector) and (not shortcut or needs_dense(per_signal)):
            vector = self.query_vector(bridged, context)
            if "dense" in embedded:
                per_signal["dense"] = self.dense_scores_of(vector, clean)
            if "neighbours" in embedded:
                nearest = self.neighbour_scores(query, vector, context)
                if nearest:
                    per_signal["neighbours"] = nearest
        if "reports" in signals and self.reports is not None:
            # Where a signature named the root error no signal reads the vector
            # (needs_dense): an evaluation, which embeds every question, must
            # rank as `ask` does.
            reads_vector = reports_read_vector and needs_dense(per_signal)
            reports_vector = vector if reads_vector else None
            learned = self.reports.scores(reports_text(clean), self.held_out, reports_vector)
            if learned:
                per_signal["reports"] = learned
        contradicted = self.contradicted_causes(query, clean)
        if contradicted:
            per_signal = with_words_lowered(per_signal, contradicted)
        if not shortcut:
            self._last_full = (key, dict(per_signal))
        return per_signal

    def neighbour_scores(
        self, query: str, vector: np.ndarray, context: str | None
    ) -> dict[str, float]:
        """The votes of the labelled reports nearest the question (neighbours.py).

        None on Chinese questions, which the English model places poorly, and
        none for a reply in a conversation: the labelled reports are first
        reports, and the first report's own answer, which the reply's ranking
        is merged with (pipeline.with_earlier_answer), already holds their
        votes; found again from the reply, they counted twice and pulled the
        thread toward whatever the reply's words resembled (session 28).
        """
        # Checked before `self.neighbours`, which loads (or first embeds) the reports.
        if context or detect_lang(query[:2000]) == "zh" or self.neighbours is None:
            return {}
        return self.neighbours.scores(vector, self.held_out)

    def contradicted_causes(self, query: str, clean: CleanLog) -> frozenset[str]:
        """Causes whose premise the report itself contradicts (reportkind.py).

        A report of an error or a hang contradicts the causes that never fail a
        job (`fails: false`); a report of a hang and no error contradicts the
        causes that only ever fail with an error (`hangs: false`); a report
        launched with torchrun or another launcher contradicts a launch
        without one (`no_launcher: true`); a report of several processes
        (DDP, torchrun, ranks) contradicts the causes of one process driving
        several GPUs (`one_process: true`, nn.DataParallel); a report that
        never names a tool-bound cause's tool contradicts it (`named_by`).
        """
        contradicted: set[str] = set()
        if reports_failure(query, clean.root_error is not None):
            contradicted |= self.causes_where("fails", False)
        if reports_hang_only(query, clean.root_error is not None):
            contradicted |= self.causes_where("hangs", False)
        if reports_launcher_only(query):
            contradicted |= self.causes_where("no_launcher", True)
        if reports_several_processes(query):
            contradicted |= self.causes_where("one_process", True)
        return frozenset(contradicted | self.causes_not_named(clean))

    def causes_not_named(self, clean: CleanLog) -> set[str]:
        """Tool-bound causes (`named_by`) whose tool the whole report never names.

        Their words are generic ("save the checkpoint", "config mismatch"), so
        without this a report of a plain DDP save could be answered with FSDP's
        cause; paths in a traceback (`.../fsdp/...`) count as naming it.
        """
        if not LINEAR_ENGINE:
            return set()  # without RE2 no pattern matches: that is no evidence of absence
        text = clean.text[:SIGNATURE_TEXT_LIMIT]
        return {cid for cid, words in self.named_by.items() if words.search(text) is None}

    def causes_where(self, field: str, value: bool) -> frozenset[str]:
        """Causes whose KB entry sets `field` to `value` (computed once per field)."""
        key = (field, value)
        if key not in self._causes_where:
            self._causes_where[key] = frozenset(
                c for c, data in self.index.causes.items() if data.get(field) is value
            )
        return self._causes_where[key]


def question_text(clean: CleanLog) -> str:
    """What the word signals search: the failure's own lines when the log has them."""
    return clean.focus or clean.text[:2000]


def reports_text(clean: CleanLog) -> str:
    """What the labelled reports' model reads: the whole log, its first searched
    line once more.

    That line is the root error, or in a report without one its title: what
    the person, or the failing rank, says the failure is. Read twice its words
    weigh more than the environment dumps, launch lines and config around
    them. Each labelled file held out (2,249 queries, session 30): 0.733 / 0.868
    -> 0.739 / 0.871 (19 first now, 5 no longer; traffic-like 0.670 / 0.833 ->
    0.677 / 0.834); three copies gave 0.740 / 0.869, and a report's title twice
    in the lexical search as well 0.741 / 0.866.
    """
    root = clean.root_error
    first = f"{root.type}: {root.message}" if root else question_text(clean).split("\n", 1)[0]
    return f"{first}\n{clean.text}"


def embedded_text(clean: CleanLog, bridge: Bridge) -> str:
    """What the dense signal embeds of a question (or a labelled report, neighbours.py).

    The English of its Chinese terms is appended (the KB and the model are
    mostly English), so it reaches the model only when the question is short.
    """
    return bridge.expand(question_text(clean))[:DENSE_TEXT_LIMIT]


def any_of(patterns: list[str]) -> PatternSet | None:
    """A cause's `named_by` words as one alternation: one pass over a long log
    instead of one per word (48 -> 9 ms on 370 KB). Words that do not compile
    are left out, as signatures are; None when none is left, so that a cause is
    never lowered for words nothing could match."""
    if not patterns:
        return None
    words = PatternSet.from_patterns(["|".join(f"(?:{p})" for p in patterns)], skip_invalid=True)
    if not len(words):  # one bad word spoils the alternation: each on its own
        words = PatternSet.from_patterns(patterns, skip_invalid=True)
    return words if len(words) else None


def summed_shares(*parts: dict[str, float]) -> dict[str, float]:
    """Per cause, the sum over `parts` of its score as a share of that part's best."""
    return weighted_shares((1.0, scores) for scores in parts)


def weighted_shares(parts) -> dict[str, float]:
    """Per cause, the sum over (weight, scores) parts of weight x its score as a
    share of that part's best (0..1); only positive scores count, as they alone rank."""
    summed: dict[str, float] = {}
    for weight, scores in parts:
        best = max(scores.values(), default=0.0)
        if best <= 0:
            continue
        for cid, score in scores.items():
            if score > 0:
                summed[cid] = summed.get(cid, 0.0) + weight * score / best
    return summed


def with_words_lowered(
    per_signal: dict[str, dict[str, float]], causes: frozenset[str]
) -> dict[str, dict[str, float]]:
    """The word signals with `causes` scaled down, but for the reports model.

    Only the words are scaled: a signature names the failure it prints. The
    reports model is not: fitted on every labelled report, it learned what
    reports that read like this one had, contradictions included, and lowered
    as well it counted them twice. With its vector block, each labelled file
    held out (2,249 queries, session 31): lowered 0.743 / 0.871, not lowered
    0.747 / 0.873 (16 first now, 9 no longer); without the block it made no
    difference. The neighbours, the votes of ten look-alikes, stay lowered:
    not lowered, 0 first places gained and 1 lost (2,295 queries).
    """
    scaled = dict(per_signal)
    for signal in ("lexical", "dense", "neighbours"):
        if signal in scaled:
            scaled[signal] = {
                cid: lowered(score) if cid in causes else score
                for cid, score in scaled[signal].items()
            }
    return scaled


ROOT_HIT = 3.0  # the signature score of a match in the root error


def lowered(score: float) -> float:
    """`score` made smaller by CONTRADICTED_FACTOR of its size (a classifier vote may be negative)."""
    return score - (1.0 - CONTRADICTED_FACTOR) * abs(score)


def needs_dense(per_signal: dict[str, dict[str, float]]) -> bool:
    """Whether the dense signal can still change the answer.

    Dense search finds paraphrases and questions. When an exact signature has
    matched the root error the cause is known, and the query embedding (most
    of a warm query's time on a small CPU) is skipped; on the labelled set
    this changed no metric while skipping 62 of 149 embeddings.
    """
    return max(per_signal.get("signature", {}).values(), default=0.0) < ROOT_HIT


def with_shortcut(per_signal: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The signals the product fuses, given all were computed."""
    if "signature" in per_signal and not needs_dense(per_signal):
        return {name: scores for name, scores in per_signal.items() if name not in EMBEDDED}
    return per_signal


def fuse(per_signal: dict[str, dict[str, float]]) -> list[RankedCause]:
    """Weighted reciprocal rank fusion plus a share of each cause's closeness to
    each signal's best score (see CLOSENESS_WEIGHT), scaled to 0..1."""
    fused: dict[str, RankedCause] = {}
    for signal, scores in per_signal.items():
        ordered = sorted(scores.items(), key=lambda item: (-item[1], item[0]))
        soft = soft_ranks(scores)
        for rank, (cid, _) in enumerate(ordered, start=1):
            entry = fused.setdefault(cid, RankedCause(cid, 0.0))
            entry.ranks[signal] = rank
            entry.score += SIGNAL_WEIGHTS[signal] / (RRF_K + soft[cid])
            entry.root_hit |= signal == "signature" and scores[cid] >= ROOT_HIT
        if ordered:
            best, runner_up = ordered[0][1], ordered[1][1] if len(ordered) > 1 else 0.0
            fused[ordered[0][0]].leads[signal] = best - runner_up
    best_possible = sum(SIGNAL_WEIGHTS[s] / (RRF_K + 1) for s in per_signal) or 1.0
    all_weights = sum(SIGNAL_WEIGHTS[s] for s in per_signal) or 1.0
    closeness = closeness_to_best(per_signal)
    for entry in fused.values():
        by_rank = entry.score / best_possible
        by_score = closeness.get(entry.id, 0.0) / all_weights
        entry.score = (by_rank + CLOSENESS_WEIGHT * by_score) / (1.0 + CLOSENESS_WEIGHT)
    return sorted(fused.values(), key=lambda e: (-round(e.score, 9), e.id))


def soft_ranks(scores: dict[str, float]) -> dict[str, float]:
    """Each cause's rank within one signal, with near-ties shared (see RANK_TIE_WIDTH)."""
    if not scores:
        return {}
    ids = list(scores)
    values = np.array([scores[cid] for cid in ids], dtype=np.float64)
    width = RANK_TIE_WIDTH * (float(np.abs(values).max()) or 1.0)
    ahead = np.clip((values[None, :] - values[:, None]) / width, -60.0, 60.0)
    # Row i sums a step for every cause, itself included (0.5): 1 + the others' steps.
    ranks = 0.5 + (1.0 / (1.0 + np.exp(-ahead))).sum(axis=1)
    return dict(zip(ids, ranks.tolist()))


def closeness_to_best(per_signal: dict[str, dict[str, float]]) -> dict[str, float]:
    """Per cause, the sum over signals of its share of the signal's best, weighted
    as the signal is in fusion."""
    return weighted_shares((SIGNAL_WEIGHTS[s], scores) for s, scores in per_signal.items())
