"""Cross-node verdicts from recorded multi-node facts (tests/fixtures/facts/nodes/*.json).

These files were recorded on this project's CPU machine: two doctor
agents over 127.0.0.1, and two agents in network namespaces joined by a veth
pair. Scenarios no machine here can produce (another NCCL on one node, a
host name that is loopback on a real second machine, a wrong WORLD_SIZE)
are those recorded facts with one value changed, each named in its test.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from rich.console import Console

from assistant.cli.render import render_machine_check
from assistant.pipeline import Pipeline
from assistant.probing.recorded import load_runs
from assistant.results import ProbeRun
from assistant.verdicts import JUDGES, Inputs, judge
from assistant.verdicts import system as system_verdicts
from assistant.verdicts.nodes import (
    CROSS_NODE_CAUSES,
    gathered,
    node_verdicts,
    nodes_problem,
    nodes_report,
    odd_ones,
)

FACTS = Path(__file__).resolve().parent.parent / "fixtures" / "facts" / "nodes"


def runs_of(name: str, folder: Path = FACTS) -> dict[str, ProbeRun]:
    return {run.name: run for run in load_runs(folder / f"{name}.json")}


def verdicts(runs: dict[str, ProbeRun]) -> dict[str, object]:
    return {cause: judge(cause, runs, None, [], signatures={}) for cause in CROSS_NODE_CAUSES}


def changed(name: str, change) -> dict[str, ProbeRun]:
    """A recorded nodes run with change(facts) applied to its gathered facts."""
    run = runs_of(name)["nodes"]
    record = copy.deepcopy(run.ranks[0])
    change(record["facts"])
    return {"nodes": ProbeRun("nodes", run.status, run.seconds, [record], run.detail)}


def per_node(runs) -> dict:
    facts = gathered(runs)
    return {
        rank: {entry["id"]: entry["verdict"] for entry in entries}
        for rank, entries in node_verdicts(facts, Inputs(runs, None).t).items()
    }


def test_healthy_nodes_confirm_nothing():
    found = verdicts(runs_of("healthy_2"))
    assert {v.verdict for v in found.values()} == {"ruled_out"}
    assert any(
        "gloo all_reduce" in line and "GB/s" in line for line in found["network-interface"].evidence
    )
    assert "2 nodes agree" in found["world-size-mismatch"].evidence[0]


def test_a_folder_every_node_sees_rules_out_node_local_checkpoints():
    found = verdicts(runs_of("healthy_2"))["checkpoint-on-node-local-disk"]
    assert found.verdict == "ruled_out" and found.source == "probe"
    assert "the folder is shared" in found.evidence[0]


def test_a_folder_on_a_nodes_own_disk_is_confirmed_for_each_node_that_misses_a_file():
    """Recorded: node 1 in its own mount namespace, a tmpfs over the same path."""
    runs = runs_of("local_disk_2")
    found = verdicts(runs)["checkpoint-on-node-local-disk"]
    assert found.verdict == "confirmed" and found.source == "probe"
    folder = gathered(runs).nodes[0].storage["dir"]
    assert all(folder in line and "own disk" in line for line in found.evidence)
    assert {line.split(" (")[0] for line in found.evidence} == {"node 0", "node 1"}
    assert per_node(runs)[0]["checkpoint-on-node-local-disk"] == "confirmed"
    # the other causes are untouched by the storage check
    assert verdicts(runs)["network-interface"].verdict == "ruled_out"


def test_a_node_that_could_not_write_its_marker_leaves_the_folder_undecided():
    """healthy_2 with node 1's write refused (a read-only folder), one value changed."""

    def refused(facts):
        node = next(n for n in facts["nodes"] if n["node_rank"] == 1)
        node["storage"] = {"dir": node["storage"]["dir"], "wrote": False,
                           "error": "PermissionError: [Errno 13] Permission denied"}  # fmt: skip
        for other in facts["nodes"]:
            other["storage"].get("sees", {}).pop(str(node["group_rank"]), None)

    runs = changed("healthy_2", refused)
    found = verdicts(runs)["checkpoint-on-node-local-disk"]
    assert found.verdict == "inconclusive"
    assert "could not write" in found.evidence[0] and "Permission denied" in found.evidence[0]
    assert per_node(runs)[1]["checkpoint-on-node-local-disk"] == "inconclusive"


def test_nodes_without_a_storage_check_leave_the_cause_unjudged():
    """Older records (and a doctor given no folder) carry no storage facts."""

    def unchecked(facts):
        for node in facts["nodes"]:
            node.pop("storage", None)

    found = verdicts(changed("healthy_2", unchecked))["checkpoint-on-node-local-disk"]
    assert found.verdict == "not_run"


def test_bogus_gloo_ifname_is_confirmed_for_that_node_only():
    runs = runs_of("bogus_ifname")
    found = verdicts(runs)["network-interface"]
    assert found.verdict == "confirmed" and found.source == "probe"
    assert (
        found.evidence[0].startswith("node 1 (")
        and "GLOO_SOCKET_IFNAME=bogus0" in found.evidence[0]
    )
    nodes = per_node(runs)
    assert nodes[1]["network-interface"] == "confirmed"
    assert nodes[0]["network-interface"] == "ruled_out"


def test_missing_node_is_named_and_the_rest_is_not_guessed():
    runs = runs_of("missing_1")
    found = verdicts(runs)
    assert found["world-size-mismatch"].verdict == "confirmed"
    assert "node rank 1 never joined" in found["world-size-mismatch"].evidence[0]
    assert found["nccl-version-mismatch"].verdict == "inconclusive"
    assert "nothing to compare" in found["nccl-version-mismatch"].evidence[-1]
    nodes = per_node(runs)
    assert nodes[1]["world-size-mismatch"] == "confirmed"
    assert nodes[1]["nccl-version-mismatch"] == "not_run"
    assert "never joined" in nodes_problem(list(runs.values()))


def test_interface_unreachable_across_namespaces_names_node_and_interface():
    found = verdicts(runs_of("netns_lo_unreachable"))["network-interface"]
    assert found.verdict == "confirmed"
    assert found.evidence[0].startswith("node 1 (")
    assert "GLOO_SOCKET_IFNAME=lo (127.0.0.1) is not reachable from node 0" in found.evidence[0]
    # node 0's interface on the veth pair was reached, and gloo ran over it
    assert any("GLOO_SOCKET_IFNAME=ddpa0 (10.77.0.1) is reached" in line for line in found.evidence)


def test_ranks_store_named_by_an_unreachable_host_name():
    runs = runs_of("netns_store_unreachable")
    found = verdicts(runs)
    assert found["master-endpoint-mismatch"].verdict == "confirmed"
    assert "--local-addr" in found["master-endpoint-mismatch"].evidence[0]
    # separate network stacks: a loopback host name is a problem on each node
    assert found["network-interface"].verdict == "confirmed"
    assert per_node(runs)[1]["master-endpoint-mismatch"] == "confirmed"


def test_another_nccl_on_one_node_names_that_node():
    def other_nccl(facts):
        facts["nodes"][1]["versions"]["nccl"] = "2.21.5"

    found = verdicts(changed("healthy_2", other_nccl))["nccl-version-mismatch"]
    assert found.verdict == "confirmed"
    assert found.evidence[0].startswith("node 1 (") and "NCCL 2.21.5" in found.evidence[0]


def test_loopback_host_name_matters_only_between_machines():
    def second_machine(facts):
        facts["nodes"][1]["network_id"] = "another-boot/4026531992"

    healthy = verdicts(runs_of("healthy_2"))["network-interface"]
    assert healthy.verdict == "ruled_out"  # one machine: loopback joins the two agents
    apart = verdicts(changed("healthy_2", second_machine))
    assert apart["network-interface"].verdict == "confirmed"
    assert "(loopback)" in apart["network-interface"].evidence[0]
    assert apart["master-endpoint-mismatch"].verdict == "confirmed"  # master 127.0.0.1 too


def test_world_size_told_against_nodes_and_duplicate_node_ranks():
    def wrong_world(facts):
        facts["nodes"][0]["told"]["world_size"] = 8

    line = verdicts(changed("healthy_2", wrong_world))["world-size-mismatch"].evidence[0]
    assert line.startswith("node 0 (") and "WORLD_SIZE=8" in line and "make 4" in line

    def same_rank(facts):
        facts["nodes"][1]["node_rank"] = 0

    line = verdicts(changed("healthy_2", same_rank))["world-size-mismatch"].evidence[0]
    assert "node rank 0 is claimed by 2 nodes" in line


def test_different_master_told_names_the_odd_node():
    def other_master(facts):
        for node in facts["nodes"]:
            node["told"]["master_port"] = 29500
        facts["nodes"].append(copy.deepcopy(facts["nodes"][1]))
        facts["nodes"][2].update(node_rank=2, group_rank=2)
        facts["nodes"][2]["told"]["master_port"] = 29501

    found = verdicts(changed("healthy_2", other_master))["master-endpoint-mismatch"]
    assert found.verdict == "confirmed" and found.evidence[0].startswith("node 2 (")


def test_odd_ones_prefers_the_majority_then_the_lowest_rank():
    assert odd_ones({0: "a", 1: "a", 2: "b"}) == [2]
    assert odd_ones({0: "a", 1: "b"}) == [1]
    assert odd_ones({0: "a", 1: "a"}) == []


def test_single_machine_judges_are_unchanged_without_a_nodes_run():
    runs = runs_of("cpu_2ranks", FACTS.parent)
    assert "nodes" not in runs
    inputs = Inputs(runs, None, signatures={})
    assert JUDGES["network-interface"](inputs) == system_verdicts.network_interface(inputs)


def test_nodes_json_lists_every_node_with_its_verdicts():
    report = nodes_report(list(runs_of("missing_1").values()))
    assert [entry["node_rank"] for entry in report] == [0, 1]
    joined, missing = report
    for key in ("hostname", "addresses", "versions", "verdicts", "collectives", "told"):
        assert key in joined
    assert joined["versions"]["torch"].startswith("2.")
    assert missing["joined"] is False
    assert {v["id"] for v in missing["verdicts"]} == set(CROSS_NODE_CAUSES)
    json.dumps(report)
    assert nodes_report(list(runs_of("cpu_2ranks", FACTS.parent).values())) is None


def test_a_node_that_could_not_join_has_no_facts_but_a_reason():
    run = ProbeRun("nodes", "error", 24.0, [], "node 1 could not join the rendezvous at h:1")
    assert nodes_report([run]) == []  # no record at all: nothing to list
    assert "could not join" in nodes_problem([run])


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_doctor_shows_the_nodes_side_by_side(lang):
    runs = list(runs_of("missing_1").values())

    class Recorded:  # the runner of a doctor, answering with the recorded runs
        def run(self, names, on_progress=None, cancel=None):
            return runs

    result = Pipeline(runner=Recorded()).doctor(lang=lang)
    assert result.nodes_problem and "never joined" in result.nodes_problem
    console = Console(width=160, record=True)
    render_machine_check(result, console)
    text = console.export_text()
    words = {"en": ("node 0", "node 1", "never joined"), "zh": ("节点 0", "节点 1", "未加入")}
    assert all(word in text for word in words[lang])  # the table speaks the doctor's language
    assert "world-size-mismatch" in text


def test_this_nodes_own_probes_and_the_nodes_check_together():
    """doctor --nnodes without --nodes-only: the machine's hedges that the nodes settled."""
    runs = runs_of("cpu_2ranks", FACTS.parent) | runs_of("healthy_2")
    alone = runs_of("cpu_2ranks", FACTS.parent)
    inputs = {"signatures": {}}
    # one machine: a loopback host name is a doubt; two nodes reached each other: settled
    assert judge("network-interface", alone, None, [], **inputs).verdict == "inconclusive"
    settled = judge("network-interface", runs, None, [], **inputs)
    assert settled.verdict == "ruled_out"
    assert not any("cannot connect" in line for line in settled.evidence)
    # a CPU-only build stays not applicable, with the nodes' versions beside it
    versions = judge("nccl-version-mismatch", runs, None, [], **inputs)
    assert versions.verdict == "not_applicable" and "on all 2 nodes" in versions.evidence[-1]
    # the script may still fix a world size: the machine's hedge stays
    assert judge("world-size-mismatch", runs, None, [], **inputs).verdict == "inconclusive"


def doctor_of(runs: dict[str, ProbeRun]):
    class Recorded:  # the runner of a doctor, answering with the recorded runs
        def run(self, names, on_progress=None, cancel=None):
            return list(runs.values())

    return Pipeline(runner=Recorded()).doctor()


def test_doctor_lists_the_causes_only_the_nodes_decide_beside_the_contract_ones():
    """`doctor --nnodes`'s top-level causes carry the storage check's verdict too."""
    local = {c.id: c for c in doctor_of(runs_of("local_disk_2")).causes}
    assert local["checkpoint-on-node-local-disk"].verdict.verdict == "confirmed"
    assert local["checkpoint-on-node-local-disk"].verdict.source == "probe"
    assert "network-interface" in local  # the contract's causes are all still there
    healthy = {c.id: c for c in doctor_of(runs_of("healthy_2")).causes}
    assert healthy["checkpoint-on-node-local-disk"].verdict.verdict == "ruled_out"


def test_a_one_machine_doctor_lists_the_contract_causes_only():
    one = doctor_of(runs_of("cpu_2ranks", FACTS.parent))
    assert "checkpoint-on-node-local-disk" not in {c.id for c in one.causes}
    assert len(one.causes) == 27
