"""Verdict functions against recorded facts of machines this project does not have.

Each fixture in tests/fixtures/facts/ is a doctor run in the runner's exact
format (see assistant.probing.recorded.save_runs); the tests check what each cause's
verdict says about it, with and without a root error or a script finding.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from assistant.config import contract_ids
from assistant.probing.recorded import load_runs
from assistant.results import AnswerRef, CauseResult, Finding, Result, RootError
from assistant.verdicts import (
    JUDGES,
    advice_outcomes,
    apply_verdicts,
    arch_supported,
    judge,
    probes_for,
    variant_outcomes,
)

FACTS = Path(__file__).parents[1] / "fixtures" / "facts"
SYNTHETIC = (
    "healthy_8gpu",
    "two_ranks_one_gpu",
    "cvd_empty",
    "more_procs_than_gpus",
    "driver_too_old",
    "shm_64mb",
    "busy_port",
    "hostname_loopback",
)


RECORDED = ("cpu_2ranks",)  # real runs: this project's CPU CI machine
H200 = ("h200_1rank", "h200_2ranks_one_gpu")  # recorded on one H200 by tests/gpu/record_facts.sh


def runs_of(name: str) -> dict:
    return {run.name: run for run in load_runs(FACTS / f"{name}.json")}


def verdict_of(cause: str, name: str, error: RootError | None = None, findings=(), lang="en"):
    return judge(cause, runs_of(name), error, list(findings), lang)


def verdicts(name: str) -> dict[str, str]:
    runs = runs_of(name)
    return {cause: judge(cause, runs, None, []).verdict for cause in contract_ids()}


def confirmed(name: str) -> set[str]:
    return {cause for cause, verdict in verdicts(name).items() if verdict == "confirmed"}


# --- every fixture, every cause -----------------------------------------------------


def test_every_contract_cause_has_a_verdict_function():
    assert set(contract_ids()) <= set(JUDGES)


@pytest.mark.parametrize("name", SYNTHETIC + RECORDED)
@pytest.mark.parametrize("lang", ["en", "zh"])
def test_every_verdict_is_valid_with_one_line_evidence(name, lang):
    runs = runs_of(name)
    for cause in contract_ids():
        verdict = judge(cause, runs, None, [], lang)
        assert verdict.verdict in (
            "confirmed",
            "ruled_out",
            "inconclusive",
            "not_applicable",
            "not_run",
        )
        if verdict.verdict in ("confirmed", "ruled_out", "inconclusive"):
            assert verdict.evidence, f"{name}/{cause}: {verdict.verdict} without evidence"
        for line in verdict.evidence:
            assert line and "\n" not in line and len(line) < 500
            assert "{" not in line, f"unformatted template in {line!r}"


def test_evidence_follows_the_language():
    english = verdict_of("shm-too-small", "shm_64mb", lang="en").evidence
    chinese = verdict_of("shm-too-small", "shm_64mb", lang="zh").evidence
    assert "MiB free" in english[0]
    assert "空闲" in chinese[0]


# --- what each machine confirms ---------------------------------------------------------


def test_healthy_8gpu_confirms_nothing():
    assert confirmed("healthy_8gpu") == set()
    results = verdicts("healthy_8gpu")
    for cause in (
        "no-cuda-visible",
        "shm-too-small",
        "master-port-in-use",
        "nccl-version-mismatch",
        "p2p-hang",
    ):
        assert results[cause] == "ruled_out", cause
    # Causes the script can still produce on a healthy machine stay open.
    for cause in ("duplicate-gpu-per-rank", "hardcoded-device", "local-rank-not-from-env"):
        assert results[cause] == "inconclusive", cause


def test_healthy_8gpu_shows_each_rank_on_its_own_gpu():
    evidence = " ".join(verdict_of("duplicate-gpu-per-rank", "healthy_8gpu").evidence)
    assert "0->GPU-708c1fa1" in evidence and "7->GPU-77a4e8a1" in evidence


def test_two_ranks_on_one_gpu():
    assert {
        "duplicate-gpu-per-rank",
        "world-size-exceeds-devices",
        "cuda-visible-devices-mismatch",
    } <= confirmed("two_ranks_one_gpu")
    evidence = " ".join(verdict_of("duplicate-gpu-per-rank", "two_ranks_one_gpu").evidence)
    assert "only 1 visible GPU" in evidence and "invalid device ordinal" in evidence
    assert (
        "CUDA_VISIBLE_DEVICES=0 shows 1 of the 2 GPUs"
        in verdict_of("cuda-visible-devices-mismatch", "two_ranks_one_gpu").evidence[0]
    )


def test_empty_cuda_visible_devices():
    assert confirmed("cvd_empty") == {"no-cuda-visible", "cuda-visible-devices-mismatch"}
    assert "set but empty" in verdict_of("no-cuda-visible", "cvd_empty").evidence[0]
    assert (
        "hides all 4 GPU(s)" in verdict_of("cuda-visible-devices-mismatch", "cvd_empty").evidence[0]
    )
    assert verdict_of("set-device-order", "cvd_empty").verdict == "not_applicable"


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_a_misspelled_visible_devices_variable_is_said_as_what_the_text_sets(lang):
    # The launch line, not an error CUDA gave: the evidence names the missing S, and
    # this machine's healthy GPUs do not turn it into "changed after CUDA started".
    query = "OOM on three GPUs\nCUDA_VISIBLE_DEVICE=0,1,2 python train.py"
    for machine in ("healthy_8gpu", "cpu_2ranks"):
        found = judge(
            "cuda-visible-devices-mismatch", runs_of(machine), None, [], lang, None, query
        )
        assert (found.verdict, found.source) == ("confirmed", "error")
        assert "CUDA_VISIBLE_DEVICE" in found.evidence[0] and "=0,1,2" in found.evidence[0]
        words = ("no S", "never reads") if lang == "en" else ("少了 S", "不读")
        assert all(word in found.evidence[0] for word in words), found.evidence
        assert not any("after CUDA started" in e or "启动后" in e for e in found.evidence)


def test_more_processes_than_gpus():
    assert confirmed("more_procs_than_gpus") == {
        "duplicate-gpu-per-rank",
        "world-size-exceeds-devices",
    }
    evidence = verdict_of("world-size-exceeds-devices", "more_procs_than_gpus").evidence
    assert evidence == ["8 processes on l40s-04 but 4 visible GPU(s)"]
    # The machine hides nothing: CUDA_VISIBLE_DEVICES is not the reason.
    assert (
        verdict_of("cuda-visible-devices-mismatch", "more_procs_than_gpus").verdict == "ruled_out"
    )


def test_driver_too_old_for_the_cuda_runtime():
    assert confirmed("driver_too_old") == {"nccl-version-mismatch", "no-cuda-visible"}
    evidence = verdict_of("nccl-version-mismatch", "driver_too_old").evidence
    assert any(
        "supports CUDA up to 11.4, but torch uses the CUDA 12.4 runtime" in e for e in evidence
    )


def test_small_dev_shm():
    assert confirmed("shm_64mb") == {"shm-too-small"}
    assert verdict_of("shm-too-small", "shm_64mb").evidence[0] == "/dev/shm is 64 MiB (64 MiB free)"


def test_busy_port_names_the_holder():
    assert confirmed("busy_port") == {"master-port-in-use"}
    evidence = verdict_of("master-port-in-use", "busy_port").evidence[0]
    assert "port 29500 is in use, held by pid 31337" in evidence and "train.py" in evidence


def test_hostname_resolving_to_loopback_in_a_multi_node_job():
    assert confirmed("hostname_loopback") == {"master-endpoint-mismatch", "network-interface"}
    evidence = verdict_of("master-endpoint-mismatch", "hostname_loopback").evidence[0]
    assert "127.0.1.1" in evidence and "loopback" in evidence


def test_hostname_resolving_to_loopback_on_a_single_node_is_only_a_note():
    runs = runs_of("hostname_loopback")
    for record in runs["launch_env"].ranks:
        record["facts"]["multi_node_hints"] = {"GROUP_WORLD_SIZE": "1"}
    assert judge("network-interface", runs, None, []).verdict == "inconclusive"
    assert judge("master-endpoint-mismatch", runs, None, []).verdict == "ruled_out"


def test_recorded_cpu_machine_confirms_the_missing_gpu_and_nccl():
    # A CPU-only torch has no NCCL: init_process_group("nccl") fails here, which
    # is what nccl-not-available says (its title: "on this platform or build").
    assert confirmed("cpu_2ranks") == {"no-cuda-visible", "nccl-not-available"}
    assert "CPU-only build" in verdict_of("no-cuda-visible", "cpu_2ranks").evidence[0]
    nccl = verdict_of("nccl-not-available", "cpu_2ranks")
    assert nccl.source == "probe"
    assert "2.13.0+cpu) is a CPU-only build without NCCL" in nccl.evidence[0]
    results = verdicts("cpu_2ranks")
    for cause in ("shm-too-small", "master-port-in-use", "oom-killed"):
        assert results[cause] == "ruled_out", cause
    for cause in ("duplicate-gpu-per-rank", "set-device-order", "p2p-hang"):
        assert results[cause] == "not_applicable", cause


def _h200(name: str):
    if not (FACTS / f"{name}.json").exists():
        pytest.skip(f"{name}.json not recorded yet (tests/gpu/record_facts.sh on a GPU machine)")
    return verdicts(name)


def test_h200_single_rank_is_healthy():
    results = _h200("h200_1rank")
    assert confirmed("h200_1rank") == set()
    assert results["no-cuda-visible"] == "ruled_out"
    assert results["nccl-version-mismatch"] == "ruled_out"
    assert results["set-device-order"] == "ruled_out"  # one rank: every order works


def test_h200_two_ranks_on_one_gpu_reproduce_duplicate_gpu():
    _h200("h200_2ranks_one_gpu")
    assert {"duplicate-gpu-per-rank", "world-size-exceeds-devices"} <= confirmed(
        "h200_2ranks_one_gpu"
    )
    verdict = verdict_of("set-device-order", "h200_2ranks_one_gpu")
    assert verdict.verdict == "inconclusive" and verdict.refutes == []


# --- set_device order: the seed's contradiction --------------------------------------------


def test_healthy_machine_refutes_removing_set_device():
    verdict = verdict_of("set-device-order", "healthy_8gpu")
    assert verdict.verdict == "inconclusive"
    assert verdict.refutes == ["remove-set-device"]
    assert any("Duplicate GPU detected" in line for line in verdict.evidence)
    refuted, supported = advice_outcomes(runs_of("healthy_8gpu"))
    assert refuted == {"remove-set-device"}
    assert supported == {"set-device-before-init", "set-device-after-init"}


def test_hung_variant_counts_as_not_working():
    outcome = variant_outcomes(runs_of("healthy_8gpu"))["device-id"]
    assert outcome.works is False
    assert (outcome.kind, outcome.step, outcome.error) == ("hang", "all_gather_object", None)


def test_when_no_order_works_no_advice_is_refuted():
    verdict = verdict_of("set-device-order", "two_ranks_one_gpu")
    assert verdict.verdict == "inconclusive"
    assert verdict.refutes == []
    assert "not about the order" in verdict.evidence[0]
    # rank 1's own error explains rank 0 hanging in the barrier
    assert (
        "fails in set_device: RuntimeError: CUDA error: invalid device ordinal"
        in verdict.evidence[1]
    )


def test_every_order_working_rules_the_cause_out():
    runs = runs_of("healthy_8gpu")
    for record in runs["set_device_order"].ranks:
        for variant in record["facts"]["variants"].values():
            variant.update(status="ok")
            variant["facts"].update(step="done", current_uuid=f"GPU-{record['rank']}")
    assert judge("set-device-order", runs, None, []).verdict == "ruled_out"


# --- root errors and findings -----------------------------------------------------------------


def test_root_error_alone_confirms_a_named_cause():
    error = RootError(
        "RuntimeError",
        "Expected to have finished reduction in the prior iteration before starting a new one.",
        1,
    )
    assert judge("unused-parameters", {}, error, []).verdict == "confirmed"
    assert judge("unused-parameters", {}, None, []).verdict == "not_run"


def test_duplicate_gpu_error_on_a_healthy_machine_points_at_the_script():
    error = RootError(
        "torch.distributed.DistBackendError",
        "NCCL error ... ncclInvalidUsage ... Last error: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000",
        1,
    )
    verdict = verdict_of("duplicate-gpu-per-rank", "healthy_8gpu", error)
    assert verdict.verdict == "confirmed"
    assert any("chose it in the script" in line for line in verdict.evidence)
    assert verdict_of("launched-without-torchrun", "healthy_8gpu", error).verdict == "ruled_out"


def test_missing_env_var_confirms_launch_without_torchrun():
    error = RootError(
        "ValueError",
        "Error initializing torch.distributed using env:// rendezvous: environment variable RANK expected, but not set",
    )
    verdict = verdict_of("launched-without-torchrun", "healthy_8gpu", error)
    assert verdict.verdict == "confirmed"
    assert verdict.evidence[0].startswith("the error says RANK is not set")


def test_address_in_use_error_with_a_free_port_now():
    error = RootError(
        "torch.distributed.DistNetworkError",
        "The server socket has failed to listen on any local network address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use",
    )
    verdict = verdict_of("master-port-in-use", "healthy_8gpu", error)
    assert verdict.verdict == "confirmed"
    assert "free now" in " ".join(verdict.evidence)


def test_sigkill_without_oom_kills_here_stays_open():
    # The SIGKILL may come from another node: no OOM kill here does not rule it out.
    error = RootError(
        "ChildFailedError",
        "train.py FAILED ... exitcode : -9 (pid: 4242) Signal 9 (SIGKILL) received by PID 4242",
    )
    verdict = verdict_of("oom-killed", "healthy_8gpu", error)
    assert verdict.verdict == "inconclusive"
    assert "if the job ran here, the SIGKILL came from elsewhere" in verdict.evidence[0]
    assert verdict_of("oom-killed", "healthy_8gpu").verdict == "ruled_out"


def test_sigkill_with_oom_kills_is_confirmed():
    runs = runs_of("healthy_8gpu")
    for record in runs["system"].ranks:
        record["facts"]["oom"]["vmstat_oom_kill"] = 3
    error = RootError("ChildFailedError", "exitcode : -9 Signal 9 (SIGKILL) received")
    assert judge("oom-killed", runs, error, []).verdict == "confirmed"
    assert judge("oom-killed", runs, None, []).verdict == "inconclusive"


def test_finding_confirms_a_code_cause_with_its_line():
    finding = Finding("hardcoded-device", 12, "model.to('cuda:0') ignores LOCAL_RANK", "train.py")
    verdict = verdict_of("hardcoded-device", "healthy_8gpu", findings=[finding])
    assert verdict.verdict == "confirmed"
    assert verdict.evidence[0] == "script train.py:12: model.to('cuda:0') ignores LOCAL_RANK"
    other = verdict_of(
        "hardcoded-device", "healthy_8gpu", findings=[Finding("unused-parameters", 3, "x")]
    )
    assert other.verdict == "inconclusive"


def test_unknown_cause_is_not_run_unless_a_finding_names_it():
    assert judge("a-new-kb-cause", runs_of("healthy_8gpu"), None, []).verdict == "not_run"
    finding = Finding("a-new-kb-cause", 1, "seen")
    assert judge("a-new-kb-cause", {}, None, [finding]).verdict == "confirmed"


# --- probe trouble --------------------------------------------------------------------------


def test_a_timed_out_probe_gives_inconclusive_with_the_reason():
    runs = runs_of("healthy_8gpu")
    runs["system"].status = "timeout"
    runs["system"].detail = "no answer within 30 s"
    verdict = judge("shm-too-small", runs, None, [])
    assert verdict.verdict == "inconclusive"
    assert verdict.evidence == ["the system probe ended with timeout: no answer within 30 s"]


def test_a_probe_that_did_not_run_gives_not_run():
    runs = runs_of("healthy_8gpu")
    del runs["system"]
    assert judge("shm-too-small", runs, None, []).verdict == "not_run"


def test_nccl_all_reduce_hang_with_translating_iommu_confirms_p2p_hang():
    runs = runs_of("healthy_8gpu")
    backend = runs["backend"]
    backend.status = "timeout"
    for record in backend.ranks:
        record["status"] = "timeout"
        record["facts"]["nccl"] = {"result": "running", "step": "all_reduce"}
    for record in runs["system"].ranks:
        record["facts"]["iommu"] = {
            "groups": 120,
            "types": ["DMA-FQ"],
            "cmdline": ["intel_iommu=on"],
        }
    verdict = judge("p2p-hang", runs, None, [])
    assert verdict.verdict == "confirmed"
    assert any("IOMMU translates device DMA" in line for line in verdict.evidence)


# --- versions --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "capability, arch_list, expected",
    [
        ("9.0", ["sm_80", "sm_90"], True),
        ("8.6", ["sm_80"], True),  # same major, newer minor runs sm_80 cubins
        ("6.1", ["sm_70", "sm_80", "sm_90"], False),
        ("12.0", ["sm_90", "compute_90"], True),  # PTX is compiled for newer GPUs
        ("12.0", ["sm_90", "sm_100"], False),
        ("9.0", ["sm_90a"], True),
        ("10.0", ["sm_90a"], False),
        ("9.0", [], None),
    ],
)
def test_arch_support(capability, arch_list, expected):
    assert arch_supported(capability, arch_list) is expected


def test_versions_differing_between_nodes_are_confirmed():
    runs = runs_of("healthy_8gpu")
    second = copy.deepcopy(runs["versions"].ranks[0])
    second.update(rank=8, host="dgx-h100-08")
    second["facts"]["nccl"] = "2.18.1"
    runs["versions"].ranks.append(second)
    verdict = judge("nccl-version-mismatch", runs, None, [])
    assert verdict.verdict == "confirmed"
    assert "NCCL differs between nodes" in verdict.evidence[0]


# --- applying verdicts to a result -----------------------------------------------------------


def _cause(cause_id: str, probes: list[str], answers=()) -> CauseResult:
    return CauseResult(id=cause_id, title=cause_id, score=1.0, probes=probes, answers=list(answers))


def test_apply_verdicts_reranks_and_marks_advice():
    def answer(advice):
        return AnswerRef(
            text="...", lang="zh", thread="seed-000", stance="unverified", advice=advice
        )

    causes = [
        _cause(
            "set-device-order",
            ["set_device_order"],
            [answer("remove-set-device"), answer("set-device-before-init")],
        ),
        _cause("master-port-in-use", ["rendezvous"]),
        _cause("unused-parameters", []),
        _cause("shm-too-small", ["system"]),
    ]
    given = Result(query="q", root_error=None, causes=causes, lang="en")
    runs = load_runs(FACTS / "shm_64mb.json")
    result = apply_verdicts(given, runs, [])
    assert [c.id for c in result.causes] == [
        "shm-too-small",  # confirmed rises
        "set-device-order",  # then inconclusive, then not_run
        "unused-parameters",
        "master-port-in-use",  # ruled out sinks
    ]
    # What this machine showed goes beside the community stance, never over it;
    # the advice confirmed here comes first.
    answers = result.causes[1].answers
    assert [(a.advice, a.here, a.stance) for a in answers] == [
        ("set-device-before-init", "confirmed_here", "unverified"),
        ("remove-set-device", "refuted_here", "unverified"),
    ]
    assert result.probes == runs
    assert result.to_json()["causes"][0]["verdict"] == "confirmed"
    assert result.to_json()["causes"][0]["verdict_source"] == "probe"
    # Pure: the given result is as it was.
    assert [c.id for c in given.causes] == [
        "set-device-order",
        "master-port-in-use",
        "unused-parameters",
        "shm-too-small",
    ]
    assert all(c.verdict.verdict == "not_run" for c in given.causes)
    assert [a.here for a in given.causes[0].answers] == ["", ""]
    assert given.probes == []


def test_apply_verdicts_uses_the_result_language():
    given = Result(
        query=None, root_error=None, causes=[_cause("shm-too-small", ["system"])], lang="zh"
    )
    result = apply_verdicts(given, load_runs(FACTS / "shm_64mb.json"), [])
    assert "空闲" in result.causes[0].verdict.evidence[0]


def test_probes_for_deduplicates_in_order_and_limits_causes():
    causes = [
        _cause("a", ["devices", "launch_env"]),
        _cause("b", ["launch_env", "set_device_order", "not-a-probe"]),
        _cause("c", ["system"]),
    ]
    assert probes_for(causes) == ["devices", "launch_env", "set_device_order", "system"]
    assert probes_for(causes, limit=1) == ["devices", "launch_env"]
    assert probes_for([]) == []


def test_a_gpu_error_pasted_on_a_cpu_machine_is_not_blamed_on_the_missing_gpu():
    error = RootError(
        "torch.distributed.DistBackendError",
        "NCCL error in: NCCLUtils.hpp:317, invalid usage, NCCL version 2.21.5 "
        "ncclInvalidUsage: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000",
        1,
    )
    verdict = verdict_of("no-cuda-visible", "cpu_2ranks", error)
    assert verdict.verdict == "not_applicable"
    assert "failing machine" in verdict.evidence[0]
    assert verdict_of("no-cuda-visible", "cpu_2ranks").verdict == "confirmed"


def test_a_confirmed_cause_with_weak_retrieval_does_not_jump_the_error_s_own_cause():
    error = RootError(
        "RuntimeError", "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000"
    )
    given = Result(
        query="q",
        root_error=error,
        causes=[
            CauseResult(id="hardcoded-device", title="t", score=1.0),
            CauseResult(id="shm-too-small", title="t", score=0.9),
            CauseResult(id="master-port-in-use", title="t", score=0.2),
        ],
    )
    runs = list(runs_of("busy_port").values())
    result = apply_verdicts(given, runs, [])
    by_id = {c.id: c.verdict.verdict for c in result.causes}
    assert by_id["master-port-in-use"] == "confirmed"
    assert next(c.id for c in result.causes) == "hardcoded-device"


def test_causes_do_not_share_one_default_verdict():
    first, second = (
        CauseResult(id="a", title="a", score=1.0),
        CauseResult(id="b", title="b", score=0.5),
    )
    first.verdict.evidence.append("only about a")
    assert second.verdict.evidence == []


def test_workers_of_another_run_still_alive_confirm_leftover_processes():
    runs = runs_of("healthy_8gpu")
    # recorded before the probe looked for them: nothing is said either way
    assert judge("leftover-processes", runs, None, []).verdict == "not_run"
    stale = {
        "pid": 4242,
        "ppid": 1,
        "orphaned": True,
        "local_rank": "0",
        "cmdline": "python train.py",
    }
    for record in runs["system"].ranks:
        record["facts"]["stale_workers"] = [stale]
    verdict = judge("leftover-processes", runs, None, [])
    assert verdict.verdict == "confirmed" and verdict.source == "probe"
    assert "pid 4242 (python train.py, orphaned)" in verdict.evidence[0]
    for record in runs["system"].ranks:
        record["facts"]["stale_workers"] = []
    assert judge("leftover-processes", runs, None, []).verdict == "ruled_out"
    for record in runs["system"].ranks:
        record["facts"]["stale_workers"] = None  # no /proc (not Linux)
    assert judge("leftover-processes", runs, None, []).verdict == "not_applicable"
