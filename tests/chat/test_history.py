"""Chat history in SQLite: save, list, load, delete, and what goes wrong."""

from __future__ import annotations

import sqlite3

import pytest
import sqlite_utils

from assistant.chat.conversation import (
    JOB_LINE_CHARS,
    JOB_OUTPUT_LINES,
    JOB_RANK_LINES,
    Conversation,
    JobRecord,
    Turn,
)
from assistant.chat.history import MIGRATIONS, History, migrate
from assistant.errors import UserError
from assistant.results import CauseResult, ProbeRun, Result, RootError, Verdict


def judged_turn(query: str = "log", created: float = 10.0) -> Turn:
    result = Result(
        query=query,
        root_error=RootError("RuntimeError", "Duplicate GPU detected", 1),
        causes=[
            CauseResult(
                "duplicate-gpu-per-rank",
                "Two ranks on one GPU",
                0.9,
                verdict=Verdict("confirmed", ["both on GPU-3f2a"]),
            )
        ],
        probes=[ProbeRun("devices", "ok", 1.2, ranks=[{"rank": 0, "uuid": "GPU-3f2a"}])],
    )
    return Turn(query=query, result=result, created=created)


@pytest.fixture
def history(tmp_path) -> History:
    return History(tmp_path / "sub" / "history.sqlite")


def test_save_list_load_round_trip(history):
    conversation = Conversation(created=5.0)
    conversation.add(judged_turn())
    conversation.add(Turn(query="what if I use gloo?", created=11.0))
    conversation_id = history.save(conversation, now=20.0)
    assert conversation.id == conversation_id

    [entry] = history.list()
    assert (entry.id, entry.turns, entry.created, entry.updated) == (conversation_id, 2, 5.0, 20.0)
    assert entry.title == "RuntimeError: Duplicate GPU detected"
    assert history.load(conversation_id) == conversation


def test_saving_again_updates_the_same_conversation(history):
    conversation = Conversation()
    conversation.add(Turn(query="first"))
    history.save(conversation, now=1.0)
    conversation.turns[0] = judged_turn("first")
    conversation.add(Turn(query="second"))
    history.save(conversation, now=2.0)
    [entry] = history.list()
    assert entry.turns == 2 and entry.updated == 2.0
    loaded = history.load(conversation.id)
    assert loaded.turns[0].result.causes[0].verdict.verdict == "confirmed"


def test_a_query_is_written_once(history):
    conversation = Conversation()
    conversation.add(Turn(query="original log"))
    history.save(conversation)
    conversation.turns[0].query = "changed in memory"
    conversation.turns[0].error = "later error"
    history.save(conversation)
    turn = history.load(conversation.id).turns[0]
    assert turn.query == "original log" and turn.error == "later error"


def test_list_is_newest_first(history):
    ids = []
    for stamp in (3.0, 1.0, 2.0):
        conversation = Conversation()
        conversation.add(Turn(query=f"q{stamp}"))
        ids.append(history.save(conversation, now=stamp))
    assert [e.id for e in history.list()] == [ids[0], ids[2], ids[1]]
    assert len(history.list(limit=2)) == 2


def test_delete_removes_the_conversation_and_its_turns(history):
    keep, drop = Conversation(), Conversation()
    keep.add(Turn(query="keep"))
    drop.add(Turn(query="drop"))
    history.save(keep)
    history.save(drop)
    history.delete(drop.id)
    assert [e.id for e in history.list()] == [keep.id]
    db = sqlite_utils.Database(history.path)
    assert db["turns"].count == 1
    with pytest.raises(UserError, match=f"no saved conversation #{drop.id}"):
        history.delete(drop.id)
    with pytest.raises(UserError, match=f"no saved conversation #{drop.id}"):
        history.load(drop.id)


def test_a_deleted_conversation_saved_again_comes_back(history):
    conversation = Conversation()
    conversation.add(Turn(query="q"))
    history.save(conversation)
    history.delete(conversation.id)
    history.save(conversation)
    assert [e.id for e in history.list()] == [conversation.id]


def test_a_10_mb_log_is_kept(history):
    log = "x" * 10_000_000
    conversation = Conversation()
    conversation.add(Turn(query=log))
    history.save(conversation)
    assert history.load(conversation.id).turns[0].query == log


def test_a_file_that_is_not_a_database_is_a_user_error(tmp_path):
    path = tmp_path / "history.sqlite"
    path.write_text("not sqlite at all, just text " * 100)
    with pytest.raises(UserError, match="cannot open the chat history"):
        History(path).list()


def test_a_newer_schema_is_refused_not_damaged(tmp_path):
    path = tmp_path / "history.sqlite"
    sqlite3.connect(path).execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}").connection.close()
    with pytest.raises(UserError, match="newer than this assistant knows"):
        History(path).list()


def test_migrations_run_once_and_record_the_version(tmp_path):
    db = sqlite_utils.Database(tmp_path / "h.sqlite")
    assert migrate(db) == len(MIGRATIONS)
    assert migrate(db) == len(MIGRATIONS)  # a second run changes nothing
    assert db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    assert set(db.table_names()) == {"conversations", "turns", "meta"}


def test_the_file_is_private_and_a_new_folder_too(tmp_path):
    path = tmp_path / "new" / "history.sqlite"
    History(path).list()
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700


def test_the_privacy_notice_is_due_once_and_survives_clearing(history):
    assert history.notice_due()
    history.mark_notice_shown()
    history.mark_notice_shown()  # idempotent
    assert not history.notice_due()
    conversation = Conversation()
    conversation.add(judged_turn())
    history.save(conversation)
    assert history.clear() == 1
    assert history.list() == [] and not history.notice_due()
    assert History(history.path).list() == []  # cleared on disk, not in a cache


def test_cleared_logs_are_gone_from_the_file_itself(history):
    conversation = Conversation()
    conversation.add(judged_turn(query="secret-token-4242 in a pasted log"))
    history.save(conversation)
    history.clear()
    assert b"secret-token-4242" not in history.path.read_bytes()


def run_turn(output: list[str], ranks: list[str]) -> Turn:
    """A chat run turn as it ended: its job's output tail and rank lines, then its answer."""
    turn = judged_turn(query="$ torchrun --nproc_per_node=2 train.py")
    turn.job = JobRecord.kept(output, ranks, seconds=12.5)
    return turn


def test_a_run_turn_keeps_its_jobs_output_and_rank_lines(history):
    ranks = [
        "rank 0 (node-a, exit -15): waits in barrier at /w/train.py:30 in main",
        "rank 1 (node-a, exit 1): ValueError: bad batch at /w/train.py:12 in main",
        "logs: /home/me/.cache/ddp-assistant/runs/20261130-150000-abc123",
    ]
    conversation = Conversation(created=5.0)
    conversation.add(run_turn(["step 1", "  File train.py, line 12", "ValueError: bad"], ranks))
    finished = Turn(query="$ python train.py")
    finished.job = JobRecord.kept(["trained"], [], 3.0, "The job finished: exit 0", True)
    conversation.add(finished)
    history.save(conversation)

    loaded = History(history.path).load(conversation.id)
    assert loaded == conversation
    assert loaded.turns[0].job.output[1] == "  File train.py, line 12"  # indentation kept
    assert loaded.turns[0].job.ranks == ranks and loaded.turns[0].job.seconds == 12.5
    assert loaded.turns[1].job.note == "The job finished: exit 0" and loaded.turns[1].job.succeeded


def test_a_jobs_record_is_bounded_however_much_it_printed(history):
    output = [f"line {n} " + "x" * 20_000 for n in range(5_000)]
    ranks = [f"rank {n} (node, exit 1): RuntimeError" for n in range(1_024)] + ["logs: /r"]
    conversation = Conversation()
    conversation.add(run_turn(output, ranks))
    history.save(conversation)

    job = history.load(conversation.id).turns[0].job
    assert len(job.output) == JOB_OUTPUT_LINES and job.output[-1].startswith("line 4999 ")
    assert max(len(line) for line in job.output) == JOB_LINE_CHARS
    assert len(job.ranks) == JOB_RANK_LINES and job.ranks[0].startswith("rank 0 ")
    assert job.ranks[-2] == f"… {len(ranks) - JOB_RANK_LINES + 1} more"
    assert job.ranks[-1] == "logs: /r"  # where the logs are is never cut away
    assert history.path.stat().st_size < 500_000


def test_a_file_of_the_previous_schema_gains_the_job_and_keeps_its_turns(tmp_path):
    path = tmp_path / "history.sqlite"
    db = sqlite_utils.Database(path)
    for step in MIGRATIONS[:2]:  # the file as the previous version left it
        step(db)
    db.execute("PRAGMA user_version = 2")
    db["conversations"].insert({"id": 1, "title": "old", "created": 1.0, "updated": 1.0})
    db["turns"].insert({"conversation_id": 1, "position": 0, "kind": "ask", "query": "old q"})
    db.close()

    history = History(path)
    conversation = history.load(1)
    assert conversation.turns[0].query == "old q" and conversation.turns[0].job is None
    conversation.turns[0].job = JobRecord.kept(["out"], ["rank 0 (h, exit 0)"])
    history.save(conversation)
    assert history.load(1).turns[0].job.output == ["out"]
