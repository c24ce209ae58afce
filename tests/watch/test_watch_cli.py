"""`assistant run` as a user starts it: a real process, real signals, exit codes, --json."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from watch_helpers import PYTHON, SCRIPTS, TORCHRUN, job_pids, no_job_left

from assistant.cli import main

pytestmark = pytest.mark.slow

ASSISTANT = [sys.executable, "-m", "assistant", "run"]


def start_assistant(args, tmp_path) -> subprocess.Popen:
    return subprocess.Popen(
        [*ASSISTANT, "--no-probe", "--log-dir", str(tmp_path / "logs"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_line(stream, wanted: str, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = stream.readline()
        if wanted in line:
            return
        if not line:
            time.sleep(0.05)
    raise AssertionError(f"{wanted!r} never printed")


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_assistant_run_ends_the_whole_job(tmp_path, signum, code, terminal_sigint):
    script = str(SCRIPTS / "rank_one_sleeps_outside_collective.py")
    process = start_assistant(["--", *TORCHRUN, script], tmp_path)
    try:
        wait_for_line(process.stdout, "rank 1 ready")
        assert job_pids(tmp_path / "logs")
        process.send_signal(signum)
        assert process.wait(timeout=20) == code
    finally:
        process.kill()
    assert no_job_left(tmp_path / "logs")
    assert f"logs in {tmp_path / 'logs'}" in process.stderr.read()


def test_json_after_a_hang_has_launch_and_ranks_and_exit_code_124(tmp_path, engine):
    script = str(SCRIPTS / "rank_one_sleeps_outside_collective.py")
    process = start_assistant(["--json", "--hang-after", "6", "--", *TORCHRUN, script], tmp_path)
    out, err = process.communicate(timeout=240)
    assert process.returncode == 124, err[-2000:]
    assert "rank 0 ready" in err  # the job's own output goes to stderr under --json
    payload = json.loads(out)
    assert payload["launch"]["hung"] is True and payload["launch"]["exit_code"] is None
    assert payload["launch"]["log_dir"] == str(tmp_path / "logs")
    assert payload["ranks"][1]["where"]["function"] == "slow_preprocessing"
    assert payload["ranks"][0]["waiting_in"] == "all_reduce"
    assert payload["causes"][0]["id"] == "collective-timeout"
    assert no_job_left(tmp_path / "logs")


def test_a_succeeding_command_streams_and_exits_0_without_loading_anything(tmp_path):
    result = CliRunner().invoke(
        main, ["run", "--log-dir", str(tmp_path / "logs"), "--", PYTHON, "-c", "print('trained')"]
    )
    assert result.exit_code == 0, result.output
    assert "trained" in result.output


def test_the_commands_own_exit_code_comes_back(tmp_path):
    code = "import sys; print('bye'); sys.exit(3)"
    process = start_assistant(["--json", "--", PYTHON, "-c", code], tmp_path)
    out, err = process.communicate(timeout=240)
    assert process.returncode == 3, err[-2000:]
    assert json.loads(out)["launch"]["exit_code"] == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "Missing argument"),
        (
            ["--", "no-such-launcher-xyz", "train.py"],
            "cannot run no-such-launcher-xyz: not found on PATH",
        ),
        (["--", "./missing.sh"], "not an executable file"),
    ],
)
def test_a_command_that_cannot_run_is_a_one_line_usage_error(tmp_path, args, message):
    result = CliRunner().invoke(main, ["run", "--log-dir", str(tmp_path / "logs"), *args])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output
