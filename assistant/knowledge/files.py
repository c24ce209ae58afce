"""The KB's source files and their content hash, without parsing them.

Kept apart from kb.py (which imports pydantic and yaml) so that every query
can check the index against its source cheaply.

A KB is one or more layers: the built-in kb/ first, then team folders of the
same layout (causes/, threads/) that add to it (see config.kb_layers).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

# 2: signatures must be safe for the linear engine, and the KB may be layered.
SCHEMA_VERSION = 2

Layers = Path | Sequence[Path]


def as_layers(roots: Layers) -> list[Path]:
    """One folder or several -> the list of layers, bottom (built-in) first."""
    return [Path(roots)] if isinstance(roots, (str, Path)) else [Path(r) for r in roots]


def kb_files(root: Path) -> list[Path]:
    """One layer's source files, in a stable order."""
    return sorted(root.glob("causes/*.yaml")) + sorted(root.glob("threads/*.yaml"))


def content_hash(roots: Layers) -> str:
    """Hash of every layer's files (name and bytes), in layer order, plus the schema version.

    A change in any layer, or in the order of the layers, changes the hash,
    so the index notices it and rebuilds.
    """
    digest = hashlib.sha256(f"schema-{SCHEMA_VERSION}".encode())
    for number, root in enumerate(as_layers(roots)):
        digest.update(f"layer-{number}\0".encode())
        for path in kb_files(root):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()
