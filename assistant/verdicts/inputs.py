"""Shared inputs of every verdict: the Inputs dataclass, thresholds, error
patterns, small helpers, and the registry of verdict functions (judges, judge)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from assistant.results import Finding, ProbeRun, RootError, Verdict

USABLE = ("ok", "failed", "not_applicable")
TROUBLE = ("timeout", "error", "interrupted")
MIB_PER_GIB = 1024

# Advice tags of kb threads, and the set_device_order variant that tests each.
ADVICE_VARIANTS = {
    "set-device-before-init": "before-init",
    "set-device-after-init": "after-init",
    "remove-set-device": "no-set-device",
}
VARIANT_NAMES = {
    "before-init": ("set_device before init_process_group", "先 set_device 再 init_process_group"),
    "after-init": ("set_device after init_process_group", "先 init_process_group 再 set_device"),
    "no-set-device": (
        "no set_device (tensors on cuda:LOCAL_RANK)",
        "不调用 set_device（张量放在 cuda:LOCAL_RANK）",
    ),
    "device-id": ("init_process_group(device_id=...)", "init_process_group(device_id=...)"),
}

# Oldest Linux driver for each CUDA major version (minor-version compatibility).
MIN_DRIVER = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580, 65, 6)}
SHM_CONFIRM_MIB = 512  # Docker's 64 MB default and the like: NCCL and DataLoader run out
SHM_DOUBT_MIB = 2048
SHM_FREE_CONFIRM_MIB = 256
GPU_BUSY_FRACTION = 0.1  # less free than this before training starts: someone holds the GPU


def _pattern(*alternatives: str) -> re.Pattern:
    return re.compile("|".join(alternatives), re.IGNORECASE)


# Error texts precise enough to name a cause (or to add evidence for one).
ENV_MISSING = _pattern(
    r"environment variable (\w+) expected, but not set",
    r"KeyError: '(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT)'",
)
LOCAL_RANK_ARG = _pattern(r"unrecognized arguments?:.*--local[-_]rank")
DUPLICATE_GPU = _pattern(r"Duplicate GPU detected", r"both on CUDA device")
INVALID_ORDINAL = _pattern(r"invalid device ordinal")
PORT_IN_USE = _pattern(r"address already in use", r"EADDRINUSE", r"errno:? ?98\b")
ENDPOINT = _pattern(
    r"client socket has timed out",
    r"failed to connect to",
    r"Connection refused",
    r"Name or service not known",
    r"Temporary failure in name resolution",
    r"nodename nor servname",
    r"No route to host",
)
DRIVER_OLD = _pattern(r"driver version is insufficient", r"driver on your system is too old")
NO_KERNEL = _pattern(r"no kernel image is available")
NCCL_CUDA_ERROR = _pattern(r"unhandled cuda error", r"ncclUnhandledCudaError")
SHM_ERROR = _pattern(
    r"\bBus error\b",
    r"/dev/shm",
    r"shared memory",
    r"shm_open",
    r"unhandled system error",
    r"No space left on device",
)
NETWORK = _pattern(
    r"no socket interface found",
    r"Bootstrap ?: ?no socket",
    r"Unable to find address for",
    r"getifaddrs",
)
NO_CUDA = _pattern(
    r"Torch not compiled with CUDA enabled",
    r"no CUDA GPUs are available",
    r"Found no NVIDIA driver",
    r"doesn't have NCCL built in",
    r"CUDA driver initialization failed",
    r"no GPUs found",
    r"cudaErrorNoDevice",
)
# Error text that only a job with a working GPU can print.
GPU_USED = _pattern(
    r"Duplicate GPU detected",
    r"both on CUDA device",
    r"NCCL (?:error|WARN|version)",
    r"nccl\w*(?:Invalid|Unhandled|System|Internal)\w*",
    r"CUDA out of memory",
    r"GPU \d+ has a total capacity",
    r"Watchdog caught collective operation timeout",
    r"ProcessGroupNCCL",
)
NCCL_MISSING = _pattern(
    r"doesn't have NCCL built in", r"NCCL is not available", r"backend nccl is not available"
)
CPU_TENSORS = _pattern(
    r"Tensors must be CUDA and dense",
    r"No backend type associated with device type cpu",
    r"ProcessGroupNCCL only supports CUDA",
)
UNUSED_PARAMETERS = _pattern(
    r"Expected to have finished reduction in the prior iteration",
    r"did not receive grad",
    r"find_unused_parameters=True",
)
DDP_CPU_MODULE = _pattern(
    r"device_ids and output_device arguments only work with",
    r"module parameters \{device\(type='cpu'\)\}",
    r"device_ids can only be None or contain a single element",
)
PG_NOT_INITIALIZED = _pattern(r"Default process group has not been initialized")
COLLECTIVE_MISMATCH = _pattern(
    r"Detected mismatch between collectives",
    r"CollectiveFingerPrint",
    r"Tensor list input and output sizes",
    r"tensors? (?:must|should) have the same (?:size|shape|dtype)",
)
CONNECTION_CLOSED = _pattern(r"Connection closed by peer", r"Connection reset by peer")
COLLECTIVE_TIMEOUT = _pattern(
    r"Watchdog caught collective operation timeout",
    r"collective operation timeout",
    r"ran for \d+ milliseconds before timing out",
    r"Timed out waiting \d+ ?ms for (?:recv|send)",
)
STORE_BARRIER = _pattern(
    r"Timed out initializing process group in store based barrier",
    r"clients joined",
    r"waiting for all \d+ workers",
)
OOM_KILLED = _pattern(
    r"Signal 9 \(SIGKILL\)",
    r"exit ?code\s*:?\s*-9\b",
    r"\bSIGKILL\b",
    r"Out of memory: Killed process",
    r"oom-kill",
)
CUDA_OOM = _pattern(r"CUDA out of memory", r"OutOfMemoryError", r"CUDA error: out of memory")
MAIN_GUARD = _pattern(
    r"An attempt has been made to start a new process before",
    r"bootstrapping phase",
    r"freeze_support\(\)",
)


# --- the inputs of a judgement -------------------------------------------------


@dataclass(frozen=True)
class Inputs:
    """Everything a verdict function may look at, and helpers to read it."""

    runs: dict[str, ProbeRun]
    root_error: RootError | None
    findings: list[Finding] = field(default_factory=list)
    lang: str = "en"

    def t(self, en: str, zh: str, **values) -> str:
        """One evidence line in the user's language."""
        return (zh if self.lang == "zh" else en).format(**values)

    def error_text(self) -> str:
        if self.root_error is None:
            return ""
        return f"{self.root_error.type}: {self.root_error.message}"

    def error_line(self, en: str = "the error: {error}", zh: str = "报错：{error}") -> str:
        """An evidence line quoting the root error, in the user's language."""
        return self.t(en, zh, error=_quote(self.error_text(), 120))

    def error_match(self, pattern: re.Pattern) -> re.Match | None:
        return pattern.search(self.error_text())

    def records(self, probe: str) -> list[dict] | None:
        """The per-rank records of a probe that ran to an answer, else None."""
        run = self.runs.get(probe)
        if run is None or run.status not in USABLE or not run.ranks:
            return None
        return [r for r in run.ranks if r.get("status") in USABLE]

    def facts(self, probe: str, with_status: tuple[str, ...] = ("ok", "failed")) -> list[dict]:
        """The records of a probe's ranks whose own status is one of with_status."""
        return [r for r in self.records(probe) or [] if r["status"] in with_status]

    def trouble(self, *probes: str) -> list[str]:
        """Evidence lines for needed probes that timed out, crashed or were stopped."""
        lines = []
        for name in probes:
            run = self.runs.get(name)
            if run is not None and run.status in TROUBLE:
                lines.append(
                    self.t(
                        "the {probe} probe ended with {status}: {detail}",
                        "{probe} 探针结果为 {status}：{detail}",
                        probe=name,
                        status=run.status,
                        detail=run.detail or "-",
                    )
                )
        return lines

    def ran(self, *probes: str) -> bool:
        return any(name in self.runs for name in probes)


def _verdict(value: str, evidence: list[str], refutes: list[str] | None = None) -> Verdict:
    seen: list[str] = []
    for line in evidence:
        line = " ".join(str(line).split())
        if line and line not in seen:
            seen.append(line)
    return Verdict(value, seen, list(refutes or []))


def _undecided(i: Inputs, probes: tuple[str, ...], evidence: list[str]) -> Verdict:
    """Inconclusive when there is something to say, else not_run."""
    evidence = evidence + i.trouble(*probes)
    return _verdict("inconclusive" if evidence or i.ran(*probes) else "not_run", evidence)


def _quote(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _gist(error: str, limit: int = 120) -> str:
    """The informative part of a long CUDA or NCCL error message.

    NCCL puts the reason after "Last error:"; CUDA appends advice about
    asynchronous kernel errors that says nothing about the cause.
    """
    text = " ".join(error.split()).split(" CUDA kernel errors might")[0]
    if "Last error:" in text:
        code = re.search(r"\bnccl[A-Z]\w+", text)
        reason = text.split("Last error:", 1)[1].strip()
        text = f"{code.group(0)}: {reason}" if code else reason
    return _quote(text, limit)


def _short(uuid: str | None) -> str:
    return (uuid or "?")[:12]


def _by_host(records: list[dict]) -> dict[str, list[dict]]:
    hosts: dict[str, list[dict]] = {}
    for record in sorted(records, key=lambda r: r.get("rank") or 0):
        hosts.setdefault(record.get("host") or "?", []).append(record)
    return hosts


def _int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _version(text: str | None) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text or ""))


def _multi_node(i: Inputs) -> bool:
    """Whether the facts show a job spanning several nodes."""
    hosts = {r.get("host") for run in i.runs.values() for r in run.ranks if r.get("host")}
    if len(hosts) > 1:
        return True
    for record in i.facts("launch_env"):
        facts = record["facts"]
        values = dict(facts.get("user_env") or {})
        values.update(facts.get("multi_node_hints") or {})
        for key in (
            "SLURM_NNODES",
            "SLURM_JOB_NUM_NODES",
            "PET_NNODES",
            "NNODES",
            "GROUP_WORLD_SIZE",
        ):
            if (_int(values.get(key)) or 0) > 1:
                return True
        if (_int(values.get("NODE_RANK")) or 0) > 0:
            return True
    return False


# --- registry -----------------------------------------------------------------

Judge = Callable[[Inputs], Verdict]
JUDGES: dict[str, Judge] = {}


def judges(cause_id: str) -> Callable[[Judge], Judge]:
    """Register the verdict function of a cause."""

    def register(function: Judge) -> Judge:
        JUDGES[cause_id] = function
        return function

    return register


def judge(
    cause_id: str,
    runs: dict[str, ProbeRun],
    root_error: RootError | None,
    findings: list[Finding],
    lang: str = "en",
) -> Verdict:
    """The verdict on one cause. A finding in the user's script confirms it."""
    inputs = Inputs(runs, root_error, list(findings), lang)
    verdict = JUDGES.get(cause_id, _no_probe)(inputs)
    own = [f for f in findings if f.cause_id == cause_id]
    if not own:
        return verdict
    lines = [_finding_line(inputs, f) for f in own]
    return _verdict("confirmed", lines + verdict.evidence, verdict.refutes)


def _finding_line(i: Inputs, finding: Finding) -> str:
    where = (
        f"{finding.path}:{finding.line}"
        if finding.path
        else i.t("line {n}", "第 {n} 行", n=finding.line)
    )
    return i.t(
        "script {where}: {message}", "脚本 {where}：{message}", where=where, message=finding.message
    )


def _no_probe(i: Inputs) -> Verdict:
    """Causes no probe can decide: only a finding (handled by judge) confirms."""
    return _not_run()


def _not_run() -> Verdict:
    # A fresh object each time: callers may extend a verdict's evidence.
    return Verdict("not_run")


def _by_error(pattern: re.Pattern, en: str, zh: str) -> Judge:
    """A verdict function for a cause only the error text can confirm."""

    def decide(i: Inputs) -> Verdict:
        if i.error_match(pattern):
            return _verdict("confirmed", [i.t(en, zh, error=_quote(i.error_text()))])
        return _not_run()

    return decide
