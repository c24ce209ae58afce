"""Facts about this machine the runner needs before a launch: a free port, the GPU count.

The GPU count follows the protocol's one rule (probes/probe_protocol.py), so
the runner's default rank count and the devices probe's `physical_gpus`
cannot disagree about "no GPU" (0 without a driver, None only when a driver
is there but cannot be asked).
"""

from __future__ import annotations

import os
import socket

from assistant.probing import protocol


def free_port() -> int:
    """A TCP port nothing listens on right now (it can still be taken before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def physical_gpu_count() -> int | None:
    """NVIDIA GPUs the driver reports (see probe_protocol.physical_gpu_count)."""
    return protocol.physical_gpu_count()


def visible_gpu_count(env: dict[str, str] | None = None) -> int:
    """GPUs a process with this environment would see, without importing torch.

    The driver's GPUs narrowed by CUDA_VISIBLE_DEVICES the way CUDA reads it
    (entries up to the first invalid one); 0 when there is no driver.
    """
    env = os.environ if env is None else env
    return protocol.visible_gpu_count(physical_gpu_count(), env.get("CUDA_VISIBLE_DEVICES"))
