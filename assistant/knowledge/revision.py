"""The KB at another git revision, for review: `assistant kb eval --compare REV`.

The revision is read from the git repository holding the top KB layer (the
team folder when there is one, else kb/): the layer a pull request changes.
Its files come out of git's object store (`git archive`) into a temporary
folder and are indexed in a temporary build folder, so the user's working
tree and index are never touched.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from assistant.errors import UserError
from assistant.knowledge.bridges import BRIDGE_FILE
from assistant.knowledge.evaluate import all_signal_scores, compare_rankings, fused_rankings
from assistant.knowledge.files import as_layers

KB_FOLDERS = ("causes", "threads")
KB_FILES = (BRIDGE_FILE,)  # a layer's term bridge ranks Chinese questions too
GIT_TIMEOUT = 60  # seconds; archiving a KB folder takes well under one


def _git(folder: Path, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            ["git", "-C", str(folder), *args],
            capture_output=True,
            timeout=GIT_TIMEOUT,
            check=False,
        )
    except FileNotFoundError:
        raise UserError("--compare needs git, and no git command was found") from None


def _git_text(folder: Path, *args: str) -> str | None:
    done = _git(folder, *args)
    return done.stdout.decode("utf-8", "replace").strip() if done.returncode == 0 else None


def layer_at_revision(layer: Path, revision: str, dest: Path) -> Path:
    """Write `layer` (causes/, threads/, bridge.yaml) as it was at `revision` into `dest`.

    A folder missing at that revision (a team layer the change adds) comes
    out empty: the comparison is then against the KB without it.
    """
    top = _git_text(layer, "rev-parse", "--show-toplevel")
    if top is None:
        raise UserError(f"--compare: {layer} is not in a git repository")
    prefix = _git_text(layer, "rev-parse", "--show-prefix") or ""
    commit = _git_text(layer, "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}")
    if not commit:
        raise UserError(f"--compare: unknown revision {revision!r} in {top}")
    present = [
        f"{prefix}{name}"
        for name in (*KB_FOLDERS, *KB_FILES)
        if _git_text(Path(top), "ls-tree", "--name-only", commit, "--", f"{prefix}{name}")
    ]
    unpacked = dest.parent / f"{dest.name}-archive"
    if present:
        archive = _git(Path(top), "archive", "--format=tar", commit, "--", *present)
        if archive.returncode != 0:
            reason = archive.stderr.decode("utf-8", "replace").strip().splitlines()
            raise UserError(f"--compare: git archive failed: {reason[-1] if reason else '?'}")
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            _extract(tar, unpacked)
    source = unpacked / prefix
    for name in KB_FOLDERS:
        target = dest / name
        if (source / name).is_dir():
            shutil.copytree(source / name, target)
        else:
            target.mkdir(parents=True, exist_ok=True)
    for name in KB_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)
    return dest


def _extract(tar: tarfile.TarFile, folder: Path) -> None:
    """Extract refusing links out of the folder and odd members (the "data" filter,
    where this Python has it: 3.10.12+, 3.11.4+)."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(folder, filter="data")
    else:  # git archive of our own repository: plain files and folders only
        members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
        tar.extractall(folder, members=members)


def compare_to_revision(
    engine, queries: list[dict], revision: str, after: list[list[str]] | None = None, log=None
) -> dict:
    """Rank every query with the KB at `revision`, against the working tree's KB.

    `engine` is the working tree's (`after`: its rankings, when already
    computed); the other side shares its embedding model and starts from a
    copy of its index, so only changed text is re-embedded.
    """
    from assistant.knowledge.engine import Engine

    if after is None:
        after = fused_rankings(all_signal_scores(engine, queries))
    layers = as_layers(engine.kb_root)
    with tempfile.TemporaryDirectory(prefix="assistant-compare-") as tmp:
        folder = Path(tmp)
        old_top = layer_at_revision(layers[-1], revision, folder / "kb")
        index_path = folder / "build" / "index.sqlite"
        index_path.parent.mkdir()
        if Path(engine.index_path).exists():
            shutil.copy2(engine.index_path, index_path)
        if log:
            log(f"assistant: indexing the KB at {revision} in a temporary folder")
        other = Engine(
            kb_root=[*layers[:-1], old_top],
            index_path=index_path,
            log=lambda message: None,  # its rebuild is expected, not news
            require_contract=engine.require_contract,
            embedder=engine.embedder,
        )
        try:
            before = fused_rankings(all_signal_scores(other, queries))
        except UserError as exc:
            raise UserError(f"--compare {revision}: {exc}", exc.code) from None
        del other  # its SQLite connection closes before the folder goes
    return {"revision": revision, **compare_rankings(queries, before, after)}
