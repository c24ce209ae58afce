"""The registered probes: the only scripts the assistant will ever launch.

A KB entry names probes by these names, never by path. This module imports
nothing heavy, so `assistant kb lint` can check probe names without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from assistant.config import probes_dir


@dataclass(frozen=True)
class ProbeSpec:
    """A probe script and the question it answers."""

    name: str
    question: str
    needs_gpu: bool = False
    # Seconds the probe may take on a rank once it has started; past that
    # the runner kills the launch and reports "timeout".
    timeout: float = 30.0
    # Variants that each need a launch of their own (the same names as the
    # probe script's VARIANTS); empty for probes that share the batch launch.
    variants: tuple[str, ...] = ()

    @property
    def script(self) -> Path:
        return probes_dir() / f"{self.name}.py"


PROBES: dict[str, ProbeSpec] = {
    spec.name: spec
    for spec in (
        ProbeSpec(
            "launch_env",
            "Which launch variables does each rank see, and do they agree?",
            timeout=15.0,
        ),
        # CUDA initialisation on a many-GPU node can take tens of seconds.
        ProbeSpec(
            "devices",
            "Which physical GPU does each rank land on, and do two share one?",
            timeout=60.0,
        ),
        ProbeSpec(
            "set_device_order",
            "Which set_device / init_process_group order works on this machine?",
            needs_gpu=True,
            timeout=45.0,
            variants=("before-init", "after-init", "no-set-device", "device-id"),
        ),
        ProbeSpec(
            "backend",
            "Which backends (gloo, nccl) work here on the same collective?",
            timeout=45.0,
        ),
        ProbeSpec("rendezvous", "Do MASTER_ADDR and MASTER_PORT work for a rendezvous here?"),
        ProbeSpec("versions", "Do torch, CUDA, NCCL and the driver match?"),
        ProbeSpec("system", "Are /dev/shm, file limits, memory and network interfaces adequate?"),
    )
}


def probe_names() -> list[str]:
    """Names of all registered probes, in a stable order."""
    return list(PROBES)
