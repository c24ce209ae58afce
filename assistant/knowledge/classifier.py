"""A supervised signal: which cause an embedded query looks like, learned from the KB.

Every dense chunk of the KB (a cause's symptoms, title, summary, the questions
and answers of its threads) is a labelled example of how that cause is
described. A ridge (least-squares, one column per cause) classifier over the
same MiniLM vectors the dense signal already computes learns what separates
the causes, where nearest-neighbour search only sees which single chunk is
closest. It is fitted in closed form when the index is opened (a 384x384
solve: milliseconds) and costs one small matrix product per query; no model
file, nothing to keep in sync with the KB.

retrieve.py adds its scores to the dense signal (weight 0.5) for English
prose without a root error. Measured on the tuning sets (queries, real_reports,
holdout, holdout2, holdout3; data/eval/README.md) fused top-1 moved
0.946/0.800/0.775/0.778/0.932 -> 0.940/0.820/0.800/0.806/0.932, recall@3
0.993/0.960/0.850/0.972/0.932 -> 0.993/0.980/0.900/0.972/0.932.
"""

from __future__ import annotations

import sqlite3

import numpy as np

from assistant.knowledge.index import LoadedIndex, stored_vectors

RIDGE = 3.0  # chosen on the tuning sets among 0.1/0.3/1/3; larger is smoother
PRIMARY_STRENGTH = 1.0  # a chunk is an example only of the causes it speaks for fully
TOP_CAUSES = 8  # only the head of the ranking matters to reciprocal-rank fusion


class CauseClassifier:
    """Ridge weights (dimension x causes) and the cause of each column."""

    def __init__(self, weights: np.ndarray, causes: list[str]):
        self.weights = weights
        self.causes = causes

    @classmethod
    def from_index(cls, index: LoadedIndex) -> CauseClassifier | None:
        """Fit on the index's embedded chunks; None when there are too few to learn from."""
        vectors, labels = labelled_vectors(index)
        causes = sorted(set(labels))
        if len(causes) < 2:
            return None
        # float32 throughout: the ridge term keeps the system well conditioned,
        # and the fit stays a few milliseconds of every index load.
        x = np.asarray(vectors, dtype=np.float32)
        y = np.zeros((len(labels), len(causes)), dtype=np.float32)
        for row, cause in enumerate(labels):
            y[row, causes.index(cause)] = 1.0
        gram = x.T @ x + RIDGE * np.eye(x.shape[1], dtype=np.float32)
        weights = np.linalg.solve(gram, x.T @ y)
        return cls(weights, causes)

    def scores(self, vector: np.ndarray) -> dict[str, float]:
        """The best-fitting causes for one query vector (1 x dimension)."""
        values = (np.asarray(vector, dtype=np.float32).reshape(1, -1) @ self.weights)[0]
        best = np.argsort(-values)[:TOP_CAUSES]
        return {self.causes[i]: float(values[i]) for i in best}


def labelled_vectors(index: LoadedIndex) -> tuple[list, list[str]]:
    """(vector, cause) for every embedded chunk and each cause of the index it fully speaks for."""
    vectors, labels = [], []
    try:
        for chunk_id, blob in stored_vectors(index.db):
            vector = np.frombuffer(blob, dtype=np.float32)
            for cause, strength in index.chunk_causes[chunk_id].items():
                if strength >= PRIMARY_STRENGTH and cause in index.causes:
                    vectors.append(vector)
                    labels.append(cause)
    except (sqlite3.Error, ValueError):  # unreadable stored vectors: no classifier
        return [], []
    if vectors and len({len(v) for v in vectors}) != 1:
        return [], []
    return vectors, labels
