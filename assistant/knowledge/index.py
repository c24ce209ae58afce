"""The built index: one SQLite file (sqlite-utils) holding the KB, FTS5 and FAISS.

`build_index` compiles kb/ into index.sqlite:

  meta        key/value: schema, KB content hash, embedding model fingerprint,
              and the ONNX graph check (onnxembed.GraphCheck: whether the exported
              graph reproduces the model, with the model's vectors of the check texts)
  causes      one row per cause, the validated entry as JSON
  threads     one row per thread, as JSON
  chunks      searchable pieces of text, each linked to the causes it speaks for,
              with a content hash and its embedding (reused on rebuild)
  chunks_fts  FTS5 over a CJK-aware token string of each chunk
  token_df    in how many chunks each token occurs (for choosing query terms)
  blobs       the serialized FAISS index over chunk embeddings, and each cause's
              TF-IDF centroid (centroids.py), fitted once here

Building writes a temporary file beside the index and renames it into place,
so a failed or concurrent build never leaves a broken index. `open_index`
refuses a stale or damaged one (IndexProblem) so the caller can rebuild.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from assistant.i18n import has_cjk
from assistant.knowledge.onnxembed import GraphCheck
from assistant.knowledge.textsearch import search_tokens

INDEX_SCHEMA = 6  # 6: the ONNX graph check in meta

# How much each kind of chunk counts when it is the best match for a cause.
KIND_WEIGHTS = {
    "title": 1.0,
    "summary": 1.0,
    "symptom": 1.0,
    "why": 0.85,
    "fix": 0.7,
    "question": 0.75,
    "answer": 0.8,
}


# The kinds of text the dense signal embeds: short texts worded like what users
# paste or ask. Why-paragraphs and fix code stay lexical only: cut to the
# model's 128 tokens their vectors are diffuse, and in the eval's ablation they
# never won a dense match (same MRR without them) while costing 37% of the
# embedding time of a build.
DENSE_KINDS = frozenset({"title", "summary", "symptom", "question", "answer"})


class IndexProblem(Exception):
    """The index is missing, stale or damaged; the message says which."""


@dataclass(frozen=True)
class Chunk:
    text: str
    kind: str
    lang: str
    # The causes this text speaks for, each with how strongly (0..1).
    causes: tuple[tuple[str, float], ...]
    ref: str = ""  # thread id and answer id for answers

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:24]

    @property
    def dense(self) -> bool:
        return self.kind in DENSE_KINDS


def chunks_from_kb(kb) -> list[Chunk]:
    """Every searchable piece of the KB, each linked to the causes it speaks for."""
    chunks: list[Chunk] = []
    for cause in kb.causes.values():
        own = ((cause.id, 1.0),)
        chunks.append(Chunk(cause.title, "title", "en", own))
        chunks.append(Chunk(cause.title_zh, "title", "zh", own))
        chunks.append(Chunk(cause.summary, "summary", "en", own))
        chunks.append(Chunk(cause.summary_zh, "summary", "zh", own))
        chunks.append(Chunk(cause.why, "why", "en", own))
        if cause.why_zh:
            chunks.append(Chunk(cause.why_zh, "why", "zh", own))
        chunks.append(Chunk(cause.fix, "fix", "en", own))
        for symptom in cause.symptoms:
            chunks.append(Chunk(symptom, "symptom", "zh" if has_cjk(symptom) else "en", own))
    for thread in kb.threads:
        votes = _thread_votes(thread)
        if votes:
            chunks.append(Chunk(thread.question, "question", thread.lang, votes, thread.id))
        for answer in thread.answers:
            if answer.claims and answer.stance != "wrong":
                ref = f"{thread.id}#{answer.id}"
                weight = _claim_weight(len(answer.claims))
                causes = tuple((cid, weight) for cid in answer.claims)
                chunks.append(Chunk(answer.text, "answer", answer.lang, causes, ref))
    return _dedupe(chunks)


# How much an answer's claim counts, by the KB's judgment of the answer.
STANCE_VOTES = {"right": 1.0, "partly_right": 0.7, "unverified": 0.5, "wrong": 0.0}


def _claim_weight(n_causes: int) -> float:
    """An answer that blames seven causes says less about each one."""
    return 1.0 / (1.0 + 0.3 * (n_causes - 1))


def _thread_votes(thread) -> tuple[tuple[str, float], ...]:
    """A thread's question speaks for the causes its answers claim, by weighted vote."""
    votes: dict[str, float] = {}
    for answer in thread.answers:
        for cid in answer.claims:
            votes[cid] = votes.get(cid, 0.0) + STANCE_VOTES[answer.stance] * _claim_weight(
                len(answer.claims)
            )
    top = max(votes.values(), default=0.0)
    if top <= 0:
        return ()
    return tuple((cid, round(v / top, 4)) for cid, v in votes.items() if v > 0)


def _dedupe(chunks: list[Chunk]) -> list[Chunk]:
    seen: set[tuple] = set()
    out = []
    for chunk in chunks:
        key = (chunk.text, chunk.causes)
        if chunk.text.strip() and key not in seen:
            seen.add(key)
            out.append(chunk)
    return out


@dataclass
class BuildReport:
    path: Path
    chunks: int
    dense: int  # chunks with an embedding (DENSE_KINDS)
    embedded: int  # of those, how many had to be computed (the rest reused)
    seconds: float
    graph: GraphCheck | None = None  # the ONNX graph check recorded for queries
    learned: str = ""  # what the reports signal was fitted on (engine.build)

    def summary(self) -> str:
        text = (
            f"built {self.path} with {self.chunks} chunks, {self.dense} with embeddings "
            f"({self.embedded} computed, {self.dense - self.embedded} reused) "
            f"in {self.seconds:.1f}s"
        )
        if self.graph is not None:
            backend = "onnxruntime" if self.graph.ok else "sentence-transformers"
            text += f"; queries run on {backend} ({self.graph.detail})"
        if self.learned:
            text += f"; {self.learned}"
        return text


def _earlier_build(path: Path, fingerprint: str) -> tuple[dict[str, bytes], GraphCheck | None]:
    """Embeddings of an earlier build by the same model, keyed by chunk hash, and its
    graph check; nothing when there is no such build."""
    if not path.exists():
        return {}, None
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            meta = dict(db.execute("select key, value from meta"))
            if meta.get("model") != fingerprint:
                return {}, None
            vectors = dict(
                db.execute("select hash, embedding from chunks where embedding is not null")
            )
            return vectors, GraphCheck.from_json(meta.get("onnx_check"))
        finally:
            db.close()
    except sqlite3.DatabaseError:
        return {}, None


def build_index(kb, embedder, path: Path, log=None, shipped=dict) -> BuildReport:
    """Compile a validated KB into the index file at `path`, atomically.

    First the embedder's ONNX graph is checked (exported when there is none,
    announced through `log`) so that the build embeds on it and the first
    query after the build needs no torch. A chunk no earlier build embedded
    takes its vector from `shipped()` (text hash -> vector, shipped.py) when
    it is there, else from the model.
    """
    started = time.perf_counter()
    chunks = chunks_from_kb(kb)
    dense = [c for c in chunks if c.dense]
    vectors, earlier_check = _earlier_build(path, embedder.fingerprint)
    graph = embedder.check_graph(
        earlier_check, log=log or (lambda message: None), index_dir=path.parent
    )
    missing = list({c.hash: c for c in dense if c.hash not in vectors}.values())
    if missing:
        from assistant.knowledge.neighbours import text_hash  # numpy: a build's, not a query's

        known = shipped()
        found = [(c, known.get(text_hash(c.text))) for c in missing]
        vectors.update({c.hash: v.tobytes() for c, v in found if v is not None})
        missing = [c for c, v in found if v is None]
    if missing:
        fresh = embedder.encode([c.text for c in missing])
        vectors.update({c.hash: v.tobytes() for c, v in zip(missing, fresh)})

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".index-", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write_db(tmp, kb, chunks, vectors, embedder.fingerprint, graph)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    seconds = time.perf_counter() - started
    return BuildReport(path, len(chunks), len(dense), len(missing), seconds, graph)


def write_db(
    path: Path,
    kb,
    chunks: list[Chunk],
    vectors: dict,
    fingerprint: str,
    graph: GraphCheck | None = None,
) -> None:
    """Write the whole index; `vectors` maps the hash of every dense chunk to its embedding."""
    import numpy as np
    import sqlite_utils

    db = sqlite_utils.Database(path, recreate=True)
    db["meta"].insert_all(
        [
            {"key": "schema", "value": str(INDEX_SCHEMA)},
            {"key": "kb_hash", "value": kb.content_hash},
            {"key": "model", "value": fingerprint},
            {"key": "onnx_check", "value": graph.to_json() if graph is not None else ""},
            {"key": "built_at", "value": time.strftime("%Y-%m-%dT%H:%M:%S")},
        ],
        pk="key",
    )
    db["causes"].insert_all(
        (
            {"id": c.id, "data": json.dumps(c.model_dump(), ensure_ascii=False)}
            for c in kb.causes.values()
        ),
        pk="id",
    )
    db["threads"].insert_all(
        ({"id": t.id, "data": json.dumps(t.model_dump(), ensure_ascii=False)} for t in kb.threads),
        pk="id",
    )
    tokens = [search_tokens(c.text) for c in chunks]
    db["chunks"].insert_all(
        (
            {
                "id": i,
                "kind": c.kind,
                "lang": c.lang,
                "causes": json.dumps(dict(c.causes)),
                "ref": c.ref,
                "text": c.text,
                "tokens": " ".join(tokens[i]),
                "hash": c.hash,
                "embedding": vectors[c.hash] if c.dense else None,
            }
            for i, c in enumerate(chunks)
        ),
        pk="id",
        columns={"embedding": bytes},
    )
    db["chunks"].enable_fts(["tokens"], tokenize="unicode61", create_triggers=False)
    # Document frequency per token, so queries can keep their rarest tokens.
    db.execute("create virtual table chunks_vocab using fts5vocab(chunks_fts, 'row')")
    db.execute("create table token_df as select term, doc from chunks_vocab")
    dense_ids = np.array([i for i, c in enumerate(chunks) if c.dense], dtype=np.int64)
    matrix = np.vstack([np.frombuffer(vectors[chunks[i].hash], np.float32) for i in dense_ids])
    db["blobs"].insert({"name": "faiss", "data": _faiss_bytes(matrix, dense_ids)}, pk="name")
    _store_centroids(db, tokens, chunks, set(kb.causes))
    db.conn.commit()
    db.close()


def _store_centroids(db, tokens: list[list[str]], chunks: list[Chunk], known: set[str]) -> None:
    """Fit the causes' centroids once, here, on the chunks as written (with FTS5's
    token counts), rather than on every cold start; not above FIT_LIMIT chunks."""
    from assistant.knowledge.centroids import FIT_LIMIT, STORED_NAME, CauseCentroids

    if len(chunks) > FIT_LIMIT:
        return
    token_df = dict(db.execute("select term, doc from token_df").fetchall())
    # Each chunk's causes as a query reads them back (json round trip of the same dict).
    chunk_causes = [dict(c.causes) for c in chunks]
    # A token as stored in chunks.tokens (a space-joined string) splits back the same way.
    token_lists = [" ".join(t).split() for t in tokens]
    centroids = CauseCentroids.fit(token_lists, chunk_causes, token_df, known)
    if centroids is not None:
        data = centroids.to_json().encode("utf-8")
        db["blobs"].insert({"name": STORED_NAME, "data": data}, pk="name")


# Up to this many chunks an exact (flat) search is fast enough; above it an
# HNSW graph answers in about a millisecond instead of tens.
FLAT_LIMIT = 20_000


def _faiss_bytes(matrix, chunk_ids) -> bytes:
    """A FAISS index over `matrix` whose search returns the rows' chunk ids."""
    import faiss

    dim = matrix.shape[1]
    if len(matrix) <= FLAT_LIMIT:
        inner = faiss.IndexFlatIP(dim)
    else:
        inner = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT)
        inner.hnsw.efSearch = 128
    index = faiss.IndexIDMap(inner)
    index.add_with_ids(matrix, chunk_ids)
    return faiss.serialize_index(index).tobytes()


class QuerySearch:
    """The FAISS index as queries use it: a vector or two, searched on the calling thread."""

    def __init__(self, index):
        self.index = index

    @property
    def ntotal(self) -> int:
        return self.index.ntotal

    def search(self, vectors, k: int):
        import faiss

        # For one query OpenMP workers only add handoffs, and on a busy 2-core
        # machine their spin-waits made a 0.02 ms flat search take 8-19 ms (p90).
        # Set per call: OpenMP keeps the setting per thread (the chat searches
        # from its engine thread).
        faiss.omp_set_num_threads(1)
        return self.index.search(vectors, k)


@dataclass
class LoadedIndex:
    """What a query needs, read once from the index file."""

    path: Path
    kb_hash: str
    model: str
    causes: dict[str, dict]
    threads: dict[str, dict]
    chunk_kinds: list[str]
    chunk_causes: list[dict[str, float]]  # cause id -> how strongly the chunk speaks for it
    chunk_refs: list[str]
    token_df: dict[str, int]
    faiss_index: QuerySearch
    graph_check: GraphCheck | None  # the ONNX check recorded at build time (None: none)
    db: sqlite3.Connection  # kept open for FTS queries (check_same_thread=False)

    def close(self) -> None:
        self.db.close()


def open_index(path: Path, kb_hash: str | None, fingerprint: str | None) -> LoadedIndex:
    """Open and verify an index; IndexProblem when missing, stale or damaged.

    Pass kb_hash / fingerprint as None to skip that staleness check (for a
    synthetic index in benchmarks).
    """
    if not path.exists():
        raise IndexProblem(f"no index at {path}")
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        meta = dict(db.execute("select key, value from meta"))
        if meta.get("schema") != str(INDEX_SCHEMA):
            raise IndexProblem("index was built by another version of the assistant")
        if kb_hash is not None and meta.get("kb_hash") != kb_hash:
            raise IndexProblem("the knowledge base changed since the index was built")
        if fingerprint is not None and meta.get("model") != fingerprint:
            raise IndexProblem(
                f"index was built with another embedding model ({meta.get('model')})"
            )
        return _load(db, path, meta)
    except IndexProblem:
        raise
    except Exception as exc:  # noqa: BLE001 - sqlite3, faiss, JSON errors: all mean "damaged"
        raise IndexProblem(f"index is damaged ({type(exc).__name__}: {exc})") from None


def stored_vectors(db: sqlite3.Connection):
    """(chunk id, embedding bytes) of every chunk that has an embedding, in chunk order."""
    return db.execute("select id, embedding from chunks where embedding is not null order by id")


def _load(db: sqlite3.Connection, path: Path, meta: dict) -> LoadedIndex:
    import faiss
    import numpy as np

    causes = {cid: json.loads(data) for cid, data in db.execute("select id, data from causes")}
    threads = {tid: json.loads(data) for tid, data in db.execute("select id, data from threads")}
    rows = db.execute("select kind, causes, ref from chunks order by id").fetchall()
    dense = db.execute("select count(*) from chunks where embedding is not null").fetchone()[0]
    blob = db.execute("select data from blobs where name='faiss'").fetchone()
    if blob is None:
        raise IndexProblem("index is damaged (no FAISS index)")
    index = faiss.deserialize_index(np.frombuffer(blob[0], dtype=np.uint8))
    if index.ntotal != dense:
        raise IndexProblem("index is damaged (FAISS and chunk counts differ)")
    db.execute("select count(*) from chunks_fts").fetchone()  # FTS table must be readable
    return LoadedIndex(
        path=path,
        kb_hash=meta.get("kb_hash", ""),
        model=meta.get("model", ""),
        causes=causes,
        threads=threads,
        chunk_kinds=[r[0] for r in rows],
        chunk_causes=[json.loads(r[1]) for r in rows],
        chunk_refs=[r[2] for r in rows],
        token_df=dict(db.execute("select term, doc from token_df")),
        faiss_index=QuerySearch(index),
        graph_check=GraphCheck.from_json(meta.get("onnx_check")),
        db=db,
    )
