"""Benchmark: `assistant doctor` and `assistant ask` with probes against one bare
torchrun launch (not a test).

    .venv/bin/python tests/bench_doctor.py [--repeat 3]

The bare launch is init_process_group + one all_reduce with gloo on 2 ranks,
timed until torchrun exits. The doctor run is Pipeline.doctor() with the
default runner, as `assistant doctor` calls it, in this process. The ask run
is a whole cold `assistant ask --json "<error>"` process: import, index and
model load, retrieval, and the probe launch the pipeline starts at once.
All three alternate and the medians are compared: targets doctor <= 1.5x
bare, ask with probes <= 1.2x bare.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from assistant.pipeline import Pipeline
from assistant.probing.machine import free_port
from assistant.probing.runner import ProbeRunner

BARE = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
tensor = torch.ones(1)
dist.all_reduce(tensor)
dist.destroy_process_group()
"""
TARGET = 1.5
ASK_TARGET = 1.2
ERROR = "RuntimeError: Default process group has not been initialized"


def time_bare(script: Path) -> float:
    started = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={free_port()}",
            str(script),
        ],
        check=True,
        capture_output=True,
        env=None,
    )
    return time.monotonic() - started


def time_doctor() -> tuple[float, int]:
    runner = ProbeRunner()
    started = time.monotonic()
    Pipeline(runner=runner).doctor()
    return time.monotonic() - started, runner.launches


def time_ask() -> float:
    started = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "assistant", "ask", "--json", ERROR],
        check=True,
        capture_output=True,
    )
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeat", type=int, default=3, help="pairs of runs (medians are compared)"
    )
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "bare.py"
        script.write_text(BARE)
        time_ask()  # the first ask after a build may export the model: not a query's cost
        bare, doc, asks, launches = [], [], [], set()
        for round_number in range(1, options.repeat + 1):
            bare.append(time_bare(script))
            seconds, count = time_doctor()
            doc.append(seconds)
            launches.add(count)
            asks.append(time_ask())
            print(
                f"round {round_number}: bare torchrun {bare[-1]:.2f} s, doctor {doc[-1]:.2f} s "
                f"({count} launch), ask with probes {asks[-1]:.2f} s"
            )
    ratio = statistics.median(doc) / statistics.median(bare)
    ask_ratio = statistics.median(asks) / statistics.median(bare)
    print(f"median bare torchrun launch: {statistics.median(bare):.2f} s")
    print(
        f"median assistant doctor:     {statistics.median(doc):.2f} s (torchrun launches: {sorted(launches)})"
    )
    print(f"median assistant ask:        {statistics.median(asks):.2f} s (cold process, probes)")
    print(f"ratio doctor / bare:         {ratio:.2f} (target <= {TARGET})")
    print(f"ratio ask / bare:            {ask_ratio:.2f} (target <= {ASK_TARGET})")
    return 0 if ratio <= TARGET and ask_ratio <= ASK_TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
