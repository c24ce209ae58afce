"""What users say about answers, kept on this machine only (never sent anywhere).

Every answer the CLI gives gets an `answer_id`; the answer (question, ranked
cause ids) is kept in a private SQLite file so that later

    assistant feedback 3f2a9c01d4e5 --cause duplicate-gpu-per-rank --fixed

can record "this fixed it" (or --wrong: "not this cause"). An answer given with
`assistant ask --after ID` keeps that ID as its `after`, so a reply to a reply
is read with the whole thread (`thread_of`), as the chat reads its turns.
Support teams read it back with `assistant kb feedback` (per cause) and turn
the confirmed cases into eval lines with `assistant kb feedback --export
FILE`, which `assistant kb eval FILE` reads.

The file holds pasted logs, so it is created 0600 in a 0700 folder, and
ASSISTANT_NO_HISTORY=1 turns keeping answers off (feedback then has nothing
to refer to and says so).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from assistant.errors import ExitCode, UserError

SCHEMA = """
CREATE TABLE IF NOT EXISTS answers (
    answer_id TEXT PRIMARY KEY,
    query TEXT NOT NULL,
    causes TEXT NOT NULL,          -- JSON list of cause ids, best first
    created REAL NOT NULL,
    after TEXT                     -- the answer this one replied to (ask --after), or NULL
);
CREATE TABLE IF NOT EXISTS feedback (
    answer_id TEXT NOT NULL REFERENCES answers(answer_id),
    cause_id TEXT NOT NULL,
    verdict TEXT NOT NULL CHECK (verdict IN ('fixed', 'wrong')),
    note TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL
);
"""
KEPT_ANSWERS = 2000  # older answers are dropped: this is a feedback inbox, not an archive
QUERY_LIMIT = 50_000  # characters of a question kept (a 36 MB log is not)
ID_LENGTH = 12
# Turns of a thread read back for a reply: its first question and the latest
# replies. A longer chain is a person pasting on and on; the middle adds little.
THREAD_TURNS = 8


def answer_id(query: str, cause_ids: list[str], after: str | None = None) -> str:
    """A short, stable handle for one answer: the same question and ranking give
    the same id (a reply's also depends on the answer it replied to)."""
    key = [query, cause_ids] if after is None else [query, cause_ids, after]
    digest = hashlib.sha256(json.dumps(key).encode("utf-8", "replace"))
    return digest.hexdigest()[:ID_LENGTH]


def keeping_disabled() -> bool:
    """ASSISTANT_NO_HISTORY=1 (also honoured by the chat's history) keeps nothing."""
    return os.environ.get("ASSISTANT_NO_HISTORY", "") not in ("", "0")


@dataclass(frozen=True)
class CauseFeedback:
    """What users said about one cause."""

    cause_id: str
    fixed: int
    wrong: int


class FeedbackStore:
    """The local answers and the feedback on them."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def _connect(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            os.close(fd)
            db = sqlite3.connect(self.path)
            db.executescript(SCHEMA)
            with_after_column(db)
        except (OSError, sqlite3.Error) as exc:
            raise UserError(f"cannot open the feedback file {self.path}: {exc}", ExitCode.FAILED)
        return db

    def remember(self, query: str, cause_ids: list[str], after: str | None = None) -> str:
        """Keep an answer (unless keeping is off); its id either way. `after`: the
        id of the answer it replied to."""
        handle = answer_id(query, cause_ids, after)
        if keeping_disabled():
            return handle
        with self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO answers (answer_id, query, causes, created, after) "
                "VALUES (?, ?, ?, ?, ?)",
                (handle, query[:QUERY_LIMIT], json.dumps(cause_ids), time.time(), after),
            )
            # Answers with feedback stay, and so do the threads they replied in
            # (their export needs the first question).
            db.execute(
                "WITH RECURSIVE kept(id) AS (SELECT answer_id FROM feedback UNION "
                "SELECT a.after FROM answers a JOIN kept ON a.answer_id = kept.id "
                "WHERE a.after IS NOT NULL) "
                "DELETE FROM answers WHERE answer_id NOT IN (SELECT answer_id FROM answers "
                "ORDER BY created DESC LIMIT ?) AND answer_id NOT IN (SELECT id FROM kept)",
                (KEPT_ANSWERS,),
            )
        return handle

    def thread_of(self, handle: str) -> list[str]:
        """The questions of a kept answer's thread, oldest first, ending with its
        own (`ask --after` reads a reply with them; see thread_questions)."""
        if keeping_disabled():
            raise UserError(
                f"no answer {handle!r}: ASSISTANT_NO_HISTORY is set, answers are not kept"
            )
        questions: list[str] = []
        if self.path.exists():
            with self._connect() as db:
                questions = thread_questions(db, handle)
        if not questions:
            raise UserError(
                f"no answer {handle!r} kept here (answers are kept where they were given)"
            )
        return questions

    def record(self, handle: str, cause_id: str, verdict: str, note: str = "") -> None:
        """One user's word on one cause of one answer."""
        with self._connect() as db:
            row = db.execute("SELECT causes FROM answers WHERE answer_id = ?", (handle,)).fetchone()
            if row is None:
                raise UserError(
                    f"no answer {handle!r} kept here (answers are kept on the machine that gave "
                    "them, unless ASSISTANT_NO_HISTORY is set)"
                )
            if verdict == "fixed" and cause_id not in json.loads(row[0]):
                raise UserError(
                    f"{cause_id!r} was not among that answer's causes ({', '.join(json.loads(row[0]))})"
                )
            db.execute(
                "INSERT INTO feedback VALUES (?, ?, ?, ?, ?)",
                (handle, cause_id, verdict, note, time.time()),
            )

    def summary(self) -> list[CauseFeedback]:
        """Per cause: how often it fixed the problem, how often it was the wrong cause."""
        if not self.path.exists():
            return []
        with self._connect() as db:
            rows = db.execute(
                "SELECT cause_id, SUM(verdict = 'fixed'), SUM(verdict = 'wrong') FROM feedback "
                "GROUP BY cause_id ORDER BY cause_id"
            ).fetchall()
        return [CauseFeedback(cause_id, fixed, wrong) for cause_id, fixed, wrong in rows]

    def confirmed_cases(self) -> list[dict]:
        """Eval lines {"id", "query", "causes"} for answers a user said a cause fixed.

        A reply's line is its thread: the first question as the query and the
        replies as its "followup" (kb eval asks it as the second turn), since a
        reply alone ("24G each") is no report to measure on. The thread is the
        one `--after` reads (thread_questions: a long one loses its middle).
        """
        if not self.path.exists():
            return []
        with self._connect() as db:
            rows = db.execute(
                "SELECT a.answer_id, GROUP_CONCAT(DISTINCT f.cause_id) FROM answers a "
                "JOIN feedback f ON f.answer_id = a.answer_id WHERE f.verdict = 'fixed' "
                "GROUP BY a.answer_id ORDER BY MIN(f.created)"
            ).fetchall()
            threads = [thread_questions(db, handle) for handle, _ in rows]
        cases = []
        for (handle, causes), (first, *replies) in zip(rows, threads):
            case = {"id": f"feedback-{handle}", "query": first, "causes": sorted(causes.split(","))}
            if replies:
                case["followup"] = "\n\n".join(replies)
            cases.append(case)
        return cases

    def export(self, out: Path) -> int:
        """Write the confirmed cases as JSON lines to a new file; how many were written."""
        cases = self.confirmed_cases()
        try:
            with open(out, "x", encoding="utf-8") as handle:  # never overwrites
                handle.writelines(json.dumps(case, ensure_ascii=False) + "\n" for case in cases)
        except FileExistsError:
            raise UserError(f"{out} exists; choose a new file (nothing is overwritten)") from None
        except OSError as exc:
            raise UserError(f"cannot write {out}: {exc.strerror}") from None
        return len(cases)


def thread_questions(db: sqlite3.Connection, handle: str) -> list[str]:
    """The questions from a thread's first to `handle`'s own, following `after`
    ([] if `handle` is not kept): the first and at most THREAD_TURNS - 1 of the
    latest. A link to an answer no longer kept ends the thread there; a loop (a
    hand-edited file) is cut where it closes."""
    questions: list[str] = []
    seen: set[str] = set()
    link: str | None = handle
    while link is not None and link not in seen:
        seen.add(link)
        row = db.execute("SELECT query, after FROM answers WHERE answer_id = ?", (link,)).fetchone()
        if row is None:
            break
        questions.append(row[0])
        link = row[1]
    questions.reverse()
    if len(questions) > THREAD_TURNS:
        questions = questions[:1] + questions[len(questions) - (THREAD_TURNS - 1) :]
    return questions


def with_after_column(db: sqlite3.Connection) -> None:
    """Add `answers.after` to a file written before replies were linked (its
    answers are kept as they are: each one a thread of its own)."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(answers)")}
    if "after" not in columns:
        db.execute("ALTER TABLE answers ADD COLUMN after TEXT")
