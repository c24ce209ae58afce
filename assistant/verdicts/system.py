"""Verdicts on the system: shared memory, network interfaces, the OOM killer."""

from __future__ import annotations

from assistant.results import Verdict
from assistant.verdicts.inputs import (
    SHM_CONFIRM_MIB,
    SHM_DOUBT_MIB,
    SHM_FREE_CONFIRM_MIB,
    Inputs,
    by_host,
    judges,
    multi_node,
    undecided,
    verdict,
)

# --- system -----------------------------------------------------------------------


@judges("shm-too-small")
def shm_too_small(i: Inputs) -> Verdict:
    records = i.facts("system")
    said = i.error_says(
        "shm-too-small", "the error points at shared memory: {error}", "报错指向共享内存：{error}"
    )
    if not records:
        return undecided(i, ("system",), said)
    shm = records[0]["facts"].get("shm")
    if not shm:
        return verdict(
            "not_applicable",
            [i.t("no /dev/shm on this system", "本系统没有 /dev/shm")] + said,
            source="probe",
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
        return verdict("confirmed", [size, fix] + said, source="probe")
    if shm["total_mib"] < SHM_DOUBT_MIB:
        return verdict("confirmed" if said else "inconclusive", [size] + said, source="probe")
    return verdict("inconclusive" if said else "ruled_out", [size] + said, source="probe")


@judges("network-interface")
def network_interface(i: Inputs) -> Verdict:
    records = i.facts("system")
    evidence = i.error_says("network-interface")
    if not records:
        if evidence:
            return verdict("confirmed", evidence, source="error")
        return undecided(i, ("system",), [])
    problems, notes = [], []
    for record in by_host(records).values():
        found, seen = _interface_findings(i, record[0]["facts"])
        problems.extend(found)
        notes.extend(seen)
    if problems:
        return verdict("confirmed", problems + evidence + notes, source="probe")
    if evidence:
        return verdict("confirmed", evidence + notes, source="error")
    if any(r["facts"].get("hostname_loopback") for r in records):
        return verdict("inconclusive", notes, source="probe")
    return verdict("ruled_out", notes, source="probe")


def _interface_findings(i: Inputs, facts: dict) -> tuple[list[str], list[str]]:
    """(problems, neutral notes) about the interfaces NCCL and gloo would use on a host."""
    problems, notes = [], []
    env = facts.get("env") or {}
    names = ", ".join(n["name"] for n in facts.get("interfaces") or []) or "-"
    multi = multi_node(i)
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
def oom_killed(i: Inputs) -> Verdict:
    said = i.error_names("oom-killed")
    evidence = []
    if said:
        evidence.append(
            i.error_line("the error shows a SIGKILL: {error}", "报错显示进程被 SIGKILL：{error}")
        )
    records = i.facts("system")
    if not records:
        return undecided(i, ("system",), evidence)
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
        return verdict("confirmed" if said else "inconclusive", [line] + evidence, source="probe")
    if kernel is None and cgroup is None:
        return verdict(
            "inconclusive",
            evidence
            + [i.t("the OOM-kill counters are not readable here", "本机读不到 OOM kill 计数")],
            source="probe",
        )
    line = i.t(
        "the OOM killer has killed nothing here since boot",
        "本机开机以来 OOM killer 没有杀过任何进程",
    )
    if not said:
        return verdict("ruled_out", [line] + evidence, source="probe")
    # The error may come from another node: a SIGKILL there stays open.
    line += i.t(
        ": if the job ran here, the SIGKILL came from elsewhere (a scheduler limit, a timeout, a person)",
        "：如果任务跑在本机，SIGKILL 来自别处（调度器限制、超时或人为）",
    )
    return verdict("inconclusive", [line] + evidence, source="probe")


@judges("leftover-processes")
def leftover_processes(i: Inputs) -> Verdict:
    # Facts recorded before the probe looked for stale workers say nothing.
    records = [r for r in i.facts("system") if "stale_workers" in r["facts"]]
    if not records:
        return undecided(i, ("system",), [])
    stale = [
        (host, worker)
        for host, host_records in by_host(records).items()
        for worker in host_records[0]["facts"]["stale_workers"] or []
    ]
    if stale:
        shown = ", ".join(
            f"{host}: pid {w['pid']} ({w['cmdline'][:60] or '?'}"
            + (", orphaned" if w["orphaned"] else "")
            + ")"
            for host, w in stale[:3]
        )
        line = i.t(
            "{count} worker(s) of another distributed run are still alive here, holding their GPU memory and ports: {shown}; end them (kill PID) before the next launch",
            "本机还有 {count} 个其他分布式任务的 worker 进程活着，占着显存和端口：{shown}；下次启动前先结束它们（kill PID）",
            count=len(stale),
            shown=shown,
        )
        return verdict("confirmed", [line], source="probe")
    if all(record["facts"]["stale_workers"] is None for record in records):
        line = i.t(
            "this system has no /proc to look for workers of earlier runs",
            "本系统没有 /proc，无法查找之前运行留下的 worker 进程",
        )
        return verdict("not_applicable", [line], source="probe")
    line = i.t(
        "no worker of another distributed run is alive here now",
        "本机现在没有其他分布式任务的 worker 进程还活着",
    )
    return verdict("ruled_out", [line], source="probe")
