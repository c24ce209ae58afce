"""Watch real NCCL launches on a GPU machine, as `assistant run` does, for tests/fixtures/gpu/runs.json.

    PYTHONPATH=. python3 tests/gpu/record_runs.py --out DIR [--only NAME ...]

Each case launches one of tests/gpu/jobs/ under torchrun through the
watcher (assistant.watch.watch: the job hook, stacks at a hang, the flight
recorder, nvidia-smi), and keeps the LaunchReport, the end of the job's
output and the raw files the ranks left (flight-recorder dumps, stack
dumps, error records). Only the watcher runs here: it is standard library
alone, so this runs on a GPU machine's bare python3; the diagnosis of
these reports (KB, lint, verdicts) is tested on the recorded file
(tests/watch/test_gpu_launches.py). Writes DIR/runs.json and DIR/runs.log.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from assistant.watch.jobhook import procs_dir
from assistant.watch.recorded import report_to_json, save_launches
from assistant.watch.watcher import WatchOptions, watch

JOBS = Path(__file__).resolve().parent / "jobs"
OUTPUT_CHARS = 20_000  # the end of the job's output kept per case
RAW_SUFFIXES = (".fr.json", ".stacks", ".error.json")


@dataclass
class Case:
    name: str
    script: str
    nproc: int
    description: str
    hang_after: float = 60.0
    env: dict[str, str] = field(default_factory=dict)


CASES = [
    Case("healthy_ddp", "healthy_ddp.py", 1, "one rank trains DDP on NCCL and exits 0"),
    Case(
        "two_ranks_on_cuda0",
        "two_ranks_on_cuda0.py",
        2,
        "two ranks both set_device(0) and wrap DDP over NCCL on the one GPU",
    ),
    Case(
        "local_rank_beyond_gpus",
        "local_rank_beyond_gpus.py",
        2,
        "two ranks per node, one GPU: rank 1 sets cuda:1",
    ),
    Case("nccl_cpu_tensor", "nccl_cpu_tensor.py", 1, "NCCL all_reduce of a CPU tensor"),
    Case(
        "cpu_module_device_ids",
        "cpu_module_device_ids.py",
        1,
        "DDP(device_ids=[0]) around a model still on the CPU",
    ),
    Case("cuda_oom", "cuda_oom.py", 1, "a 763 GiB batch: CUDA out of memory"),
    Case(
        "label_out_of_range",
        "label_out_of_range.py",
        1,
        "labels beyond the classes reach cross_entropy on the GPU: a device-side assert",
    ),
    Case(
        "cuda_tensors_in_forked_workers",
        "cuda_tensors_in_forked_workers.py",
        1,
        "a dataset holding CUDA tensors made in the parent, read by 2 forked DataLoader workers",
    ),
    Case(
        "cuda_in_forked_worker_getitem",
        "cuda_in_forked_worker_getitem.py",
        1,
        "forked DataLoader workers calling .cuda() in __getitem__ after the parent set CUDA up",
    ),
    Case(
        "rank0_only_all_reduce_hang",
        "rank0_only_all_reduce.py",
        2,
        "rank 0 all_reduces on NCCL, rank 1 waits in a gloo barrier: declared hung after 20 s",
        hang_after=20.0,
    ),
    Case(
        "rank0_only_all_reduce_timeout",
        "rank0_only_all_reduce.py",
        2,
        "the same with a 20 s process-group timeout: what NCCL and torch do when it runs out",
        hang_after=90.0,
        env={"JOB_TIMEOUT_SECONDS": "20"},
    ),
]


def record(case: Case, work: Path) -> dict:
    """Watch one case's launch; its report, output end and raw rank files."""
    log_dir = work / case.name
    chunks: list[bytes] = []
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={case.nproc}",
        str(JOBS / case.script),
    ]
    started = time.monotonic()
    report = watch(
        command,
        WatchOptions(hang_after=case.hang_after, log_dir=log_dir, env={**os.environ, **case.env}),
        lambda stream, data: chunks.append(data),
    )
    output = b"".join(chunks).decode(errors="replace")
    files = {}
    for path in sorted(Path(procs_dir(str(log_dir))).iterdir()):
        if path.name.endswith(RAW_SUFFIXES):
            text = path.read_text(errors="replace")
            files[path.name] = json.loads(text) if path.name.endswith(".json") else text
    print(
        f"== {case.name}: {time.monotonic() - started:.1f} s, exit {report.exit_code}, "
        f"hung {report.hung}, root {report.root_error}",
        flush=True,
    )
    print(output[-3000:], flush=True)
    return {
        "name": case.name,
        "description": case.description,
        "hang_after": case.hang_after,
        "env": case.env,
        "report": report_to_json(report),
        "output": output[-OUTPUT_CHARS:],
        "files": files,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--only", nargs="*", help="case names (default: all)")
    options = parser.parse_args(argv)
    options.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="record-runs-"))
    runs = []
    machine = describe_machine()
    print(machine, flush=True)
    try:
        for case in CASES:
            if options.only and case.name not in options.only:
                continue
            runs.append(record(case, work))
            # Saved after every case: a step cut short by its time limit keeps the others.
            save_launches(options.out / "runs.json", runs, machine)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def describe_machine() -> str:
    """torch, CUDA and NCCL versions and the GPU, as the jobs saw them (one line)."""
    import subprocess

    probe = (
        "import torch; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL '"
        " + '.'.join(map(str, torch.cuda.nccl.version())) + ', ' + torch.cuda.get_device_name(0))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=60
        )
        return done.stdout.strip() or done.stderr.strip()[-300:]
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"versions unknown: {exc}"


if __name__ == "__main__":
    sys.exit(main())
