"""The registered probes: the only scripts the assistant will ever launch.

A KB entry names probes by these names, never by path. The list and its
order come from the protocol (probes/probe_protocol.py), which the probe
scripts read too; this module adds each probe's question and budget. It
imports nothing heavy, so `assistant kb lint` can check names without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from assistant.config import probes_dir
from assistant.probing.protocol import PROBE_ORDER, PROBE_VARIANTS


@dataclass(frozen=True)
class ProbeSpec:
    """A probe script and the question it answers."""

    name: str
    question: str
    needs_gpu: bool = False
    # Seconds the probe may take on a rank once it has started; past that
    # the runner kills the launch and reports "timeout".
    timeout: float = 30.0
    # Variants that each need a launch of their own (from the protocol's
    # PROBE_VARIANTS); empty for probes that share the batch launch.
    variants: tuple[str, ...] = ()

    @property
    def script(self) -> Path:
        return probes_dir() / f"{self.name}.py"


# What the assistant adds to the protocol's probe list: the question each
# probe answers, whether it needs a GPU, and its time budget.
_SPECS = (
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
    ProbeSpec("versions", "Do torch, CUDA, NCCL and the driver match?"),
    ProbeSpec(
        "system",
        "Are /dev/shm, file limits, memory and network interfaces adequate, and no earlier run alive?",
    ),
    ProbeSpec("rendezvous", "Do MASTER_ADDR and MASTER_PORT work for a rendezvous here?"),
    ProbeSpec(
        "set_device_order",
        "Which set_device / init_process_group order works on this machine?",
        needs_gpu=True,
        timeout=45.0,
    ),
    ProbeSpec(
        "backend", "Which backends (gloo, nccl) work here on the same collective?", timeout=45.0
    ),
)


def _registered() -> dict[str, ProbeSpec]:
    """The protocol's probes, in its order, each with its details and variants."""
    specs = {spec.name: spec for spec in _SPECS}
    mismatch = set(PROBE_ORDER) ^ set(specs)
    if mismatch:  # a probe added on one side only: fail at import, not in a user's run
        raise RuntimeError(f"probe registry and protocol disagree on {sorted(mismatch)}")
    return {
        name: replace(specs[name], variants=PROBE_VARIANTS.get(name, ())) for name in PROBE_ORDER
    }


PROBES: dict[str, ProbeSpec] = _registered()


def probe_names() -> list[str]:
    """Names of all registered probes, in a stable order."""
    return list(PROBES)
