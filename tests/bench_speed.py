"""Speed figures for issue 2, printed (a benchmark, not a test).

    .venv/bin/python tests/bench_speed.py

Measures, in one run so that the ratios compare like with like:
  - cold `assistant ask --no-probe` vs `python -c "import torch, sentence_transformers"`
    (target: ratio <= 1.25)
  - warm query median on the real KB (target: <= 30 ms), over all labelled
    queries and over the questions alone (which always need the embedding)
  - the same on a synthetic 100,000-chunk index (target: <= 50 ms)
  - `assistant kb build` of the whole KB from nothing (target: <= 20 s)
  - `assistant --help` and `assistant kb lint` (target: < 1 s each)
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
QUESTION = "RuntimeError: Default process group has not been initialized, please make sure to call init_process_group."
REPEATS = 3


def wall(cmd: list[str], env: dict | None = None) -> float:
    started = time.perf_counter()
    subprocess.run(
        cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO
    )
    return time.perf_counter() - started


def best_of(cmd: list[str], env: dict | None = None, repeats: int = REPEATS) -> float:
    """Best of a few runs: the least disturbed by other work on the machine."""
    return min(wall(cmd, env) for _ in range(repeats))


def queries(questions_only: bool = False) -> list[str]:
    """The labelled queries: logs, messages and questions (or questions alone).

    The mix matters: a log or message whose root error hits a signature
    skips the embedding, a question never does, so both medians are printed.
    """
    path = REPO / "data" / "eval" / "queries.jsonl"
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if questions_only:
        items = [item for item in items if item["source"].startswith("question")]
    return [item["query"] for item in items]


def warm_median(engine, texts: list[str]) -> float:
    for text in texts[:3]:
        engine.ask(text)
    times = []
    for text in texts:
        started = time.perf_counter()
        engine.ask(text)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def embed_median(engine, texts: list[str]) -> float:
    """The query embedding alone: the floor under every warm query on this CPU."""
    from assistant.clean import clean_log
    from assistant.knowledge.retrieve import DENSE_TEXT_LIMIT

    focus = [clean_log(text).focus[:DENSE_TEXT_LIMIT] for text in texts]
    times = []
    for text in focus:
        started = time.perf_counter()
        engine.embedder.encode([text])
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def synthetic_index(engine, path: Path, size: int = 100_000) -> None:
    """The real KB plus `size` synthetic chunks (shuffled KB words, random vectors)."""
    import numpy as np

    from assistant.config import kb_dir
    from assistant.knowledge.index import Chunk, chunks_from_kb, write_db
    from assistant.knowledge.kb import load_kb

    kb = load_kb(kb_dir())
    real = chunks_from_kb(kb)
    words = " ".join(c.text for c in real).split()
    ids = list(kb.causes)
    rng = random.Random(0)
    chunks = real + [
        Chunk(
            " ".join(rng.choices(words, k=24)) + f" #{i}",
            "symptom",
            "en",
            ((rng.choice(ids), 1.0),),
        )
        for i in range(size)
    ]
    vectors = engine.embedder.encode([c.text for c in real])
    noise = np.random.default_rng(0).standard_normal((size, vectors.shape[1])).astype(np.float32)
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    matrix = np.vstack([vectors, noise])
    by_hash = {c.hash: row.tobytes() for c, row in zip(chunks, matrix)}
    write_db(path, kb, chunks, by_hash, engine.embedder.fingerprint)


def main() -> None:
    from assistant.knowledge.engine import Engine

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    assistant = str(BIN / "assistant")
    python = sys.executable
    figures: dict[str, float] = {}

    with tempfile.TemporaryDirectory() as tmp:
        build_env = dict(env, ASSISTANT_BUILD=tmp)
        figures["kb_build_s"] = wall([assistant, "kb", "build"], build_env)
        figures["import_torch_st_s"] = best_of(
            [python, "-c", "import torch, sentence_transformers"], env
        )
        figures["cold_ask_s"] = best_of(
            [assistant, "ask", "--no-probe", "--json", QUESTION], build_env
        )
        figures["cold_ratio"] = figures["cold_ask_s"] / figures["import_torch_st_s"]
        figures["help_s"] = best_of([assistant, "--help"], env)
        figures["kb_lint_s"] = best_of([assistant, "kb", "lint"], env)

        engine = Engine(index_path=Path(tmp) / "index.sqlite", log=lambda m: None)
        engine.load()
        texts = queries()
        figures["warm_median_ms"] = warm_median(engine, texts)
        figures["warm_median_questions_ms"] = warm_median(engine, queries(questions_only=True))
        figures["embed_only_median_ms"] = embed_median(engine, texts)

        synthetic = Engine(
            index_path=Path(tmp) / "synthetic.sqlite", log=lambda m: None, embedder=engine.embedder
        )
        synthetic_index(engine, synthetic.index_path)
        from assistant.knowledge.index import open_index
        from assistant.knowledge.retrieve import Retriever

        synthetic._index = open_index(synthetic.index_path, None, None)
        synthetic._retriever = Retriever(synthetic._index, engine.embedder)
        figures["synthetic_chunks"] = float(synthetic._index.faiss_index.ntotal)
        figures["warm_median_100k_ms"] = warm_median(synthetic, texts)
        figures["warm_median_100k_questions_ms"] = warm_median(
            synthetic, queries(questions_only=True)
        )

    targets = {
        "cold_ratio": 1.25,
        "warm_median_ms": 30,
        "warm_median_100k_ms": 50,
        "warm_median_questions_ms": 30,
        "warm_median_100k_questions_ms": 50,
        "kb_build_s": 20,
        "help_s": 1,
        "kb_lint_s": 1,
    }
    for key, value in figures.items():
        target = targets.get(key)
        verdict = (
            "" if target is None else ("  ok" if value <= target else f"  OVER target {target}")
        )
        print(f"{key:22} {value:10.3f}{verdict}")


if __name__ == "__main__":
    main()
