"""Re-record the `torchrun-log` queries of the evaluation set.

Each run below launches one broken script from data/eval/scripts/ exactly as
a user would (torchrun, torch.distributed.launch or plain python, CPU, gloo),
captures stdout and stderr together, unedited, and stores the output

  - as data/eval/logs/<id>.log (for reading), and
  - as the `query` of the entry <id> in data/eval/queries.jsonl (replaced in
    place; entries from other sources are kept as they are).

Usage (from the repository root, takes a few minutes on two cores):

    .venv/bin/python data/eval/record_logs.py            # every CPU run
    .venv/bin/python data/eval/record_logs.py log-foo    # only some ids
    .venv/bin/python data/eval/record_logs.py --labels   # copy labels from RUNS, no launch

The `gpu=True` runs need CUDA (they were recorded on a one-GPU machine):

    python data/eval/record_logs.py --gpu --out DIR      # there: DIR/recorded.jsonl
    .venv/bin/python data/eval/record_logs.py --merge DIR/recorded.jsonl   # here

`{port}` in a command is a free port picked for that run; `hold_port` keeps
that port bound by this process while the run lasts (an earlier job that is
still alive). Labels are written here, next to the command, and follow the
policy in data/eval/README.md: what the log itself shows, best first.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

EVAL_DIR = Path(__file__).resolve().parent
SCRIPTS = EVAL_DIR / "scripts"
LOGS = EVAL_DIR / "logs"
QUERIES = EVAL_DIR / "queries.jsonl"
VENV_BIN = EVAL_DIR.parent.parent / ".venv" / "bin"

TORCHRUN2 = ["timeout", "120", "torchrun", "--nproc_per_node=2", "--master_port={port}"]
TORCHRUN3 = ["timeout", "120", "torchrun", "--nproc-per-node", "3", "--master-port", "{port}"]
PYTHON = ["timeout", "120", "python"]
TORCHRUN1 = ["timeout", "120", "torchrun", "--nproc_per_node=1", "--master_port={port}"]
SHM_4MB = "mount -t tmpfs -o size=4m tmpfs /dev/shm && exec "


@dataclass(frozen=True)
class Run:
    """One recorded launch of a broken script."""

    id: str
    command: list[str]
    causes: list[str]
    env: dict[str, str] = field(default_factory=dict)
    hold_port: bool = False
    gpu: bool = False


RUNS = [
    Run("log-plain-python-env-init", [*PYTHON, "plain_python_env_init.py"],
        ["launched-without-torchrun"]),
    Run("log-plain-python-local-rank-keyerror", [*PYTHON, "plain_python_local_rank_env.py"],
        ["launched-without-torchrun"]),
    Run("log-plain-python-master-addr-missing", [*PYTHON, "plain_python_rank_defaults.py"],
        ["launched-without-torchrun", "master-endpoint-mismatch"]),
    Run("log-launch-local-rank-underscore",
        ["timeout", "120", "python", "-m", "torch.distributed.launch", "--nproc_per_node=2",
         "--master_port={port}", "local_rank_underscore_launch.py", "--lr", "0.05"],
        ["local-rank-arg-mismatch"]),
    Run("log-torchrun-local-rank-required", [*TORCHRUN2, "local_rank_required_torchrun.py"],
        ["local-rank-arg-mismatch"]),
    Run("log-world-size-hardcoded-4", [*TORCHRUN2, "world_size_hardcoded.py"],
        ["world-size-mismatch"]),
    Run("log-rank-hardcoded-zero", [*TORCHRUN3, "rank_hardcoded_zero.py"],
        ["world-size-mismatch"]),
    Run("log-torchrun-port-in-use", [*TORCHRUN2, "port_in_use_train.py"],
        ["master-port-in-use"], hold_port=True),
    Run("log-spawn-port-in-use", [*PYTHON, "spawn_fixed_master_port.py", "{port}"],
        ["master-port-in-use"], hold_port=True),
    Run("log-spawn-no-main-guard", [*PYTHON, "spawn_no_main_guard.py"],
        ["missing-main-guard"], env={"EVAL_PORT": "{port}"}),
    Run("log-dataloader-spawn-no-main-guard",
        [*TORCHRUN2, "dataloader_spawn_workers_no_guard.py"], ["missing-main-guard"]),
    Run("log-sampler-before-init", [*TORCHRUN2, "sampler_before_init.py"],
        ["process-group-not-initialized"]),
    Run("log-get-rank-before-init", [*TORCHRUN3, "log_rank_before_init.py"],
        ["process-group-not-initialized"]),
    Run("log-unused-aux-head", [*TORCHRUN2, "unused_aux_head.py"], ["unused-parameters"]),
    # TORCH_DISTRIBUTED_DEBUG=DETAIL made every rank of this DDP script die with
    # SIGSEGV under torch 2.13+cpu here; INFO names the unused parameters too.
    Run("log-unused-branch-debug-info", [*TORCHRUN3, "frozen_branch_unused.py"],
        ["unused-parameters"], env={"TORCH_DISTRIBUTED_DEBUG": "INFO"}),
    Run("log-allreduce-shape-mismatch", [*TORCHRUN3, "metric_allreduce_shape_mismatch.py"],
        ["collective-mismatch"]),
    Run("log-allreduce-shape-mismatch-detail",
        [*TORCHRUN2, "metric_allreduce_shape_mismatch.py"], ["collective-mismatch"],
        env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}),
    Run("log-broadcast-vs-allreduce-detail", [*TORCHRUN2, "broadcast_vs_allreduce.py"],
        ["collective-mismatch"], env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}),
    Run("log-broadcast-vs-allreduce", [*TORCHRUN3, "broadcast_vs_allreduce.py"],
        ["collective-mismatch", "collective-timeout"]),
    Run("log-barrier-only-rank0", [*TORCHRUN2, "barrier_only_rank0.py"],
        ["collective-mismatch", "uneven-inputs"]),
    Run("log-uneven-batches", [*TORCHRUN3, "uneven_batches.py"], ["uneven-inputs"]),
    Run("log-early-exit-nan", [*TORCHRUN2, "early_exit_on_nan.py"],
        ["uneven-inputs", "collective-timeout"]),
    Run("log-slow-rank0-checkpoint", [*TORCHRUN2, "slow_rank0_checkpoint.py"],
        ["collective-timeout"]),
    Run("log-monitored-barrier-slow-loader", [*TORCHRUN3, "monitored_barrier_slow_loader.py"],
        ["collective-timeout"]),
    Run("log-rank-sigkill", [*TORCHRUN2, "rank_killed_sigkill.py"], ["oom-killed"]),
    Run("log-dataloader-worker-sigkill", [*TORCHRUN2, "dataloader_worker_killed.py"],
        ["oom-killed"]),
    Run("log-nccl-on-cpu-build", [*TORCHRUN2, "nccl_backend_cpu_build.py"],
        ["no-cuda-visible", "nccl-not-available"]),
    Run("log-ddp-device-ids-cpu", [*TORCHRUN2, "ddp_device_ids_cpu.py"],
        ["ddp-device-ids-cpu-module"]),
    Run("log-model-cuda-cpu-build", [*TORCHRUN2, "model_cuda_no_index.py"],
        ["no-cuda-visible", "hardcoded-device"]),
    Run("log-set-device-cpu-build", [*TORCHRUN3, "set_device_cpu_build.py"],
        ["no-cuda-visible"]),
    Run("log-master-port-per-rank", [*PYTHON, "master_port_per_rank.py", "{port}"],
        ["master-endpoint-mismatch", "world-size-mismatch"]),
    Run("log-second-node-unknown-master",
        ["timeout", "120", "torchrun", "--nnodes=2", "--node_rank=1", "--nproc_per_node=2",
         "--master_addr=gpu-node-01", "--master_port=29500", "two_node_second_node.py"],
        ["master-endpoint-mismatch", "network-interface"]),
    Run("log-gloo-wrong-ifname", [*TORCHRUN2, "gloo_wrong_ifname.py"],
        ["network-interface"], env={"GLOO_SOCKET_IFNAME": "ib0"}),
    # A private mount namespace with a 4 MB /dev/shm, as in a default container.
    Run("log-dataloader-small-shm",
        ["unshare", "-m", "sh", "-c", SHM_4MB + " ".join(TORCHRUN2) + " dataloader_small_shm.py"],
        ["shm-too-small"]),
    # Recorded on one GPU (see the module docstring).
    Run("log-gpu-local-rank-default-duplicate",
        [*TORCHRUN2, "gpu_local_rank_default_duplicate.py"],
        ["duplicate-gpu-per-rank", "local-rank-not-from-env"], gpu=True),
    Run("log-gpu-device-ids-zero-nccl-debug", [*TORCHRUN2, "gpu_device_ids_zero.py"],
        ["duplicate-gpu-per-rank", "hardcoded-device"], env={"NCCL_DEBUG": "INFO"}, gpu=True),
    Run("log-gpu-no-set-device-barrier", [*TORCHRUN2, "gpu_no_set_device_barrier.py"],
        ["duplicate-gpu-per-rank", "set-device-order"], gpu=True),
    Run("log-gpu-more-ranks-than-gpus", [*TORCHRUN2, "gpu_more_ranks_than_gpus.py"],
        ["world-size-exceeds-devices"], gpu=True),
    Run("log-gpu-activation-oom", [*TORCHRUN1, "gpu_activation_oom.py"],
        ["cuda-out-of-memory"], gpu=True),
    Run("log-gpu-nccl-cpu-tensor", [*TORCHRUN1, "gpu_nccl_cpu_tensor.py"],
        ["nccl-with-cpu-tensors"], gpu=True),
    Run("log-gpu-broadcast-cpu-weights", [*TORCHRUN1, "gpu_broadcast_cpu_weights.py"],
        ["nccl-with-cpu-tensors"], gpu=True),
    Run("log-gpu-empty-visible-devices", [*TORCHRUN1, "gpu_empty_visible_devices.py"],
        ["no-cuda-visible", "cuda-visible-devices-mismatch"],
        env={"CUDA_VISIBLE_DEVICES": ""}, gpu=True),
]  # fmt: skip


def free_port() -> int:
    """A port nothing listens on right now (the kernel picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(run: Run) -> str:
    """Run one broken script; return everything it printed, stdout and stderr merged."""
    port = free_port()
    command = [part.replace("{port}", str(port)) for part in run.command]
    env = {**os.environ, **{k: v.replace("{port}", str(port)) for k, v in run.env.items()}}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    holder = socket.socket() if run.hold_port else None
    try:
        if holder:
            holder.bind(("", port))  # all interfaces, as a running job would
            holder.listen()
        done = subprocess.run(
            command, cwd=SCRIPTS, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            timeout=180, check=False,
        )  # fmt: skip
    finally:
        if holder:
            holder.close()
    return done.stdout.decode("utf-8", errors="replace")


def update_queries(recorded: dict[str, dict]) -> None:
    """Replace the recorded entries in queries.jsonl in place; append new ones."""
    lines = QUERIES.read_text(encoding="utf-8").splitlines() if QUERIES.exists() else []
    entries = [json.loads(line) for line in lines if line.strip()]
    written = set()
    for i, entry in enumerate(entries):
        if entry["id"] in recorded:
            entries[i] = recorded[entry["id"]]
            written.add(entry["id"])
    entries += [entry for key, entry in recorded.items() if key not in written]
    text = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries)
    QUERIES.write_text(text, encoding="utf-8")


def relabel() -> None:
    """Copy each run's labels onto its recorded entry; drop entries of removed runs."""
    labels = {run.id: run.causes for run in RUNS}
    entries = [json.loads(line) for line in QUERIES.read_text(encoding="utf-8").splitlines()]
    kept = []
    for entry in entries:
        if entry["source"] == "torchrun-log" and entry["id"] not in labels:
            print(f"dropped {entry['id']}: no such run", file=sys.stderr)
            continue
        if entry["id"] in labels:
            entry["causes"] = labels[entry["id"]]
        kept.append(entry)
    text = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in kept)
    QUERIES.write_text(text, encoding="utf-8")


def save(recorded: dict[str, dict]) -> None:
    """Write each log to logs/<id>.log and into queries.jsonl."""
    LOGS.mkdir(exist_ok=True)
    for key, entry in recorded.items():
        (LOGS / f"{key}.log").write_text(entry["query"], encoding="utf-8")
    update_queries(recorded)


def record(runs: list[Run]) -> dict[str, dict]:
    """Launch each run in turn; its entry for queries.jsonl, keyed by id."""
    recorded = {}
    for run in runs:
        output = launch(run)
        recorded[run.id] = {
            "id": run.id,
            "query": output,
            "causes": run.causes,
            "source": "torchrun-log",
        }
        print(f"{run.id}: {len(output.splitlines())} lines", flush=True)
    return recorded


def main(argv: list[str]) -> int:
    """Record the selected runs (every CPU run, or every GPU run, without ids)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ids", nargs="*", help="run ids to record (default: all of the kind)")
    parser.add_argument("--gpu", action="store_true", help="record the runs that need CUDA")
    parser.add_argument("--out", type=Path, help="write DIR/recorded.jsonl instead of data/eval")
    parser.add_argument("--merge", type=Path, help="save a recorded.jsonl made with --out")
    parser.add_argument("--labels", action="store_true", help="only refresh labels from RUNS")
    args = parser.parse_args(argv)
    if args.labels:
        relabel()
        return 0
    if args.merge:
        lines = args.merge.read_text(encoding="utf-8").splitlines()
        save({e["id"]: e for e in map(json.loads, lines)})
        return 0
    unknown = set(args.ids) - {run.id for run in RUNS}
    if unknown:
        parser.error(f"unknown run ids: {', '.join(sorted(unknown))}")
    runs = [r for r in RUNS if r.id in args.ids or (not args.ids and r.gpu == args.gpu)]
    recorded = record(runs)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in recorded.values())
        (args.out / "recorded.jsonl").write_text(text, encoding="utf-8")
    else:
        save(recorded)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
