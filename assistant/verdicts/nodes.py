"""Cross-node verdicts: what the nodes of a multi-node job show about each other.

The facts are the "nodes" run (`assistant doctor --nnodes N ...`, see
assistant/probing/multinode.py and probes/nodes.py): one record whose
NodesFacts lists every node that joined the rendezvous, each with its
versions, host name, interfaces, what it was told, and which of the other
nodes' addresses it reached.

findings() is a pure function of those facts: every problem and every
reassuring fact, each about one node (or the job), per cause. The causes
below keep their single-machine verdict functions; with a nodes run present
their judge is extended (extend_judge): a cross-node problem confirms the
cause and names the node, otherwise the machine's own verdict stands with
the cross-node facts added, and a cause the nodes cleared is ruled out.
node_verdicts() gives each node its own verdicts for `doctor --json`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from assistant.probing.protocol import NODES_PROBE, NodeFacts, NodesFacts
from assistant.results import ProbeRun, Verdict

# The areas whose judges are extended here register them on import.
from assistant.verdicts import launch, network, system, versions  # noqa: F401
from assistant.verdicts.inputs import JUDGES, Inputs, Judge, no_probe, not_run, verdict
from assistant.verdicts.versions import VERSION_KEYS

CROSS_NODE_CAUSES = (
    "nccl-version-mismatch",
    "network-interface",
    "master-endpoint-mismatch",
    "master-port-in-use",
    "world-size-mismatch",
    "checkpoint-on-node-local-disk",
)
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

Say = Callable[..., str]  # Inputs.t: (en, zh, **values) -> one line in the user's language


@dataclass(frozen=True)
class NodeFinding:
    """One cross-node fact about a cause: a problem or a reassurance, about one node.

    node_rank None: about the job as a whole.
    """

    cause_id: str
    node_rank: int | None
    problem: bool
    text: str
    # False for a check that could not be made (a folder a node could not write
    # in): no problem, but nothing ruled out either.
    settles: bool = True


def gathered(runs: dict[str, ProbeRun]) -> NodesFacts | None:
    """The nodes run's facts, or None when no nodes probe ran to an answer."""
    run = runs.get(NODES_PROBE)
    if run is None or run.status not in ("ok", "failed") or not run.ranks:
        return None
    return NodesFacts.from_dict(run.ranks[0].get("facts"))


def findings(facts: NodesFacts, say: Say) -> list[NodeFinding]:
    """Every cross-node finding, per cause (pure)."""
    return (
        version_findings(facts, say)
        + interface_findings(facts, say)
        + master_findings(facts, say)
        + size_findings(facts, say)
        + storage_findings(facts, say)
    )


# --- naming nodes -----------------------------------------------------------------


def label(node: NodeFacts) -> str:
    return f"node {node.node_rank} ({node.hostname or '?'})"


def separate_machines(facts: NodesFacts) -> bool:
    """Whether the nodes have network stacks of their own (loopback does not join them)."""
    ids = {node.network_id for node in facts.nodes}
    return len(ids) > 1 or None in ids


def odd_ones(values: dict[int, object]) -> list[int]:
    """Node ranks whose value differs from the most common one (ties: from the lowest rank's)."""
    counts = Counter(values.values())
    if len(counts) < 2:
        return []
    top = max(counts.values())
    lowest = min(values)
    usual = values[lowest] if counts[values[lowest]] == top else counts.most_common(1)[0][0]
    return sorted(rank for rank, value in values.items() if value != usual)


# --- versions -----------------------------------------------------------------------


def version_findings(facts: NodesFacts, say: Say) -> list[NodeFinding]:
    found = []
    by_rank = {node.node_rank: node for node in facts.nodes}
    for key, name in VERSION_KEYS:
        values = {node.node_rank: node.versions.get(key) for node in facts.nodes}
        for rank in odd_ones(values):
            others = ", ".join(
                f"{label(by_rank[r])}: {values[r]}" for r in sorted(values) if r != rank
            )
            text = say(
                "{node} has {name} {value}, unlike {others}",
                "{node} 的 {name} 是 {value}，与其他节点不同（{others}）",
                node=label(by_rank[rank]),
                name=name,
                value=values[rank],
                others=others,
            )
            found.append(NodeFinding("nccl-version-mismatch", rank, True, text))
    if not found and len(facts.nodes) > 1:
        versions = facts.nodes[0].versions
        text = say(
            "torch {torch}, CUDA {cuda}, NCCL {nccl}, driver {driver} on all {n} nodes",
            "全部 {n} 个节点都是 torch {torch}、CUDA {cuda}、NCCL {nccl}、驱动 {driver}",
            torch=versions.get("torch"),
            cuda=versions.get("torch_cuda"),
            nccl=versions.get("nccl"),
            driver=versions.get("driver"),
            n=len(facts.nodes),
        )
        found.append(NodeFinding("nccl-version-mismatch", None, False, text))
    return found


# --- interfaces and host names -------------------------------------------------------------


def addresses_of(node: NodeFacts, names: list[str]) -> list[str]:
    return [nic["ipv4"] for nic in node.interfaces if nic.get("name") in names and nic.get("ipv4")]


def reached_from(facts: NodesFacts, node: NodeFacts, addresses: list[str]) -> dict[int, list]:
    """Per other node: what its connections to these addresses of `node` gave."""
    results = {}
    for peer in facts.nodes:
        if peer.group_rank == node.group_rank:
            continue
        tried = (peer.reach or {}).get(str(node.group_rank)) or {}
        results[peer.node_rank] = [tried.get(address) for address in addresses if address in tried]
    return results


def unreached_by(facts: NodesFacts, node: NodeFacts, addresses: list[str]) -> list[str]:
    """Labels of the peers that reached none of these addresses (and tried some)."""
    by_rank = {peer.node_rank: peer for peer in facts.nodes}
    return [
        f"{label(by_rank[rank])}: {', '.join(str(r) for r in results)}"
        for rank, results in reached_from(facts, node, addresses).items()
        if results and "ok" not in results
    ]


def interface_findings(facts: NodesFacts, say: Say) -> list[NodeFinding]:
    found = []
    for node in facts.nodes:
        found += _ifname_findings(facts, node, say)
        found += _hostname_findings(facts, node, say)
    found += _collective_findings(facts, say)
    return found


def _ifname_findings(facts: NodesFacts, node: NodeFacts, say: Say) -> list[NodeFinding]:
    found = []
    have = ", ".join(nic.get("name", "?") for nic in node.interfaces) or "-"
    for var in IFNAME_VARS:
        value = node.env.get(var)
        if not value:
            continue
        selected = node.gloo_selected if var.startswith("GLOO") else node.nccl_selected
        if not selected:
            text = say(
                "{node}: {var}={value} names no interface there (it has {have})",
                "{node}：{var}={value} 在该节点上没有对应网卡（现有 {have}）",
                node=label(node),
                var=var,
                value=value,
                have=have,
            )
            found.append(NodeFinding("network-interface", node.node_rank, True, text))
            continue
        addresses = addresses_of(node, selected)
        missed = unreached_by(facts, node, addresses)
        values = {"node": label(node), "var": var, "value": value, "ips": ", ".join(addresses)}
        if missed:
            text = say(
                "{node}: {var}={value} ({ips}) is not reachable from {peers}",
                "{node}：{var}={value}（{ips}）从 {peers} 连不上",
                peers="; ".join(missed),
                **values,
            )
            found.append(NodeFinding("network-interface", node.node_rank, True, text))
        elif addresses:
            text = say(
                "{node}: {var}={value} ({ips}) is reached by the other nodes",
                "{node}：{var}={value}（{ips}）其他节点都能连上",
                **values,
            )
            found.append(NodeFinding("network-interface", node.node_rank, False, text))
    return found


def _hostname_findings(facts: NodesFacts, node: NodeFacts, say: Say) -> list[NodeFinding]:
    """gloo binds to the host name's address unless GLOO_SOCKET_IFNAME says otherwise."""
    if node.env.get("GLOO_SOCKET_IFNAME"):
        return []
    values = {"node": label(node), "host": node.hostname}
    if node.hostname_error:
        text = say(
            "{node}: its host name {host} does not resolve: {error}",
            "{node}：主机名 {host} 解析失败：{error}",
            error=node.hostname_error,
            **values,
        )
        return [NodeFinding("network-interface", node.node_rank, True, text)]
    addresses = [a for a in node.hostname_addresses if ":" not in a]
    values["ips"] = ", ".join(node.hostname_addresses) or "-"
    if node.hostname_loopback and separate_machines(facts):
        text = say(
            "{node}: its host name {host} resolves to {ips} (loopback): gloo binds there and the "
            "other nodes cannot connect; set GLOO_SOCKET_IFNAME or fix /etc/hosts",
            "{node}：主机名 {host} 解析为 {ips}（回环地址）：gloo 会绑定在这里，其他节点连不上；"
            "请设置 GLOO_SOCKET_IFNAME 或修改 /etc/hosts",
            **values,
        )
        return [NodeFinding("network-interface", node.node_rank, True, text)]
    missed = unreached_by(facts, node, addresses)
    if missed:
        text = say(
            "{node}: its host name {host} resolves to {ips}, which {peers} cannot reach",
            "{node}：主机名 {host} 解析为 {ips}，{peers} 连不上",
            peers="; ".join(missed),
            **values,
        )
        return [NodeFinding("network-interface", node.node_rank, True, text)]
    if len(facts.nodes) < 2:
        return []
    text = say(
        "{node}: its host name {host} resolves to {ips}, reached by the other nodes",
        "{node}：主机名 {host} 解析为 {ips}，其他节点都能连上",
        **values,
    )
    return [NodeFinding("network-interface", node.node_rank, False, text)]


def _collective_findings(facts: NodesFacts, say: Say) -> list[NodeFinding]:
    """A cross-node all_reduce that failed names the node; one that worked, its bandwidth."""
    found = []
    first = facts.nodes[0] if facts.nodes else None
    if first is not None and first.gloo is not None and first.gloo.result == "skipped":
        text = say(
            "no all_reduce across the nodes was tried: {reason}",
            "没有尝试跨节点 all_reduce：{reason}",
            reason=first.gloo.reason or "-",
        )
        found.append(NodeFinding("network-interface", None, False, text))
    for node in facts.nodes:
        for backend, outcome in (("gloo", node.gloo), ("NCCL", node.nccl)):
            if outcome is None:
                continue
            if outcome.result in ("failed", "wrong_result"):
                text = say(
                    "{node}: the {backend} all_reduce across the nodes {result}: {error}",
                    "{node}：跨节点 {backend} all_reduce {result}：{error}",
                    node=label(node),
                    backend=backend,
                    result=outcome.result.replace("_", " "),
                    error=outcome.error or "-",
                )
                found.append(NodeFinding("network-interface", node.node_rank, True, text))
            elif outcome.result == "ok":
                text = say(
                    "{node}: {backend} all_reduce of {mb} MB across {n} nodes at {gbps} GB/s",
                    "{node}：跨 {n} 个节点的 {backend} all_reduce（{mb} MB）带宽 {gbps} GB/s",
                    node=label(node),
                    backend=backend,
                    mb=outcome.megabytes,
                    n=len(facts.nodes),
                    gbps=outcome.gbps,
                )
                found.append(NodeFinding("network-interface", node.node_rank, False, text))
    return found


# --- the master endpoint -------------------------------------------------------------------


def master_findings(facts: NodesFacts, say: Say) -> list[NodeFinding]:
    found = []
    by_rank = {node.node_rank: node for node in facts.nodes}
    endpoints = {
        node.node_rank: f"{node.told.get('master_addr')}:{node.told.get('master_port')}"
        for node in facts.nodes
    }
    for rank in odd_ones(endpoints):
        text = say(
            "{node} was told the master is {mine}, the others {theirs}",
            "{node} 拿到的 master 是 {mine}，其他节点是 {theirs}",
            node=label(by_rank[rank]),
            mine=endpoints[rank],
            theirs=", ".join(sorted({v for r, v in endpoints.items() if r != rank})),
        )
        found.append(NodeFinding("master-endpoint-mismatch", rank, True, text))
    for node in facts.nodes:
        found += _master_reach(facts, node, say)
    if len(facts.nodes) > 1 and not any(f.problem for f in found):
        answered = all((node.master or {}).get("connect") == "ok" for node in facts.nodes)
        if answered:
            master = facts.nodes[0].master
            text = say(
                "the master {addr}:{port} resolves and answers from all {n} nodes",
                "master {addr}:{port} 在全部 {n} 个节点上都能解析并连通",
                addr=master.get("addr"),
                port=master.get("port"),
                n=len(facts.nodes),
            )
            found.append(NodeFinding("master-endpoint-mismatch", None, False, text))
            port = say(
                "port {port} on {addr} served the rendezvous for every node",
                "{addr} 的端口 {port} 为每个节点提供了 rendezvous",
                addr=master.get("addr"),
                port=master.get("port"),
            )
            found.append(NodeFinding("master-port-in-use", None, False, port))
    return found


def _master_reach(facts: NodesFacts, node: NodeFacts, say: Say) -> list[NodeFinding]:
    master = node.master or {}
    values = {"node": label(node), "addr": master.get("addr"), "port": master.get("port")}
    problem = None
    if master.get("resolve_error"):
        problem = say(
            "{node}: the master {addr} does not resolve there: {error}",
            "{node}：在该节点解析不了 master {addr}：{error}",
            error=master["resolve_error"],
            **values,
        )
    elif master.get("loopback") and separate_machines(facts):
        problem = say(
            "{node}: the master {addr} resolves to {ips} (loopback) there, not to the master node",
            "{node}：master {addr} 在该节点解析为 {ips}（回环地址），不是 master 节点",
            ips=", ".join(master.get("resolved") or []),
            **values,
        )
    elif master.get("connect") not in (None, "ok"):
        problem = say(
            "{node}: the master {addr}:{port} does not answer from there: {result}",
            "{node}：从该节点连不上 master {addr}:{port}：{result}",
            result=master["connect"],
            **values,
        )
    store = node.worker_store or {}
    found = (
        [NodeFinding("master-endpoint-mismatch", node.node_rank, True, problem)] if problem else []
    )
    if store and store.get("connect") != "ok":
        text = say(
            "{node}: the store torchrun gives the ranks ({addr}:{port}) does not answer from "
            "there: {result}; torchrun names it by the host name of the node it ranked first, "
            "so fix that name or pass torchrun --local-addr with an address the others reach",
            "{node}：torchrun 交给各 rank 的 store（{addr}:{port}）从该节点连不上：{result}；"
            "torchrun 用排在第一的节点的主机名指向它，请修正主机名或给 torchrun 加 --local-addr",
            node=label(node),
            addr=store.get("addr"),
            port=store.get("port"),
            result=store.get("connect"),
        )
        found.append(NodeFinding("master-endpoint-mismatch", node.node_rank, True, text))
    return found


# --- sizes: nodes, ranks per node, world size, who joined ------------------------------------


def size_findings(facts: NodesFacts, say: Say) -> list[NodeFinding]:
    found = [_missing(facts, rank, say) for rank in facts.missing]
    if facts.silent:
        text = say(
            "{n} node(s) joined the rendezvous but never sent their facts",
            "{n} 个节点加入了 rendezvous 但没有发来信息",
            n=len(facts.silent),
        )
        found.append(NodeFinding("world-size-mismatch", None, True, text))
    claimed = Counter(node.node_rank for node in facts.nodes)
    for rank, count in sorted(claimed.items(), key=lambda item: str(item[0])):
        if count > 1:
            hosts = ", ".join(n.hostname or "?" for n in facts.nodes if n.node_rank == rank)
            text = say(
                "node rank {rank} is claimed by {count} nodes ({hosts})",
                "有 {count} 个节点都用 node rank {rank}（{hosts}）",
                rank=rank,
                count=count,
                hosts=hosts,
            )
            found.append(NodeFinding("world-size-mismatch", rank, True, text))
    found += _told_sizes(facts, say)
    return found


def _missing(facts: NodesFacts, rank: int, say: Say) -> NodeFinding:
    text = say(
        "node rank {rank} never joined the rendezvous at {endpoint}: the job would wait for it",
        "node rank {rank} 一直没有加入 {endpoint} 的 rendezvous：训练会一直等它",
        rank=rank,
        endpoint=facts.rendezvous or "?",
    )
    return NodeFinding("world-size-mismatch", rank, True, text)


def _told_sizes(facts: NodesFacts, say: Say) -> list[NodeFinding]:
    found = []
    by_rank = {node.node_rank: node for node in facts.nodes}
    nnodes = {node.node_rank: node.told.get("nnodes") for node in facts.nodes}
    for rank in odd_ones(nnodes):
        text = say(
            "{node} was told nnodes={mine}, the others {theirs}",
            "{node} 拿到的 nnodes={mine}，其他节点是 {theirs}",
            node=label(by_rank[rank]),
            mine=nnodes[rank],
            theirs=", ".join(sorted({str(v) for r, v in nnodes.items() if r != rank})),
        )
        found.append(NodeFinding("world-size-mismatch", rank, True, text))
    nprocs = [node.told.get("nproc_per_node") or 0 for node in facts.nodes]
    expected = facts.expected_nnodes or len(facts.nodes)
    # Nodes that did not come are counted with the ranks per node of those that did.
    world = sum(nprocs) + (expected - len(facts.nodes)) * (max(nprocs) if nprocs else 0)
    for node in facts.nodes:
        told_world = node.told.get("world_size")
        if told_world is not None and told_world != world:
            text = say(
                "{node} has WORLD_SIZE={told}, but {n} nodes x ranks per node ({nprocs}) make {world}",
                "{node} 的 WORLD_SIZE={told}，但 {n} 个节点 x 每节点 rank 数（{nprocs}）等于 {world}",
                node=label(node),
                told=told_world,
                n=expected,
                nprocs="+".join(str(p) for p in nprocs),
                world=world,
            )
            found.append(NodeFinding("world-size-mismatch", node.node_rank, True, text))
    if not any(f.problem for f in found) and not facts.missing and len(facts.nodes) > 1:
        text = say(
            "{n} nodes agree: nnodes {n}, {nprocs} ranks per node, world size {world}",
            "{n} 个节点一致：nnodes {n}，每节点 {nprocs} 个 rank，world size {world}",
            n=len(facts.nodes),
            nprocs="+".join(str(p) for p in nprocs),
            world=world,
        )
        found.append(NodeFinding("world-size-mismatch", None, False, text))
    return found


# --- shared storage --------------------------------------------------------------------------


def storage_findings(facts: NodesFacts, say: Say) -> list[NodeFinding]:
    """Whether the folder each node checked (its marker file, probes/nodes.py) shows the
    other nodes' markers: a node that misses one keeps that folder on its own disk."""
    by_group = {node.group_rank: node for node in facts.nodes}
    checked = [node for node in facts.nodes if node.storage.get("dir")]
    found: list[NodeFinding] = []
    for node in checked:
        storage = node.storage
        if not storage.get("wrote"):
            text = say(
                "{node} could not write in {dir} to check it is shared: {error}",
                "{node} 无法在 {dir} 里写文件来检查它是否共享：{error}",
                node=label(node), dir=storage["dir"], error=storage.get("error") or "?",
            )  # fmt: skip
            found.append(
                NodeFinding("checkpoint-on-node-local-disk", node.node_rank, False, text, False)
            )
            continue
        unseen = [
            by_group[int(rank)]
            for rank, seen in sorted((storage.get("sees") or {}).items())
            if not seen and int(rank) in by_group
        ]
        if unseen:
            text = say(
                "{node} does not see the file {others} wrote in {dir}: that folder is on "
                "each machine's own disk, so what one node saves there is missing on the others",
                "{node} 看不到 {others} 在 {dir} 里写的文件：这个目录在每台机器自己的盘上，"
                "一个节点保存在这里的东西，其他节点上没有",
                node=label(node), others=", ".join(label(o) for o in unseen), dir=storage["dir"],
            )  # fmt: skip
            found.append(NodeFinding("checkpoint-on-node-local-disk", node.node_rank, True, text))
    writers = [node for node in checked if node.storage.get("wrote")]
    everyone_sees = all(all((n.storage.get("sees") or {}).values()) for n in writers)
    if len(writers) > 1 and len(writers) == len(facts.nodes) and everyone_sees:
        text = say(
            "every node sees the files the others wrote in {dirs}: the folder is shared",
            "每个节点都能看到其他节点在 {dirs} 里写的文件：这个目录是共享的",
            dirs=", ".join(sorted({n.storage["dir"] for n in writers})),
        )
        found.append(NodeFinding("checkpoint-on-node-local-disk", None, False, text))
    return found


# --- verdicts ------------------------------------------------------------------------------


def cross_node_verdict(i: Inputs, cause_id: str, single: Judge) -> Verdict:
    """The verdict on a cause with the nodes' facts: their problems first, else the machine's."""
    facts = gathered(i.runs)
    if facts is None:
        failed = failed_join(i.runs)
        return join_verdict(i, cause_id, failed, single) if failed else single(i)
    found = [f for f in findings(facts, i.t) if f.cause_id == cause_id]
    problems = [f.text for f in found if f.problem]
    notes = [f.text for f in found if not f.problem]
    if problems:
        return verdict("confirmed", problems + notes, source="probe")
    local = single(i) if len(i.runs) > 1 else None  # this node's own probes ran too
    if local is not None and local.verdict == "inconclusive" and settled_across(facts, cause_id):
        # e.g. "the master refuses connections now": it answered every node in the
        # rendezvous. The machine's hedge is left out: ruled_out beside it would read
        # as a contradiction, and the nodes' connections are the stronger fact.
        return verdict("ruled_out", notes, source="probe")
    if local is not None and local.verdict in ("confirmed", "inconclusive", "not_applicable"):
        return verdict(local.verdict, local.evidence + notes, local.refutes, source=local.source)
    if local is not None and len(facts.nodes) < 2 and not facts.missing:
        return local  # a one-node job: this machine's own verdict is the whole story
    if len(facts.nodes) < 2:  # nobody to compare with: the missing nodes are the news
        alone = i.t(
            "only {nodes} joined: nothing to compare across nodes",
            "只有 {nodes} 加入：没有可比较的节点",
            nodes=", ".join(label(node) for node in facts.nodes) or "-",
        )
        return verdict("inconclusive", notes + [alone], source="probe")
    if notes:
        settled = all(f.settles for f in found)
        return verdict("ruled_out" if settled else "inconclusive", notes, source="probe")
    return local if local is not None else not_run()


# Causes the nodes check tests directly (connections between the nodes, to the
# master, over the named interfaces): with every node there and no problem, a
# machine's own hedge ("refuses connections now", "loopback host name") is settled.
SETTLED_ACROSS = ("network-interface", "master-endpoint-mismatch", "master-port-in-use")


def settled_across(facts: NodesFacts, cause_id: str) -> bool:
    """Whether every node joined and the nodes' own connections decide this cause."""
    complete = not facts.missing and not facts.silent and len(facts.nodes) > 1
    return complete and cause_id in SETTLED_ACROSS


def failed_join(runs: dict[str, ProbeRun]) -> NodesFacts | None:
    """The runner's facts of a node that never got through the rendezvous, else None."""
    run = runs.get(NODES_PROBE)
    if run is None or not run.ranks:
        return None
    facts = NodesFacts.from_dict(run.ranks[0].get("facts"))
    return facts if facts.join_error else None


def join_verdict(i: Inputs, cause_id: str, facts: NodesFacts, single: Judge) -> Verdict:
    """This node could not join: a port taken beforehand decides master-port-in-use;
    for the endpoint itself the failure is evidence, not a verdict (the others may
    simply not have started)."""
    values = {"node": facts.node_rank, "endpoint": facts.rendezvous, "error": facts.join_error}
    if cause_id == "master-port-in-use" and facts.endpoint_busy_before:
        line = i.t(
            "port {port} was already in use on node {node} before the doctor started, and the "
            "node could not join the rendezvous there: {error}",
            "doctor 启动前 node {node} 上的端口 {port} 就已被占用，该节点无法在那里加入 rendezvous：{error}",
            port=facts.rendezvous.rsplit(":", 1)[-1] if facts.rendezvous else "?",
            **values,
        )
        return verdict("confirmed", [line], source="probe")
    if cause_id == "master-endpoint-mismatch":
        line = i.t(
            "node {node} could not join the rendezvous at {endpoint}: {error}",
            "node {node} 无法加入 {endpoint} 的 rendezvous：{error}",
            **values,
        )
        local = single(i) if len(i.runs) > 1 else None
        if local is not None and local.verdict == "confirmed":
            return verdict("confirmed", local.evidence + [line], local.refutes, source=local.source)
        return verdict("inconclusive", [line], source="probe")
    return single(i)


def extend_judge(cause_id: str) -> None:
    """Layer the cross-node judgement over the cause's registered single-machine judge."""
    single = JUDGES[cause_id]

    def decide(i: Inputs) -> Verdict:
        return cross_node_verdict(i, cause_id, single)

    decide.__doc__ = f"{cause_id} across nodes, over {single.__name__}."
    JUDGES[cause_id] = decide


def node_verdicts(facts: NodesFacts, say: Say) -> dict[int | None, list[dict]]:
    """Per node rank (missing ones too): each cross-node cause's verdict about that node.

    confirmed: a problem about this node; inconclusive: a problem about the
    job that names no node; not_run: a node that never joined, on what only
    its facts could show; else ruled_out, with what was checked.
    """
    found = findings(facts, say)
    ranks = [node.node_rank for node in facts.nodes] + list(facts.missing)
    result: dict[int | None, list[dict]] = {}
    for rank in ranks:
        entries = []
        for cause_id in CROSS_NODE_CAUSES:
            own = [f for f in found if f.cause_id == cause_id and f.node_rank == rank]
            job = [f for f in found if f.cause_id == cause_id and f.node_rank is None]
            problems = [f.text for f in own if f.problem]
            if problems:
                value, evidence = "confirmed", problems
            elif any(f.problem for f in job):
                value, evidence = "inconclusive", [f.text for f in job if f.problem]
            elif rank in facts.missing:
                value, evidence = "not_run", []
            elif not all(f.settles for f in own + job):
                value, evidence = "inconclusive", [f.text for f in own + job]
            else:
                value, evidence = "ruled_out", [f.text for f in own + job]
            entries.append({"id": cause_id, "verdict": value, "evidence": evidence})
        result[rank] = entries
    return result


# Causes only the nodes decide have no single-machine judge of their own.
JUDGES.setdefault("checkpoint-on-node-local-disk", no_probe)
for _cause in CROSS_NODE_CAUSES:
    extend_judge(_cause)


# --- the report: `doctor --json`'s "nodes" and the side-by-side table ------------------------


def nodes_report(runs: list[ProbeRun], lang: str = "en") -> list[dict] | None:
    """Per node, its facts and its verdicts (`doctor --json`'s "nodes"); None without a nodes run.

    Nodes that never joined are listed too, with "joined": false. A node
    that could not join itself lists only itself, with torchrun's "error".
    """
    by_name = {run.name: run for run in runs}
    if NODES_PROBE not in by_name:
        return None
    facts = gathered(by_name)
    if facts is None:
        failed = failed_join(by_name)
        if failed is None:
            return []
        return [{"node_rank": failed.node_rank, "joined": False, "error": failed.join_error}]
    say = Inputs(by_name, None, lang=lang).t
    verdicts = node_verdicts(facts, say)
    report = [_node_entry(node, verdicts.get(node.node_rank, [])) for node in facts.nodes]
    report += [
        {"node_rank": rank, "joined": False, "verdicts": verdicts.get(rank, [])}
        for rank in facts.missing
    ]
    return sorted(report, key=lambda entry: (entry["node_rank"] is None, entry["node_rank"] or 0))


def _node_entry(node: NodeFacts, verdicts: list[dict]) -> dict:
    return {
        "node_rank": node.node_rank,
        "joined": True,
        "hostname": node.hostname,
        "addresses": [nic["ipv4"] for nic in node.interfaces if nic.get("ipv4")],
        "hostname_addresses": list(node.hostname_addresses),
        "interfaces": {var: node.env.get(var) for var in IFNAME_VARS if node.env.get(var)},
        "versions": dict(node.versions),
        "gpus": node.gpus,
        "told": dict(node.told),
        "collectives": {
            "gloo": node.gloo.to_dict() if node.gloo else None,
            "nccl": node.nccl.to_dict() if node.nccl else None,
        },
        "verdicts": verdicts,
    }


def nodes_problem(runs: list[ProbeRun]) -> str | None:
    """Why the multi-node check did not reach every node (for a non-zero exit), or None."""
    run = next((run for run in runs if run.name == NODES_PROBE), None)
    if run is None:
        return None
    facts = gathered({NODES_PROBE: run})
    if facts is None:
        return run.detail or f"the nodes check ended with {run.status}"
    if facts.missing or facts.silent:
        return run.detail or "not every node joined"
    return None
