"""Where things live: the variables that move them, and empty ones that do not."""

from __future__ import annotations

from pathlib import Path

import pytest

from assistant import config

LOCATIONS = {
    "ASSISTANT_BUILD": config.build_dir,
    "ASSISTANT_KB": config.kb_dir,
    "ASSISTANT_PROBES": config.probes_dir,
    "ASSISTANT_HISTORY": config.history_path,
    "ASSISTANT_FEEDBACK": config.feedback_path,
}


@pytest.mark.parametrize("name", sorted(LOCATIONS))
def test_a_variable_moves_its_location(name, monkeypatch, tmp_path):
    monkeypatch.setenv(name, str(tmp_path / "elsewhere"))
    assert LOCATIONS[name]() == tmp_path / "elsewhere"


@pytest.mark.parametrize("name", sorted(LOCATIONS))
def test_an_empty_variable_is_unset_not_the_working_directory(name, monkeypatch, tmp_path):
    # `ASSISTANT_BUILD= assistant ask` once wrote the index into the working
    # directory: Path("") is ".".
    monkeypatch.delenv(name, raising=False)
    default = LOCATIONS[name]()
    monkeypatch.setenv(name, "")
    monkeypatch.chdir(tmp_path)
    assert LOCATIONS[name]() == default
    assert LOCATIONS[name]().resolve() != Path.cwd()


def test_history_and_feedback_follow_the_build_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("ASSISTANT_BUILD", str(tmp_path))
    monkeypatch.setenv("ASSISTANT_HISTORY", "")
    monkeypatch.delenv("ASSISTANT_FEEDBACK", raising=False)
    assert config.history_path() == tmp_path / "history.sqlite"
    assert config.feedback_path() == tmp_path / "feedback.sqlite"
