"""Verdicts: what this machine's probe facts say about each cause.

One pure function per cause, from (probe runs, the query's root error,
script findings) to a Verdict with one-line evidence in the user's language
(en or zh). The facts are the per-rank records the probes write (see
probes/_probekit.py); recorded facts from machines we do not have live in
tests/fixtures/facts/.

The rules of evidence:
- confirmed needs a fact, a finding in the script, or an error text that
  names the cause itself (EADDRINUSE names a busy port);
- ruled_out needs a fact that excludes the cause on this machine; causes
  that the script can produce on a healthy machine (a hardcoded device,
  ranks sharing a GPU) stay inconclusive there, with the facts as evidence;
- a probe that timed out or crashed gives inconclusive, a probe that did
  not run gives not_run, a GPU probe on a GPU-less machine not_applicable.

Submodules:
- inputs: the Inputs dataclass, thresholds, error patterns, small helpers,
  the registry (judges, JUDGES) and judge();
- launch: torchrun, LOCAL_RANK, world size, the main guard;
- devices: GPU sharing, visible devices, no CUDA, CUDA OOM, and the
  set_device order experiment (variant_outcomes, advice_outcomes);
- backend: NCCL availability, CPU tensors, P2P, collective timeouts, and
  the causes only the error text decides;
- network: the rendezvous (master port, master endpoint);
- versions: NCCL, driver, CUDA and GPU architecture versions;
- system: shared memory, network interfaces, the OOM killer;
- apply: apply_verdicts and probes_for.

Importing this package imports every area module, which registers its
verdict functions in JUDGES.

Standard library only (plus assistant.results / config / probe_registry).
"""

from __future__ import annotations

from assistant.verdicts import backend, devices, launch, network, system, versions
from assistant.verdicts.apply import apply_verdicts, probes_for
from assistant.verdicts.devices import advice_outcomes, variant_outcomes
from assistant.verdicts.inputs import JUDGES, Inputs, Judge, judge, judges
from assistant.verdicts.versions import _arch_supported

__all__ = [
    "JUDGES",
    "Inputs",
    "Judge",
    "_arch_supported",
    "advice_outcomes",
    "apply_verdicts",
    "backend",
    "devices",
    "judge",
    "judges",
    "launch",
    "network",
    "probes_for",
    "system",
    "variant_outcomes",
    "versions",
]
