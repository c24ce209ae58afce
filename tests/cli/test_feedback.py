"""Feedback from users: answer ids, `assistant feedback`, `assistant kb feedback` and its export."""

from __future__ import annotations

import json
import os
import sqlite3
import stat

import pytest
from click.testing import CliRunner

from assistant.cli import main
from assistant.feedback import FeedbackStore, answer_id

pytestmark = pytest.mark.slow

ERROR = "RuntimeError: Default process group has not been initialized"


@pytest.fixture
def run(engine, monkeypatch, tmp_path):
    monkeypatch.setattr("assistant.cli.commands._engine", lambda model: engine)
    monkeypatch.setenv("ASSISTANT_FEEDBACK", str(tmp_path / "private" / "feedback.sqlite"))
    monkeypatch.delenv("ASSISTANT_NO_HISTORY", raising=False)
    return lambda args: CliRunner().invoke(main, args)


def ask(run, text=ERROR) -> dict:
    result = run(["ask", "--json", "--no-probe", text])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_an_answer_carries_an_id_that_feedback_accepts(run, tmp_path):
    answer = ask(run)
    handle = answer["answer_id"]
    assert handle == answer_id(answer["query"], [c["id"] for c in answer["causes"]])
    first = answer["causes"][0]["id"]
    done = run(["feedback", handle, "--cause", first, "--fixed", "--note", "moved init up"])
    assert done.exit_code == 0, done.output
    summary = run(["kb", "feedback", "--json"])
    assert json.loads(summary.output) == [{"cause_id": first, "fixed": 1, "wrong": 0}]
    path = tmp_path / "private" / "feedback.sqlite"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_export_writes_confirmed_cases_that_kb_eval_reads(run, tmp_path):
    answer = ask(run)
    first = answer["causes"][0]["id"]
    run(["feedback", answer["answer_id"], "--cause", first, "--fixed"])
    other = ask(run, "DDP hangs forever at the first all_reduce")
    run(["feedback", other["answer_id"], "--cause", other["causes"][0]["id"], "--wrong"])
    out = tmp_path / "confirmed.jsonl"
    exported = run(["kb", "feedback", "--export", str(out)])
    assert exported.exit_code == 0 and "wrote 1" in exported.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == [{"id": f"feedback-{answer['answer_id']}", "query": ERROR, "causes": [first]}]
    again = run(["kb", "feedback", "--export", str(out)])
    assert again.exit_code == 2 and "exists" in again.output
    evaluated = run(["kb", "eval", str(out), "--json"])
    assert evaluated.exit_code == 0, evaluated.output


def test_feedback_on_an_unknown_answer_or_cause_is_one_line(run):
    unknown = run(["feedback", "000000000000", "--cause", "oom-killed", "--fixed"])
    assert unknown.exit_code == 2 and "no answer" in unknown.output
    answer = ask(run)
    stranger = run(["feedback", answer["answer_id"], "--cause", "p2p-hang", "--fixed"])
    if "p2p-hang" not in [c["id"] for c in answer["causes"]]:
        assert stranger.exit_code == 2 and "not among" in stranger.output
    neither = run(["feedback", answer["answer_id"], "--cause", "p2p-hang"])
    assert neither.exit_code == 2 and "--fixed or --wrong" in neither.output


def test_no_history_keeps_no_answer(run, monkeypatch, tmp_path):
    monkeypatch.setenv("ASSISTANT_NO_HISTORY", "1")
    answer = ask(run)
    assert not (tmp_path / "private" / "feedback.sqlite").exists()
    refused = run(["feedback", answer["answer_id"], "--cause", "oom-killed", "--wrong"])
    assert refused.exit_code == 2


def test_old_answers_are_dropped_but_answers_with_feedback_stay(tmp_path, monkeypatch):
    monkeypatch.setattr("assistant.feedback.KEPT_ANSWERS", 3)
    monkeypatch.delenv("ASSISTANT_NO_HISTORY", raising=False)
    store = FeedbackStore(tmp_path / "f.sqlite")
    first = store.remember("q0", ["a"])
    store.record(first, "a", "fixed")
    for n in range(1, 8):
        store.remember(f"q{n}", ["a"])
    assert [case["query"] for case in store.confirmed_cases()] == ["q0"]


# --- ask --after: a reply to what an answer asked for --------------------------------

GPU0_MEMORY = "GPU 0 uses much more memory than the other GPUs"
THIN_REPLY = "I tried to disable some NCCL features but it doesn't work"


def kept_questions(tmp_path) -> list[str]:
    with sqlite3.connect(tmp_path / "private" / "feedback.sqlite") as db:
        return [row[0] for row in db.execute("SELECT query FROM answers ORDER BY created")]


def test_a_reply_after_an_unsure_answer_is_ranked_with_it(run, tmp_path):
    first = ask(run, GPU0_MEMORY)
    assert first["confidence"] != "high" and first["decide"]
    text = run(["ask", "--no-probe", GPU0_MEMORY]).output
    assert f'assistant ask --after {first["answer_id"]} "<what you add>"' in text
    reply = run(["ask", "--json", "--no-probe", "--after", first["answer_id"], THIN_REPLY])
    assert reply.exit_code == 0, reply.output
    # Only the reply is kept: ranking the earlier question again keeps nothing new.
    assert kept_questions(tmp_path) == [GPU0_MEMORY, THIN_REPLY]
    alone = ask(run, THIN_REPLY)
    # On its own the line names NCCL; as a reply it adds to the report it answers.
    assert alone["causes"][0]["id"] != first["causes"][0]["id"]
    assert json.loads(reply.output)["causes"][0]["id"] == first["causes"][0]["id"]
    # A reply that shows the error decides.
    decided = run(["ask", "--json", "--no-probe", "--after", first["answer_id"], ERROR])
    assert json.loads(decided.output)["causes"][0]["id"] == "process-group-not-initialized"


def test_a_reply_to_an_answer_not_kept_is_a_one_line_error(run, monkeypatch):
    unknown = run(["ask", "--no-probe", "--after", "0123456789ab", THIN_REPLY])
    assert unknown.exit_code == 2
    assert unknown.stderr.strip() == (
        "assistant: error: no answer '0123456789ab' kept here (answers are kept where they "
        "were given)"
    )
    handle = ask(run, GPU0_MEMORY)["answer_id"]
    monkeypatch.setenv("ASSISTANT_NO_HISTORY", "1")
    off = run(["ask", "--no-probe", "--after", handle, THIN_REPLY])
    assert off.exit_code == 2 and "ASSISTANT_NO_HISTORY is set" in off.stderr
    both = run(["ask", "--no-probe", "--after", handle, "--batch", "x.jsonl"])
    assert both.exit_code == 2 and "cannot go with --batch" in both.stderr


ANOTHER_THIN_REPLY = "it still happens with the same settings on the next run"


def test_a_reply_to_a_reply_is_read_with_the_whole_thread(run, tmp_path):
    first = ask(run, GPU0_MEMORY)
    reply = run(["ask", "--json", "--no-probe", "--after", first["answer_id"], THIN_REPLY])
    reply_id = json.loads(reply.output)["answer_id"]
    again = run(["ask", "--json", "--no-probe", "--after", reply_id, ANOTHER_THIN_REPLY])
    assert again.exit_code == 0, again.output
    # Read after the first reply alone, the line would be a reply to a line about NCCL;
    # read with the thread it still adds to the report that started it. Its two
    # GPU-0-memory causes stay the thread's two first (after two replies that add
    # nothing they are within a hundredth of each other, so their order is not
    # what this checks); each reply alone leads with neither.
    leading = {cause["id"] for cause in first["causes"][:2]}
    assert {cause["id"] for cause in json.loads(again.output)["causes"][:2]} == leading
    for alone in (THIN_REPLY, ANOTHER_THIN_REPLY):
        assert ask(run, alone)["causes"][0]["id"] not in leading
    assert kept_questions(tmp_path) == [
        GPU0_MEMORY,
        THIN_REPLY,
        ANOTHER_THIN_REPLY,
        THIN_REPLY,
        ANOTHER_THIN_REPLY,
    ]
    # The text answer says first what it was read with.
    shown = run(["ask", "--no-probe", "--after", reply_id, ANOTHER_THIN_REPLY]).output
    assert shown.startswith(f"Read as a reply to answer {reply_id}, with the 2 earlier")


def test_a_confirmed_reply_exports_its_thread_as_query_and_followup(run, tmp_path):
    first = ask(run, GPU0_MEMORY)
    reply = json.loads(
        run(["ask", "--json", "--no-probe", "--after", first["answer_id"], ERROR]).output
    )
    run(["feedback", reply["answer_id"], "--cause", reply["causes"][0]["id"], "--fixed"])
    out = tmp_path / "confirmed.jsonl"
    assert run(["kb", "feedback", "--export", str(out)]).exit_code == 0
    [case] = [json.loads(line) for line in out.read_text().splitlines()]
    assert (case["query"], case["followup"]) == (GPU0_MEMORY, ERROR)
    assert run(["kb", "eval", str(out), "--json"]).exit_code == 0


def link(store: FeedbackStore, handle: str, after: str) -> None:
    """Point a kept answer at another, as a hand-edited or damaged file might."""
    with sqlite3.connect(store.path) as db:
        db.execute("UPDATE answers SET after = ? WHERE answer_id = ?", (after, handle))


def test_a_thread_keeps_its_first_question_and_latest_turns_and_survives_a_loop(
    tmp_path, monkeypatch
):
    monkeypatch.setattr("assistant.feedback.THREAD_TURNS", 3)
    monkeypatch.delenv("ASSISTANT_NO_HISTORY", raising=False)
    store = FeedbackStore(tmp_path / "f.sqlite")
    handles = [store.remember("q0", ["a"])]
    for n in range(1, 6):
        handles.append(store.remember(f"q{n}", ["a"], after=handles[-1]))
    assert store.thread_of(handles[-1]) == ["q0", "q4", "q5"]
    assert store.thread_of(handles[1]) == ["q0", "q1"]
    link(store, handles[0], handles[2])  # q0 -> q2 -> q1 -> q0: a loop
    assert store.thread_of(handles[2]) == ["q0", "q1", "q2"]


def test_pruning_keeps_the_thread_a_confirmed_reply_needs(tmp_path, monkeypatch):
    monkeypatch.setattr("assistant.feedback.KEPT_ANSWERS", 2)
    monkeypatch.delenv("ASSISTANT_NO_HISTORY", raising=False)
    store = FeedbackStore(tmp_path / "f.sqlite")
    first = store.remember("the report", ["a"])
    reply = store.remember("the reply", ["a"], after=first)
    store.record(reply, "a", "fixed")
    for n in range(5):
        store.remember(f"q{n}", ["a"])
    assert store.confirmed_cases() == [
        {"id": f"feedback-{reply}", "query": "the report", "causes": ["a"], "followup": "the reply"}
    ]


def test_a_file_from_before_replies_were_linked_is_read_and_extended(tmp_path, monkeypatch):
    monkeypatch.delenv("ASSISTANT_NO_HISTORY", raising=False)
    path = tmp_path / "f.sqlite"
    with sqlite3.connect(path) as db:  # the schema of earlier releases
        db.executescript(
            "CREATE TABLE answers (answer_id TEXT PRIMARY KEY, query TEXT NOT NULL, "
            "causes TEXT NOT NULL, created REAL NOT NULL);"
            "CREATE TABLE feedback (answer_id TEXT NOT NULL, cause_id TEXT NOT NULL, "
            "verdict TEXT NOT NULL, note TEXT NOT NULL DEFAULT '', created REAL NOT NULL);"
        )
        db.execute("INSERT INTO answers VALUES ('0123456789ab', 'old question', '[\"a\"]', 1.0)")
    store = FeedbackStore(path)
    assert store.thread_of("0123456789ab") == ["old question"]
    reply = store.remember("new reply", ["a"], after="0123456789ab")
    assert store.thread_of(reply) == ["old question", "new reply"]
