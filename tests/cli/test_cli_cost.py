"""`assistant --help` and `assistant kb lint` must not pay for torch or the model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "sentence_transformers", "faiss", "textual", "transformers")

PROBE = """
import sys
from assistant.cli import main
try:
    main({args!r}, prog_name="assistant")
except SystemExit:
    pass
heavy = [m for m in {heavy!r} if m in sys.modules]
print("HEAVY=" + ",".join(heavy), file=sys.stderr)
"""


@pytest.mark.parametrize(
    "args", [["--help"], ["kb", "lint"], ["ask", "--help"], ["lint", "--help"]]
)
def test_light_commands_import_nothing_heavy(args):
    code = PROBE.format(args=args, heavy=HEAVY)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    marker = [line for line in done.stderr.splitlines() if line.startswith("HEAVY=")]
    assert marker == ["HEAVY="], done.stderr


def test_every_command_has_help_with_an_example():
    from click.testing import CliRunner

    from assistant.cli import main

    def walk(group, prefix):
        for name, command in group.commands.items():
            yield prefix + [name], command
            if hasattr(command, "commands"):
                yield from walk(command, prefix + [name])

    for path, command in walk(main, []):
        assert command.help, f"{' '.join(path)} has no help"
        if not hasattr(command, "commands"):
            assert "assistant " in command.help, f"{' '.join(path)} help shows no example"
        result = CliRunner().invoke(main, path + ["--help"])
        assert result.exit_code == 0


# The query commands against the session's real index (built by the `engine`
# fixture, with its checked ONNX graph): the model's own tokenizer, ONNX
# Runtime, FAISS and SQLite, never torch or sentence-transformers.
QUERY_HEAVY = ("torch", "sentence_transformers", "transformers", "textual")
QUESTION = "RuntimeError: Default process group has not been initialized"
MAX_PEAK_RSS_MIB = 350  # the one-shot ask: ~240 MiB measured; torch alone adds ~400


def run_cli(args: list[str], heavy=QUERY_HEAVY) -> subprocess.CompletedProcess:
    code = PROBE.format(args=args, heavy=heavy)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )


def query_commands(tmp_path) -> dict[str, list[str]]:
    batch = tmp_path / "batch.jsonl"
    batch.write_text(
        json.dumps({"id": "a", "query": QUESTION})
        + "\n"
        + json.dumps({"id": "b", "query": "多卡训练两个进程都跑到0号卡上了"})
        + "\n"
    )
    return {
        "ask": ["ask", "--no-probe", "--json", QUESTION],
        "ask --batch": ["ask", "--no-probe", "--batch", str(batch)],
        "explain": ["explain", "duplicate-gpu-per-rank", "--json"],
    }


@pytest.mark.slow
@pytest.mark.parametrize("command", ["ask", "ask --batch", "explain"])
def test_query_commands_answer_without_the_model_stack(engine, tmp_path, command):
    done = run_cli(query_commands(tmp_path)[command])
    marker = [line for line in done.stderr.splitlines() if line.startswith("HEAVY=")]
    assert marker == ["HEAVY="], done.stderr
    # No fallback and no export notice (a KB edited meanwhile may be rebuilt: that is fine).
    assert not [line for line in done.stderr.splitlines() if "ONNX" in line], done.stderr
    if command == "ask":
        assert json.loads(done.stdout)["causes"][0]["id"] == "process-group-not-initialized"
    if command == "ask --batch":
        assert [json.loads(line)["id"] for line in done.stdout.splitlines()] == ["a", "b"]


# A wrapper process whose only child is the ask: its RUSAGE_CHILDREN peak is the ask's.
PEAK_RSS = """
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)
print(done.stderr, file=sys.stderr)
"""


@pytest.mark.slow
def test_a_cold_ask_peaks_under_350_mib(engine):
    ask = [sys.executable, "-m", "assistant", "ask", "--no-probe", "--json", QUESTION]
    done = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, *ask],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    returncode, peak_mib = map(int, done.stdout.split())
    assert returncode == 0, done.stderr
    assert peak_mib <= MAX_PEAK_RSS_MIB, f"{peak_mib} MiB"
