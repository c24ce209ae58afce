"""Which backends (gloo, nccl) work here on the same collective?

Run by hand (standard library and torch only; copy the probes/ folder):

    torchrun --nproc_per_node=2 probes/backend.py

Runs the same all_reduce with gloo (CPU tensors) and, where every rank has
a GPU of its own, with NCCL (a 16 MiB tensor, large enough to use the
peer-to-peer or shared-memory path), checks the values, and records what
NCCL says when given a CPU tensor. Lists which backends this torch build
has at all (no NCCL on Windows and macOS).

If it hangs in the NCCL all_reduce while gloo worked: rerun with
NCCL_DEBUG=INFO; if NCCL_P2P_DISABLE=1 makes it pass, peer-to-peer
transfers are broken here (IOMMU / PCIe ACS, virtualised hosts).
"""

from __future__ import annotations

import platform
import sys
import time

from _probekit import cuda_status, main, one_line, pg_timeout, process_group

NAME = "backend"
NCCL_ELEMENTS = 1 << 22  # float32: 16 MiB


def collect(ctx) -> dict:
    """gloo and NCCL on one all_reduce each; the default group is gloo."""
    import torch.distributed as dist

    facts = {
        "platform": platform.system(),
        "available": {
            "gloo": dist.is_gloo_available(),
            "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available(),
            "ucc": bool(getattr(dist, "is_ucc_available", lambda: False)()),
        },
    }
    process_group(ctx.rank)
    facts["gloo"] = _gloo(ctx)
    ctx.checkpoint(facts)
    facts["nccl"] = _nccl(ctx, facts)
    problems = []
    if facts["gloo"]["result"] != "ok":
        problems.append(f"gloo all_reduce {facts['gloo']['result']}: {facts['gloo'].get('error')}")
    if facts["nccl"]["result"] in ("failed", "wrong_result"):
        problems.append(f"nccl all_reduce {facts['nccl']['result']}: {facts['nccl'].get('error')}")
    facts["problems"] = problems
    facts["summary"] = f"gloo {facts['gloo']['result']}, nccl {facts['nccl']['result']}" + (
        f" ({facts['nccl']['reason']})" if facts["nccl"].get("reason") else ""
    )
    return facts


def _expected(world: int) -> float:
    return world * (world + 1) / 2  # every rank contributes rank + 1


def _gloo(ctx) -> dict:
    import torch
    import torch.distributed as dist

    tensor = torch.full((1,), float(ctx.rank.rank + 1))
    started = time.monotonic()
    try:
        dist.all_reduce(tensor)
    except Exception as exc:  # noqa: BLE001 - the failure is the fact this probe reports
        return {"result": "failed", "error": one_line(exc)}
    ok = tensor.item() == _expected(ctx.rank.world_size)
    return {
        "result": "ok" if ok else "wrong_result",
        "seconds": round(time.monotonic() - started, 4),
    }


def _nccl(ctx, facts: dict) -> dict:
    import torch
    import torch.distributed as dist

    if not facts["available"]["nccl"]:
        return {"result": "unavailable"}
    cuda = cuda_status()
    local_rank = ctx.rank.local_rank
    reason = None
    if not cuda["available"]:
        reason = "no CUDA device visible"
    elif local_rank >= cuda["device_count"]:
        reason = f"{cuda['device_count']} visible GPU(s) for local rank {local_rank}"
    # Every rank must take the same branch: new_group waits for all of them.
    everyone = torch.tensor([0 if reason else 1])
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
    if everyone.item() == 0:
        return {"result": "skipped", "reason": reason or "another rank has no GPU of its own"}
    torch.cuda.set_device(local_rank)
    result: dict = {"result": None, "elements": NCCL_ELEMENTS}
    try:
        group = dist.new_group(backend="nccl", timeout=pg_timeout())
        tensor = torch.full((NCCL_ELEMENTS,), float(ctx.rank.rank + 1), device=f"cuda:{local_rank}")
        ctx.checkpoint({**facts, "nccl": {"result": "running", "step": "all_reduce"}})
        started = time.monotonic()
        dist.all_reduce(tensor, group=group)
        torch.cuda.synchronize(local_rank)
        result["seconds"] = round(time.monotonic() - started, 4)
        expected = _expected(ctx.rank.world_size)
        ok = tensor.min().item() == expected == tensor.max().item()
        result["result"] = "ok" if ok else "wrong_result"
        result["cpu_tensor_error"] = _cpu_tensor_error(group)
        dist.destroy_process_group(group)
    except Exception as exc:  # noqa: BLE001 - the failure is the fact this probe reports
        result.update(result="failed", error=one_line(exc, limit=600))
        ctx.hard_exit = True  # NCCL may be wedged: do not wait for its watchdog at exit
    return result


def _cpu_tensor_error(group) -> str | None:
    """What NCCL says to a CPU tensor on this torch (None if it accepted it)."""
    import torch
    import torch.distributed as dist

    try:
        dist.all_reduce(torch.ones(1), group=group)
    except Exception as exc:  # noqa: BLE001 - the failure is the fact this probe reports
        return one_line(exc, limit=200)
    return None


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
