"""`assistant kb eval` over several files: pooled figures, and each file's own."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from assistant.cli import main
from assistant.knowledge.evaluate import by_set, load_query_sets

DUPLICATE = "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000"
PORT = "RuntimeError: The server socket has failed to listen on any local network address. port: 29500, useIpv6: 0, code: -98, name: [::]:29500, message: address already in use"


def write(path: Path, *items: tuple[str, str, str]) -> Path:
    lines = [json.dumps({"id": i, "query": q, "causes": [c]}) for i, q, c in items]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_by_set_scores_each_file_in_order():
    queries = [
        {"id": "a", "causes": ["x"], "set": "one"},
        {"id": "b", "causes": ["y"], "set": "one"},
        {"id": "c", "causes": ["z"], "set": "two"},
    ]
    rows = by_set(queries, [["x"], ["q", "y"], ["q", "r", "s", "z"]])
    assert list(rows) == ["one", "two"]
    assert rows["one"] == {"queries": 2, "top1": 0.5, "recall3": 1.0, "mrr": 0.75}
    assert rows["two"] == {"queries": 1, "top1": 0.0, "recall3": 0.0, "mrr": 0.25}


def test_several_files_are_pooled_and_listed(private_engine, tmp_path):
    right = write(tmp_path / "right.jsonl", ("dup", DUPLICATE, "duplicate-gpu-per-rank"))
    wrong = write(tmp_path / "wrong.jsonl", ("port", PORT, "shm-too-small"))
    result = CliRunner().invoke(main, ["kb", "eval", str(right), str(wrong), "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["queries"] == 2 and report["fused"]["top1"] == 0.5
    assert report["by_set"]["right"]["top1"] == 1.0
    assert report["by_set"]["wrong"]["top1"] == 0.0
    text = CliRunner().invoke(main, ["kb", "eval", str(right), str(wrong)]).stdout
    assert "\nright " in text and "\nwrong " in text


def test_files_of_one_name_in_two_folders_stay_two_rows(tmp_path):
    (tmp_path / "team").mkdir()
    ours = write(tmp_path / "reports.jsonl", ("dup", DUPLICATE, "duplicate-gpu-per-rank"))
    theirs = write(tmp_path / "team" / "reports.jsonl", ("port", PORT, "master-port-in-use"))
    queries = load_query_sets([ours, theirs])
    assert [item["set"] for item in queries] == [str(ours), str(theirs)]
    assert len(by_set(queries, [["duplicate-gpu-per-rank"], ["x"]])) == 2


def test_one_file_keeps_its_report_without_a_per_set_table(private_engine, tmp_path):
    only = write(tmp_path / "only.jsonl", ("dup", DUPLICATE, "duplicate-gpu-per-rank"))
    report = json.loads(CliRunner().invoke(main, ["kb", "eval", str(only), "--json"]).stdout)
    assert "by_set" not in report and report["queries"] == 1


def test_a_report_in_two_files_is_one_line_error(tmp_path):
    first = write(tmp_path / "a.jsonl", ("same", DUPLICATE, "duplicate-gpu-per-rank"))
    second = write(tmp_path / "b.jsonl", ("same", PORT, "master-port-in-use"))
    result = CliRunner().invoke(main, ["kb", "eval", str(first), str(second)])
    assert result.exit_code == 2
    assert (
        result.stderr.strip() == f"assistant: error: {second}: query id 'same' is also in {first}"
    )


# A report that names no error, and the traceback its reporter posted when asked.
VAGUE = "DDP training with 2 GPUs doesn't work, please help"
TRACEBACK = (
    "Here is the full log:\nTraceback (most recent call last):\n"
    '  File "train.py", line 40, in <module>\n    model = DDP(model, device_ids=[local_rank])\n'
    "RuntimeError: Default process group has not been initialized, "
    "please make sure to call init_process_group."
)


def test_a_followup_is_scored_as_the_chats_second_turn(private_engine, tmp_path):
    labelled = tmp_path / "two.jsonl"
    rows = [
        {"id": "vague", "query": VAGUE, "causes": ["process-group-not-initialized"]},
        {"id": "dup", "query": DUPLICATE, "causes": ["duplicate-gpu-per-rank"]},
    ]
    rows[0]["followup"] = TRACEBACK
    labelled.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    report = json.loads(CliRunner().invoke(main, ["kb", "eval", str(labelled), "--json"]).stdout)
    # Only the report with a followup counts; its first answer was unsure and asked for more.
    assert report["two_turns"]["queries"] == report["two_turns"]["asked"] == 1
    assert report["two_turns"]["first"]["top1"] == 0.0
    assert report["two_turns"]["second"]["top1"] == 1.0
    # The reply showed the error itself: the second answer is sure, and right.
    assert report["two_turns"]["second_high"] == {"answers": 1, "top1": 1.0}
    assert report["fused"]["top1"] == 0.5  # the first turns' figures are unchanged
    text = CliRunner().invoke(main, ["kb", "eval", str(labelled)]).stdout
    assert "two turns (1 queries with a followup, 1 asked for more): top-1 0.000 -> 1.000" in text


def test_a_set_without_followups_has_no_two_turn_figures(private_engine, tmp_path):
    only = write(tmp_path / "only.jsonl", ("dup", DUPLICATE, "duplicate-gpu-per-rank"))
    report = json.loads(CliRunner().invoke(main, ["kb", "eval", str(only), "--json"]).stdout)
    assert "two_turns" not in report


def test_a_followup_that_is_not_text_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    row = {"id": "x", "query": VAGUE, "causes": ["process-group-not-initialized"], "followup": 3}
    bad.write_text(json.dumps(row) + "\n", encoding="utf-8")
    result = CliRunner().invoke(main, ["kb", "eval", str(bad)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"assistant: error: {bad}:1: followup must be text"


def test_answered_scores_the_order_ask_shows_after_the_verdicts(private_engine, tmp_path):
    # The words say "timeout"; the pasted loop shows a barrier only rank 0
    # reaches, which confirms collective-mismatch and puts it first in `ask`.
    hang = (
        "Training hangs when it saves. My loop:\n\n"
        "for step, batch in enumerate(loader):\n"
        "    loss = model(batch)\n"
        "    if dist.get_rank() == 0:\n"
        "        save(model)\n"
        "        dist.barrier()\n"
    )
    labelled = write(tmp_path / "hang.jsonl", ("hang", hang, "collective-mismatch"))
    result = CliRunner().invoke(main, ["kb", "eval", str(labelled), "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["answered"]["top1"] == 1.0
    assert report["answered"]["top1"] >= report["fused"]["top1"]
    text = CliRunner().invoke(main, ["kb", "eval", str(labelled)]).stdout
    assert "\nanswered " in text
