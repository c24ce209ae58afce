"""`assistant run` on real failing launches: real torchrun, gloo, 2 CPU ranks, the real pipeline."""

from __future__ import annotations

import socket

import pytest
from watch_helpers import PYTHON, SCRIPTS, TORCHRUN, no_job_left

from assistant.watch.session import RunCallbacks, RunOptions, run_and_diagnose

pytestmark = pytest.mark.slow


def run(command, tmp_path, engine, output, probe=False):
    options = RunOptions(hang_after=60, log_dir=tmp_path / "logs", probe=probe, top=5)
    outcome = run_and_diagnose(command, options, engine, RunCallbacks(on_output=output))
    assert no_job_left(tmp_path / "logs"), "a process of the job was left behind"
    return outcome


def test_an_exception_on_one_rank_is_the_root_error_from_its_own_record(tmp_path, engine, output):
    outcome = run([*TORCHRUN, str(SCRIPTS / "raises_on_rank_one.py")], tmp_path, engine, output)
    launch = outcome.launch
    assert launch.exit_code == 1 and not launch.hung
    assert "rank 1 ready" in output.text("stdout")  # streamed as the job wrote it
    assert "ValueError: bad batch shape on rank one" in output.text("stderr")
    assert "sitecustomize" not in output.text()
    assert (outcome.result.root_error.type, outcome.result.root_error.rank) == ("ValueError", 1)
    rank1 = outcome.to_json()["ranks"][1]
    assert rank1["error"] == {"type": "ValueError", "message": "bad batch shape on rank one"}
    assert rank1["exit_code"] == 1 and rank1["where"]["line"] == 12
    assert (rank1["rank"], rank1["local_rank"]) == (1, 1)
    payload = outcome.to_json()
    assert payload["launch"]["exit_code"] == 1 and payload["launch"]["hung"] is False
    assert payload["causes"] and "root_error" in payload  # the ask contract, plus launch and ranks
    assert "ValueError: bad batch shape on rank one" in (launch.log_dir / "rank1.err").read_text()


def test_a_rank_killed_by_sigkill_is_the_root_error_not_its_peers_connection_error(
    tmp_path, engine, output
):
    outcome = run([*TORCHRUN, str(SCRIPTS / "sigkill_on_rank_one.py")], tmp_path, engine, output)
    root = outcome.result.root_error
    assert outcome.launch.exit_code == 1
    assert root.rank == 1 and "SIGKILL" in root.message and root.type.endswith("ChildFailedError")
    ranks = {r["rank"]: r for r in outcome.to_json()["ranks"]}
    assert ranks[1]["exit_code"] == -9 and ranks[1]["error"] is None
    assert "oom-killed" in [c.id for c in outcome.result.causes[:3]]


def test_a_torchrun_script_started_with_plain_python(tmp_path, engine, output):
    outcome = run([PYTHON, str(SCRIPTS / "raises_on_rank_one.py")], tmp_path, engine, output)
    assert outcome.launch.exit_code == 1
    (only,) = outcome.to_json()["ranks"]
    assert only["rank"] is None and "RANK expected" in only["error"]["message"]
    assert outcome.result.root_error.message.startswith("Error initializing torch.distributed")
    assert outcome.result.causes[0].id == "launched-without-torchrun"


def test_mp_spawn_childrens_exceptions_are_recorded(tmp_path, engine, output):
    outcome = run([PYTHON, str(SCRIPTS / "spawn_raises_on_rank_one.py")], tmp_path, engine, output)
    assert outcome.launch.exit_code == 1
    root = outcome.result.root_error
    assert (root.type, root.message, root.rank) == ("RuntimeError", "loss is NaN on rank one", 1)
    assert [r["rank"] for r in outcome.to_json()["ranks"]] == [0, 1]
    # The hook stays out of the tracebacks the user reads.
    assert "Traceback" in output.text() and "sitecustomize" not in output.text()


def test_a_busy_master_port_fails_in_torchrun_and_probes_run_like_the_job(tmp_path, engine, output):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        command = [*TORCHRUN, f"--master_port={port}", str(SCRIPTS / "raises_on_rank_one.py")]
        outcome = run(command, tmp_path, engine, output, probe=True)
    assert outcome.launch.exit_code == 1 and outcome.to_json()["ranks"] == []
    root = outcome.result.root_error
    assert "EADDRINUSE" in root.message and root.type.endswith("DistNetworkError")
    first = outcome.result.causes[0]
    assert (first.id, first.verdict.verdict) == ("master-port-in-use", "confirmed")
    probes = outcome.to_json()["probes"]
    assert probes and all(p["status"] in ("ok", "failed", "not_applicable") for p in probes)


def test_torchruns_own_redirects_are_kept_and_the_records_still_come(tmp_path, engine, output):
    theirs = tmp_path / "torchrun-logs"
    command = [*TORCHRUN, "--redirects", "3", "--log-dir", str(theirs)]
    outcome = run([*command, str(SCRIPTS / "raises_on_rank_one.py")], tmp_path, engine, output)
    assert (outcome.result.root_error.type, outcome.result.root_error.rank) == ("ValueError", 1)
    (rank1_stderr,) = theirs.glob("*/attempt_0/1/stderr.log")
    assert "ValueError: bad batch shape on rank one" in rank1_stderr.read_text()
