"""Embeddings shipped with the checkout, so a fresh clone does not embed them again.

A first build embeds every KB chunk and every labelled report with the model:
~7,900 texts, about a minute on two cores, before the first answer. The
vectors depend only on the model and the text, so `assistant kb build
--ship-vectors` writes them, keyed by each text's SHA-256, into
data/eval/vectors.npz (beside the labelled reports, installed with them),
and every build reads them before it runs the model: only texts added or
changed since the file was written are embedded. The file is read only; it
is never needed (another model, a damaged or missing file: everything is
embedded as before), and a stale one still saves what it holds, so it is
rewritten now and then, not on every edit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from assistant import config
from assistant.knowledge.neighbours import read_saved, text_hash
from assistant.knowledge.reports import save_arrays

SHIPPED_FILE = "vectors.npz"


def shipped_path() -> Path:
    return config.eval_dir() / SHIPPED_FILE


def read_shipped(path: Path, fingerprint: str) -> dict[str, np.ndarray]:
    """text hash -> vector of the shipped file when it was made by this model; else {}
    (missing, damaged or another model's: everything is embedded, as without it)."""
    saved = read_saved(path, fingerprint)
    return {} if saved is None else dict(zip(saved[0]["hashes"], saved[1]))


def write_shipped(path: Path, fingerprint: str, vectors: dict[str, np.ndarray]) -> bool:
    """Write text hash -> vector for this model, in a stable order; False when unwritable."""
    hashes = sorted(vectors)
    matrix = np.stack([np.asarray(vectors[h], dtype=np.float32) for h in hashes])
    return save_arrays(path, {"key": fingerprint, "hashes": hashes}, vectors=matrix)


def indexed_vectors(index_path: Path) -> dict[str, np.ndarray]:
    """text hash -> vector of every embedded chunk of a built index."""
    import sqlite3

    db = sqlite3.connect(f"file:{index_path}?mode=ro", uri=True)
    try:
        rows = db.execute("select text, embedding from chunks where embedding is not null")
        return {text_hash(text): np.frombuffer(blob, dtype=np.float32) for text, blob in rows}
    finally:
        db.close()


def neighbour_vectors(neighbours) -> dict[str, np.ndarray]:
    """text hash -> vector of every labelled report and KB symptom the neighbours hold."""
    if neighbours is None:
        return {}
    return {digest: neighbours.vectors[row] for digest, row in neighbours.row_of_text.items()}
