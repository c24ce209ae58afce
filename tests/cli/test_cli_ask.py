"""`assistant ask` in process: three ways in, the JSON contract, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from assistant.cli import main

pytestmark = pytest.mark.slow

DUPLICATE = (
    "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, "
    "invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version 2.21.5\n"
    "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
    "Last error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000"
)


@pytest.fixture
def run(engine, monkeypatch):
    """Invoke the CLI in process, sharing the session's loaded engine."""
    monkeypatch.setattr("assistant.cli.commands._engine", lambda model: engine)

    def invoke(args, stdin=None):
        return CliRunner().invoke(main, args, input=stdin)

    return invoke


@pytest.mark.parametrize("way", ["argument", "file", "stdin"])
def test_three_ways_in_give_the_same_contract(run, tmp_path, way):
    if way == "argument":
        result = run(["ask", "--json", "--no-probe", DUPLICATE])
    elif way == "file":
        path = tmp_path / "error.log"
        path.write_text(DUPLICATE)
        result = run(["ask", "--json", "--no-probe", "--file", str(path)])
    else:
        result = run(["ask", "--json", "--no-probe", "-"], stdin=DUPLICATE)
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    # The contract's keys first, in order; keys are only ever added after them.
    assert list(payload)[:4] == ["query", "root_error", "causes", "probes"]
    assert {"confidence", "decide", "answer_id"} <= set(payload)
    assert payload["confidence"] == "high" and payload["decide"] == []
    assert payload["query"] == DUPLICATE
    assert payload["root_error"]["type"] == "torch.distributed.DistBackendError"
    first = payload["causes"][0]
    assert first["id"] == "duplicate-gpu-per-rank"
    assert list(first)[:3] == ["id", "title", "score"]
    assert {"verdict", "verdict_source", "evidence", "answers", "fix"} <= set(first)
    # No probe ran: the verdict rests on the error text, and says so.
    assert (first["verdict"], first["verdict_source"]) == ("confirmed", "error")
    assert 0 < first["score"] <= 1
    assert set(first["answers"][0]) == {"text", "lang", "thread", "stance"}
    assert payload["probes"] == []


def test_top_limits_causes(run):
    result = run(["ask", "--json", "--no-probe", "--top", "2", DUPLICATE])
    assert len(json.loads(result.stdout)["causes"]) == 2


def test_chinese_question_gets_chinese_titles_and_seed_answers(run):
    result = run(
        ["ask", "--json", "--no-probe", "用PyTorch做多卡训练，DDP一直报错找不到设备，求指点"]
    )
    payload = json.loads(result.stdout)
    ids = [c["id"] for c in payload["causes"]]
    assert {"duplicate-gpu-per-rank", "local-rank-not-from-env", "set-device-order"} & set(ids[:3])
    assert any("\u4e00" <= ch <= "\u9fff" for ch in payload["causes"][0]["title"])
    threads = {a["thread"] for c in payload["causes"] for a in c["answers"]}
    assert "seed-000-ddp-cant-find-device" in threads


def test_human_output_shows_root_error_causes_and_fix(run):
    result = run(["ask", "--no-probe", DUPLICATE])
    assert result.exit_code == 0
    assert "Root error" in result.stdout
    assert "duplicate-gpu-per-rank" in result.stdout
    assert "LOCAL_RANK" in result.stdout


def test_code_piped_in_with_the_question_is_linted_and_named_as_the_evidence(run):
    question = (
        "self.all_gather in test_epoch_end hangs forever on 2 GPUs\n"
        "\n"
        "```python\n"
        "class Model(pl.LightningModule):\n"
        "    def test_epoch_end(self, outputs):\n"
        "        if self.trainer.is_global_zero:\n"
        "            outputs = self.all_gather(outputs)\n"
        "            return outputs\n"
        "```\n"
    )
    result = run(["ask", "--no-probe", "--json", "-"], stdin=question)
    assert result.exit_code == 0, result.stderr
    first = json.loads(result.stdout)["causes"][0]
    assert (first["id"], first["verdict"], first["verdict_source"]) == (
        "collective-mismatch",
        "confirmed",
        "script",
    )
    assert first["evidence"][0].startswith("the code in the question, line 7: all_gather()")


def test_batch_keeps_order_and_ids(run, tmp_path):
    batch = tmp_path / "q.jsonl"
    batch.write_text(
        json.dumps({"id": "x1", "query": DUPLICATE})
        + "\n"
        + json.dumps({"id": "x2", "query": "Default process group has not been initialized"})
        + "\n"
    )
    result = run(["ask", "--no-probe", "--batch", str(batch)])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["id"] for line in lines] == ["x1", "x2"]
    assert lines[1]["causes"][0]["id"] == "process-group-not-initialized"


@pytest.mark.parametrize(
    "args, stdin, message",
    [
        (["ask", "--no-probe", "   "], None, "the question is empty"),
        (["ask", "--no-probe", "-"], "\n\n", "the question is empty"),
        (["ask", "--no-probe", "--top", "0", "x"], None, "--top must be between"),
        (
            ["ask", "--no-probe", "--batch", "/nonexistent/q.jsonl"],
            None,
            "cannot read --batch file",
        ),
        (["ask", "--no-probe", "--file", "/nonexistent/e.log"], None, "cannot read"),
        (["probe", "crystal_ball"], None, "unknown probe crystal_ball"),
        (["probe", "--python", "/nonexistent/python", "versions"], None, "--python: no python"),
        (["ask", "--python", "/nonexistent/python", "x"], None, "--python: no python"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(run, args, stdin, message):
    result = run(args, stdin)
    assert result.exit_code == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_bad_batch_line_names_file_and_line(run, tmp_path):
    batch = tmp_path / "q.jsonl"
    batch.write_text('{"id": 1, "query": "x"}\nnot json\n')
    result = run(["ask", "--no-probe", "--batch", str(batch)])
    assert result.exit_code == 2
    assert f"{batch}:2:" in result.stderr


def test_invalid_utf8_on_stdin_is_answered(engine, monkeypatch):
    from assistant.cli.commands import decode_input

    text = decode_input(b"RuntimeError: Default process group has not been initialized \xff\xfe\n")
    assert "\ufffd" in text
    assert engine.ask(text).causes[0].id == "process-group-not-initialized"


def test_binary_on_stdin_is_refused(run):
    result = CliRunner().invoke(main, ["ask", "--no-probe", "-"], input=bytes(range(256)) * 100)
    assert result.exit_code == 2
    assert "looks binary" in result.stderr


def test_ask_runs_linked_probes_and_confirms_a_held_port(run, monkeypatch):
    """Real torchrun: port 29500 is held, the error says EADDRINUSE -> confirmed first."""
    import socket

    monkeypatch.delenv("MASTER_PORT", raising=False)
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        holder.bind(("0.0.0.0", 29500))
        holder.listen(1)
    except OSError:
        pytest.skip("port 29500 is busy already")
    error = (
        "torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
        "network address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, "
        "message: address already in use"
    )
    try:
        result = run(["ask", "--json", "--top", "3", "--nproc-per-node", "2", error])
    finally:
        holder.close()
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    first = payload["causes"][0]
    assert first["id"] == "master-port-in-use"
    assert first["verdict"] == "confirmed"
    assert any("29500" in line for line in first["evidence"])
    assert payload["probes"] and {p["status"] for p in payload["probes"]} <= {
        "ok",
        "failed",
        "not_applicable",
    }


def test_ten_megabyte_log_on_stdin_is_answered_with_the_right_root_error(run):
    from pathlib import Path

    log = (Path(__file__).parents[1] / "data/logs/sigkill_rank1_sibling_sigterm.txt").read_text()
    noise = "[rank0]: step 1234 loss 0.5432 lr 0.001 throughput 1234.5 samples/s\n" * 150_000
    result = run(["ask", "--json", "--no-probe", "-"], stdin=noise + log)
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["root_error"]["type"] == "SIGKILL" and payload["root_error"]["rank"] == 1
    assert payload["causes"][0]["id"] == "oom-killed"


def test_a_clean_script_given_with_script_is_not_asked_for_again(run, tmp_path):
    # A vague question leaves the answer unsure; what would decide it must not
    # ask for the training script the user just handed over (and that lint
    # found clean: no finding, and nothing confirmed by the script).
    script = tmp_path / "train.py"
    script.write_text(
        (
            Path(__file__).resolve().parents[1]
            / "data"
            / "scripts"
            / "correct_checkpoint_loaded_with_map_location.py"
        ).read_text()
    )
    question = "all processes use gpu 0"
    without = json.loads(run(["ask", "--json", "--no-probe", question]).stdout)
    given = run(["ask", "--json", "--no-probe", "--script", str(script), question])
    assert given.exit_code == 0, given.output
    payload = json.loads(given.stdout)
    assert without["confidence"] != "high"
    assert any("training script" in line for line in without["decide"])
    assert payload["confidence"] != "high" and payload["decide"]
    assert not any("training script" in line for line in payload["decide"])
    assert all(c["verdict_source"] != "script" for c in payload["causes"])
    # and the text output says the script was checked and found clean
    text = run(["ask", "--no-probe", "--script", str(script), question]).output
    assert "found none of its mistakes in this script" in " ".join(text.split())
