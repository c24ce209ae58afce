"""A fifth signal: the causes of the labelled reports that read most like this one.

The reports signal (reports.py) learns which n-grams go with which resolved
cause; this one asks the embedding model which labelled reports mean the
same as the question, and lets each of the nearest vote for its causes: a
report in other words than any the n-grams know ("the second card sits
idle" beside "only GPU 0 trains") still finds its neighbours. The question's
vector is the dense signal's own, so the signal costs a matrix product.

English only: the bundled model is English, and on Chinese questions the
neighbours it found lost more than they found (data/eval/README.md, session
27). The KB's own symptoms are embedded beside the reports, for the reports
model's vector block (reports.py), but never vote: the dense signal already
searches them.

The reports' vectors are kept in the build folder and in the user's cache
under the model's fingerprint, with the key of the KB and report files they
were made for (a process loads them as they are) and each text's hash: a
build embeds only texts no build on this machine has seen, nor the vectors
shipped with the checkout hold (shipped.py; without them the first build
embeds them all, about 45 s here).
An evaluation masks the reports it scores (`held_out`), as the reports signal
refits without them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from assistant.knowledge.reports import is_example_key, load_arrays, save_arrays

VECTORS_FILE = "reports_vectors.npz"
NEAREST = 10  # reports that vote
FLOOR = 0.2  # cosine below this is noise for MiniLM (retrieve.DENSE_FLOOR)
ALSO_VOTE = 0.5  # a report's later labels vote half (reports.ALSO_TARGET)
# Vectors a saved file keeps: the set it was made for, then texts other sets
# embedded (another KB's layers, an older revision under `kb eval --compare`),
# so switching back embeds nothing. 10,000 x 384 floats is 15 MB.
KEPT_VECTORS = 10_000


class ReportNeighbours:
    """Unit vectors of the labelled reports, their identities and their causes."""

    def __init__(
        self,
        vectors: np.ndarray,
        keys: list[str],
        labels: list[tuple[str, ...]],
        hashes: list[str] | None = None,
    ):
        self.vectors = vectors  # reports x dimensions, float32, unit length
        self.keys = np.array(keys)
        self.labels = labels
        # text_hash of each row's embedded text: a question that is one of these
        # texts (every query of `kb eval`) reads its vector instead of running
        # the model again (vector_of).
        self.row_of_text = {digest: row for row, digest in enumerate(hashes or [])}
        # The KB's examples (reports.example_key) are there for the reports model only.
        self.voters = np.fromiter(
            (not is_example_key(k) for k in keys), dtype=bool, count=len(keys)
        )

    def rows_for(self, keys: list[str]) -> np.ndarray | None:
        """The vectors of these texts (by key) in their order; None when one is missing."""
        row_of = {key: row for row, key in enumerate(self.keys.tolist())}
        rows = [row_of.get(key) for key in keys]
        if any(row is None for row in rows):
            return None
        return self.vectors[np.array(rows, dtype=np.int64)]

    def vector_of(self, text: str) -> np.ndarray | None:
        """The saved vector of exactly this embedded text (1 x dimensions), if any:
        the model made it from the same text, so the question needs no new one."""
        row = self.row_of_text.get(text_hash(text))
        return None if row is None else self.vectors[row : row + 1]

    def scores(
        self, vector: np.ndarray, held_out: frozenset[str] = frozenset()
    ) -> dict[str, float]:
        """Per cause, the summed cosine of the nearest reports that name it (later labels half)."""
        if not len(self.labels):
            return {}
        similarity = self.vectors @ np.asarray(vector, dtype=np.float32).reshape(-1)
        similarity[~self.voters] = -1.0
        if held_out:
            similarity[np.isin(self.keys, list(held_out))] = -1.0
        nearest = np.argsort(-similarity, kind="stable")[:NEAREST]
        votes: dict[str, float] = {}
        for row in nearest.tolist():
            cosine = float(similarity[row])
            if cosine < FLOOR:
                break  # sorted: the rest are further
            for place, cause in enumerate(self.labels[row]):
                votes[cause] = votes.get(cause, 0.0) + cosine * (1.0 if place == 0 else ALSO_VOTE)
        return votes

    @classmethod
    def load_or_embed(
        cls,
        key: str,
        reports: Callable[[], list[tuple[str, tuple[str, ...], str]]],
        embedder,
        caches: list[Path],
        shipped: Callable[[], dict[str, np.ndarray]] = dict,
    ) -> ReportNeighbours:
        """The saved neighbours when `key` (the model, the KB, the report files)
        matches, else `reports()` embedded and saved.

        `reports()`: (text as the dense signal embeds it, causes best first,
        key). Only texts no saved vector was made from are embedded: a KB
        edit that changes no report's text costs their cleaning, not the model.
        Every cache is read and written: the build folder's, and the user's,
        which every build folder of this machine shares (a fresh clone, `kb
        eval --compare`'s temporary index and a test's private KB embed only
        what no earlier build did). `shipped()`: text hash -> vector of the
        vectors shipped with the checkout (shipped.py), read only when some
        text has none in the caches.
        """
        fingerprint = str(embedder.fingerprint)
        known: dict[str, np.ndarray] = {}
        for cache in caches:
            saved = read_saved(cache, fingerprint)
            if saved is None:
                continue
            header, vectors = saved
            if header.get("set") == key:
                neighbours = cls.from_saved(header, vectors)
                if neighbours is not None:
                    # A cache that is not there yet (a user cache cleared, or a build
                    # folder older than it) gets the file, so the next folder finds it.
                    for other in caches:
                        if not other.exists():
                            save_arrays(other, header, vectors=vectors)
                    return neighbours
            known.update(zip(header["hashes"], vectors))
        texts = reports()
        hashes = [text_hash(text) for text, _, _ in texts]
        if any(h not in known for h in hashes):
            known = {**shipped(), **known}  # this machine's own vectors first
        missing = list(
            {h: text for h, (text, _, _) in zip(hashes, texts) if h not in known}.items()
        )
        if missing:
            fresh = embedder.encode([text for _, text in missing])
            known.update({h: vector for (h, _), vector in zip(missing, fresh)})
        # The set's rows first (from_saved reads them), then others' texts, kept.
        in_set = set(hashes)
        others = [digest for digest in known if digest not in in_set]
        rows = hashes + others[: max(0, KEPT_VECTORS - len(hashes))]
        dimensions = next(iter(known.values())).shape[0] if known else 0
        vectors = np.zeros((len(rows), dimensions), dtype=np.float32)
        for row, digest in enumerate(rows):
            vectors[row] = known[digest]
        header = {
            "key": fingerprint,
            "set": key,
            "hashes": rows,
            "keys": [report_key for _, _, report_key in texts],
            "labels": [list(causes) for _, causes, _ in texts],
        }
        for cache in caches:
            save_arrays(cache, header, vectors=vectors)  # False (read-only) is fine
        labels = [tuple(c) for c in header["labels"]]
        return cls(vectors[: len(hashes)], header["keys"], labels, hashes)

    @classmethod
    def from_saved(cls, header: dict, vectors: np.ndarray) -> ReportNeighbours | None:
        keys, labels = header.get("keys"), header.get("labels")
        if not (isinstance(keys, list) and isinstance(labels, list)):
            return None
        if not len(keys) == len(labels) <= len(vectors):
            return None
        if not all(isinstance(k, str) for k in keys) or not all(
            isinstance(row, list) and all(isinstance(c, str) for c in row) for row in labels
        ):
            return None
        hashes = header.get("hashes")
        if not (isinstance(hashes, list) and all(isinstance(h, str) for h in hashes)):
            hashes = None  # an older file: every question is embedded
        else:
            hashes = hashes[: len(keys)]
        return cls(vectors[: len(keys)], keys, [tuple(row) for row in labels], hashes)


def text_hash(text: str) -> str:
    """A text's identity among embedded texts (the neighbours', the index's, shipped.py's)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def read_saved(path: Path, fingerprint: str) -> tuple[dict, np.ndarray] | None:
    """(header, vectors) saved for this model; None when missing, damaged or another model's."""
    loaded = load_arrays(path, fingerprint, ("vectors",))
    if loaded is None:
        return None
    header, arrays = loaded
    vectors = arrays["vectors"]
    hashes = header.get("hashes")
    if not isinstance(hashes, list) or vectors.ndim != 2 or len(hashes) != len(vectors):
        return None
    if not all(isinstance(digest, str) for digest in hashes):
        return None  # damaged: embedded again rather than failing on a list as a key
    return header, vectors.astype(np.float32)
