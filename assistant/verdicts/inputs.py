"""Shared inputs of every verdict: the Inputs dataclass, thresholds, small
helpers, and the registry of verdict functions (judges, judge).

Error patterns are not here: whether the error text names a cause is asked
of the KB's signatures (Inputs.error_names, see verdicts/signatures.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from assistant.knowledge.patterns import PatternSet
from assistant.probing.protocol import RankRecord
from assistant.results import Finding, ProbeRun, RootError, Verdict, VerdictSource
from assistant.verdicts.signatures import Signatures, compiled, kb_signatures, patterns_of

USABLE = ("ok", "failed", "not_applicable")
TROUBLE = ("timeout", "error", "interrupted")

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
# Without a root error the question itself is searched (a pasted sentence);
# a huge log is cut like retrieval cuts it.
QUERY_SCAN_CHARS = 400_000
# Every evidence line read from the error text starts with one of these, so a
# reader never takes it for something tested on this machine.
ERROR_WORDS = ("the error", "报错")


# --- the inputs of a judgement -------------------------------------------------


@dataclass(frozen=True)
class Inputs:
    """Everything a verdict function may look at, and helpers to read it.

    `signatures` are the KB's (cause id -> regex sources); None reads them
    from the KB files on the first error lookup. `query` is the question as
    pasted: searched for error text only when no root error was found in it.
    """

    runs: dict[str, ProbeRun]
    root_error: RootError | None
    findings: list[Finding] = field(default_factory=list)
    lang: str = "en"
    signatures: Signatures | None = None
    query: str = ""

    def t(self, en: str, zh: str, **values) -> str:
        """One evidence line in the user's language."""
        return (zh if self.lang == "zh" else en).format(**values)

    def error_text(self) -> str:
        """The text the error patterns search: the root error, else the question."""
        if self.root_error is not None:
            return f"{self.root_error.type}: {self.root_error.message}"
        return self.query[:QUERY_SCAN_CHARS]

    def signature_set(self, *cause_ids: str) -> PatternSet:
        """The KB signatures of these causes, compiled (all causes when none are named)."""
        signatures = self.signatures if self.signatures is not None else kb_signatures()
        return compiled(patterns_of(signatures, cause_ids or tuple(signatures)))

    def error_names(self, *cause_ids: str):
        """The match (.group(), .groups()) of any of these causes' KB signatures in
        the error text, or None."""
        text = self.error_text()
        return self.signature_set(*cause_ids).search(text) if text and cause_ids else None

    def quoted_error(self, limit: int = 120) -> str:
        """The error as evidence quotes it: the root error, else the question's line
        that the signatures matched (or its first line)."""
        if self.root_error is not None or not self.query:
            return quote(self.error_text(), limit)
        lines = [line for line in self.query.splitlines() if line.strip()] or [""]
        named = self.signature_set()
        return quote(next((line for line in lines if named.search(line)), lines[0]), limit)

    def error_line(self, en: str = "the error says: {error}", zh: str = "报错：{error}") -> str:
        """An evidence line quoting the error, in the user's language.

        Templates must start with "the error" / "报错" (ERROR_WORDS): the
        line is about the pasted text, not about this machine.
        """
        return self.t(en, zh, error=self.quoted_error())

    def error_says(
        self, cause_id: str, en: str = "the error says: {error}", zh: str = "报错：{error}"
    ) -> list[str]:
        """[error_line(en, zh)] when the error text names this cause, else []."""
        return [self.error_line(en, zh)] if self.error_names(cause_id) else []

    def records(self, probe: str) -> list[dict] | None:
        """The per-rank records of a probe that ran to an answer, else None."""
        run = self.runs.get(probe)
        if run is None or run.status not in USABLE or not run.ranks:
            return None
        return [r for r in run.ranks if r.get("status") in USABLE]

    def facts(self, probe: str, with_status: tuple[str, ...] = ("ok", "failed")) -> list[dict]:
        """The records of a probe's ranks whose own status is one of with_status."""
        return [r for r in self.records(probe) or [] if r["status"] in with_status]

    def typed(
        self, probe: str, with_status: tuple[str, ...] = ("ok", "failed")
    ) -> list[RankRecord]:
        """facts() as the probe protocol's typed records (rank, host, facts fields)."""
        return [RankRecord.from_dict(r) for r in self.facts(probe, with_status)]

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


def verdict(
    value: str,
    evidence: list[str],
    refutes: list[str] | None = None,
    source: VerdictSource | None = None,
) -> Verdict:
    """A verdict with its evidence (blank and repeated lines dropped) and its source.

    Every judged verdict says what decided it: "probe" (facts of this
    machine), "error" (the error text) or "script" (a lint finding); only
    not_run has none.
    """
    if (value == "not_run") != (source is None):
        raise ValueError(f"a {value} verdict with source {source!r}")
    seen: list[str] = []
    for line in evidence:
        line = " ".join(str(line).split())
        if line and line not in seen:
            seen.append(line)
    return Verdict(value, seen, list(refutes or []), source)


def undecided(i: Inputs, probes: tuple[str, ...], evidence: list[str]) -> Verdict:
    """Inconclusive when there is something to say, else not_run.

    Its source is "error" when every line is the error's own (they start
    with ERROR_WORDS), else "probe": a fact of this machine, or a probe's
    trouble, is part of it.
    """
    evidence = evidence + i.trouble(*probes)
    if not evidence:  # nothing bears on it, whether or not the probes ran
        return not_run()
    only_error = evidence and all(line.startswith(ERROR_WORDS) for line in evidence)
    return verdict("inconclusive", evidence, source="error" if only_error else "probe")


def kept_open(said: list[str], found: Verdict) -> Verdict:
    """This machine's verdict `found` beside the error lines `said` that name the cause.

    The error is the failing job's own word, and this machine may not be
    where it ran: a fact here that rules the cause out (or cannot judge it)
    leaves it inconclusive, with both as evidence. With nothing from the
    machine the error's words stand alone; otherwise they are added.
    """
    if not said:
        return found
    if found.verdict in ("ruled_out", "not_applicable", "not_run"):
        return verdict("inconclusive", said + found.evidence, found.refutes, source="error")
    return verdict(found.verdict, found.evidence + said, found.refutes, source=found.source)


def quote(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def gist(error: str, limit: int = 120) -> str:
    """The informative part of a long CUDA or NCCL error message.

    NCCL puts the reason after "Last error:"; CUDA appends advice about
    asynchronous kernel errors that says nothing about the cause.
    """
    text = " ".join(error.split()).split(" CUDA kernel errors might")[0]
    if "Last error:" in text:
        code = re.search(r"\bnccl[A-Z]\w+", text)  # NCCL's result code, e.g. ncclInvalidUsage
        reason = text.split("Last error:", 1)[1].strip()
        text = f"{code.group(0)}: {reason}" if code else reason
    return quote(text, limit)


def short(uuid: str | None) -> str:
    return (uuid or "?")[:12]


def by_host(records: list[dict]) -> dict[str, list[dict]]:
    hosts: dict[str, list[dict]] = {}
    for record in sorted(records, key=lambda r: r.get("rank") or 0):
        hosts.setdefault(record.get("host") or "?", []).append(record)
    return hosts


def as_int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def version_tuple(text: str | None) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text or ""))


def multi_node(i: Inputs) -> bool:
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
            if (as_int(values.get(key)) or 0) > 1:
                return True
        if (as_int(values.get("NODE_RANK")) or 0) > 0:
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
    signatures: Signatures | None = None,
    query: str = "",
) -> Verdict:
    """The verdict on one cause. A finding in the user's script confirms it.

    `signatures`: the KB's (None: read from the KB files when an error is
    looked up); `query`: the question, searched when there is no root error.
    """
    inputs = Inputs(runs, root_error, list(findings), lang, signatures, query)
    found = JUDGES.get(cause_id, no_probe)(inputs)
    own = [f for f in findings if f.cause_id == cause_id]
    if not own:
        return found
    lines = [finding_line(inputs, f) for f in own]
    # What `assistant run` saw in the running job (a hang's stacks) is
    # observed on this machine, like a probe's fact; a lint finding is static.
    observed = any(f.source == "probe" for f in own)
    confirmed = verdict(
        "confirmed", lines + found.evidence, found.refutes, source="probe" if observed else "script"
    )
    confirmed.from_job = observed
    return confirmed


# A finding's evidence line, by where it was seen (Finding.source): English, Chinese.
FINDING_LINES = {
    "script": ("script {where}: {message}", "脚本 {where}：{message}"),
    "question": (
        "the code in the question, {where}: {message}",
        "问题里贴出的代码，{where}：{message}",
    ),
    "probe": ("the running job, {where}: {message}", "运行中的作业，{where}：{message}"),
}


def finding_line(i: Inputs, finding: Finding) -> str:
    where = (
        f"{finding.path}:{finding.line}"
        if finding.path
        else i.t("line {n}", "第 {n} 行", n=finding.line)
    )
    english, chinese = FINDING_LINES.get(finding.source, FINDING_LINES["script"])
    return i.t(english, chinese, where=where, message=finding.message)


def no_probe(i: Inputs) -> Verdict:
    """Causes no probe can decide: only a finding (handled by judge) confirms."""
    return not_run()


def not_run() -> Verdict:
    # A fresh object each time: callers may extend a verdict's evidence.
    return Verdict("not_run")


def by_error(cause_id: str, en: str, zh: str, value: str = "confirmed") -> Judge:
    """A verdict function for a cause only the error text can decide.

    The cause's own KB signatures decide whether the error names it; the
    templates start with "the error" / "报错" and may quote it as {error}.
    `value` is the verdict then: "inconclusive" for an error that only
    points at the cause (uneven-inputs).
    """

    def decide(i: Inputs) -> Verdict:
        if i.error_names(cause_id):
            return verdict(value, [i.error_line(en, zh)], source="error")
        return not_run()

    return decide
