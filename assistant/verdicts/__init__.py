"""Verdicts: what this machine's probe facts say about each cause.

One pure function per cause, from (probe runs, the query's root error,
script findings) to a Verdict with one-line evidence in the user's language
(en or zh). The facts are the per-rank records the probes write (see
probes/_probekit.py); recorded facts from machines we do not have live in
tests/fixtures/facts/.

The rules of evidence:
- every verdict but not_run states its source: "probe" (facts of this
  machine decided it), "error" (the error text did) or "script" (a lint
  finding did); evidence read from the error starts with "the error" (报错),
  so it is never taken for something tested here;
- whether the error text names a cause is asked of that cause's KB
  signatures (kb/causes/*.yaml), never of patterns of our own;
- confirmed needs a fact, a finding in the script, or an error text that
  names the cause itself (EADDRINUSE names a busy port); a symptom shared by
  several causes (a collective timeout, a SIGKILL) leaves them inconclusive;
- ruled_out needs a fact that excludes the cause on this machine, and never
  stands beside an error that names the cause (that error came from another
  environment); causes that the script can produce on a healthy machine (a
  hardcoded device, ranks sharing a GPU) stay inconclusive there;
- a probe that timed out or crashed gives inconclusive, a probe that did
  not run gives not_run, a GPU probe on a GPU-less machine not_applicable.

Submodules:
- signatures: the KB's error signatures, compiled through
  assistant.knowledge.patterns (and GPU_CAUSES, whose union means "a job
  with a working GPU printed this");
- inputs: the Inputs dataclass, thresholds, small helpers, the registry
  (judges, JUDGES) and judge();
- launch: torchrun, LOCAL_RANK, world size, the main guard;
- devices: GPU sharing, visible devices, no CUDA, CUDA OOM, and the
  set_device order experiment (variant_outcomes, advice_outcomes);
- backend: NCCL availability, CPU tensors, P2P, collective timeouts, and
  the causes only the error text decides;
- network: the rendezvous (master port, master endpoint);
- versions: NCCL, driver, CUDA and GPU architecture versions;
- system: shared memory, network interfaces, the OOM killer;
- nodes: across the nodes of a multi-node job (`doctor --nnodes`): versions,
  interfaces, host names, the master endpoint, sizes; it extends the judges
  of those causes (and imports their areas first);
- apply: apply_verdicts (pure; the reading order within a score margin,
  the answers under each cause) and probes_for.

Importing this package imports every area module, which registers its
verdict functions in JUDGES.

Standard library only (plus assistant.results, the probe registry and
assistant.knowledge.patterns).
"""

from __future__ import annotations

from assistant.verdicts import backend, devices, launch, network, nodes, system, versions
from assistant.verdicts.apply import (
    VERDICT_MARGIN,
    apply_verdicts,
    probes_for,
    reading_order,
    shown_answers,
)
from assistant.verdicts.devices import advice_outcomes, variant_outcomes
from assistant.verdicts.inputs import ERROR_WORDS, JUDGES, Inputs, Judge, judge, judges
from assistant.verdicts.signatures import GPU_CAUSES
from assistant.verdicts.versions import arch_supported

__all__ = [
    "ERROR_WORDS",
    "GPU_CAUSES",
    "JUDGES",
    "VERDICT_MARGIN",
    "Inputs",
    "Judge",
    "advice_outcomes",
    "apply_verdicts",
    "arch_supported",
    "backend",
    "devices",
    "judge",
    "judges",
    "launch",
    "network",
    "nodes",
    "probes_for",
    "reading_order",
    "shown_answers",
    "system",
    "variant_outcomes",
    "versions",
]
