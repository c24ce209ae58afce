"""Which physical GPU does each rank land on, and do two share one?

Run by hand (standard library and torch only; copy the probes/ folder):

    torchrun --nproc_per_node=2 probes/devices.py

Each rank reports whether torch was built with CUDA, whether the NVIDIA
driver is loaded, CUDA_VISIBLE_DEVICES, the visible devices with their
UUIDs, the GPU it gets with cuda:LOCAL_RANK (allocating a tiny tensor, so
"invalid device ordinal" shows up as it would in training) and the GPU its
default device points at before any set_device. Two ranks with the same
UUID share a GPU.

If it hangs: CUDA initialisation is stuck (a wedged driver or GPU). Check
`nvidia-smi` on its own, then try one rank: `torchrun --nproc_per_node=1`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from _probekit import NotApplicable, cuda_status, gpu_uuid, main, one_line
from probe_protocol import physical_gpu_count

NAME = "devices"
MIB = 1024 * 1024


def collect(ctx) -> dict:
    """This rank's devices; raises NotApplicable (with the facts) without CUDA."""
    cuda = cuda_status()
    facts = {
        "cuda_built": cuda["built"],
        "torch_cuda": cuda["torch_cuda"],
        "driver_loaded": Path("/proc/driver/nvidia/version").exists(),
        "physical_gpus": physical_gpu_count(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_available": cuda["available"],
        "cuda_error": cuda["error"],
        "cuda_warning": cuda["warning"],
        "device_count": cuda["device_count"],
    }
    if not cuda["available"]:
        raise NotApplicable("no CUDA device visible", facts)
    ctx.checkpoint(facts)
    facts["visible"] = [_describe_device(i) for i in range(cuda["device_count"])]
    facts["local_rank_device"] = _land_on(ctx.rank.local_rank)
    facts["default_device"] = _default_device()
    facts["problems"] = (
        [f"cuda:{ctx.rank.local_rank}: {facts['local_rank_device']['error']}"]
        if facts["local_rank_device"]["error"]
        else []
    )
    landed = facts["local_rank_device"]
    facts["summary"] = (
        f"cuda:{ctx.rank.local_rank} -> {landed['uuid'] or landed['error']}; "
        f"default device cuda:{facts['default_device']['index']} -> {facts['default_device']['uuid']}; "
        f"{cuda['device_count']} visible"
    )
    return facts


def _describe_device(index: int) -> dict:
    import torch

    props = torch.cuda.get_device_properties(index)
    return {
        "index": index,
        "name": props.name,
        "uuid": gpu_uuid(index),
        "capability": f"{props.major}.{props.minor}",
        "total_mib": props.total_memory // MIB,
        "pci_bus_id": getattr(props, "pci_bus_id", None),
    }


def _land_on(index: int) -> dict:
    """Allocate on cuda:index the way training code would, and see where it lands."""
    import torch

    landed = {"requested": f"cuda:{index}", "index": None, "uuid": None, "error": None}
    try:
        tensor = torch.empty(1, device=f"cuda:{index}")
        landed["index"] = tensor.device.index
        landed["uuid"] = gpu_uuid(tensor.device.index)
        free, total = torch.cuda.mem_get_info(tensor.device.index)
        landed["free_mib"], landed["total_mib"] = free // MIB, total // MIB
    except Exception as exc:  # noqa: BLE001 - the error text (e.g. invalid device ordinal) is the fact
        landed["error"] = one_line(exc, limit=200)
    return landed


def _default_device() -> dict:
    """The current device before any set_device: where a bare .cuda() goes."""
    import torch

    index = torch.cuda.current_device()
    return {"index": index, "uuid": gpu_uuid(index)}


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
