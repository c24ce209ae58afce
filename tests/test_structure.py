"""The structure stays easy to see: a package per side of the flow, no private
names crossing module borders, and one core call that every front end uses."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "assistant"
SIDES = ("knowledge", "probing", "lint", "verdicts", "chat", "cli", "tui", "watch")
FRONT_ENDS = ("cli", "tui", "watch")


def python_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_side_of_the_flow_is_a_package():
    for side in SIDES:
        assert (PACKAGE / side / "__init__.py").is_file(), side
        assert (PACKAGE / side / "__init__.py").read_text().lstrip().startswith('"""'), side


def test_no_private_name_is_imported_from_another_module():
    crossings = []
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("assistant"):
                crossings += [
                    f"{path.relative_to(PACKAGE)}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    assert crossings == []


def test_front_ends_reach_verdicts_only_through_the_pipeline():
    # The flow (retrieve -> probes -> verdicts) is assembled in assistant/pipeline.py only.
    offenders = []
    for side in FRONT_ENDS:
        for path in (PACKAGE / side).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            if "apply_verdicts" in text or "probes_for" in text:
                offenders.append(str(path.relative_to(PACKAGE)))
    assert offenders == []
