"""The KB's source files and their content hash, without parsing them.

Kept apart from kb.py (which imports pydantic and yaml) so that every query
can check the index against its source cheaply.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SCHEMA_VERSION = 1


def kb_files(root: Path) -> list[Path]:
    """The KB source files, in a stable order."""
    return sorted(root.glob("causes/*.yaml")) + sorted(root.glob("threads/*.yaml"))


def content_hash(root: Path) -> str:
    """Hash of every KB file's name and bytes plus the schema version."""
    digest = hashlib.sha256(f"schema-{SCHEMA_VERSION}".encode())
    for path in kb_files(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()
