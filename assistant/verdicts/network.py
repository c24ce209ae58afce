"""Verdicts on the rendezvous: the master port and the master endpoint."""

from __future__ import annotations

from assistant.results import Verdict
from assistant.verdicts.inputs import (
    Inputs,
    judges,
    multi_node,
    quote,
    undecided,
    verdict,
)

# --- rendezvous -------------------------------------------------------------------


def _endpoint_record(i: Inputs) -> dict | None:
    """The rendezvous facts of the rank that checked the endpoint (local rank 0)."""
    checked = [
        r for r in i.facts("rendezvous") if "port_free" in r["facts"] or "connect" in r["facts"]
    ]
    return checked[0] if checked else None


@judges("master-port-in-use")
def master_port_in_use(i: Inputs) -> Verdict:
    said = i.error_says(
        "master-port-in-use",
        "the error reports the port in use: {error}",
        "报错说端口已被占用：{error}",
    )
    evidence = list(said)
    record = _endpoint_record(i)
    if record is None:
        if said:
            return verdict("confirmed", evidence, source="error")
        return undecided(i, ("rendezvous",), evidence)
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
                cmd=quote(holder.get("cmdline") or "?", 80),
            )
            if holder
            else i.t("port {port} is in use on this host", "本机端口 {port} 已被占用", port=port)
        )
        return verdict("confirmed", [line] + evidence, source="probe")
    if facts.get("port_free") is True:
        line = i.t("port {port} is free now", "端口 {port} 现在是空闲的", port=port)
        if said:
            later = i.t(
                "so the process that held it has exited since",
                "所以当时占用它的进程已经退出了",
            )
            return verdict("confirmed", evidence + [line, later], source="error")
        return verdict("ruled_out", [line], source="probe")
    if "connect" in facts:
        evidence.append(
            i.t(
                "MASTER_ADDR {addr} is another host: the port is checked there, not here",
                "MASTER_ADDR {addr} 是另一台主机：端口要在那台机器上检查",
                addr=facts.get("addr"),
            )
        )
    if said:
        return verdict("confirmed", evidence, source="error")
    return verdict("inconclusive", evidence, source="probe")


@judges("master-endpoint-mismatch")
def master_endpoint_mismatch(i: Inputs) -> Verdict:
    records = i.facts("rendezvous")
    evidence = i.error_says("master-endpoint-mismatch")
    if not records:
        return undecided(i, ("rendezvous",), evidence)
    endpoints = {(r["facts"].get("addr"), r["facts"].get("port")) for r in records}
    if len(endpoints) > 1:
        line = i.t(
            "ranks use different endpoints: {endpoints}",
            "各 rank 用的地址不一致：{endpoints}",
            endpoints=", ".join(f"{a}:{p}" for a, p in sorted(endpoints, key=str)),
        )
        return verdict("confirmed", [line] + evidence, source="probe")
    facts = (_endpoint_record(i) or records[0])["facts"]
    addr, port = facts.get("addr"), facts.get("port")
    problem = _endpoint_problem(i, facts)
    if problem:
        return verdict("confirmed", [problem] + evidence, source="probe")
    if facts.get("connect") == "refused":
        line = i.t(
            "{addr}:{port} refuses connections now: nothing listens there (fine if the job is not running)",
            "{addr}:{port} 现在拒绝连接：没有进程在监听（如果任务没在跑，这是正常的）",
            addr=addr,
            port=port,
        )
        return verdict("inconclusive", [line] + evidence, source="probe")
    if facts.get("master_addr") is None and multi_node(i):
        line = i.t(
            "MASTER_ADDR is not set while the job spans several nodes: torchrun's default 127.0.0.1 works on one node only",
            "任务跨多个节点，却没有设置 MASTER_ADDR：torchrun 默认的 127.0.0.1 只在单机上可用",
        )
        return verdict("inconclusive", [line] + evidence, source="probe")
    works = _endpoint_works(i, facts)
    if works and not evidence:
        return verdict("ruled_out", works, source="probe")
    return (
        verdict("inconclusive", works + evidence, source="probe")
        if works or evidence
        else undecided(i, ("rendezvous",), [])
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
    if facts.get("loopback") and multi_node(i):
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
            error=quote(store.get("error") or "?", 100),
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
