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

Standard library only (plus assistant.results / config / probe_registry).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from assistant.probe_registry import PROBES
from assistant.results import (
    VERDICT_RANK,
    CauseResult,
    Finding,
    ProbeRun,
    Result,
    RootError,
    Verdict,
)

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


# --- launch -------------------------------------------------------------------


@judges("launched-without-torchrun")
def _launched_without_torchrun(i: Inputs) -> Verdict:
    evidence = []
    match = i.error_match(ENV_MISSING)
    launch = i.facts("launch_env")
    missing = [(r["rank"], r["facts"]["missing"]) for r in launch if r["facts"].get("missing")]
    for rank, names in missing:
        evidence.append(
            i.t(
                "rank {rank} was started without {names}: not by torchrun",
                "rank {rank} 启动时没有 {names}：不是用 torchrun 启动的",
                rank=rank,
                names=", ".join(names),
            )
        )
    if launch and not missing:
        evidence.append(
            i.t(
                "under torchrun every rank here gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT",
                "在本机用 torchrun 启动时，每个 rank 都拿到了 RANK、LOCAL_RANK、WORLD_SIZE、LOCAL_WORLD_SIZE、MASTER_ADDR 和 MASTER_PORT",
            )
        )
    if match:
        name = next((g for g in match.groups() if g), "RANK")
        line = i.t(
            "the error says {name} is not set: the script was not started by torchrun (or got no rank and world size)",
            "报错说 {name} 没有设置：脚本不是用 torchrun 启动的（或者没有拿到 rank 和 world_size）",
            name=name,
        )
        return _verdict("confirmed", [line] + evidence)
    if missing:
        return _verdict("confirmed", evidence)
    if i.root_error is not None and i.root_error.rank is not None:
        line = i.t(
            "the error comes from rank {rank}, so the process group knew its rank",
            "报错来自 rank {rank}，说明进程组已经拿到了 rank",
            rank=i.root_error.rank,
        )
        return _verdict("ruled_out", [line] + evidence)
    return _undecided(i, ("launch_env",), evidence)


@judges("local-rank-not-from-env")
def _local_rank_not_from_env(i: Inputs) -> Verdict:
    evidence = []
    launch = i.facts("launch_env")
    if launch:
        local_ranks = sorted({r["facts"]["env"].get("LOCAL_RANK") for r in launch}, key=str)
        if not any(r["facts"].get("local_rank_args") for r in launch):
            evidence.append(
                i.t(
                    "torchrun here passes LOCAL_RANK ({values}) only in the environment, no --local-rank argument: an argparse default gives every rank the same device",
                    "本机 torchrun 只通过环境变量传 LOCAL_RANK（{values}），不传 --local-rank 参数：用 argparse 默认值的话，每个 rank 都会拿到同一张卡",
                    values=", ".join(str(v) for v in local_ranks),
                )
            )
    evidence.extend(_script_picks_device(i))
    return _undecided(i, ("launch_env", "devices"), evidence)


@judges("local-rank-arg-mismatch")
def _local_rank_arg_mismatch(i: Inputs) -> Verdict:
    evidence = []
    launch = i.facts("launch_env")
    passed = sorted({a for r in launch for a in r["facts"].get("local_rank_args") or []})
    if passed:
        evidence.append(
            i.t(
                "the launcher passed {args} to the script",
                "启动器给脚本传了 {args}",
                args=", ".join(passed),
            )
        )
    elif launch:
        evidence.append(
            i.t(
                "torchrun here passes no --local-rank argument; read os.environ['LOCAL_RANK'] instead",
                "本机 torchrun 不传 --local-rank 参数；请改读 os.environ['LOCAL_RANK']",
            )
        )
    if i.error_match(LOCAL_RANK_ARG):
        line = i.t(
            "the script rejects the --local-rank argument its launcher passed: {error}",
            "脚本不认启动器传入的 --local-rank 参数：{error}",
            error=_quote(i.error_text()),
        )
        return _verdict("confirmed", [line] + evidence)
    return _undecided(i, ("launch_env",), evidence)


@judges("world-size-mismatch")
def _world_size_mismatch(i: Inputs) -> Verdict:
    launch = i.facts("launch_env")
    evidence = []
    if i.error_match(STORE_BARRIER):
        evidence.append(
            i.t(
                "the error shows the rendezvous waiting for ranks that never joined",
                "报错显示 rendezvous 在等一直没有加入的 rank",
            )
        )
    if not launch:
        return _undecided(i, ("launch_env",), evidence)
    sizes = {r["facts"]["env"].get("WORLD_SIZE") for r in launch}
    ranks = [_int(r["facts"]["env"].get("RANK")) for r in launch]
    world = _int(next(iter(sizes))) if len(sizes) == 1 else None
    complete = len(launch) == len(i.runs["launch_env"].ranks)
    if len(sizes) > 1:
        line = i.t(
            "ranks disagree on WORLD_SIZE: {sizes}",
            "各 rank 的 WORLD_SIZE 不一致：{sizes}",
            sizes=", ".join(
                f"rank {r['rank']}: {r['facts']['env'].get('WORLD_SIZE')}" for r in launch
            ),
        )
        return _verdict("confirmed", [line] + evidence)
    if len(set(ranks)) < len(ranks) or (
        complete and world is not None and sorted(ranks) != list(range(world))
    ):
        line = i.t(
            "RANK values {ranks} are not 0..{last} once each",
            "RANK 取值 {ranks} 不是 0..{last} 各一次",
            ranks=sorted(ranks, key=lambda v: -1 if v is None else v),
            last=(world or len(ranks)) - 1,
        )
        return _verdict("confirmed", [line] + evidence)
    evidence.append(
        i.t(
            "torchrun here gives {n} rank(s) RANK 0..{last} and WORLD_SIZE {world}: a mismatch would come from an explicit world_size or rank in the script",
            "本机 torchrun 给 {n} 个 rank 分配了 RANK 0..{last}、WORLD_SIZE {world}：若不一致，来自脚本里显式写的 world_size 或 rank",
            n=len(launch),
            last=len(launch) - 1,
            world=world,
        )
    )
    user_world = next((r["facts"].get("user_env") or {} for r in launch), {}).get("WORLD_SIZE")
    if user_world:
        evidence.append(
            i.t(
                "your environment exports WORLD_SIZE={value}; torchrun overrides it, a plain python start would use it",
                "你的环境里导出了 WORLD_SIZE={value}；torchrun 会覆盖它，直接用 python 启动则会用它",
                value=user_world,
            )
        )
    return _verdict("inconclusive", evidence)


@judges("missing-main-guard")
def _missing_main_guard(i: Inputs) -> Verdict:
    evidence = []
    methods = sorted(
        {r["facts"].get("default_start_method") for r in i.facts("launch_env")} - {None}
    )
    for method in methods:
        if method == "fork":
            evidence.append(
                i.t(
                    "the default start method here is fork: DataLoader workers do not re-import the script; mp.spawn and the spawn method still do",
                    "本机默认的进程启动方式是 fork：DataLoader worker 不会重新导入脚本；mp.spawn 和 spawn 方式仍然会",
                )
            )
        else:
            evidence.append(
                i.t(
                    'the default start method here is {method}: every worker process re-imports the script, so code outside `if __name__ == "__main__":` runs again',
                    '本机默认的进程启动方式是 {method}：每个子进程都会重新导入脚本，`if __name__ == "__main__":` 之外的代码会再跑一遍',
                    method=method,
                )
            )
    if i.error_match(MAIN_GUARD):
        line = i.t(
            "the error is Python's message for a process started while the script was still being imported",
            "这个报错是 Python 在脚本导入过程中又启动新进程时给出的",
        )
        return _verdict("confirmed", [line] + evidence)
    return _undecided(i, ("launch_env",), evidence)


# --- devices --------------------------------------------------------------------


def _gpu_records(i: Inputs) -> list[dict]:
    """devices records of ranks that see CUDA."""
    return [r for r in i.facts("devices") if r["facts"].get("cuda_available")]


def _sharing(i: Inputs) -> list[str]:
    """Evidence lines of ranks that cannot each have a GPU of their own."""
    lines = []
    for host, records in _by_host(_gpu_records(i)).items():
        by_uuid: dict[str, list[int]] = {}
        for record in records:
            landed = record["facts"]["local_rank_device"]
            if landed.get("uuid"):
                by_uuid.setdefault(landed["uuid"], []).append(record["rank"])
        for uuid, ranks in by_uuid.items():
            if len(ranks) > 1:
                lines.append(
                    i.t(
                        "ranks {ranks} all land on {gpu} with cuda:LOCAL_RANK on {host}",
                        "{host} 上 rank {ranks} 用 cuda:LOCAL_RANK 都落在 {gpu} 上",
                        ranks=", ".join(map(str, ranks)),
                        gpu=_short(uuid),
                        host=host,
                    )
                )
        local_world = max(r.get("local_world_size") or 0 for r in records)
        count = min(r["facts"]["device_count"] for r in records)
        if local_world > count:
            gpus = sorted(
                {_short(d["uuid"]) for r in records for d in r["facts"].get("visible") or []}
            )
            lines.append(
                i.t(
                    "{n} ranks on {host} but only {count} visible GPU(s) ({gpus}): ranks must share",
                    "{host} 上有 {n} 个 rank，但只看得到 {count} 张 GPU（{gpus}）：只能共用",
                    n=local_world,
                    host=host,
                    count=count,
                    gpus=", ".join(gpus) or "-",
                )
            )
            defaults = {r["facts"]["default_device"]["uuid"] for r in records}
            if len(defaults) == 1 and len(records) > 1:
                lines.append(
                    i.t(
                        "every rank's default device is {gpu}",
                        "每个 rank 的默认设备都是 {gpu}",
                        gpu=_short(next(iter(defaults))),
                    )
                )
        failing: dict[str, list[int]] = {}
        for record in records:
            error = record["facts"]["local_rank_device"].get("error")
            if error:
                failing.setdefault(_gist(error, 100), []).append(record["rank"])
        for error, ranks in failing.items():
            lines.append(
                i.t(
                    "rank {ranks}: cuda:LOCAL_RANK fails: {error}",
                    "rank {ranks}：cuda:LOCAL_RANK 出错：{error}",
                    ranks=", ".join(map(str, ranks)),
                    error=error,
                )
            )
    lines.extend(_nccl_duplicate_lines(i))
    return lines


def _nccl_duplicate_lines(i: Inputs) -> list[str]:
    """NCCL's own "Duplicate GPU" error from the backend probe."""
    # Not set_device_order: its no-set-device variant puts ranks on one GPU on purpose.
    for record in i.facts("backend"):
        error = (record["facts"].get("nccl") or {}).get("error") or ""
        match = DUPLICATE_GPU.search(error)
        if match:
            return [
                i.t(
                    "NCCL refused the backend probe's all_reduce: {error}",
                    "backend 探针的 all_reduce 被 NCCL 拒绝：{error}",
                    error=_gist(error[match.start() :], 100),
                )
            ]
    return []


def _own_gpus(i: Inputs) -> list[str]:
    """One line saying each rank has a GPU of its own, when it does."""
    records = _gpu_records(i)
    if not records or _sharing(i):
        return []
    landed = [f"{r['rank']}->{_short(r['facts']['local_rank_device']['uuid'])}" for r in records]
    return [
        i.t(
            "with cuda:LOCAL_RANK each rank gets a GPU of its own here ({pairs})",
            "在本机用 cuda:LOCAL_RANK 时每个 rank 各有一张卡（{pairs}）",
            pairs=", ".join(landed),
        )
    ]


def _default_device_line(i: Inputs) -> list[str]:
    records = _gpu_records(i)
    defaults = {r["facts"]["default_device"]["uuid"] for r in records}
    if len(records) > 1 and len(defaults) == 1:
        return [
            i.t(
                "without set_device every rank's current device is cuda:0 ({gpu}): bare .cuda() and 'cuda' land there",
                "不调用 set_device 时每个 rank 的当前设备都是 cuda:0（{gpu}）：.cuda() 和 'cuda' 都会落到这张卡",
                gpu=_short(next(iter(defaults))),
            )
        ]
    return []


def _script_picks_device(i: Inputs) -> list[str]:
    """Evidence that, on a healthy launch, the device choice is the script's."""
    lines = _own_gpus(i)
    if lines and i.error_match(DUPLICATE_GPU):
        lines.append(
            i.t(
                "so the ranks that share a GPU in your error chose it in the script",
                "所以报错里共用一张卡的 rank，是脚本自己选的设备",
            )
        )
    return lines


def _no_gpu(i: Inputs) -> Verdict | None:
    """not_applicable when the devices probe found no CUDA at all."""
    records = i.records("devices")
    if records and all(r["status"] == "not_applicable" for r in records):
        return _verdict("not_applicable", [i.t("no CUDA device visible", "看不到任何 CUDA 设备")])
    return None


@judges("duplicate-gpu-per-rank")
def _duplicate_gpu_per_rank(i: Inputs) -> Verdict:
    sharing = _sharing(i)
    if sharing:
        return _verdict("confirmed", sharing)
    if i.error_match(DUPLICATE_GPU):
        line = i.t(
            "the error says two ranks are on one GPU: {error}",
            "报错说两个 rank 在同一张卡上：{error}",
            error=_quote(i.error_text(), 120),
        )
        return _verdict("confirmed", [line] + _script_picks_device(i))
    no_gpu = _no_gpu(i)
    if no_gpu:
        return no_gpu
    evidence = _own_gpus(i)
    if evidence:
        evidence.append(
            i.t(
                "if ranks still share a GPU, the script picks the device (see local-rank-not-from-env, hardcoded-device)",
                "如果 rank 仍然共用一张卡，是脚本选设备的方式有问题（见 local-rank-not-from-env、hardcoded-device）",
            )
        )
    return _undecided(i, ("devices",), evidence)


@judges("hardcoded-device")
def _hardcoded_device(i: Inputs) -> Verdict:
    no_gpu = _no_gpu(i)
    if no_gpu and not i.error_match(DUPLICATE_GPU):
        return no_gpu
    return _undecided(i, ("devices",), _script_picks_device(i) + _default_device_line(i))


@judges("world-size-exceeds-devices")
def _world_size_exceeds_devices(i: Inputs) -> Verdict:
    evidence = []
    if i.error_match(INVALID_ORDINAL):
        evidence.append(
            i.t(
                "'invalid device ordinal' means a rank asked for a GPU index that does not exist",
                "'invalid device ordinal' 表示某个 rank 请求了不存在的 GPU 编号",
            )
        )
    records = _gpu_records(i)
    over = []
    for host, mine in _by_host(records).items():
        local_world = max(r.get("local_world_size") or 0 for r in mine)
        count = min(r["facts"]["device_count"] for r in mine)
        if local_world > count:
            over.append(
                i.t(
                    "{n} processes on {host} but {count} visible GPU(s)",
                    "{host} 上有 {n} 个进程，但只看得到 {count} 张 GPU",
                    n=local_world,
                    host=host,
                    count=count,
                )
            )
    if over:
        return _verdict("confirmed", over + evidence)
    no_gpu = _no_gpu(i)
    if no_gpu:
        return no_gpu
    if not records:
        return _undecided(i, ("devices",), evidence)
    count = min(r["facts"]["device_count"] for r in records)
    local_world = max(r.get("local_world_size") or 0 for r in records)
    sources = {r["facts"].get("nproc_source") for r in i.facts("launch_env")}
    if sources == {"user"}:
        line = i.t(
            "{n} process(es) per node fit the {count} visible GPU(s)",
            "每个节点 {n} 个进程，看得到的 {count} 张 GPU 够用",
            n=local_world,
            count=count,
        )
        return _verdict("ruled_out", [line] + evidence)
    line = i.t(
        "{count} visible GPU(s) here: launch at most {count} process(es) per node",
        "本机看得到 {count} 张 GPU：每个节点最多启动 {count} 个进程",
        count=count,
    )
    return _verdict("inconclusive", [line] + evidence)


@judges("cuda-visible-devices-mismatch")
def _cuda_visible_devices_mismatch(i: Inputs) -> Verdict:
    records = i.facts("devices", ("ok", "failed", "not_applicable"))
    if not records:
        return _undecided(i, ("devices",), [])
    problems: list[str] = []
    healthy: list[str] = []
    for mine in _by_host(records).values():
        for value in sorted({r["facts"].get("cuda_visible_devices") for r in mine}, key=str):
            same = [r for r in mine if r["facts"].get("cuda_visible_devices") == value]
            problem = _visible_devices_problem(i, value, same)
            (problems if problem else healthy).append(
                problem or _visible_devices_ok(i, value, same)
            )
    if problems:
        return _verdict("confirmed", problems)
    if all(
        r["facts"].get("physical_gpus") in (0, None) and not r["facts"].get("cuda_available")
        for r in records
    ):
        return _verdict(
            "not_applicable", [i.t("no NVIDIA GPU on this machine", "本机没有 NVIDIA GPU")]
        )
    return _verdict("ruled_out", healthy)


def _visible_devices_problem(i: Inputs, value: str | None, records: list[dict]) -> str | None:
    """What is wrong with one CUDA_VISIBLE_DEVICES value, for the ranks that have it."""
    if value is None:
        return None
    physical = max((r["facts"].get("physical_gpus") or 0) for r in records)
    count = min(r["facts"].get("device_count") or 0 for r in records)
    local_world = max(r.get("local_world_size") or 0 for r in records)
    entries = [e.strip() for e in value.split(",")]
    if not value.strip():
        if not physical:
            return i.t(
                "CUDA_VISIBLE_DEVICES is set but empty: it hides every GPU",
                "CUDA_VISIBLE_DEVICES 设成了空值：把所有 GPU 都藏起来了",
            )
        return i.t(
            "CUDA_VISIBLE_DEVICES is set but empty: it hides all {physical} GPU(s)",
            "CUDA_VISIBLE_DEVICES 设成了空值：把 {physical} 张 GPU 全都藏起来了",
            physical=physical,
        )
    duplicates = sorted({e for e in entries if entries.count(e) > 1})
    if duplicates:
        return i.t(
            "CUDA_VISIBLE_DEVICES={value} lists {dup} twice",
            "CUDA_VISIBLE_DEVICES={value} 把 {dup} 列了两次",
            value=value,
            dup=", ".join(duplicates),
        )
    invalid = [
        e
        for e in entries
        if not (
            e.startswith(("GPU-", "MIG-")) or (e.isdigit() and (not physical or int(e) < physical))
        )
    ]
    if invalid:
        return i.t(
            "CUDA_VISIBLE_DEVICES={value} names {bad}, which this machine does not have ({physical} GPU(s))",
            "CUDA_VISIBLE_DEVICES={value} 里的 {bad} 本机没有（共 {physical} 张 GPU）",
            value=value,
            bad=", ".join(invalid),
            physical=physical,
        )
    if count < local_world and physical > count:
        return i.t(
            "CUDA_VISIBLE_DEVICES={value} shows {count} of the {physical} GPUs to {n} ranks",
            "CUDA_VISIBLE_DEVICES={value} 只给 {n} 个 rank 看到 {physical} 张 GPU 中的 {count} 张",
            value=value,
            count=count,
            physical=physical,
            n=local_world,
        )
    return None


def _visible_devices_ok(i: Inputs, value: str | None, records: list[dict]) -> str:
    count = min(r["facts"].get("device_count") or 0 for r in records)
    if value is None:
        physical = max((r["facts"].get("physical_gpus") or 0) for r in records)
        return i.t(
            "CUDA_VISIBLE_DEVICES is not set: it hides none of the {n} GPU(s)",
            "没有设置 CUDA_VISIBLE_DEVICES：{n} 张 GPU 都没有被隐藏",
            n=max(count, physical),
        )
    return i.t(
        "CUDA_VISIBLE_DEVICES={value} shows {count} GPU(s)",
        "CUDA_VISIBLE_DEVICES={value} 可见 {count} 张 GPU",
        value=value,
        count=count,
    )


@judges("no-cuda-visible")
def _no_cuda_visible(i: Inputs) -> Verdict:
    records = i.facts("devices", ("ok", "failed", "not_applicable"))
    evidence = []
    if i.error_match(NO_CUDA):
        evidence.append(
            i.t("the error: {error}", "报错：{error}", error=_quote(i.error_text(), 120))
        )
    if not records:
        if evidence:
            return _verdict("confirmed", evidence)
        return _undecided(i, ("devices",), [])
    blind = [r for r in records if not r["facts"].get("cuda_available")]
    if blind and not evidence and i.error_match(GPU_USED):
        # The pasted error came from a GPU job elsewhere: this machine's lack of
        # a GPU says nothing about it.
        return _verdict(
            "not_applicable",
            [
                i.t(
                    "the error came from a job that used a GPU, but this machine has none: "
                    "run the probes on the failing machine",
                    "报错来自一个用了 GPU 的任务，但本机没有 GPU：请在出错的机器上运行探针",
                )
            ],
        )
    if not blind:
        names = sorted({d["name"] for r in records for d in r["facts"].get("visible") or []})
        count = max(r["facts"]["device_count"] for r in records)
        line = i.t(
            "torch sees {count} GPU(s) on every rank ({names})",
            "每个 rank 的 torch 都能看到 {count} 张 GPU（{names}）",
            count=count,
            names=", ".join(names),
        )
        return _verdict("ruled_out", [line] + evidence)
    return _verdict("confirmed", [_why_no_cuda(i, blind[0]["facts"], blind[0]["rank"])] + evidence)


def _why_no_cuda(i: Inputs, facts: dict, rank: int) -> str:
    if not facts.get("cuda_built"):
        version = next((r["facts"].get("torch") for r in i.facts("versions")), None)
        return i.t(
            "this torch{version} is a CPU-only build",
            "这个 torch{version} 是只支持 CPU 的版本",
            version=f" ({version})" if version else "",
        )
    if facts.get("cuda_visible_devices") is not None and not facts["cuda_visible_devices"].strip():
        return i.t(
            "CUDA_VISIBLE_DEVICES is set but empty: no GPU is visible",
            "CUDA_VISIBLE_DEVICES 设成了空值：看不到任何 GPU",
        )
    if facts.get("cuda_warning") or facts.get("cuda_error"):
        return i.t(
            "CUDA initialisation failed: {message}",
            "CUDA 初始化失败：{message}",
            message=_quote(facts.get("cuda_warning") or facts.get("cuda_error"), 140),
        )
    if not facts.get("driver_loaded") and not facts.get("physical_gpus"):
        return i.t(
            "no NVIDIA driver is loaded (no /proc/driver/nvidia)",
            "没有加载 NVIDIA 驱动（没有 /proc/driver/nvidia）",
        )
    return i.t(
        "torch.cuda.is_available() is False on rank {rank}",
        "rank {rank} 上 torch.cuda.is_available() 为 False",
        rank=rank,
    )


@judges("cuda-out-of-memory")
def _cuda_out_of_memory(i: Inputs) -> Verdict:
    evidence = []
    for record in _gpu_records(i):
        landed = record["facts"]["local_rank_device"]
        free, total = landed.get("free_mib"), landed.get("total_mib")
        if free is not None and total and free < GPU_BUSY_FRACTION * total:
            evidence.append(
                i.t(
                    "{gpu} has {free} MiB free of {total} MiB before any training: another process holds it",
                    "训练开始前 {gpu} 只剩 {free} MiB（共 {total} MiB）：有别的进程占着",
                    gpu=_short(landed["uuid"]),
                    free=free,
                    total=total,
                )
            )
    if i.error_match(CUDA_OOM):
        line = i.t("the error: {error}", "报错：{error}", error=_quote(i.error_text(), 120))
        return _verdict("confirmed", [line] + evidence + _default_device_line(i))
    no_gpu = _no_gpu(i)
    if no_gpu:
        return no_gpu
    if not evidence and _gpu_records(i):
        evidence.append(
            i.t(
                "every rank's GPU is at least {pct}% free before training",
                "训练开始前每个 rank 的 GPU 至少有 {pct}% 空闲",
                pct=round(100 * (1 - GPU_BUSY_FRACTION)),
            )
        )
    return _undecided(i, ("devices",), evidence)


# --- set_device order -----------------------------------------------------------


def variant_outcomes(runs: dict[str, ProbeRun]) -> dict[str, dict]:
    """Per set_device_order variant: whether it works here and why not.

    {"before-init": {"works": True, "failure": None, "shared": False}, ...}
    A variant works when every rank finished all its collectives and the
    ranks of a host do not end on one current device.
    """
    run = runs.get("set_device_order")
    if run is None:
        return {}
    outcomes: dict[str, dict] = {}
    for record in run.ranks:
        for variant, outcome in ((record.get("facts") or {}).get("variants") or {}).items():
            entry = outcomes.setdefault(
                variant, {"works": True, "failure": None, "shared": False, "hosts": {}}
            )
            facts = outcome.get("facts") or {}
            status = outcome.get("status")
            if status != "ok" or facts.get("step") != "done":
                entry["works"] = False
                failure = _variant_failure(status, facts, outcome)
                # A rank's own error explains the ranks that hung waiting for it.
                if entry["failure"] is None or (
                    entry["failure"]["kind"] == "hang" and failure["kind"] != "hang"
                ):
                    entry["failure"] = failure
            entry["hosts"].setdefault(record.get("host"), []).append(facts.get("current_uuid"))
    for entry in outcomes.values():
        for uuids in entry["hosts"].values():
            if len(uuids) > 1 and len(set(uuids)) == 1 and uuids[0]:
                entry["shared"] = True
                entry["works"] = False
                entry["shared_uuid"] = uuids[0]
    return outcomes


def _variant_failure(status: str | None, facts: dict, outcome: dict) -> dict:
    if status == "timeout":
        return {"kind": "hang", "step": facts.get("step"), "error": None}
    return {
        "kind": "failed",
        "step": facts.get("failed_step") or facts.get("step"),
        "error": facts.get("error") or outcome.get("reason"),
    }


def advice_outcomes(runs: dict[str, ProbeRun]) -> tuple[set[str], set[str]]:
    """(refuted, confirmed) advice tags: a variant fails (works) while another works (fails)."""
    outcomes = variant_outcomes(runs)
    if not outcomes:
        return set(), set()
    any_works = any(o["works"] for o in outcomes.values())
    any_fails = any(not o["works"] for o in outcomes.values())
    refuted, confirmed = set(), set()
    for tag, variant in ADVICE_VARIANTS.items():
        if variant not in outcomes:
            continue
        if not outcomes[variant]["works"] and any_works:
            refuted.add(tag)
        if outcomes[variant]["works"] and any_fails:
            confirmed.add(tag)
    return refuted, confirmed


@judges("set-device-order")
def _set_device_order(i: Inputs) -> Verdict:
    run = i.runs.get("set_device_order")
    if run is None:
        return _not_run()
    if run.status == "not_applicable":
        # The probe's own reason is English; say it in the user's language.
        return _verdict("not_applicable", [i.t("no CUDA device visible", "看不到任何 CUDA 设备")])
    outcomes = variant_outcomes(i.runs)
    if not outcomes:
        return _undecided(i, ("set_device_order",), [])
    evidence = [_variant_line(i, variant, outcome) for variant, outcome in outcomes.items()]
    refuted, _ = advice_outcomes(i.runs)
    working = [v for v, o in outcomes.items() if o["works"]]
    if len(working) == len(outcomes):
        evidence.insert(0, i.t("every order works here", "本机上每种顺序都能跑通"))
        return _verdict("ruled_out", evidence)
    if not working:
        evidence.insert(
            0,
            i.t(
                "no order works here, so the failure is not about the order (see duplicate-gpu-per-rank)",
                "本机上哪种顺序都跑不通，所以问题不在顺序（见 duplicate-gpu-per-rank）",
            ),
        )
        return _verdict("inconclusive", evidence + i.trouble("set_device_order"))
    return _verdict("inconclusive", evidence, sorted(refuted))


def _variant_line(i: Inputs, variant: str, outcome: dict) -> str:
    en, zh = VARIANT_NAMES.get(variant, (variant, variant))
    name = i.t(en, zh)
    failure = outcome["failure"]
    if failure and failure["kind"] == "hang":
        return i.t(
            "{name}: hangs in {step}", "{name}：卡在 {step}", name=name, step=failure["step"] or "?"
        )
    if failure:
        return i.t(
            "{name}: fails in {step}: {error}",
            "{name}：在 {step} 出错：{error}",
            name=name,
            step=failure["step"] or "?",
            error=_gist(failure["error"] or "?", 100),
        )
    if outcome["shared"]:
        return i.t(
            "{name}: collectives work, but every rank's current device is {gpu}, where .cuda(), barrier and object collectives go",
            "{name}：集合通信能跑通，但每个 rank 的当前设备都是 {gpu}，.cuda()、barrier 和对象集合通信都会落到这张卡",
            name=name,
            gpu=_short(outcome.get("shared_uuid")),
        )
    return i.t(
        "{name}: barrier, all_reduce and all_gather_object work, one GPU per rank",
        "{name}：barrier、all_reduce 和 all_gather_object 都正常，每个 rank 一张卡",
        name=name,
    )


# --- backend ------------------------------------------------------------------


@judges("nccl-not-available")
def _nccl_not_available(i: Inputs) -> Verdict:
    records = i.facts("backend")
    evidence = []
    if i.error_match(NCCL_MISSING):
        evidence.append(
            i.t("the error: {error}", "报错：{error}", error=_quote(i.error_text(), 120))
        )
    if not records:
        return _undecided(i, ("backend",), evidence)
    facts = records[0]["facts"]
    platform = facts.get("platform")
    if facts["available"].get("nccl"):
        version = next((r["facts"].get("nccl") for r in i.facts("versions")), None)
        line = i.t(
            "this torch has NCCL{version}",
            "这个 torch 带有 NCCL{version}",
            version=f" {version}" if version else "",
        )
        return _verdict("ruled_out", [line] + evidence)
    if platform in ("Windows", "Darwin"):
        line = i.t(
            "there is no NCCL on {platform}: use the gloo backend",
            "{platform} 上没有 NCCL：请用 gloo 后端",
            platform=platform,
        )
        return _verdict("confirmed", [line] + evidence)
    line = i.t(
        "{platform} has NCCL; this torch build lacks it (see no-cuda-visible)",
        "{platform} 平台本身有 NCCL；是这个 torch 版本没带（见 no-cuda-visible）",
        platform=platform,
    )
    return _verdict("ruled_out", [line] + evidence)


@judges("nccl-with-cpu-tensors")
def _nccl_with_cpu_tensors(i: Inputs) -> Verdict:
    evidence = []
    for record in i.facts("backend"):
        text = (record["facts"].get("nccl") or {}).get("cpu_tensor_error")
        if text:
            evidence.append(
                i.t(
                    "here NCCL answers a CPU tensor with: {error}",
                    "本机上 NCCL 收到 CPU 张量时报：{error}",
                    error=_quote(text, 120),
                )
            )
            break
    if i.error_match(CPU_TENSORS):
        line = i.t(
            "the error is NCCL refusing a CPU tensor: {error}",
            "报错是 NCCL 拒绝 CPU 张量：{error}",
            error=_quote(i.error_text(), 120),
        )
        return _verdict("confirmed", [line] + evidence)
    records = i.facts("backend")
    if records and not records[0]["facts"]["available"].get("nccl"):
        return _verdict("not_applicable", [i.t("this torch has no NCCL", "这个 torch 没有 NCCL")])
    no_gpu = _no_gpu(i)
    if no_gpu:
        return no_gpu
    skipped = next(
        (
            r["facts"]["nccl"].get("reason")
            for r in records
            if (r["facts"].get("nccl") or {}).get("result") == "skipped"
        ),
        None,
    )
    if skipped and not evidence:
        evidence.append(
            i.t(
                "the backend probe skipped NCCL: {reason}",
                "backend 探针跳过了 NCCL：{reason}",
                reason=skipped,
            )
        )
    return _undecided(i, ("backend",), evidence)


@judges("p2p-hang")
def _p2p_hang(i: Inputs) -> Verdict:
    no_gpu = _no_gpu(i)
    if no_gpu:
        return no_gpu
    gpus = _gpu_records(i)
    if gpus and max(r["facts"]["device_count"] for r in gpus) < 2:
        return _verdict(
            "not_applicable",
            [
                i.t(
                    "fewer than two GPUs per node: no peer-to-peer traffic",
                    "每个节点不到两张 GPU：没有点对点传输",
                )
            ],
        )
    evidence = _p2p_facts(i)
    run = i.runs.get("backend")
    nccl = next(
        (r["facts"].get("nccl") or {} for r in (run.ranks if run else []) if r.get("facts")), {}
    )
    iommu_translates = any(
        t.startswith("DMA")
        for r in i.facts("system")
        for t in (r["facts"].get("iommu") or {}).get("types", [])
    )
    if run is not None and run.status == "timeout" and nccl.get("step") == "all_reduce":
        line = i.t(
            "the NCCL all_reduce hung across the GPUs while gloo worked",
            "gloo 正常，但跨 GPU 的 NCCL all_reduce 卡住了",
        )
        return _verdict("confirmed" if iommu_translates else "inconclusive", [line] + evidence)
    if nccl.get("result") == "wrong_result":
        line = i.t("the NCCL all_reduce returned wrong values", "NCCL all_reduce 返回了错误的结果")
        return _verdict("confirmed", [line] + evidence)
    if nccl.get("result") == "ok":
        world = len(run.ranks)
        line = i.t(
            "a {mib} MiB NCCL all_reduce across {n} GPUs finished in {ms} ms with correct values",
            "跨 {n} 张 GPU 的 {mib} MiB NCCL all_reduce 用时 {ms} ms，结果正确",
            mib=(nccl.get("elements") or 0) * 4 // (1024 * 1024),
            n=world,
            ms=round((nccl.get("seconds") or 0) * 1000, 1),
        )
        if world > 1:
            return _verdict("ruled_out", [line] + evidence)
    return _undecided(i, ("backend", "system"), evidence)


def _p2p_facts(i: Inputs) -> list[str]:
    lines = []
    for record in i.facts("system"):
        facts = record["facts"]
        if (facts.get("env") or {}).get("NCCL_P2P_DISABLE") in ("1", "true"):
            lines.append(
                i.t(
                    "NCCL_P2P_DISABLE=1 is set: P2P is off",
                    "已设置 NCCL_P2P_DISABLE=1：点对点传输已关闭",
                )
            )
        p2p = facts.get("p2p") or {}
        if p2p.get("pairs"):
            missing = [f"{a}->{b}" for a, b, ok in p2p["pairs"] if not ok]
            if not missing:
                lines.append(
                    i.t("every GPU pair has P2P access", "所有 GPU 两两之间都能点对点访问")
                )
            elif len(missing) == len(p2p["pairs"]):
                lines.append(
                    i.t(
                        "no GPU pair has P2P access: NCCL goes through host memory",
                        "没有任何 GPU 对能点对点访问：NCCL 经主机内存传输",
                    )
                )
            else:
                lines.append(
                    i.t(
                        "GPU pairs without P2P access: {pairs}",
                        "不能点对点访问的 GPU 对：{pairs}",
                        pairs=", ".join(missing),
                    )
                )
        types = (facts.get("iommu") or {}).get("types") or []
        if any(t.startswith("DMA") for t in types):
            lines.append(
                i.t(
                    "the IOMMU translates device DMA ({types}): a known cause of P2P hangs",
                    "IOMMU 在转换设备 DMA（{types}）：这是点对点传输卡住的已知原因",
                    types=", ".join(types),
                )
            )
    return lines


@judges("collective-timeout")
def _collective_timeout(i: Inputs) -> Verdict:
    if not i.error_match(COLLECTIVE_TIMEOUT):
        return _not_run()
    evidence = [i.t("the error: {error}", "报错：{error}", error=_quote(i.error_text(), 120))]
    for record in i.facts("backend")[:1]:
        gloo = record["facts"].get("gloo") or {}
        if gloo.get("result") == "ok":
            evidence.append(
                i.t(
                    "a gloo all_reduce across {n} ranks takes {ms} ms here: the collective itself is fast, so a rank was late",
                    "本机 {n} 个 rank 的 gloo all_reduce 只要 {ms} ms：集合通信本身很快，是某个 rank 迟到了",
                    n=record.get("world_size"),
                    ms=round((gloo.get("seconds") or 0) * 1000, 1),
                )
            )
    return _verdict("confirmed", evidence)


@judges("uneven-inputs")
def _uneven_inputs(i: Inputs) -> Verdict:
    if i.error_match(CONNECTION_CLOSED):
        line = i.t(
            "the error shows a peer that left while others still waited, as when one rank finishes its data early",
            "报错显示某个对端已经退出而其他 rank 还在等待，就像某个 rank 提前跑完了数据",
        )
        return _verdict("inconclusive", [line])
    return _not_run()


JUDGES["unused-parameters"] = _by_error(
    UNUSED_PARAMETERS,
    "the error is DDP's message for parameters without a gradient: {error}",
    "这是 DDP 在有参数没有梯度时的报错：{error}",
)
JUDGES["ddp-device-ids-cpu-module"] = _by_error(
    DDP_CPU_MODULE,
    "the error is DDP refusing device_ids for a module on the CPU: {error}",
    "这是 DDP 拒绝为 CPU 上的模型设置 device_ids 的报错：{error}",
)
JUDGES["process-group-not-initialized"] = _by_error(
    PG_NOT_INITIALIZED,
    "the error says a torch.distributed call ran before init_process_group: {error}",
    "报错说在 init_process_group 之前就调用了 torch.distributed：{error}",
)
JUDGES["collective-mismatch"] = _by_error(
    COLLECTIVE_MISMATCH,
    "the error is a collective mismatch between ranks: {error}",
    "报错是各 rank 之间的集合通信不一致：{error}",
)


# --- rendezvous -------------------------------------------------------------------


def _endpoint_record(i: Inputs) -> dict | None:
    """The rendezvous facts of the rank that checked the endpoint (local rank 0)."""
    checked = [
        r for r in i.facts("rendezvous") if "port_free" in r["facts"] or "connect" in r["facts"]
    ]
    return checked[0] if checked else None


@judges("master-port-in-use")
def _master_port_in_use(i: Inputs) -> Verdict:
    evidence = []
    said = i.error_match(PORT_IN_USE)
    if said:
        evidence.append(
            i.t(
                "the error reports the port in use: {error}",
                "报错说端口已被占用：{error}",
                error=_quote(i.error_text(), 120),
            )
        )
    record = _endpoint_record(i)
    if record is None:
        if said:
            return _verdict("confirmed", evidence)
        return _undecided(i, ("rendezvous",), evidence)
    facts = record["facts"]
    port = facts.get("port")
    if facts.get("port_free") is False:
        holder = facts.get("port_holder")
        line = (
            i.t(
                "port {port} is in use, held by pid {pid}: {cmd}",
                "端口 {port} 已被占用，占用者 pid {pid}：{cmd}",
                port=port,
                pid=holder["pid"],
                cmd=_quote(holder.get("cmdline") or "?", 80),
            )
            if holder
            else i.t("port {port} is in use on this host", "本机端口 {port} 已被占用", port=port)
        )
        return _verdict("confirmed", [line] + evidence)
    if facts.get("port_free") is True:
        line = i.t("port {port} is free now", "端口 {port} 现在是空闲的", port=port)
        if said:
            later = i.t(
                "so the process that held it has exited since",
                "所以当时占用它的进程已经退出了",
            )
            return _verdict("confirmed", evidence + [line, later])
        return _verdict("ruled_out", [line])
    if "connect" in facts:
        evidence.append(
            i.t(
                "MASTER_ADDR {addr} is another host: the port is checked there, not here",
                "MASTER_ADDR {addr} 是另一台主机：端口要在那台机器上检查",
                addr=facts.get("addr"),
            )
        )
    return _verdict("confirmed" if said else "inconclusive", evidence)


@judges("master-endpoint-mismatch")
def _master_endpoint_mismatch(i: Inputs) -> Verdict:
    records = i.facts("rendezvous")
    evidence = []
    if i.error_match(ENDPOINT):
        evidence.append(
            i.t("the error: {error}", "报错：{error}", error=_quote(i.error_text(), 120))
        )
    if not records:
        return _undecided(i, ("rendezvous",), evidence)
    endpoints = {(r["facts"].get("addr"), r["facts"].get("port")) for r in records}
    if len(endpoints) > 1:
        line = i.t(
            "ranks use different endpoints: {endpoints}",
            "各 rank 用的地址不一致：{endpoints}",
            endpoints=", ".join(f"{a}:{p}" for a, p in sorted(endpoints, key=str)),
        )
        return _verdict("confirmed", [line] + evidence)
    facts = (_endpoint_record(i) or records[0])["facts"]
    addr, port = facts.get("addr"), facts.get("port")
    problem = _endpoint_problem(i, facts)
    if problem:
        return _verdict("confirmed", [problem] + evidence)
    if facts.get("connect") == "refused":
        line = i.t(
            "{addr}:{port} refuses connections now: nothing listens there (fine if the job is not running)",
            "{addr}:{port} 现在拒绝连接：没有进程在监听（如果任务没在跑，这是正常的）",
            addr=addr,
            port=port,
        )
        return _verdict("inconclusive", [line] + evidence)
    if facts.get("master_addr") is None and _multi_node(i):
        line = i.t(
            "MASTER_ADDR is not set while the job spans several nodes: torchrun's default 127.0.0.1 works on one node only",
            "任务跨多个节点，却没有设置 MASTER_ADDR：torchrun 默认的 127.0.0.1 只在单机上可用",
        )
        return _verdict("inconclusive", [line] + evidence)
    works = _endpoint_works(i, facts)
    if works and not evidence:
        return _verdict("ruled_out", works)
    return (
        _verdict("inconclusive", works + evidence)
        if works or evidence
        else _undecided(i, ("rendezvous",), [])
    )


def _endpoint_problem(i: Inputs, facts: dict) -> str | None:
    addr, port = facts.get("addr"), facts.get("port")
    if facts.get("resolve_error"):
        return i.t(
            "MASTER_ADDR {addr} does not resolve here: {error}",
            "本机解析不了 MASTER_ADDR {addr}：{error}",
            addr=addr,
            error=facts["resolve_error"],
        )
    if facts.get("port") is None:
        return i.t(
            "MASTER_PORT {value!r} is not a port number",
            "MASTER_PORT {value!r} 不是合法端口号",
            value=facts.get("master_port"),
        )
    if facts.get("connect") not in (None, "ok", "refused"):
        return i.t(
            "cannot reach {addr}:{port} from here: {result}",
            "从本机连不上 {addr}:{port}：{result}",
            addr=addr,
            port=port,
            result=facts["connect"],
        )
    if facts.get("loopback") and _multi_node(i):
        return i.t(
            "MASTER_ADDR {addr} resolves to {ips} (loopback) while the job spans several nodes: other nodes cannot reach it",
            "MASTER_ADDR {addr} 解析成 {ips}（回环地址），而任务跨多个节点：其他节点连不上",
            addr=addr,
            ips=", ".join(facts.get("resolved") or []),
        )
    store = facts.get("store") or {}
    if store.get("result") == "failed":
        return i.t(
            "a TCPStore round trip on {addr}:{port} fails: {error}",
            "在 {addr}:{port} 上的 TCPStore 读写失败：{error}",
            addr=addr,
            port=port,
            error=_quote(store.get("error") or "?", 100),
        )
    return None


def _endpoint_works(i: Inputs, facts: dict) -> list[str]:
    addr, port = facts.get("addr"), facts.get("port")
    lines = []
    if facts.get("master_addr") is None:
        lines.append(
            i.t(
                "MASTER_ADDR is not set: torchrun uses 127.0.0.1, which serves a single node",
                "没有设置 MASTER_ADDR：torchrun 会用 127.0.0.1，只适用于单机",
            )
        )
    if (facts.get("store") or {}).get("result") == "ok":
        resolved = facts.get("resolved") or []
        if resolved != [addr]:
            lines.append(
                i.t(
                    "{addr} resolves to {ips}",
                    "{addr} 解析为 {ips}",
                    addr=addr,
                    ips=", ".join(resolved),
                )
            )
        lines.append(
            i.t(
                "a TCPStore round trip on {addr}:{port} works",
                "在 {addr}:{port} 上的 TCPStore 读写正常",
                addr=addr,
                port=port,
            )
        )
    elif facts.get("connect") == "ok":
        lines.append(
            i.t(
                "{addr}:{port} accepts connections from here",
                "从本机能连上 {addr}:{port}",
                addr=addr,
                port=port,
            )
        )
    return lines


# --- versions -------------------------------------------------------------------


@judges("nccl-version-mismatch")
def _nccl_version_mismatch(i: Inputs) -> Verdict:
    records = i.facts("versions")
    evidence = []
    if i.error_match(DRIVER_OLD) or i.error_match(NO_KERNEL):
        line = i.t("the error: {error}", "报错：{error}", error=_quote(i.error_text(), 120))
        return _verdict(
            "confirmed", [line] + [p for r in records for p in _version_problems(i, r["facts"])]
        )
    if i.error_match(NCCL_CUDA_ERROR):
        evidence.append(
            i.t(
                "'unhandled cuda error' from NCCL often hides a driver or version mismatch",
                "NCCL 的 'unhandled cuda error' 常常掩盖了驱动或版本不匹配",
            )
        )
    if not records:
        return _undecided(i, ("versions",), evidence)
    problems = _differences(i, records)
    for record in _by_host(records).values():
        problems.extend(_version_problems(i, record[0]["facts"]))
    if problems:
        return _verdict("confirmed", problems + evidence)
    facts = records[0]["facts"]
    if not facts.get("torch_cuda"):
        return _verdict(
            "not_applicable",
            [i.t("this torch is a CPU-only build", "这个 torch 是只支持 CPU 的版本")],
        )
    if not facts.get("driver"):
        return _verdict("not_applicable", [i.t("no NVIDIA driver found", "没有找到 NVIDIA 驱动")])
    lines = [
        i.t(
            "torch {torch} (CUDA {cuda}, NCCL {nccl}) and driver {driver} (CUDA {driver_cuda}) match",
            "torch {torch}（CUDA {cuda}，NCCL {nccl}）与驱动 {driver}（CUDA {driver_cuda}）匹配",
            torch=facts.get("torch"),
            cuda=facts.get("torch_cuda"),
            nccl=facts.get("nccl"),
            driver=facts.get("driver"),
            driver_cuda=facts.get("driver_cuda") or "?",
        )
    ]
    capabilities = sorted(set(facts.get("capabilities") or []))
    if capabilities:
        lines.append(
            i.t(
                "torch has kernels for compute capability {caps}",
                "torch 带有算力 {caps} 的内核",
                caps=", ".join(capabilities),
            )
        )
    return _verdict("ruled_out", lines + evidence)


def _differences(i: Inputs, records: list[dict]) -> list[str]:
    """Versions that differ between ranks (nodes run different software)."""
    lines = []
    for key, label in (
        ("torch", "torch"),
        ("torch_cuda", "CUDA"),
        ("nccl", "NCCL"),
        ("driver", "driver"),
    ):
        values = {}
        for record in records:
            values.setdefault(record["facts"].get(key), record.get("host"))
        if len(values) > 1:
            lines.append(
                i.t(
                    "{label} differs between nodes: {values}",
                    "各节点的 {label} 版本不同：{values}",
                    label=label,
                    values=", ".join(f"{host}: {value}" for value, host in values.items()),
                )
            )
    return lines


def _version_problems(i: Inputs, facts: dict) -> list[str]:
    problems = []
    runtime = _version(facts.get("torch_cuda"))
    if facts.get("cuda_warning") and "too old" in facts["cuda_warning"]:
        problems.append(
            i.t(
                "CUDA initialisation says: {warning}",
                "CUDA 初始化提示：{warning}",
                warning=_quote(facts["cuda_warning"], 140),
            )
        )
    driver_cuda = _version(facts.get("driver_cuda"))
    if runtime and driver_cuda and driver_cuda[0] < runtime[0]:
        problems.append(
            i.t(
                "driver {driver} supports CUDA up to {driver_cuda}, but torch uses the CUDA {runtime} runtime",
                "驱动 {driver} 最高支持 CUDA {driver_cuda}，而 torch 用的是 CUDA {runtime} 运行时",
                driver=facts.get("driver") or "?",
                driver_cuda=facts.get("driver_cuda"),
                runtime=facts.get("torch_cuda"),
            )
        )
    elif runtime and facts.get("driver") and not driver_cuda:
        minimum = MIN_DRIVER.get(runtime[0])
        if minimum and _version(facts["driver"]) < minimum:
            problems.append(
                i.t(
                    "driver {driver} is older than {minimum}, the minimum for CUDA {runtime}",
                    "驱动 {driver} 低于 CUDA {runtime} 要求的最低版本 {minimum}",
                    driver=facts["driver"],
                    minimum=".".join(map(str, minimum)),
                    runtime=facts.get("torch_cuda"),
                )
            )
    for capability in sorted(set(facts.get("capabilities") or [])):
        if _arch_supported(capability, facts.get("arch_list") or []) is False:
            problems.append(
                i.t(
                    "this torch has no kernels for compute capability {cap} (it has {archs}): 'no kernel image is available'",
                    "这个 torch 没有算力 {cap} 的内核（只有 {archs}）：会报 'no kernel image is available'",
                    cap=capability,
                    archs=" ".join(facts.get("arch_list") or []),
                )
            )
    return problems


def _arch_supported(capability: str, arch_list: list[str]) -> bool | None:
    """Whether a GPU of this capability can run torch's kernels.

    A cubin for sm_XY runs on the same major version with an equal or higher
    minor; PTX (compute_XY) is compiled for any newer GPU; 'a'-suffixed
    architectures run only on exactly that GPU.
    """
    cap = _version(capability)
    if len(cap) < 2 or not arch_list:
        return None
    for arch in arch_list:
        match = re.fullmatch(r"(sm|compute)_(\d+)(\d)([a-z]?)", arch)
        if not match:
            continue
        kind, major, minor, suffix = (
            match.group(1),
            int(match.group(2)),
            int(match.group(3)),
            match.group(4),
        )
        if suffix:  # 'a'/'f' architectures run on exactly that GPU
            supported = (major, minor) == cap[:2]
        elif kind == "sm":
            supported = major == cap[0] and minor <= cap[1]
        else:  # PTX, compiled by the driver for newer GPUs
            supported = (major, minor) <= cap[:2]
        if supported:
            return True
    return False


# --- system -----------------------------------------------------------------------


@judges("shm-too-small")
def _shm_too_small(i: Inputs) -> Verdict:
    records = i.facts("system")
    said = i.error_match(SHM_ERROR)
    evidence = []
    if said:
        evidence.append(
            i.t(
                "the error points at shared memory: {error}",
                "报错指向共享内存：{error}",
                error=_quote(i.error_text(), 120),
            )
        )
    if not records:
        return _undecided(i, ("system",), evidence)
    shm = records[0]["facts"].get("shm")
    if not shm:
        return _verdict(
            "not_applicable", [i.t("no /dev/shm on this system", "本系统没有 /dev/shm")] + evidence
        )
    size = i.t(
        "/dev/shm is {total} MiB ({free} MiB free)",
        "/dev/shm 大小 {total} MiB（空闲 {free} MiB）",
        total=shm["total_mib"],
        free=shm["free_mib"],
    )
    if shm["total_mib"] < SHM_CONFIRM_MIB or shm["free_mib"] < SHM_FREE_CONFIRM_MIB:
        fix = i.t(
            "NCCL and DataLoader workers need more: run the container with --shm-size=16g or --ipc=host",
            "NCCL 和 DataLoader worker 需要更多：用 --shm-size=16g 或 --ipc=host 启动容器",
        )
        return _verdict("confirmed", [size, fix] + evidence)
    if shm["total_mib"] < SHM_DOUBT_MIB:
        return _verdict("confirmed" if said else "inconclusive", [size] + evidence)
    return _verdict("inconclusive" if said else "ruled_out", [size] + evidence)


@judges("network-interface")
def _network_interface(i: Inputs) -> Verdict:
    records = i.facts("system")
    evidence = []
    if i.error_match(NETWORK):
        evidence.append(
            i.t("the error: {error}", "报错：{error}", error=_quote(i.error_text(), 120))
        )
    if not records:
        return _verdict("confirmed", evidence) if evidence else _undecided(i, ("system",), [])
    problems, notes = [], []
    for record in _by_host(records).values():
        found, seen = _interface_findings(i, record[0]["facts"])
        problems.extend(found)
        notes.extend(seen)
    if problems or evidence:
        return _verdict("confirmed", problems + evidence + notes)
    if any(r["facts"].get("hostname_loopback") for r in records):
        return _verdict("inconclusive", notes)
    return _verdict("ruled_out", notes)


def _interface_findings(i: Inputs, facts: dict) -> tuple[list[str], list[str]]:
    """(problems, neutral notes) about the interfaces NCCL and gloo would use on a host."""
    problems, notes = [], []
    env = facts.get("env") or {}
    names = ", ".join(n["name"] for n in facts.get("interfaces") or []) or "-"
    multi = _multi_node(i)
    for var, key in (
        ("NCCL_SOCKET_IFNAME", "nccl_selected"),
        ("GLOO_SOCKET_IFNAME", "gloo_selected"),
    ):
        if env.get(var) and not facts.get(key):
            problems.append(
                i.t(
                    "{var}={value} matches no usable interface here (have: {names})",
                    "{var}={value} 在本机匹配不到可用网卡（现有：{names}）",
                    var=var,
                    value=env[var],
                    names=names,
                )
            )
    nccl = facts.get("nccl_selected") or []
    loopbacks = {n["name"] for n in facts.get("interfaces") or [] if n.get("loopback")}
    if nccl and set(nccl) <= loopbacks and multi:
        problems.append(
            i.t(
                "NCCL would use only {nics} (loopback) while the job spans several nodes",
                "任务跨多个节点，但 NCCL 只会用 {nics}（回环网卡）",
                nics=", ".join(nccl),
            )
        )
    if nccl:
        notes.append(i.t("NCCL would use {nics}", "NCCL 会使用 {nics}", nics=", ".join(nccl)))
    if facts.get("hostname_loopback") and not env.get("GLOO_SOCKET_IFNAME"):
        line = i.t(
            "hostname {host} resolves to {ips} (loopback): gloo binds there, so other nodes cannot connect; set GLOO_SOCKET_IFNAME for multi-node runs",
            "主机名 {host} 解析成 {ips}（回环地址）：gloo 会绑定到这里，其他节点连不上；多机训练请设置 GLOO_SOCKET_IFNAME",
            host=facts.get("hostname"),
            ips=", ".join(facts.get("hostname_addresses") or []),
        )
        (problems if multi else notes).append(line)
    elif facts.get("gloo_selected"):
        notes.append(
            i.t(
                "gloo would use {nics}",
                "gloo 会使用 {nics}",
                nics=", ".join(facts["gloo_selected"]),
            )
        )
    elif facts.get("hostname_addresses"):
        notes.append(
            i.t(
                "gloo binds to the hostname's address {ips}",
                "gloo 会绑定到主机名对应的地址 {ips}",
                ips=", ".join(facts["hostname_addresses"]),
            )
        )
    return problems, notes


@judges("oom-killed")
def _oom_killed(i: Inputs) -> Verdict:
    said = i.error_match(OOM_KILLED)
    evidence = []
    if said:
        evidence.append(
            i.t(
                "the error shows a SIGKILL: {error}",
                "报错显示进程被 SIGKILL：{error}",
                error=_quote(i.error_text(), 120),
            )
        )
    records = i.facts("system")
    if not records:
        return _undecided(i, ("system",), evidence)
    facts = records[0]["facts"]
    oom = facts.get("oom") or {}
    kernel, cgroup = oom.get("vmstat_oom_kill"), oom.get("cgroup_oom_kill")
    memory = facts.get("memory") or {}
    if memory.get("total_mib"):
        evidence.append(
            i.t(
                "{available} MiB of {total} MiB host memory available now",
                "主机内存当前可用 {available} MiB，共 {total} MiB",
                available=memory.get("available_mib"),
                total=memory.get("total_mib"),
            )
        )
    kills = (kernel or 0) + (cgroup or 0)
    if kills:
        line = i.t(
            "the OOM killer has killed processes here (kernel count {kernel}, this cgroup {cgroup})",
            "OOM killer 在本机杀过进程（内核计数 {kernel}，本 cgroup {cgroup}）",
            kernel=kernel,
            cgroup=cgroup,
        )
        return _verdict("confirmed" if said else "inconclusive", [line] + evidence)
    if kernel is None and cgroup is None:
        return _verdict(
            "inconclusive",
            evidence
            + [i.t("the OOM-kill counters are not readable here", "本机读不到 OOM kill 计数")],
        )
    line = i.t(
        "the OOM killer has killed nothing since boot",
        "开机以来 OOM killer 没有杀过任何进程",
    )
    if said:
        line += i.t(
            ": the SIGKILL came from elsewhere (a scheduler limit, a timeout, a person)",
            "：SIGKILL 来自别处（调度器限制、超时或人为）",
        )
    return _verdict("ruled_out", [line] + evidence)


# --- applying verdicts to a result -----------------------------------------------------


def apply_verdicts(result: Result, runs: list[ProbeRun], findings: list[Finding]) -> Result:
    """Judge every cause of a result, mark the advice this machine settles, re-rank.

    Answers whose advice the probes refute get stance "refuted_here", those
    whose advice works where another fails "confirmed_here". Causes are then
    sorted stably by VERDICT_RANK (confirmed first, ruled_out last).
    """
    by_name = {run.name: run for run in runs}
    refuted, confirmed = advice_outcomes(by_name)
    for cause in result.causes:
        cause.verdict = judge(cause.id, by_name, result.root_error, findings, result.lang)
        refuted |= set(cause.verdict.refutes)
    for cause in result.causes:
        for answer in cause.answers:
            if answer.advice and answer.advice in refuted:
                answer.stance = "refuted_here"
            elif answer.advice and answer.advice in confirmed:
                answer.stance = "confirmed_here"
    best = max((c.score for c in result.causes), default=0.0)
    result.causes = sorted(result.causes, key=lambda c: _rerank_group(c, best))
    result.probes = list(runs)
    return result


# A confirmed cause rises only when retrieval also found it relevant: a fact
# true of this machine (no GPU here, say) must not push aside the cause the
# error text points to.
RISE_FLOOR = 0.5


def _rerank_group(cause: CauseResult, best_score: float) -> int:
    group = VERDICT_RANK.get(cause.verdict.verdict, 1)
    if cause.verdict.verdict == "confirmed" and cause.score < RISE_FLOOR * best_score:
        return VERDICT_RANK["inconclusive"]
    return group


def probes_for(causes: list[CauseResult], limit: int | None = None) -> list[str]:
    """The registered probes linked to the first `limit` causes (all by default).

    Deduplicated, in the order the causes and their probe lists give them.
    """
    chosen = causes if limit is None else causes[:limit]
    names = [name for cause in chosen for name in cause.probes if name in PROBES]
    return list(dict.fromkeys(names))
