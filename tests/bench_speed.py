"""Speed figures, printed (a benchmark, not a test).

    .venv/bin/python tests/bench_speed.py

Measures, in one run so that the ratios compare like with like:
  - the floor: a fresh Python that loads ONNX Runtime, the tokenizer
    (`tokenizers`) and the exported graph and embeds one query
  - cold `assistant ask --no-probe` against that floor (target: ratio <= 2.0)
    and its peak RSS (target: <= 350 MiB); for scale, what the model stack
    alone costs to import (`import torch, sentence_transformers`)
  - the chat's engine ready for a question in a fresh process (target: < 1 s)
  - warm query median on the real KB (target: <= 15 ms), over all labelled
    queries and over the questions alone (which always need the embedding)
  - the same on a synthetic 100,000-chunk index (target: <= 50 ms)
  - `assistant kb eval` of the whole eval set, cold (target: < 10 s)
  - one held-out fit of the reports model (`kb eval` and the CI floors fit
    once per labelled file; 2.6 s before session 24, 1.33 s before session
    30's float32 solve, 0.76 s after; target: < 1.0 s)
  - `assistant kb build` of the whole KB from nothing, export included (target: <= 20 s)
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

# The floor: what any torch-free query must pay, and nothing of this project.
FLOOR = """
import sys, numpy, onnxruntime, tokenizers
tokenizer = tokenizers.Tokenizer.from_file(sys.argv[1])
tokenizer.no_padding()
tokenizer.enable_truncation(max_length=128)
options = onnxruntime.SessionOptions()
options.log_severity_level = 3
session = onnxruntime.InferenceSession(sys.argv[2], options, providers=["CPUExecutionProvider"])
encoding = tokenizer.encode(sys.argv[3])
ids = numpy.array([encoding.ids], dtype=numpy.int64)
mask = numpy.array([encoding.attention_mask], dtype=numpy.int64)
print(session.run(None, {"input_ids": ids, "attention_mask": mask})[0].shape)
"""

# A wrapper whose only child is the command: its RUSAGE_CHILDREN peak is the command's.
PEAK_RSS = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
"""

CHAT_READY = """
import time
started = time.perf_counter()
from assistant.tui.app import make_app
from assistant.tui.deps import chat_deps
from assistant.tui import services
engine = services.LazyEngine()
make_app(chat_deps(engine=engine, runner=services.LazyRunner()))
engine.load()  # what the app's loading worker does once the window is up
assert engine.ready
print(time.perf_counter() - started)
"""


def wall(cmd: list[str], env: dict | None = None) -> float:
    started = time.perf_counter()
    subprocess.run(
        cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO
    )
    return time.perf_counter() - started


def best_of(cmd: list[str], env: dict | None = None, repeats: int = REPEATS) -> float:
    """Best of a few runs: the least disturbed by other work on the machine."""
    return min(wall(cmd, env) for _ in range(repeats))


def peak_rss_mib(cmd: list[str], env: dict) -> float:
    done = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, *cmd], check=True, capture_output=True, text=True, env=env
    )
    return float(done.stdout.strip())


def printed_seconds(code: str, env: dict, repeats: int = REPEATS) -> float:
    """Best of a few fresh processes that print their own elapsed seconds."""
    runs = [
        subprocess.run(
            [sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env
        )
        for _ in range(repeats)
    ]
    return min(float(run.stdout.strip().splitlines()[-1]) for run in runs)


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


WARM_UP = [
    "NCCL error: unhandled system error",
    "为什么训练卡住了",
    "DDP hangs after the first epoch",
]


def warm_median(engine, texts: list[str]) -> float:
    for text in WARM_UP:  # not among `texts`
        engine.ask(text)
    engine.embedder.forget_recent()  # every timed query embeds afresh
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
    engine.embedder.forget_recent()
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


def cold_figures(figures: dict, env: dict, build: Path) -> None:
    """One-shot commands in fresh processes, side by side with the floor."""
    from assistant.knowledge.embed import Embedder

    assistant = str(BIN / "assistant")
    embedder = Embedder()
    graph = build / "onnx" / embedder.graph_name
    tokenizer = embedder.model_dir / "tokenizer.json"
    floor = [sys.executable, "-c", FLOOR, str(tokenizer), str(graph), QUESTION]
    ask = [assistant, "ask", "--no-probe", "--json", QUESTION]
    figures["floor_s"] = best_of(floor, env)
    figures["cold_ask_s"] = best_of(ask, env)
    figures["cold_ratio"] = figures["cold_ask_s"] / figures["floor_s"]
    figures["floor_peak_mib"] = peak_rss_mib(floor, env)
    figures["cold_ask_peak_mib"] = peak_rss_mib(ask, env)
    figures["chat_engine_ready_s"] = printed_seconds(CHAT_READY, env)
    figures["kb_eval_s"] = best_of([assistant, "kb", "eval"], env, repeats=1)
    figures["help_s"] = best_of([assistant, "--help"], env)
    figures["kb_lint_s"] = best_of([assistant, "kb", "lint"], env)
    figures["import_torch_st_s"] = best_of(
        [sys.executable, "-c", "import torch, sentence_transformers"], env, repeats=1
    )


def held_out_fit_seconds(engine) -> float:
    """One question asked with a labelled file held out, as `kb eval` asks its
    first question of each file: the reports model is fitted without that file
    then (the question itself costs milliseconds). Best of REPEATS files."""
    from assistant.config import eval_dir
    from assistant.knowledge.evaluate import load_queries

    times = []
    for path in sorted(eval_dir().glob("*.jsonl"))[:REPEATS]:
        texts = [query["query"] for query in load_queries(path)]
        with engine.holding_out(texts):
            started = time.perf_counter()
            engine.signal_scores(texts[0])
            times.append(time.perf_counter() - started)
    return min(times)


def warm_figures(figures: dict, build: Path) -> None:
    from assistant.knowledge.engine import Engine
    from assistant.knowledge.index import open_index
    from assistant.knowledge.retrieve import Retriever

    engine = Engine(index_path=build / "index.sqlite", log=lambda m: None)
    engine.load()
    figures["warm_backend_onnx"] = float(engine.embedder.backend == "onnxruntime")
    texts = queries()
    figures["warm_median_ms"] = warm_median(engine, texts)
    figures["warm_median_questions_ms"] = warm_median(engine, queries(questions_only=True))
    figures["embed_only_median_ms"] = embed_median(engine, texts)
    figures["held_out_fit_s"] = held_out_fit_seconds(engine)

    synthetic = Engine(
        index_path=build / "synthetic.sqlite", log=lambda m: None, embedder=engine.embedder
    )
    synthetic_index(engine, synthetic.index_path)
    synthetic._index = open_index(synthetic.index_path, None, None)
    synthetic._retriever = Retriever(synthetic._index, engine.embedder)
    figures["synthetic_chunks"] = float(synthetic._index.faiss_index.ntotal)
    figures["warm_median_100k_ms"] = warm_median(synthetic, texts)
    figures["warm_median_100k_questions_ms"] = warm_median(synthetic, queries(questions_only=True))


TARGETS = {
    "cold_ratio": 2.0,
    "cold_ask_peak_mib": 350,
    "chat_engine_ready_s": 1.0,
    "warm_median_ms": 15,
    "warm_median_questions_ms": 15,
    "warm_median_100k_ms": 50,
    "warm_median_100k_questions_ms": 50,
    "kb_eval_s": 10,
    "held_out_fit_s": 1.0,
    "kb_build_s": 20,
    "help_s": 1,
    "kb_lint_s": 1,
}


def main() -> None:
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        build = Path(tmp)
        # This process and its children share the fresh build (index and graph).
        os.environ["ASSISTANT_BUILD"] = tmp
        os.environ["HF_HUB_OFFLINE"] = "1"
        env = dict(os.environ)
        figures["kb_build_s"] = wall([str(BIN / "assistant"), "kb", "build"], env)
        cold_figures(figures, env, build)
        warm_figures(figures, build)

    for key, value in figures.items():
        target = TARGETS.get(key)
        verdict = (
            "" if target is None else ("  ok" if value <= target else f"  OVER target {target}")
        )
        print(f"{key:30} {value:10.3f}{verdict}")


if __name__ == "__main__":
    main()
