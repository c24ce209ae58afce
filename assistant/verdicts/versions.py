"""Verdicts on versions: NCCL, driver, CUDA and GPU architecture."""

from __future__ import annotations

import re

from assistant.probing.protocol import RankRecord, VersionsFacts
from assistant.results import Verdict
from assistant.verdicts.inputs import (
    MIN_DRIVER,
    Inputs,
    judges,
    quote,
    undecided,
    verdict,
    version_tuple,
)

# The versions compared between ranks and nodes: (VersionsFacts field, name shown).
VERSION_KEYS = (("torch", "torch"), ("torch_cuda", "CUDA"), ("nccl", "NCCL"), ("driver", "driver"))

# --- versions -------------------------------------------------------------------


@judges("nccl-version-mismatch")
def nccl_version_mismatch(i: Inputs) -> Verdict:
    # The KB's signatures for this cause name specific failures (no kernel image
    # for this GPU, an incompatible compute capability, an old driver); even
    # then the error only points here and the versions probe decides.
    records = i.typed("versions")
    said = i.error_says(
        "nccl-version-mismatch",
        "the error is one a driver, CUDA or NCCL version mismatch gives: {error}",
        "报错是驱动、CUDA 或 NCCL 版本不匹配时常见的：{error}",
    )
    if not records:
        return undecided(i, ("versions",), said)
    problems = _differences(i, records)
    for first in _first_per_host(records):
        problems.extend(_version_problems(i, first.facts))
    if problems:
        return verdict("confirmed", problems + said, source="probe")
    facts = records[0].facts
    unjudgeable = _nothing_to_compare(i, facts)
    if unjudgeable:
        # Nothing here to compare; a version error pasted from a GPU machine stays open.
        return verdict(
            "inconclusive" if said else "not_applicable", said + unjudgeable, source="probe"
        )
    lines = [
        i.t(
            "torch {torch} (CUDA {cuda}, NCCL {nccl}) and driver {driver} (CUDA {driver_cuda}) match here",
            "本机 torch {torch}（CUDA {cuda}，NCCL {nccl}）与驱动 {driver}（CUDA {driver_cuda}）匹配",
            torch=facts.torch,
            cuda=facts.torch_cuda,
            nccl=facts.nccl,
            driver=facts.driver,
            driver_cuda=facts.driver_cuda or "?",
        )
    ]
    capabilities = sorted(set(facts.capabilities))
    if capabilities:
        lines.append(
            i.t(
                "torch has kernels for compute capability {caps}",
                "torch 带有算力 {caps} 的内核",
                caps=", ".join(capabilities),
            )
        )
    if said:
        return verdict("inconclusive", said + lines, source="probe")
    return verdict("ruled_out", lines, source="probe")


def _nothing_to_compare(i: Inputs, facts: VersionsFacts) -> list[str]:
    """Why this machine has no GPU versions to compare, or []."""
    if not facts.torch_cuda:
        return [i.t("this torch is a CPU-only build", "这个 torch 是只支持 CPU 的版本")]
    if not facts.driver:
        return [i.t("no NVIDIA driver found", "没有找到 NVIDIA 驱动")]
    return []


def _first_per_host(records: list[RankRecord]) -> list[RankRecord]:
    """The lowest rank's record of each host (a host's ranks share its software)."""
    first: dict[str | None, RankRecord] = {}
    for record in sorted(records, key=lambda r: r.rank or 0):
        first.setdefault(record.host, record)
    return list(first.values())


def _differences(i: Inputs, records: list[RankRecord]) -> list[str]:
    """Versions that differ between ranks (nodes run different software)."""
    lines = []
    for key, label in VERSION_KEYS:
        values = {}
        for record in records:
            values.setdefault(getattr(record.facts, key), record.host)
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


def _version_problems(i: Inputs, facts: VersionsFacts) -> list[str]:
    problems = []
    runtime = version_tuple(facts.torch_cuda)
    if facts.cuda_warning and "too old" in facts.cuda_warning:
        problems.append(
            i.t(
                "CUDA initialisation says: {warning}",
                "CUDA 初始化提示：{warning}",
                warning=quote(facts.cuda_warning, 140),
            )
        )
    driver_cuda = version_tuple(facts.driver_cuda)
    if runtime and driver_cuda and driver_cuda[0] < runtime[0]:
        problems.append(
            i.t(
                "driver {driver} supports CUDA up to {driver_cuda}, but torch uses the CUDA {runtime} runtime",
                "驱动 {driver} 最高支持 CUDA {driver_cuda}，而 torch 用的是 CUDA {runtime} 运行时",
                driver=facts.driver or "?",
                driver_cuda=facts.driver_cuda,
                runtime=facts.torch_cuda,
            )
        )
    elif runtime and facts.driver and not driver_cuda:
        minimum = MIN_DRIVER.get(runtime[0])
        if minimum and version_tuple(facts.driver) < minimum:
            problems.append(
                i.t(
                    "driver {driver} is older than {minimum}, the minimum for CUDA {runtime}",
                    "驱动 {driver} 低于 CUDA {runtime} 要求的最低版本 {minimum}",
                    driver=facts.driver,
                    minimum=".".join(map(str, minimum)),
                    runtime=facts.torch_cuda,
                )
            )
    for capability in sorted(set(facts.capabilities or [])):
        if arch_supported(capability, facts.arch_list or []) is False:
            problems.append(
                i.t(
                    "this torch has no kernels for compute capability {cap} (it has {archs}): 'no kernel image is available'",
                    "这个 torch 没有算力 {cap} 的内核（只有 {archs}）：会报 'no kernel image is available'",
                    cap=capability,
                    archs=" ".join(facts.arch_list or []),
                )
            )
    return problems


def arch_supported(capability: str, arch_list: list[str]) -> bool | None:
    """Whether a GPU of this capability can run torch's kernels.

    A cubin for sm_XY runs on the same major version with an equal or higher
    minor; PTX (compute_XY) is compiled for any newer GPU; 'a'-suffixed
    architectures run only on exactly that GPU.
    """
    cap = version_tuple(capability)
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
