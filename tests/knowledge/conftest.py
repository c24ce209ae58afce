"""Fixtures of the knowledge tests that run CLI commands on a real engine."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture
def private_engine(engine, build_dir, tmp_path, monkeypatch):
    """CLI commands get engines in a private build folder that starts as a copy of the
    session's (so only changed text is embedded), sharing the session's loaded model.

    Returns the list the engines log into (e.g. "rebuilding the index").
    """
    from assistant.knowledge.engine import Engine

    build = tmp_path / "build"
    shutil.copytree(build_dir, build)
    logs: list[str] = []

    def make(model=None):
        return Engine(index_path=build / "index.sqlite", log=logs.append, embedder=engine.embedder)

    monkeypatch.setattr("assistant.cli.commands._engine", make)
    monkeypatch.setattr("assistant.cli.kb.make_engine", make)
    return logs


@pytest.fixture(scope="session")
def real_report_evaluations(engine) -> dict[str, dict]:
    """`evaluate` of every real-report set, by file name, computed once a session:
    the ranking floors and the confidence floors read the same figures."""
    from assistant.config import eval_dir
    from assistant.knowledge.evaluate import evaluate, load_queries

    return {
        path.name: evaluate(engine, load_queries(path))
        for path in sorted(eval_dir().glob("real_reports*.jsonl"))
    }
