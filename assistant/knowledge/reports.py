"""A fourth signal: which cause labelled real reports that read like this one had.

The KB says how each cause is described by the people who wrote it; the
labelled report sets (data/eval/*.jsonl, each report labelled from its
thread's resolution) say how users describe them: in their own words, half
of them vague, with their own launch lines and configs. A linear model over
the reports' character n-grams (within words: a Chinese sentence is one long
word, so it gets its character pairs to quads) and word unigrams/bigrams
learns which words go with which resolved cause, mistakes of the other
signals included.

Ridge regression in closed form, in its dual (reports x reports) form: the
pool is about a thousand reports plus the KB's own symptoms (so a cause no
report names yet, a team's own, is not invisible to the signal), and the
vocabulary about fifty thousand n-grams. Targets are +1 for the report's first
cause, ALSO_TARGET for the other causes its text honestly fits (its later
labels), -1 elsewhere. Measured leave-one-set-out over the ten fresh-collected
sets (holdout8-17, 587 reports; each scored by a model that never saw its
set), fused as a fourth signal of weight 1: top-1 0.557 -> 0.581, recall@3
0.704 -> 0.721 (data/eval/README.md, session 11). Its weight is 1.5 since
session 15, when the pool had grown to 1416 reports (retrieve.SIGNAL_WEIGHTS).

Beside the n-grams, each text's embedding (the dense signal's model, the
vector the neighbours signal holds for it) is a block of features weighted
VECTOR_WEIGHT: the n-grams know the words, the vectors what reports in other
words than any labelled one mean. The question's own vector, computed for
the dense signal, is its block at query time.

An evaluation must never score a report with a model that learned it, so
`LearnedReports.model(held_out)` is the model fitted on the pool less those
texts; `kb eval` holds out each file it scores (evaluate.held_out_groups).

The fitted model for the whole pool is kept in the build folder (vocabulary
and weights, keyed by a hash of the report files, the KB's symptoms, the
settings and the code that counts a text, and by what the vectors depend on),
so a query only tokenises itself and reads the rows of the weight matrix its
n-grams hit. The counted pool is kept beside it under the same key: `kb eval`
fits a model per held-out file from it without counting every report again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import zipfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise, repeat
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from assistant import clean

if TYPE_CHECKING:  # neighbours.py imports this module
    from assistant.knowledge.neighbours import ReportNeighbours

REPORT_CHARS = 6_000  # a long log's head names the failure; the rest is more of the same
CHAR_NGRAMS = (2, 4)
MAX_CHAR_FEATURES = 60_000  # the most frequent; rarer n-grams only fit single reports
MIN_DOCUMENTS = 2  # an n-gram of one report teaches nothing about the next
RIDGE = 1.0  # 0.3 / 1 / 3 tried leave-one-set-out: 1 best, all within a point
# A report's later labels (causes its text also fits) were -1, like every
# other cause, until session 16: a report that fits two causes taught the
# model that its words speak against the second. At 0.5, each labelled set
# scored by a model that never saw it, the traffic-like sets (987 reports)
# went 0.607 -> 0.615 first and 0.755 -> 0.765 in the top three (0 gave
# 0.613 / 0.762); queries.jsonl lost one query (0.953 -> 0.946).
ALSO_TARGET = 0.5
# An n-gram in at least this share of the reports is multiplied densely (gram_matrix).
COMMON_SHARE = 1 / 25
# Past this share of report pairs with an entry, the sparse part of the gram is added densely.
DENSE_PRODUCT_SHARE = 1 / 8
MIN_REPORTS = 20
MAX_LABELS = 3  # a report's causes: the first, then at most two it also fits (label policy)
MAX_FILE_BYTES = 50_000_000  # a labelled set is a few hundred KB; a dump this size is not one
MODEL_VERSION = 6  # 5: fitted in float32; 6: the vector block
# The embedding block's weight beside the n-grams' two unit-length blocks.
# Each labelled file held out (2,249 queries, session 31), fused: 0 (n-grams
# only) 0.739 / 0.870, 1.0 0.743 / 0.872, 1.5 0.747 / 0.872, 2.0 0.747 / 0.870,
# 3.0 0.746 / 0.869; traffic-like (holdout8-46) 0.678 -> 0.687 at 1.5; the
# signal alone 0.706 -> 0.716. The fusion weights stayed best as they were.
VECTOR_WEIGHT = 1.5
# The key prefix of the KB's own symptoms in the pool: never held out, never
# a neighbour that votes (neighbours.py), but learned from as examples.
EXAMPLE_PREFIX = "kb:"
WORD = re.compile(r"[a-z_][a-z0-9_]+")
# One vocabulary, two kinds of term: a word term starts with NUL, which the
# text itself is cleared of, so no character n-gram can take its place.
WORD_MARK = "\0"
SPACE = re.compile(r"\s+")


def features(text: str) -> Counter:
    """Term counts of one report: character n-grams within words, and word uni/bigrams."""
    text = SPACE.sub(" ", text[:REPORT_CHARS].lower().replace(WORD_MARK, ""))
    # Every word padded with a space each side, so words meet at two spaces: the
    # n-grams of the whole string less those with two spaces are the words' own
    # (zip and map keep the loop in C: a long log costs a few milliseconds).
    padded = "".join(f" {word} " for word in text.split(" ") if word)
    counts: Counter = Counter()
    low, high = CHAR_NGRAMS
    for n in range(low, high + 1):
        counts.update(map("".join, zip(*(padded[k:] for k in range(n)))))
    for gram in [gram for gram in counts if "  " in gram]:
        del counts[gram]
    words = WORD.findall(text)
    counts.update(map(WORD_MARK.__add__, words))
    counts.update(f"{WORD_MARK}{a} {b}" for a, b in pairwise(words))
    return counts


def weighted(counts: Counter, vocabulary: dict[str, int], idf: np.ndarray, words: int):
    """(columns, values): sublinear tf x idf over the vocabulary.

    The character and the word n-grams are each scaled to unit length: a
    report has ten times more of the first, and the words would drown. Word
    terms sort first (WORD_MARK), so they are the columns under `words`.
    """
    found = np.fromiter(map(vocabulary.get, counts, repeat(-1)), dtype=np.int64, count=len(counts))
    tf = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
    known = found >= 0
    columns = found[known]
    values = (1.0 + np.log(tf[known])) * idf[columns]
    is_word = columns < words
    for part in (is_word, ~is_word):
        norm = float(np.sqrt((values[part] ** 2).sum()))
        if norm:
            values[part] /= norm
    return columns, values


class ReportModel:
    """Per-cause weights over an n-gram vocabulary, and over the embedding's
    dimensions when the pool had vectors."""

    def __init__(
        self,
        vocabulary: dict[str, int],
        idf: np.ndarray,
        weights: np.ndarray,
        bias: np.ndarray,
        causes: list[str],
        vector_weights: np.ndarray | None = None,
    ):
        self.vocabulary = vocabulary
        self.idf = idf
        self.weights = weights  # vocabulary x causes
        self.bias = bias
        self.causes = causes
        self.vector_weights = vector_weights  # dimensions x causes, VECTOR_WEIGHT included
        # Word terms sort before every character n-gram (WORD_MARK is NUL).
        self.words = sum(1 for term in vocabulary if term[0] == WORD_MARK)

    def scores(self, text: str, vector: np.ndarray | None = None) -> dict[str, float]:
        """Every cause's score for one report (higher: more like that cause's
        reports); `vector`, its embedding, counts when the model learned vectors."""
        columns, values = weighted(features(text), self.vocabulary, self.idf, self.words)
        out = self.bias + (values @ self.weights[columns] if len(columns) else 0.0)
        if vector is not None and self.vector_weights is not None:
            query = VECTOR_WEIGHT * np.asarray(vector, dtype=np.float32).reshape(-1)
            # Another embedding model's vector (another size): the n-grams alone.
            if query.shape[0] == self.vector_weights.shape[0]:
                out = out + query @ self.vector_weights
        return {cause: float(score) for cause, score in zip(self.causes, out)}

    # -- persistence -----------------------------------------------------------

    def save(self, path: Path, key: str) -> bool:
        """Write atomically; False when the folder cannot be written."""
        terms = [""] * len(self.vocabulary)
        for term, column in self.vocabulary.items():
            terms[column] = term
        header = {"key": key, "causes": self.causes, "terms": terms}
        no_vectors = np.zeros((0, len(self.causes)), dtype=np.float32)
        return save_arrays(
            path,
            header,
            idf=self.idf.astype(np.float32),
            bias=self.bias.astype(np.float32),
            weights=self.weights.astype(np.float32),
            vector_weights=(
                no_vectors
                if self.vector_weights is None
                else self.vector_weights.astype(np.float32)
            ),
        )

    @classmethod
    def load(cls, path: Path, key: str) -> ReportModel | None:
        """The saved model when it was fitted on this pool and these causes, else None."""
        loaded = load_arrays(path, key, ("idf", "weights", "bias", "vector_weights"))
        if loaded is None:
            return None  # missing, damaged or foreign: fitted again
        header, data = loaded
        try:
            terms = header["terms"]
            model = cls(
                {t: i for i, t in enumerate(terms)},
                data["idf"].astype(np.float64),
                data["weights"],
                data["bias"].astype(np.float64),
                header["causes"],
                data["vector_weights"] if len(data["vector_weights"]) else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            return None
        if model.weights.shape != (len(terms), len(model.causes)) or len(model.idf) != len(terms):
            return None
        vectors = model.vector_weights
        if vectors is not None and (vectors.ndim != 2 or vectors.shape[1] != len(model.causes)):
            return None
        return model


class ReportPool:
    """The labelled reports, counted once into one sparse matrix; models are
    fitted on all of them or all but some (an evaluated set held out)."""

    def __init__(
        self,
        labels: list[str],
        keys: list[str],
        terms: list[str],
        counts,
        also: list[list[str]] | None = None,
    ):
        """`counts`: reports x `terms`, a scipy CSR matrix with sorted indices;
        `labels` each report's first cause, `also` its later labels."""
        self.labels = labels
        self.also = also if also is not None else [[] for _ in labels]
        self.keys = keys
        self.key_set = frozenset(keys)
        self.terms = terms
        self.is_word = np.fromiter((t[0] == WORD_MARK for t in terms), dtype=bool, count=len(terms))
        self.counts = counts

    @classmethod
    def count(cls, reports: list[tuple[str, tuple[str, ...], str]]) -> ReportPool:
        """`reports`: (text as the query is searched, its causes best first, text_key
        of the raw text)."""
        from scipy.sparse import csr_matrix  # fitting only: a query never imports scipy

        counts = [features(text) for text, _, _ in reports]
        # Columns in the terms' sorted order, so a fold's vocabulary keeps it too.
        terms = sorted({term for report in counts for term in report})
        column = {term: i for i, term in enumerate(terms)}
        indptr = np.cumsum([0] + [len(report) for report in counts])
        indices = np.fromiter(
            (column[t] for r in counts for t in r), dtype=np.int64, count=indptr[-1]
        )
        data = np.fromiter(
            (n for r in counts for n in r.values()), dtype=np.float64, count=indptr[-1]
        )
        matrix = csr_matrix((data, indices, indptr), shape=(len(counts), len(terms)))
        matrix.sort_indices()
        labels = [causes[0] for _, causes, _ in reports]
        also = [list(causes[1:]) for _, causes, _ in reports]
        return cls(labels, [key for _, _, key in reports], terms, matrix, also)

    # -- persistence: counting ~2,500 texts takes seconds, loading them a fraction --

    def save(self, path: Path, key: str) -> bool:
        """Write atomically; False when the folder cannot be written."""
        header = {
            "key": key,
            "labels": self.labels,
            "also": self.also,
            "keys": self.keys,
            "terms": self.terms,
        }
        return save_arrays(
            path,
            header,
            data=self.counts.data.astype(np.uint32),  # counts of at most REPORT_CHARS n-grams
            indices=self.counts.indices.astype(np.int32),
            indptr=self.counts.indptr.astype(np.int64),
        )

    @classmethod
    def load(cls, path: Path, key: str) -> ReportPool | None:
        """The saved pool when it was counted from these files, else None."""
        from scipy.sparse import csr_matrix

        loaded = load_arrays(path, key, ("data", "indices", "indptr"))
        if loaded is None:
            return None
        header, arrays = loaded
        try:
            labels, keys, terms = header["labels"], header["keys"], header["terms"]
            also = header["also"]
            matrix = csr_matrix(
                (arrays["data"].astype(np.float64), arrays["indices"], arrays["indptr"]),
                shape=(len(labels), len(terms)),
            )
            matrix.check_format(full_check=True)  # a damaged file must not index out of range
            if not len(keys) == len(also) == len(labels):
                return None
            if not all(isinstance(c, str) for causes in also for c in causes):
                return None  # a damaged header: counted again rather than fitted wrong
            return cls(labels, keys, terms, matrix, also)
        except (KeyError, TypeError, ValueError, IndexError):
            return None

    def fit(
        self, held_out: frozenset[str] = frozenset(), vectors: np.ndarray | None = None
    ) -> ReportModel | None:
        """Ridge on every report but those whose text key is in `held_out`; None when too few.

        `vectors`: every pooled text's embedding, in the pool's order (a block
        of features weighted VECTOR_WEIGHT), or None for the n-grams alone.
        """
        from scipy.linalg import cho_factor, cho_solve  # fitting only, like scipy.sparse

        rows = [i for i, key in enumerate(self.keys) if key not in held_out]
        causes = sorted({self.labels[i] for i in rows})
        if len(rows) < MIN_REPORTS or len(causes) < 2:
            return None
        counts = self.counts[rows]
        columns, idf = self._vocabulary(counts)
        # Solved in float32, the precision the model is saved in: the weights move
        # by under 1e-6 of their largest, and a fit (one per file in `kb eval`)
        # takes 0.7 s instead of 1.5-2.5 s on two cores (session 30).
        x = self._weighted(counts[:, columns], idf, self.is_word[columns]).astype(np.float32)
        y = -np.ones((len(rows), len(causes)), dtype=np.float32)
        index = {cause: k for k, cause in enumerate(causes)}
        for r, i in enumerate(rows):
            for cause in self.also[i]:
                if cause in index:  # a cause no kept report has first gets no column
                    y[r, index[cause]] = ALSO_TARGET
            y[r, index[self.labels[i]]] = 1.0
        bias = y.mean(axis=0)
        gram = gram_matrix(x)
        embedded = None
        if vectors is not None:
            embedded = VECTOR_WEIGHT * np.asarray(vectors, dtype=np.float32)[rows]
            gram += embedded @ embedded.T  # the kernel of the joined features
        gram[np.diag_indices_from(gram)] += RIDGE  # in place: no second n x n matrix
        # Symmetric positive definite: Cholesky, not LU (the same solution, ~2.5x faster).
        dual = cho_solve(cho_factor(gram, check_finite=False), y - bias, check_finite=False)
        weights = np.asarray(x.T @ dual)
        vector_weights = None if embedded is None else (embedded.T @ dual).astype(np.float32)
        vocabulary = {self.terms[c]: j for j, c in enumerate(columns.tolist())}
        return ReportModel(
            vocabulary, idf, weights.astype(np.float32), bias, causes, vector_weights
        )

    def _vocabulary(self, counts) -> tuple[np.ndarray, np.ndarray]:
        """The columns kept (n-grams of at least MIN_DOCUMENTS reports, the
        MAX_CHAR_FEATURES most frequent character ones) and their idf."""
        size = len(self.terms)
        documents = np.bincount(counts.indices, minlength=size)
        totals = np.bincount(counts.indices, weights=counts.data, minlength=size)
        frequent = documents >= MIN_DOCUMENTS
        chars = np.flatnonzero(frequent & ~self.is_word)
        chars = chars[np.lexsort((chars, -totals[chars]))][:MAX_CHAR_FEATURES]
        columns = np.sort(np.concatenate([chars, np.flatnonzero(frequent & self.is_word)]))
        n = counts.shape[0]
        return columns, np.log((1 + n) / (1 + documents[columns])) + 1.0

    @staticmethod
    def _weighted(counts, idf: np.ndarray, is_word: np.ndarray):
        """`weighted` for a whole matrix: sublinear tf x idf, each block of a row unit length."""
        x = counts.tocsr(copy=True)
        x.data = (1.0 + np.log(x.data)) * idf[x.indices]
        row = np.repeat(np.arange(x.shape[0]), np.diff(x.indptr))
        word = is_word[x.indices]
        for part in (word, ~word):
            norms = np.sqrt(np.bincount(row[part], weights=x.data[part] ** 2, minlength=x.shape[0]))
            scale = np.where(norms > 0, norms, 1.0)[row[part]]
            x.data[part] /= scale
        return x


def gram_matrix(x) -> np.ndarray:
    """x @ x.T of a sparse matrix, dense.

    A sparse product costs a term per pair of rows sharing a column, and the
    n-grams most reports share (" th", a common Chinese pair) pair almost
    every report with every other: those few columns go through BLAS as one
    dense block, the rest stay sparse. Same product, about 4x faster on the
    labelled pool (1.8 s -> 0.45 s per fit; `kb eval` fits once per file).
    The sparse part is added where it has entries rather than made dense
    first: the same sums, ~0.5 s less per fit on 3,100 reports (session 23).
    It stays CSR for that: scipy's sparse product already holds each (row,
    column) once, so nothing is sorted or merged (COO's global sort cost
    ~1.7 s: the gram 2.5 s -> 0.6 s, a fit 2.6 s -> 1.1 s, the same gram to
    the bit; session 24). The test compares it with the plain product, so a
    scipy that changed this would show.
    """
    documents = np.bincount(x.indices, minlength=x.shape[1])
    common = documents >= max(MIN_DOCUMENTS, COMMON_SHARE * x.shape[0])
    dense = x[:, np.flatnonzero(common)].toarray()
    rare = x[:, np.flatnonzero(~common)]
    gram = dense @ dense.T
    product = (rare @ rare.T).tocsr()  # one entry per pair: the fancy-indexed add counts each
    if product.nnz > DENSE_PRODUCT_SHARE * product.shape[0] ** 2:
        # Most pairs share a rare n-gram too (43% on the labelled pool): one dense add
        # beats indexing each entry (a gram 0.78 s -> 0.66 s), with the same sums.
        gram += product.toarray()
        return gram
    rows = np.repeat(np.arange(product.shape[0]), np.diff(product.indptr))
    gram[rows, product.indices] += product.data
    return gram


def save_arrays(path: Path, header: dict, **arrays: np.ndarray) -> bool:
    """numpy arrays and a JSON header, written atomically; False when the folder
    cannot be written."""
    encoded = json.dumps(header).encode("utf-8")
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as out:
            np.savez(out, header=np.frombuffer(encoded, dtype=np.uint8), **arrays)
        os.replace(tmp, path)
        return True
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return False


def load_arrays(path: Path, key: str, names: tuple[str, ...]) -> tuple[dict, dict] | None:
    """(header, arrays) of a file `save_arrays` wrote under `key`; None when it is
    missing, damaged, foreign or saved under another key."""
    try:
        with np.load(path, allow_pickle=False) as data:
            header = json.loads(data["header"].tobytes().decode("utf-8"))
            if not isinstance(header, dict) or header.get("key") != key:
                return None
            return header, {name: data[name] for name in names}
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile):
        return None  # a bad header is a ValueError (JSON, UTF-8) too


def report_files(folder: Path) -> list[Path]:
    """The JSON-lines files of a folder of labelled reports (none when it is missing)."""
    return sorted(folder.glob("*.jsonl")) if folder.is_dir() else []


def text_key(text: str) -> str:
    """A report's identity for holding it out: its text, whitespace aside."""
    return hashlib.sha256(SPACE.sub(" ", text).strip().encode("utf-8", "surrogatepass")).hexdigest()


def example_key(symptom: str) -> str:
    """A KB symptom's identity in the pool: never a labelled report's."""
    return EXAMPLE_PREFIX + text_key(symptom)


def is_example_key(key: str) -> bool:
    return key.startswith(EXAMPLE_PREFIX)


def read_reports(folder: Path) -> list[tuple[str, tuple[str, ...]]]:
    """(text, its causes best first) of every labelled query in the folder's JSON-lines files.

    A file another team dropped there that is not labelled queries is passed
    over line by line: this is learning material, not input to reject.
    """
    reports = []
    for path in report_files(folder):
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        for line in lines:
            try:
                item = json.loads(line)
                text, causes = item["query"], item["causes"]
            except (ValueError, KeyError, TypeError, RecursionError):  # deep nesting too
                continue
            if not (isinstance(text, str) and text.strip() and isinstance(causes, list)):
                continue
            labels = tuple(cause for cause in causes[:MAX_LABELS] if isinstance(cause, str))
            if labels and labels[0] == causes[0]:
                reports.append((text, labels))
    return reports


@dataclass(frozen=True)
class PoolVectors:
    """Where the pooled texts' embeddings come from (engine.report_neighbours):
    `key()` names what they depend on beyond the texts (the embedding model,
    the bridge, how a text is prepared) without embedding anything; `load()`
    embeds or reads them."""

    key: Callable[[], str]
    load: Callable[[], ReportNeighbours | None]


MODEL_FILE = "reports_model.npz"
POOL_FILE = "reports_pool.npz"  # the counted pool, beside the model: `kb eval` fits from it
REPORTS_FOLDER = "reports"  # in a team's KB layer: its own labelled reports


class LearnedReports:
    """The signal as the retriever uses it: the whole pool's model, or one with reports held out.

    Nothing is read or fitted until the first query that needs it (or `kb
    build`, which fits and saves it). The pool is counted at most once per
    process and only when no saved pool has its key (an evaluation's held-out
    fits start from it). The saved model and pool go to the first of `caches`
    that can be written: the build folder, else the user's cache.

    `vectors`, when set (engine.py), gives the pooled texts' embeddings: the
    model then learns its vector block too, and is saved under their key.
    """

    def __init__(
        self,
        folders: list[Path],
        caches: list[Path],
        symptoms: dict[str, list[str]],
        prepare=lambda text: text,
    ):
        """`symptoms`: each cause of the KB and its own symptoms, which join the
        pool as examples: a cause no labelled report names yet (a new cause, a
        team's own) is then still one the signal can speak for."""
        self.folders = list(folders)
        self.caches = list(caches)
        self.causes = sorted(symptoms)
        self.symptoms = [(text, cause) for cause in self.causes for text in symptoms[cause]]
        self.prepare = prepare  # the same cleaning the query gets
        # The last held-out fit only: an evaluation holds out one file at a
        # time, and each model is the size of the saved one (~18 MB).
        self._held: tuple[frozenset[str], ReportModel | None] | None = None
        self._pool: ReportPool | None = None
        self.vectors: PoolVectors | None = None

    def scores(
        self,
        text: str,
        held_out: frozenset[str] = frozenset(),
        vector: np.ndarray | None = None,
    ) -> dict[str, float]:
        model = self.model(held_out)
        return model.scores(text, vector) if model is not None else {}

    def model(self, held_out: frozenset[str] = frozenset()) -> ReportModel | None:
        if held_out:  # only what the pool holds changes the model
            held_out = held_out & self.pool().key_set
        if not held_out:
            return self.whole
        if self._held is None or self._held[0] != held_out:
            self._held = (held_out, self.pool().fit(held_out, self.pool_vectors))
        return self._held[1]

    def describe(self, model: ReportModel | None) -> str:
        """What the signal learned from, for `kb build` to say (a team sees its files count)."""
        if model is None:
            return "no labelled reports: the reports signal is off"
        known = set(self.causes)
        reports = sum(
            1 for folder in self.folders for _, causes in read_reports(folder) if causes[0] in known
        )
        return (
            f"the reports signal learned from {reports} labelled reports"
            f" and {len(self.symptoms)} KB symptoms"
        )

    @cached_property
    def whole(self) -> ReportModel | None:
        """The whole pool's model: the saved one when its key matches, else fitted and saved."""
        key = self.model_key()
        if key is None:
            return None
        for cache in self.caches:
            saved = ReportModel.load(cache, key)
            if saved is not None:
                return saved
        model = self.pool().fit(vectors=self.pool_vectors)
        if model is not None:
            any(model.save(cache, key) for cache in self.caches)
        return model

    @cached_property
    def pool_vectors(self) -> np.ndarray | None:
        """Every pooled text's embedding in the pool's order; None without a
        source, or when it lacks one of them (the n-grams alone are then learned)."""
        loaded = self.vectors.load() if self.vectors is not None else None
        return loaded.rows_for(self.pool().keys) if loaded is not None else None

    def model_key(self) -> str | None:
        """The files' key, and the vectors' (the model and the texts embedded)."""
        files = self.files_key()
        if files is None or self.vectors is None:
            return files
        return f"{files} {VECTOR_WEIGHT} {self.vectors.key()}"

    def pool(self) -> ReportPool:
        """The counted pool: the saved one when its key matches, else counted and saved."""
        if self._pool is None:
            key = self.files_key()
            saved_pools = [cache.with_name(POOL_FILE) for cache in self.caches] if key else []
            self._pool = next(filter(None, (ReportPool.load(f, key) for f in saved_pools)), None)
            if self._pool is None:
                self._pool = ReportPool.count(self._pool_texts())
                any(self._pool.save(path, key) for path in saved_pools)
        return self._pool

    def labelled(self) -> list[tuple[str, tuple[str, ...], str]]:
        """(text as written, causes best first, key) of every labelled report whose
        first cause the KB knows, its other causes kept only where the KB knows them."""
        known = set(self.causes)  # a team's KB may lack some of the labelled causes
        return [
            (text, tuple(cause for cause in causes if cause in known), text_key(text))
            for folder in self.folders
            for text, causes in read_reports(folder)
            if causes[0] in known
        ]

    def _pool_texts(self) -> list[tuple[str, tuple[str, ...], str]]:
        """(text as searched, causes best first, key) of every labelled report and KB symptom."""
        reports = [(self.prepare(text), causes, key) for text, causes, key in self.labelled()]
        # The KB's own examples are never held out: the other signals search them too.
        examples = [
            (self.prepare(text), (cause,), example_key(text)) for text, cause in self.symptoms
        ]
        return reports + examples

    def files_key(self) -> str | None:
        """The pool's files, the causes, the model's settings and the code that
        counts a text, hashed; None without files."""
        files = [path for folder in self.folders for path in report_files(folder)]
        if not files:
            return None
        digest = hashlib.sha256(
            f"v{MODEL_VERSION} {RIDGE} {ALSO_TARGET} {MAX_CHAR_FEATURES}".encode()
        )
        # The code that turns a text into counts: an upgrade that changes it refits.
        for source in (Path(__file__), Path(clean.__file__)):
            with contextlib.suppress(OSError):  # no source files (a frozen build): the version
                digest.update(source.read_bytes())
        for text, cause in self.symptoms:
            digest.update(f"{cause}\0{text}\0".encode("utf-8", "surrogatepass"))
        for path in files:
            try:
                digest.update(str(path).encode() + b"\0" + path.read_bytes() + b"\0")
            except OSError:
                continue
        return digest.hexdigest()
