"""Do torch, CUDA, NCCL and the driver match?

Run by hand (standard library and torch only; copy the probes/ folder):

    torchrun --nproc_per_node=1 probes/versions.py

Reports the torch version, the CUDA runtime torch was built with, the NCCL
torch loaded, the driver version and the newest CUDA it supports, each
GPU's compute capability and the architectures torch has kernels for, and
the warning CUDA initialisation gave, if any ("driver too old"). Run it on
every node and compare: versions must match across nodes.

If it hangs: the driver does not answer (nvidia-smi hangs too). Reboot or
reset the GPU; nothing in PyTorch can fix that.
"""

from __future__ import annotations

import ctypes
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

from _probekit import cuda_status, main, one_line

NAME = "versions"


def collect(ctx) -> dict:
    """Versions of everything between the training script and the GPU."""
    import torch

    cuda = cuda_status()
    facts = {
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "torch_cuda": torch.version.cuda,
        "torch_hip": getattr(torch.version, "hip", None),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "nccl": _nccl_version(),
        "driver": driver_version(),
        "driver_cuda": _driver_cuda_version(),
        "cuda_available": cuda["available"],
        "cuda_error": cuda["error"],
        "cuda_warning": cuda["warning"],
        "arch_list": torch.cuda.get_arch_list() if cuda["built"] else [],
        "capabilities": _capabilities() if cuda["available"] else [],
        "cudnn": _cudnn_version() if cuda["available"] else None,
    }
    facts["summary"] = (
        f"torch {facts['torch']}, CUDA runtime {facts['torch_cuda']}, NCCL {facts['nccl']}, "
        f"driver {facts['driver']} (CUDA {facts['driver_cuda']})"
    )
    if cuda["warning"]:
        facts["problems"] = [cuda["warning"]]
    return facts


def _nccl_version() -> str | None:
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - version queries differ between torch builds
        return None
    if isinstance(version, int):  # torch < 1.12 returned 2708 for 2.7.8
        return f"{version // 1000}.{version % 1000 // 100}.{version % 100}"
    return ".".join(str(part) for part in version)


def driver_version() -> str | None:
    """The kernel driver version, from /proc or else nvidia-smi."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        text = ""
    match = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    if match:
        return match.group(1)
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=15,
                check=False,
            ).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out[0] if out else None
    return None


def _driver_cuda_version() -> str | None:
    """The newest CUDA the installed driver supports (cuDriverGetVersion)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    value = ctypes.c_int()
    if libcuda.cuDriverGetVersion(ctypes.byref(value)) != 0:
        return None
    return f"{value.value // 1000}.{value.value % 1000 // 10}"


def _capabilities() -> list[str]:
    import torch

    result = []
    for index in range(torch.cuda.device_count()):
        try:
            major, minor = torch.cuda.get_device_capability(index)
            result.append(f"{major}.{minor}")
        except Exception as exc:  # noqa: BLE001 - version queries differ between torch builds
            result.append(one_line(exc, limit=80))
    return result


def _cudnn_version() -> int | None:
    import torch

    try:
        return torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001 - version queries differ between torch builds
        return None


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
