"""Linter speed figures, printed (a benchmark, not a test).

    .venv/bin/python tests/bench_lint.py [--sample K]

Measures, in one run:
  - how the time grows with a script's length, for shapes of code that a
    check could walk once per statement: the seconds for N and for 2N
    statements, and their ratio (target: <= 2.5; a check that walks the
    whole loop at every statement of it shows 4). Session 57 found the step
    checks at 4.0 on a loop of skips (3,000 skips: 42 s; now under 2 s).
  - the time per blind script (data/eval/blind_scripts, every K-th file):
    the CI test lints all of them, so this is most of its cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from assistant.lint import lint_script, lint_source

HEADER = (
    "import time\nimport torch\nimport torch.distributed as dist\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "dist.init_process_group('gloo')\nmodel = DDP(torch.nn.Linear(2, 2))\n"
)
RATIO_TARGET = 2.5


def skips_in_a_loop(n: int) -> str:
    """A training loop that skips its step on n tests of its own loss."""
    skips = "".join(f"    if torch.isnan(loss{i}):\n        continue\n" for i in range(n))
    return (
        HEADER
        + "for batch in range(10):\n    loss = model(batch)\n"
        + skips
        + "    loss.backward()\n"
    )


def assignments_in_a_loop(n: int) -> str:
    """A loop of n assignments, each from the one before, and a skip after each tenth."""
    body = "".join(
        f"    x{i} = x{i - 1} * 2 + batch\n"
        + (f"    if x{i}.sum() > 0:\n        break\n" if i % 10 == 0 else "")
        for i in range(1, n)
    )
    return (
        HEADER + "for batch in range(10):\n    x0 = model(batch)\n" + body + "    x0.backward()\n"
    )


def rank_branches(n: int) -> str:
    """n module-level branches on the rank, each around a collective."""
    return HEADER + "".join(
        f"if dist.get_rank() == {i % 3}:\n    t{i} = torch.ones(2)\ndist.all_reduce(torch.ones({i % 5 + 1}))\n"
        for i in range(n)
    )


def call_chain(n: int) -> str:
    """n functions, each calling the next, the last one all-reducing."""
    functions = "".join(f"def f{i}(x):\n    return f{i + 1}(x) + 1\n" for i in range(n))
    last = f"def f{n}(x):\n    dist.all_reduce(x)\n    return x\n"
    return HEADER + functions + last + "for step in range(3):\n    f0(model(torch.ones(2)))\n"


SHAPES: dict[str, Callable[[int], str]] = {
    "skips in a loop": skips_in_a_loop,
    "assignments in a loop": assignments_in_a_loop,
    "rank branches": rank_branches,
    "call chain": call_chain,
}


def seconds(source: str) -> float:
    started = time.perf_counter()
    lint_source(source)
    return time.perf_counter() - started


def scaling(n: int) -> list[tuple[str, float, float]]:
    rows = []
    for name, make in SHAPES.items():
        seconds(make(n // 10))  # warm: imports and the registry
        rows.append((name, seconds(make(n)), seconds(make(2 * n))))
    return rows


def blind_scripts(every: int) -> list[float]:
    folders = sorted(p for p in (REPO / "data/eval/blind_scripts").iterdir() if p.is_dir())
    files = [
        folder / json.loads(line)["file"]
        for folder in folders
        for line in (folder / "labels.jsonl").read_text().splitlines()
    ][::every]
    times = []
    for path in files:
        started = time.perf_counter()
        lint_script(path)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=800, help="statements of the shorter script")
    parser.add_argument("--sample", type=int, default=10, help="lint every K-th blind script")
    args = parser.parse_args()
    worst = 0.0
    print(f"{'shape':<24}{'N=' + str(args.n):>10}{'2N':>10}{'ratio':>8}")
    for name, short, long in scaling(args.n):
        ratio = long / short if short > 0 else float("inf")
        worst = max(worst, ratio)
        print(f"{name:<24}{short:>9.2f}s{long:>9.2f}s{ratio:>8.2f}")
    print(
        f"worst ratio {worst:.2f} (target <= {RATIO_TARGET}: {'met' if worst <= RATIO_TARGET else 'MISSED'})"
    )
    times = blind_scripts(args.sample)
    print(
        f"blind scripts: {len(times)} linted, {1000 * statistics.mean(times):.0f} ms mean, "
        f"{1000 * statistics.median(times):.0f} ms median, {max(times):.2f} s slowest"
    )


if __name__ == "__main__":
    main()
