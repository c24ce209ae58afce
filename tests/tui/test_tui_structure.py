"""The chat's shape: one pipeline, one dependencies object, public Textual API only."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from assistant.tui import app as app_module
from assistant.tui.deps import ChatDeps, chat_deps

TUI = Path(app_module.__file__).parent
SOURCES = {path.name: path.read_text(encoding="utf-8") for path in TUI.glob("*.py")}


@pytest.mark.parametrize(
    "pattern",
    [
        r"apply_verdicts",  # the pipeline judges
        r"probes_for",  # the pipeline chooses the probes
        r"assistant\.diagnose",  # the pipeline's doctor
        r"pipeline\.runner",  # probes run only inside the pipeline
        r"deepcopy",  # the pipeline returns new results
    ],
)
def test_the_chat_runs_the_flow_only_through_the_pipeline(pattern):
    offenders = [name for name, text in SOURCES.items() if re.search(pattern, text)]
    assert offenders == []


def test_only_the_lazy_runner_calls_a_runner():
    calls = [name for name, text in SOURCES.items() if re.search(r"runner\.run\(", text)]
    assert calls == ["services.py"]  # LazyRunner.run, which the pipeline calls


@pytest.mark.parametrize("private", ["_bindings", "_on_key", "_on_paste", "_notifications"])
def test_the_chat_uses_public_textual_api_only(private):
    offenders = [name for name, text in SOURCES.items() if re.search(rf"\b{private}\b", text)]
    assert offenders == []


def test_io_stays_out_of_the_app_class():
    for name in ("app.py", "tools.py", "history_actions.py", "screens.py", "turn.py"):
        text = SOURCES[name]
        assert "write_text(" not in text and "open(" not in text, name
        assert "import sqlite" not in text, name


def test_make_app_takes_one_dependencies_object_from_one_factory():
    parameters = list(inspect.signature(app_module.make_app).parameters)
    assert parameters == ["deps"]
    assert inspect.signature(app_module.make_app).parameters["deps"].annotation in (
        ChatDeps,
        "ChatDeps",
    )
    assert "chat_deps(" in inspect.getsource(app_module.run_chat)
    assert callable(chat_deps)


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_each_module_of_the_chat_stays_small(name):
    assert SOURCES[name].count("\n") < 520, name
