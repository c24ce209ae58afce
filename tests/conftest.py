"""Shared fixtures: a real index over the real KB, built once per session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The tests never write into the user's own cache (`assistant run` logs and their
# pruning, re-exported graphs): every session gets a cache of its own, removed at exit.
TEST_CACHE = tempfile.mkdtemp(prefix="ddp-assistant-test-cache-")
os.environ["XDG_CACHE_HOME"] = TEST_CACHE
atexit.register(shutil.rmtree, TEST_CACHE, ignore_errors=True)
# Nor into the machine's /tmp: torchrun makes a torchelastic_* log folder (and
# error-file pickles) in the TMPDIR of whatever launches it, and the tests launch
# it often. tempfile's own default is already fixed above, so pytest's folders
# stay where they were; only the launched processes see this one.
TEST_TMP = tempfile.mkdtemp(prefix="ddp-assistant-test-tmp-")
os.environ["TMPDIR"] = TEST_TMP
atexit.register(shutil.rmtree, TEST_TMP, ignore_errors=True)


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory) -> Path:
    """A private build directory, so tests never touch data/build/."""
    path = tmp_path_factory.mktemp("build")
    os.environ["ASSISTANT_BUILD"] = str(path)
    return path


@pytest.fixture(scope="session")
def embedder(build_dir):
    """The real embedding model, loaded once for the whole session.

    Its exported ONNX graph (onnxembed) goes to the private build directory.
    """
    from assistant.knowledge.embed import Embedder

    model = Embedder()
    model.load()
    return model


@pytest.fixture(scope="session")
def engine(build_dir, embedder):
    """The real engine: real KB, real SQLite + FAISS index, real embedding model."""
    from assistant.knowledge.engine import Engine

    eng = Engine(index_path=build_dir / "index.sqlite", log=lambda message: None, embedder=embedder)
    eng.load()
    return eng


@pytest.fixture
def mini_kb(tmp_path) -> Path:
    """A small valid KB (one cause, one thread) that tests may break."""
    root = tmp_path / "kb"
    (root / "causes").mkdir(parents=True)
    (root / "threads").mkdir()
    shutil.copy(REPO / "kb/causes/duplicate-gpu-per-rank.yaml", root / "causes")
    shutil.copy(DATA / "kb_mini_thread.yaml", root / "threads/mini.yaml")
    return root
