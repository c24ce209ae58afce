"""Chat history kept between runs, in one SQLite file (sqlite-utils).

    history = History(config.history_path())
    history.save(conversation)          # inserts, or updates the same conversation
    for entry in history.list(): ...    # newest first, without loading the turns
    conversation = history.load(entry.id)
    history.delete(entry.id)

The schema is created by numbered migrations recorded in `PRAGMA
user_version`, so a later version can add columns without losing old chats.
Each call opens its own connection: the chat may save from its UI thread and
load from a worker. Nothing here imports Textual.

The file keeps every pasted log (host names, paths, sometimes tokens), so it
is private: created 0600 (its folder 0700 when this module creates it), and
the chat tells the person once, the first time it writes (`notice_due` /
`mark_notice_shown`, remembered in the file itself). `clear()` empties it;
`history_enabled()` reads ASSISTANT_NO_HISTORY.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from assistant.chat.conversation import Conversation, Turn
from assistant.errors import UserError

if TYPE_CHECKING:  # imported on first use: sqlite_utils costs ~0.3 s, the chat opens first
    import sqlite_utils


def _migration_1(db: sqlite_utils.Database) -> None:
    db["conversations"].create(
        {"id": int, "title": str, "created": float, "updated": float, "lang": str},
        pk="id",
    )
    db["turns"].create(
        {
            "conversation_id": int,
            "position": int,
            "kind": str,
            "lang": str,
            "query": str,
            "result": str,  # JSON of assistant.chat.conversation.result_to_dict
            "error": str,
            "findings": str,  # JSON list of Finding.to_json()
            "created": float,
        },
        pk=("conversation_id", "position"),
        foreign_keys=[("conversation_id", "conversations", "id")],
    )


def _migration_2(db: sqlite_utils.Database) -> None:
    # Small facts about the file itself (e.g. that the privacy notice was shown).
    db["meta"].create({"key": str, "value": str}, pk="key")


def _migration_3(db: sqlite_utils.Database) -> None:
    # A run turn's job as it was shown: output tail, rank lines, how it ended
    # (JSON of assistant.chat.conversation.JobRecord, bounded there).
    db["turns"].add_column("job", str)


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [
    _migration_1,
    _migration_2,
    _migration_3,
]
"""Schema steps; step n (1-based) brings `user_version` from n-1 to n. Append only."""


@dataclass(frozen=True)
class ConversationSummary:
    """One row of the history list."""

    id: int
    title: str
    created: float
    updated: float
    turns: int


class History:
    """Saved conversations in the SQLite file at `path` (created on first use)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()  # one writer at a time within this process

    @contextmanager
    def _open(self) -> Iterator[sqlite_utils.Database]:
        """The file, migrated, under this process's lock; closed on the way out."""
        import sqlite_utils

        with self._lock:
            try:
                make_private(self.path)
                db = sqlite_utils.Database(self.path)
                migrate(db)
            except (OSError, sqlite3.DatabaseError) as exc:
                raise UserError(f"cannot open the chat history {self.path}: {exc}") from None
            try:
                yield db
            finally:
                db.close()

    # -- the one-time privacy notice ------------------------------------------------

    NOTICE_KEY = "privacy_notice_shown"

    def notice_due(self) -> bool:
        """Whether the person has not yet been told what this file keeps."""
        with self._open() as db:
            return not db["meta"].count_where("key = ?", [self.NOTICE_KEY])

    def mark_notice_shown(self) -> None:
        """Remember (in the file) that the notice was shown."""
        with self._open() as db, db.conn:
            db["meta"].upsert({"key": self.NOTICE_KEY, "value": "1"}, pk="key")

    def clear(self) -> int:
        """Delete every saved conversation (the notice stays remembered); returns how many."""
        with self._open() as db:
            with db.conn:
                count = db["conversations"].count
                db.execute("DELETE FROM turns")
                db.execute("DELETE FROM conversations")
            # Deleted rows linger in free pages until the file is rewritten.
            db.execute("VACUUM")
        return count

    def save(self, conversation: Conversation, now: float | None = None) -> int:
        """Store the conversation and its turns; sets and returns `conversation.id`.

        A turn's query is written once: later saves update only what changes
        (result, error, findings, a run's job), so a 10 MB pasted log is not rewritten
        each time its probes report.
        """
        stamp = time.time() if now is None else now
        with self._open() as db, db.conn:
            conversation.id = self._save_row(db, conversation, stamp)
            for position, turn in enumerate(conversation.turns):
                self._save_turn(db, conversation.id, position, turn)
            db.execute(
                "DELETE FROM turns WHERE conversation_id = ? AND position >= ?",
                [conversation.id, len(conversation.turns)],
            )
        return conversation.id

    def _save_row(self, db: sqlite_utils.Database, conversation: Conversation, stamp: float) -> int:
        lang = conversation.turns[-1].lang if conversation.turns else "en"
        row = {"title": conversation.title, "updated": stamp, "lang": lang}
        if conversation.id is not None and db["conversations"].count_where(
            "id = ?", [conversation.id]
        ):
            db["conversations"].update(conversation.id, row)
            return conversation.id
        row["created"] = conversation.created or stamp
        if conversation.id is not None:
            row["id"] = conversation.id
        return db["conversations"].insert(row).last_pk

    @staticmethod
    def _save_turn(db: sqlite_utils.Database, conversation_id: int, position: int, turn: Turn):
        data = turn.to_dict()
        db.execute(
            """
            INSERT INTO turns (conversation_id, position, kind, lang, query, result, error,
                               findings, created, job)
            VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
            ON CONFLICT (conversation_id, position) DO UPDATE SET
                kind = excluded.kind, lang = excluded.lang, result = excluded.result,
                error = excluded.error, findings = excluded.findings, job = excluded.job
            """,
            [
                conversation_id,
                position,
                turn.kind,
                turn.lang,
                turn.query,
                json.dumps(data["result"], ensure_ascii=False) if turn.result else None,
                turn.error,
                json.dumps(data["findings"], ensure_ascii=False),
                turn.created,
                json.dumps(data["job"], ensure_ascii=False) if turn.job else None,
            ],
        )

    def list(self, limit: int = 200) -> list[ConversationSummary]:
        """Saved conversations, most recently updated first."""
        with self._open() as db:
            rows = db.execute(
                """
                SELECT c.id, c.title, c.created, c.updated,
                       (SELECT COUNT(*) FROM turns t WHERE t.conversation_id = c.id)
                FROM conversations c ORDER BY c.updated DESC, c.id DESC LIMIT ?
                """,
                [limit],
            ).fetchall()
        return [ConversationSummary(*row) for row in rows]

    def load(self, conversation_id: int) -> Conversation:
        """The saved conversation `conversation_id`; UserError when there is none."""
        with self._open() as db:
            rows = list(db["conversations"].rows_where("id = ?", [conversation_id]))
            if not rows:
                raise UserError(f"no saved conversation #{conversation_id}")
            turns = list(
                db["turns"].rows_where(
                    "conversation_id = ?", [conversation_id], order_by="position"
                )
            )
        return Conversation(
            turns=[_turn_from_row(row) for row in turns],
            id=conversation_id,
            created=rows[0]["created"] or 0.0,
        )

    def delete(self, conversation_id: int) -> None:
        """Remove a conversation and its turns; UserError when there is none."""
        with self._open() as db, db.conn:
            db.execute("DELETE FROM turns WHERE conversation_id = ?", [conversation_id])
            cursor = db.execute("DELETE FROM conversations WHERE id = ?", [conversation_id])
        if cursor.rowcount == 0:
            raise UserError(f"no saved conversation #{conversation_id}")


def history_enabled(environ: dict | None = None) -> bool:
    """False when ASSISTANT_NO_HISTORY asks to keep nothing (1, true, yes)."""
    value = (environ if environ is not None else os.environ).get("ASSISTANT_NO_HISTORY", "")
    return value.strip().lower() not in ("1", "true", "yes", "on")


def make_private(path: Path) -> None:
    """Create `path`'s folder (0700) and the file (0600) if missing; tighten an existing file.

    An existing folder is left as it is: it may be the person's own (~/.cache).
    """
    folder = path.parent
    if not folder.exists():
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.close(descriptor)
    if os.stat(path).st_mode & 0o077:
        os.chmod(path, 0o600)


def migrate(db: sqlite_utils.Database) -> int:
    """Apply the migrations this file lacks; returns the schema version."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > len(MIGRATIONS):
        raise sqlite3.DatabaseError(
            f"history schema {version} is newer than this assistant knows ({len(MIGRATIONS)})"
        )
    for number in range(version + 1, len(MIGRATIONS) + 1):
        with db.conn:
            MIGRATIONS[number - 1](db)
            db.execute(f"PRAGMA user_version = {number}")
    return len(MIGRATIONS)


def _turn_from_row(row: dict) -> Turn:
    return Turn.from_dict(
        {
            "query": row["query"] or "",
            "lang": row["lang"] or "en",
            "kind": row["kind"] or "ask",
            "result": json.loads(row["result"]) if row["result"] else None,
            "error": row["error"] or "",
            "findings": json.loads(row["findings"]) if row["findings"] else [],
            "created": row["created"] or 0.0,
            "job": json.loads(row["job"]) if row.get("job") else None,
        }
    )
