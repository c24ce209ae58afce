"""The probe runner: settings and record handling here; real torchrun launches
(gloo, 2 ranks, marked slow) in the second half.

The launches are few on purpose (each costs seconds): one healthy doctor run
shared by a module fixture, one with a busy port, one hanging probe, one
cancel and one Ctrl-C. Leftover processes are found by a tag the test puts
in the launch environment, which every process of the launch inherits.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from assistant.config import PROJECT_ROOT
from assistant.pipeline import Observer, Pipeline
from assistant.probing import machine, outcomes
from assistant.probing import runner as runner_module
from assistant.probing.processes import pids_with_env
from assistant.probing.recorded import load_runs, save_runs
from assistant.probing.registry import PROBES, probe_names
from assistant.probing.runner import ProbeRunner, visible_gpu_count
from assistant.results import ProbeRun
from assistant.verdicts import judge

PROBES_DIR = PROJECT_ROOT / "probes"


def tagged_processes(tag: str) -> list[int]:
    """Live processes whose environment carries PROBE_TEST_TAG=tag (zombies excluded)."""
    return pids_with_env("PROBE_TEST_TAG", tag)


def new_tag() -> str:
    return uuid.uuid4().hex


def machine_has_nvidia_gpu() -> bool:
    """Independent of the probes: is there an NVIDIA driver on this machine at all?"""
    return shutil.which("nvidia-smi") is not None or Path("/proc/driver/nvidia").exists()


# --- settings (no launch) -------------------------------------------------------------


def test_unknown_probe_name_is_a_value_error():
    with pytest.raises(ValueError, match="unknown probe nope .*known: launch_env"):
        ProbeRunner().run(["devices", "nope"])


def test_missing_python_is_a_value_error():
    with pytest.raises(ValueError, match="no python interpreter at /no/such/python"):
        ProbeRunner(python="/no/such/python")


@pytest.mark.parametrize("kwargs", [{"nproc_per_node": 0}, {"timeout": 0}])
def test_bad_numbers_are_value_errors(kwargs):
    with pytest.raises(ValueError):
        ProbeRunner(**kwargs)


def test_launch_env_hands_over_the_users_launcher_variables():
    runner = ProbeRunner(
        nproc_per_node=2,
        env={
            "MASTER_PORT": "29999",
            "RANK": "3",
            "PET_NNODES": "2",
            "NCCL_DEBUG": "INFO",
            "PYTHONSAFEPATH": "1",
        },
    )
    env = runner._launch_env(Path("/tmp/facts"), None, Path("/tmp/launch-tmp"))
    assert "MASTER_PORT" not in env and env["PROBE_USER_MASTER_PORT"] == "29999"
    assert "RANK" not in env and env["PROBE_USER_RANK"] == "3"
    assert "PET_NNODES" not in env and env["PROBE_USER_PET_NNODES"] == "2"
    assert env["NCCL_DEBUG"] == "INFO"  # the user's NCCL settings pass through
    assert "PYTHONSAFEPATH" not in env
    assert env["PROBE_FACTS_DIR"] == "/tmp/facts" and "PROBE_VARIANT" not in env
    assert env["PROBE_NPROC_SOURCE"] == "user" and env["PROBE_RUNNER"] == "1"
    assert env["TMPDIR"] == "/tmp/launch-tmp"  # the launch's own, removed with it


def test_nproc_defaults_to_two_without_gpus(monkeypatch):
    monkeypatch.setattr(machine, "physical_gpu_count", lambda: 0)
    runner = ProbeRunner()
    assert runner.nproc_per_node == 2 and runner.nproc_source == "default"


@pytest.mark.parametrize(
    "visible, physical, expected",
    [
        (None, 8, 8),
        ("0,1", 8, 2),
        ("", 8, 0),
        ("0,9,1", 8, 1),  # CUDA stops at the first invalid entry
        ("GPU-3f2a1b2c-1111-2222-3333-444455556666", 8, 1),
        ("0,1", 0, 0),
        ("0,1", None, 0),  # a driver that cannot be asked counts as no GPU
    ],
)
def test_visible_gpu_count_reads_cuda_visible_devices_like_cuda(
    monkeypatch, visible, physical, expected
):
    monkeypatch.setattr(machine, "physical_gpu_count", lambda: physical)
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert visible_gpu_count(env) == expected


def test_facts_files_round_trip(tmp_path):
    runs = [
        ProbeRun(
            "devices",
            "not_applicable",
            0.4,
            [{"rank": 0, "status": "not_applicable", "facts": {}}],
            "no CUDA",
        )
    ]
    save_runs(tmp_path / "x.json", runs, scenario="x", description="d")
    assert load_runs(tmp_path / "x.json") == runs
    assert json.loads((tmp_path / "x.json").read_text())["format"] == 1


def _record(probe, rank, status, facts=None, **extra):
    return {
        "probe": probe,
        "rank": rank,
        "status": status,
        "reason": "",
        "summary": "",
        "problems": [],
        "seconds": 0.1,
        "facts": facts or {},
        **extra,
    }


def test_a_hung_probe_keeps_its_facts_and_unstarted_probes_are_rerun():
    records = {
        ("launch_env", 0): _record("launch_env", 0, "ok"),
        ("launch_env", 1): _record("launch_env", 1, "ok"),
        ("versions", 0): _record("versions", 0, "running", {"step": "nvidia-smi", "torch": "2.13"}),
        ("versions", 1): _record("versions", 1, "ok"),
    }
    end = outcomes.LaunchEnd("probe_timeout", hung="versions")
    launch = outcomes.LaunchResult(
        ["launch_env", "versions", "system"],
        2,
        end,
        records,
        [],
        {"launch_env": 15, "versions": 30, "system": 30},
        {"launch_env": 0.0, "versions": 0.1},
        60.0,
    )
    runs, rerun = outcomes.batch_runs(launch)
    assert rerun == ["system"]
    assert runs["launch_env"].status == "ok"
    hung = runs["versions"]
    assert hung.status == "timeout" and hung.detail == "no answer within 30 s (stuck in nvidia-smi)"
    assert hung.ranks[0]["facts"]["torch"] == "2.13" and hung.ranks[0]["status"] == "timeout"


def test_a_crashed_launch_reports_the_error_line():
    end = outcomes.LaunchEnd("exit", code=1)
    tail = [
        "Traceback (most recent call last):",
        "  File ...",
        "ModuleNotFoundError: No module named 'torch'",
    ]
    launch = outcomes.LaunchResult(["devices"], 2, end, {}, tail, {"devices": 60}, {}, 60.0)
    runs, _ = outcomes.batch_runs(launch)
    assert runs["devices"].status == "error"
    assert runs["devices"].detail == "ModuleNotFoundError: No module named 'torch'"
    assert [r["status"] for r in runs["devices"].ranks] == ["error", "error"]


def test_registry_variants_match_the_probe_script():
    sys.path.insert(0, str(PROBES_DIR))
    try:
        import set_device_order
    finally:
        sys.path.remove(str(PROBES_DIR))
    assert PROBES["set_device_order"].variants == set_device_order.VARIANTS


# --- real launches ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def healthy():
    """One doctor run on this machine, shared by the tests below."""
    tag = new_tag()
    # The user's MASTER_PORT: a port nothing holds, so the run is healthy even
    # while another job on this machine uses the default 29500.
    runner = ProbeRunner(env={"PROBE_TEST_TAG": tag, "MASTER_PORT": str(machine.free_port())})
    events = []
    started = time.monotonic()
    result = Pipeline(runner=runner).doctor(observer=Observer(on_probe=events.append))
    return {
        "result": result,
        "runner": runner,
        "events": events,
        "seconds": time.monotonic() - started,
        "tag": tag,
    }


@pytest.mark.slow
def test_healthy_run_confirms_nothing_false(healthy):
    result = healthy["result"]
    confirmed = {c.id for c in result.causes if c.verdict.verdict == "confirmed"}
    # On a machine without a GPU, no-cuda-visible is a true finding; so is
    # nccl-not-available with a torch built without NCCL (the CPU wheel).
    import torch.distributed

    allowed = set() if machine_has_nvidia_gpu() else {"no-cuda-visible"}
    if not torch.distributed.is_nccl_available():
        allowed.add("nccl-not-available")
    assert confirmed <= allowed
    assert {p.status for p in result.probes} <= {"ok", "not_applicable"}
    verdicts = [c.verdict.verdict for c in result.causes]
    assert verdicts == sorted(verdicts, key=lambda v: {"confirmed": 0, "ruled_out": 2}.get(v, 1))
    json.dumps(result.to_json())


@pytest.mark.slow
def test_healthy_run_is_one_launch_without_gpus(healthy):
    if machine_has_nvidia_gpu():
        pytest.skip("set_device_order adds a launch per variant on a GPU machine")
    assert healthy["runner"].launches == 1


@pytest.mark.slow
def test_healthy_run_reports_progress_and_leaves_no_process(healthy):
    events = healthy["events"]
    for name in probe_names():
        states = [e.state for e in events if e.probe == name]
        assert states == ["started", "finished"], (name, states)
    assert all(e.status for e in events if e.state == "finished")
    assert tagged_processes(healthy["tag"]) == []


@pytest.mark.slow
def test_rendezvous_probe_checks_the_users_port_not_the_launch_port(healthy):
    runs = {r.name: r for r in healthy["result"].probes}
    rank0 = runs["rendezvous"].ranks[0]["facts"]
    launch = runs["launch_env"].ranks[0]["facts"]
    assert rank0["port"] == int(launch["user_env"]["MASTER_PORT"])
    assert rank0["port"] != int(launch["env"]["MASTER_PORT"])
    assert rank0["port_free"] is True and rank0["store"]["result"] == "ok"


@pytest.mark.slow
def test_a_held_port_29500_confirms_master_port_in_use():
    tag = new_tag()
    holder = socket.socket()
    env = {"PROBE_TEST_TAG": tag}
    try:
        holder.bind(("0.0.0.0", 29500))
    except OSError:  # another job holds 29500 right now: hold a port of our own instead
        port = machine.free_port()
        holder.bind(("0.0.0.0", port))
        env["MASTER_PORT"] = str(port)
    holder.listen(1)
    try:
        runs = {r.name: r for r in Pipeline(runner=ProbeRunner(env=env)).run_named(["rendezvous"])}
    finally:
        holder.close()
    verdict = judge("master-port-in-use", runs, None, [])
    assert verdict.verdict == "confirmed"
    assert f"held by pid {os.getpid()}" in verdict.evidence[0]
    assert runs["rendezvous"].status == "failed"
    assert tagged_processes(tag) == []


@pytest.mark.slow
def test_a_hung_probe_times_out_within_its_budget_and_leaves_no_process(hanging_probes):
    tag = new_tag()
    runner = ProbeRunner(timeout=120, env={"PROBE_TEST_TAG": tag}, probe_timeout=3)
    events = []
    runs = {
        r.name: r
        for r in runner.run(["launch_env", "versions", "system"], on_progress=events.append)
    }
    assert runs["versions"].status == "timeout"
    assert runs["versions"].detail == "no answer within 3 s (stuck in sleeping)"
    assert all(r["facts"].get("before_hang") for r in runs["versions"].ranks)
    assert runs["launch_env"].status == "ok"
    assert runs["system"].status == "ok"  # never started in the hung launch: run again
    assert runner.launches == 2
    started = next(e.elapsed for e in events if e.probe == "versions" and e.state == "started")
    finished = next(e.elapsed for e in events if e.probe == "versions" and e.state == "finished")
    # Killed at its budget, not at the launch timeout (120 s); slack for a busy machine.
    assert 3 <= finished - started < 3 + runner_module.KILL_GRACE_SECONDS + 15
    assert tagged_processes(tag) == []


@pytest.mark.slow
def test_cancel_stops_the_launch_and_leaves_no_process(hanging_probes):
    tag = new_tag()
    cancel = threading.Event()

    def on_progress(event):
        if event.probe == "versions" and event.state == "started":
            # a moment later the probe has saved its partial fact and hangs
            threading.Timer(3.0, cancel.set).start()

    runner = ProbeRunner(timeout=120, env={"PROBE_TEST_TAG": tag})
    started = time.monotonic()
    runs = runner.run(["versions", "system"], on_progress=on_progress, cancel=cancel)
    assert time.monotonic() - started < 60
    assert [r.status for r in runs] == ["interrupted", "interrupted"]
    assert runs[0].ranks[0]["facts"]["before_hang"] is True
    assert tagged_processes(tag) == []


@pytest.mark.slow
def test_ctrl_c_kills_the_launch_and_propagates(hanging_probes, terminal_sigint):
    tag = new_tag()
    script = textwrap.dedent(
        f"""
        from assistant.probing.runner import ProbeRunner
        def show(event):
            print(event.probe, event.state, flush=True)
        ProbeRunner(timeout=120, env={{"PROBE_TEST_TAG": "{tag}"}}).run(["versions"], on_progress=show)
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "ASSISTANT_PROBES": str(hanging_probes)},
    )
    try:
        assert process.stdout.readline().strip() == "versions started"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0
    assert "KeyboardInterrupt" in stderr
    assert tagged_processes(tag) == []


def test_a_run_cancelled_before_it_starts_launches_nothing():
    cancel = threading.Event()
    cancel.set()
    runner = ProbeRunner(nproc_per_node=2)
    runs = runner.run(["launch_env", "versions"], cancel=cancel)
    assert [r.status for r in runs] == ["interrupted", "interrupted"]
    assert runner.launches == 0
    assert all(len(r.ranks) == 2 for r in runs)


@pytest.mark.slow
def test_a_launch_leaves_no_temp_folder(tmp_path, monkeypatch):
    """Neither ours nor torchrun's torchelastic_* log folder stays in the temp dir."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # for torchrun
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # for this process
    runs = ProbeRunner(nproc_per_node=2).run(["launch_env"])
    assert runs[0].status == "ok"
    assert list(temp.iterdir()) == []
