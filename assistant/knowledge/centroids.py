"""A second lexical view: how much a query's words sound like each cause as a whole.

FTS5's bm25 scores chunks, and a cause takes its best chunk: a short report
matches whichever single symptom happens to share its rarest words. Here
every chunk of a cause (its symptoms, title, summary, the questions and
answers of its threads) is folded into one TF-IDF centroid per cause (a
Rocchio classifier over the same CJK-aware tokens), so the words a cause is
described with across all its text count together. Fitted from the index's
own tokens when the index is built and stored in it (blob "centroids"), so
a cold start reads them instead of spending ~0.15 s refitting; an index
without them (built before, or above FIT_LIMIT chunks) is fitted on first
use, or skipped above the limit, where bm25 alone ranks the words.

retrieve.py adds it to the lexical signal, each part scaled by its best
score. Measured over the 896 labelled queries (data/eval/README.md,
session 7): lexical alone 0.609 -> centroid alone 0.656 top-1 (Chinese
0.560 -> 0.652); fused, with equal parts, 0.741 -> 0.747, and on the six
traffic-like sets (holdout8-13) 0.474 -> 0.495, recall@3 0.592 -> 0.629.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections import Counter
from typing import TYPE_CHECKING

from assistant.knowledge.textsearch import search_tokens

if TYPE_CHECKING:  # index.py stores the centroids it builds: no import cycle at run time
    from assistant.knowledge.index import LoadedIndex

TOP_CAUSES = 24  # only the head of the ranking matters to reciprocal-rank fusion
# Chunks; above it a fit would cost seconds (the size retrieve.LARGE_INDEX also calls large).
FIT_LIMIT = 20_000
STORED_NAME = "centroids"  # their row in the index's blobs table
# Written with the stored centroids: a change to how they are fitted changes it,
# and an index that stored another version is refitted rather than read.
FORMAT = 1


class CauseCentroids:
    """Per token, the causes whose centroid holds it and how much (unit-length centroids)."""

    def __init__(self, idf: dict[str, float], postings: dict[str, list[tuple[str, float]]]):
        self.idf = idf
        self.postings = postings

    @classmethod
    def from_index(cls, index: LoadedIndex) -> CauseCentroids | None:
        """The centroids the index stored at build time, else fitted on its chunk
        tokens; None when it has no tokens to learn from or is above FIT_LIMIT."""
        stored = cls.stored_in(index.db)
        if stored is not None:
            return stored
        if len(index.chunk_causes) > FIT_LIMIT:
            return None
        try:
            rows = index.db.execute("select tokens from chunks order by id").fetchall()
        except sqlite3.Error:
            return None
        token_lists = [(row[0] or "").split() for row in rows]
        if len(token_lists) != len(index.chunk_causes):
            return None
        return cls.fit(token_lists, index.chunk_causes, index.token_df, set(index.causes))

    @classmethod
    def fit(
        cls,
        token_lists: list[list[str]],
        chunk_causes: list[dict[str, float]],
        token_df: dict[str, int],
        known: set[str],
    ) -> CauseCentroids | None:
        """Fit on each chunk's tokens; token_df is FTS5's own count of the chunks
        holding each token. None when there are no chunks."""
        chunks = len(token_lists)
        if not chunks:
            return None
        idf = {t: math.log(chunks / count) for t, count in token_df.items() if count > 0}
        centroids: dict[str, Counter] = {}
        for tokens, causes in zip(token_lists, chunk_causes):
            chunk = unit_vector(Counter(tokens), idf)
            for cause, strength in causes.items():
                if strength > 0 and cause in known:
                    centroids.setdefault(cause, Counter()).update(chunk)
        postings: dict[str, list[tuple[str, float]]] = {}
        for cause, centroid in centroids.items():
            for token, weight in unit_vector(centroid).items():
                postings.setdefault(token, []).append((cause, weight))
        return cls(idf, postings)

    # -- stored in the index ---------------------------------------------------------

    def to_json(self) -> str:
        """Compact: each posting list flat as [cause index, weight, ...] (reads in ~45 ms
        where the plain form took ~125 ms and a fit ~150 ms)."""
        causes = sorted({cause for entries in self.postings.values() for cause, _ in entries})
        number = {cause: i for i, cause in enumerate(causes)}
        postings = {
            token: [x for cause, weight in entries for x in (number[cause], weight)]
            for token, entries in self.postings.items()
        }
        return json.dumps(
            {"format": FORMAT, "causes": causes, "idf": self.idf, "postings": postings}
        )

    @classmethod
    def stored_in(cls, db: sqlite3.Connection) -> CauseCentroids | None:
        """The centroids stored in an index's blobs table; None when there are none,
        they were stored by another FORMAT, or the row is damaged."""
        try:
            row = db.execute("select data from blobs where name = ?", (STORED_NAME,)).fetchone()
            data = json.loads(row[0]) if row is not None else None
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                return None
            causes, idf = data["causes"], data["idf"]
            if not isinstance(idf, dict) or not all(isinstance(c, str) for c in causes):
                return None
            postings = {
                token: [(causes[flat[i]], float(flat[i + 1])) for i in range(0, len(flat), 2)]
                for token, flat in data["postings"].items()
            }
        except (sqlite3.Error, ValueError, TypeError, KeyError, IndexError, AttributeError):
            return None  # damaged: fitted again from the tokens
        return cls(idf, postings)

    def scores(self, text: str) -> dict[str, float]:
        """Each cause's centroid against the query's TF-IDF vector (the best TOP_CAUSES)."""
        scores: dict[str, float] = {}
        for token, count in Counter(search_tokens(text)).items():
            weight = count * self.idf.get(token, 0.0)
            for cause, share in self.postings.get(token, ()) if weight else ():
                scores[cause] = scores.get(cause, 0.0) + weight * share
        best = sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:TOP_CAUSES]
        return {cause: score for cause, score in best if score > 0}


def unit_vector(counts: Counter, idf: dict[str, float] | None = None) -> dict[str, float]:
    """`counts` weighted by `idf` (when given) and scaled to unit length."""
    weighted = {t: c * idf[t] for t, c in counts.items()} if idf is not None else dict(counts)
    norm = math.sqrt(sum(w * w for w in weighted.values())) or 1.0
    return {token: w / norm for token, w in weighted.items() if w}
