"""Which set_device / init_process_group order works on this machine?

Forum answers disagree: set the device before init_process_group, after
it, or not at all. This probe runs each variant for real with NCCL. Run by
hand, one variant per launch (a failed variant can leave NCCL unusable for
the rest of its process):

    for v in before-init after-init no-set-device device-id; do
        timeout 120 torchrun --nproc_per_node=2 probes/set_device_order.py --variant $v
    done

    before-init    torch.cuda.set_device(local_rank); init_process_group("nccl")
    after-init     init_process_group("nccl"); torch.cuda.set_device(local_rank)
    no-set-device  init_process_group("nccl"); tensors on f"cuda:{local_rank}"
    device-id      init_process_group("nccl", device_id=torch.device("cuda", local_rank))

Each variant then runs barrier(), an all_reduce of a tensor on the device
the advice implies (.cuda() for the set_device variants, cuda:LOCAL_RANK
otherwise) and an all_gather_object (which uses the current device), and
records the step that failed or hung and the device each rank ended on.
Without --variant it only checks that CUDA and NCCL are there.

If it hangs: that is an answer (this variant hangs here). Stop it with
Ctrl-C and rerun with NCCL_DEBUG=WARN to read NCCL's reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from _probekit import NotApplicable, cuda_status, gpu_uuid, main, one_line, pg_timeout
from probe_protocol import SET_DEVICE_VARIANTS as VARIANTS

NAME = "set_device_order"


def collect(ctx) -> dict:
    """Check CUDA and NCCL; with a variant, run it and record each step."""
    import torch.distributed as dist

    cuda = cuda_status()
    facts = {
        "cuda_available": cuda["available"],
        "device_count": cuda["device_count"],
        "nccl_available": dist.is_available() and dist.is_nccl_available(),
    }
    if not cuda["available"]:
        raise NotApplicable("no CUDA device visible", facts)
    if not facts["nccl_available"]:
        raise NotApplicable("this torch build has no NCCL", facts)
    if ctx.variant is None:
        facts["variants"] = list(VARIANTS)
        facts["summary"] = f"CUDA and NCCL present; run with --variant ({', '.join(VARIANTS)})"
        return facts
    return run_variant(ctx, facts)


def run_variant(ctx, facts: dict) -> dict:
    """Run one variant; a failure is a fact, recorded with its step and error."""
    import torch
    import torch.distributed as dist

    rank, local_rank, world = ctx.rank.rank, ctx.rank.local_rank, ctx.rank.world_size
    facts.update(variant=ctx.variant, steps=[], step=None, failed_step=None, error=None)

    def step(name: str, action) -> None:
        facts["step"] = name
        ctx.checkpoint(facts)  # a hang keeps the step it hung in
        started = time.monotonic()
        action()
        facts["steps"].append({"name": name, "seconds": round(time.monotonic() - started, 3)})

    try:
        for name, action in _setup(ctx.variant, local_rank):
            step(name, action)
        step("barrier", dist.barrier)
        # .cuda() (the current device) where the advice sets it, else the
        # explicit cuda:LOCAL_RANK the no-set_device answers recommend.
        uses_current = ctx.variant in ("before-init", "after-init")
        device = torch.device("cuda") if uses_current else torch.device("cuda", local_rank)
        tensor = torch.full((1,), float(rank + 1), device=device)
        # The collective is asynchronous: wait for it inside the step, so a
        # hang or a late NCCL error is charged to this step.
        step("all_reduce", lambda: (dist.all_reduce(tensor), torch.cuda.synchronize(tensor.device)))
        facts["tensor_device"] = tensor.device.index
        facts["all_reduce_ok"] = tensor.item() == world * (world + 1) / 2
        gathered: list = [None] * world
        step("all_gather_object", lambda: dist.all_gather_object(gathered, rank))
        facts["object_ok"] = gathered == list(range(world))
        facts["step"] = "done"
        if not (facts["all_reduce_ok"] and facts["object_ok"]):
            facts.update(failed_step="check", error="collectives returned wrong values")
    except Exception as exc:  # noqa: BLE001 - a failed step is the fact this probe reports
        facts["failed_step"] = facts["step"]
        facts["error"] = one_line(exc, limit=600)
        ctx.hard_exit = True  # NCCL may be wedged: do not wait for its watchdog at exit
    facts.update(_where_it_landed())
    if facts["failed_step"]:
        facts["problems"] = [f"{facts['failed_step']} failed: {facts['error']}"]
    else:
        dist.destroy_process_group()
    facts["summary"] = (
        f"{ctx.variant}: "
        + (f"failed at {facts['failed_step']}" if facts["failed_step"] else "ok")
        + f"; current device cuda:{facts['current_device']} ({facts['current_uuid']})"
    )
    return facts


def _setup(variant: str, local_rank: int) -> list:
    """The set_device / init_process_group calls of a variant, in order."""
    import torch
    import torch.distributed as dist

    def set_device() -> None:
        torch.cuda.set_device(local_rank)

    def init() -> None:
        dist.init_process_group("nccl", timeout=pg_timeout())

    def init_bound() -> None:
        dist.init_process_group(
            "nccl", timeout=pg_timeout(), device_id=torch.device("cuda", local_rank)
        )

    return {
        "before-init": [("set_device", set_device), ("init", init)],
        "after-init": [("init", init), ("set_device", set_device)],
        "no-set-device": [("init", init)],
        "device-id": [("init", init_bound)],
    }[variant]


def _where_it_landed() -> dict:
    """The rank's current device and the GPUs its process holds a context on."""
    import torch
    import torch.distributed as dist

    try:
        index = torch.cuda.current_device()
    except Exception as exc:  # noqa: BLE001 - CUDA itself broken by the failure
        return {"current_device": None, "current_uuid": None, "where_error": one_line(exc)}
    bound = None
    if dist.is_initialized():
        bound = getattr(dist.group.WORLD, "bound_device_id", None)
    return {
        "current_device": index,
        "current_uuid": gpu_uuid(index),
        "bound_device_id": str(bound) if bound is not None else None,
        "context_gpus": _context_gpus(),
    }


def _context_gpus() -> list[str] | None:
    """GPUs on which nvidia-smi lists this process (None if it cannot tell).

    In a container with its own PID namespace nvidia-smi shows host PIDs,
    so the list stays None there.
    """
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=15,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    mine = [
        uuid.strip()
        for pid, _, uuid in (line.partition(",") for line in out.splitlines())
        if pid.strip() == str(os.getpid())
    ]
    return mine or None


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
