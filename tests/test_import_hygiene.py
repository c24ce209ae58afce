"""The headless core never imports Textual; the chat never imports the heavy stack up front.

Each check runs in a fresh interpreter, because this test process has long
since imported everything.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "assistant"
FRONT_ENDS = {"cli", "__main__"}  # thin layers that may import the TUI
HEAVY = ["torch", "sentence_transformers", "faiss", "transformers"]


def core_modules() -> list[str]:
    """Every module of the package outside the TUI, subpackages included."""
    names = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[0] in ("tui", *FRONT_ENDS):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(("assistant", *parts)))
    return sorted(names)


def loaded_after(statement: str, names: list[str]) -> list[str]:
    """Which of `names` are in sys.modules after running `statement` in a fresh interpreter."""
    code = (
        "import sys, json\n"
        f"{statement}\n"
        f"print(json.dumps([n for n in {names!r} if n in sys.modules]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_core_module_list_is_not_empty():
    modules = core_modules()
    assert "assistant.chat.conversation" in modules and "assistant.chat.history" in modules
    assert not any(m.startswith("assistant.tui") for m in modules)


def test_no_core_module_imports_textual():
    # Importing them all in one interpreter is the same check as one each:
    # any module that imports textual leaves it in sys.modules. Only a failure
    # pays an interpreter per module, to name the culprits.
    modules = core_modules()
    if loaded_after("\n".join(f"import {m}" for m in modules), ["textual"]):
        culprits = [m for m in modules if loaded_after(f"import {m}", ["textual"])]
        pytest.fail(f"these core modules import textual: {culprits}")


def test_the_chat_opens_without_torch_or_the_embedding_stack():
    # What run_chat does before the window appears: import the app and build it.
    statement = (
        "from assistant.tui.app import make_app\n"
        "from assistant.tui import services\n"
        "from assistant.tui.deps import chat_deps\n"
        "make_app(chat_deps(engine=services.LazyEngine(), runner=services.LazyRunner()))"
    )
    assert loaded_after(statement, HEAVY) == []


# The query path answers on ONNX Runtime with the model's own tokenizer: it
# must not pay ~6 s for torch and sentence-transformers. Each runs against the
# session's real index (the `engine` fixture built it and its checked graph).
QUESTION = "RuntimeError: Default process group has not been initialized"
# scipy too: only fitting the reports model needs it (kb build saves the model).
MODEL_STACK = ["torch", "sentence_transformers", "transformers", "scipy"]
QUERY_PATHS = {
    "engine": (
        "from assistant.knowledge.engine import Engine\n"
        "engine = Engine()\n"
        f"assert engine.ask({QUESTION!r}).causes[0].id == 'process-group-not-initialized'\n"
        "assert engine.embedder.backend == 'onnxruntime', engine.embedder.backend\n"
    ),
    "chat": (
        "from assistant.tui import services\n"
        "engine = services.LazyEngine()\n"
        "engine.load()\n"
        f"assert engine.ask({QUESTION!r}).causes\n"
        "assert engine.ready\n"
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(QUERY_PATHS))
def test_the_query_path_leaves_torch_and_sentence_transformers_out(engine, path):
    assert loaded_after(QUERY_PATHS[path], MODEL_STACK) == []


def test_a_question_without_code_loads_no_lint_check():
    # `ask` reads every question for pasted code (assistant.lint.pasted); the
    # checks load only when there is a fragment to lint.
    statement = (
        "from assistant.lint.pasted import lint_pasted\n"
        "assert lint_pasted('NCCL timeout after 30 minutes on rank 3') == []"
    )
    assert loaded_after(statement, ["assistant.lint.checks", "assistant.lint.script"]) == []
    with_code = "from assistant.lint.pasted import lint_pasted\nlint_pasted('```\\nx = 1\\ny = 2\\nz = 3\\n```')"
    assert loaded_after(with_code, ["assistant.lint.checks"]) == ["assistant.lint.checks"]
