"""A second lexical view: how much a query's words sound like each cause as a whole.

FTS5's bm25 scores chunks, and a cause takes its best chunk: a short report
matches whichever single symptom happens to share its rarest words. Here
every chunk of a cause (its symptoms, title, summary, the questions and
answers of its threads) is folded into one TF-IDF centroid per cause (a
Rocchio classifier over the same CJK-aware tokens), so the words a cause is
described with across all its text count together. No model file: fitted
from the index's own tokens when first needed (about 0.15 s for the KB's
1,400 chunks; retrieve.py skips it on an index above 20,000 chunks).

retrieve.py adds it to the lexical signal, each part scaled by its best
score. Measured over the 896 labelled queries (data/eval/README.md,
session 7): lexical alone 0.609 -> centroid alone 0.656 top-1 (Chinese
0.560 -> 0.652); fused, with equal parts, 0.741 -> 0.747, and on the six
traffic-like sets (holdout8-13) 0.474 -> 0.495, recall@3 0.592 -> 0.629.
"""

from __future__ import annotations

import math
import sqlite3
from collections import Counter

from assistant.knowledge.index import LoadedIndex
from assistant.knowledge.textsearch import search_tokens

TOP_CAUSES = 24  # only the head of the ranking matters to reciprocal-rank fusion


class CauseCentroids:
    """Per token, the causes whose centroid holds it and how much (unit-length centroids)."""

    def __init__(self, idf: dict[str, float], postings: dict[str, list[tuple[str, float]]]):
        self.idf = idf
        self.postings = postings

    @classmethod
    def from_index(cls, index: LoadedIndex) -> CauseCentroids | None:
        """Fit on the tokens of every chunk; None when the index has none to learn from."""
        try:
            rows = index.db.execute("select tokens from chunks order by id").fetchall()
        except sqlite3.Error:
            return None
        token_lists = [(row[0] or "").split() for row in rows]
        if len(token_lists) != len(index.chunk_causes) or not token_lists:
            return None
        # token_df is FTS5's own count of the chunks holding each token.
        chunks = len(token_lists)
        idf = {t: math.log(chunks / count) for t, count in index.token_df.items() if count > 0}
        centroids: dict[str, Counter] = {}
        for tokens, causes in zip(token_lists, index.chunk_causes):
            chunk = unit_vector(Counter(tokens), idf)
            for cause, strength in causes.items():
                if strength > 0 and cause in index.causes:
                    centroids.setdefault(cause, Counter()).update(chunk)
        postings: dict[str, list[tuple[str, float]]] = {}
        for cause, centroid in centroids.items():
            for token, weight in unit_vector(centroid).items():
                postings.setdefault(token, []).append((cause, weight))
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
