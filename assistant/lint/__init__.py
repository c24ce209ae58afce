"""Static checks of a training script (`assistant lint`); never runs it.

- script: the entry points, lint_script(path) and lint_source(text);
- model: reading and parsing the file into a `Script`, small AST helpers;
- torchapi: names of PyTorch's collectives, spawners, tensor factories;
- ranks: which ranks run a branch (`if rank == 0:` and its relatives);
- tracer: the rough execution order of calls, stepping into same-file functions;
- launchtext: launch commands written as text (a docstring's, a pasted one);
- registry: `@check("cause-id")` and CHECKS;
- checks/: the checks, one module per area (see its docstring to add one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from assistant.lint.registry import CHECKS, check
    from assistant.lint.script import lint_script, lint_source

__all__ = ["CHECKS", "check", "lint_script", "lint_source"]


def __getattr__(name: str):
    """Import the checks on first use: `ask` reads assistant.lint.pasted on every
    question, and most questions hold no code to lint."""
    if name == "check":
        from assistant.lint.registry import check

        return check
    if name in ("CHECKS", "lint_script", "lint_source"):
        from assistant.lint import registry, script  # script registers every check

        return registry.CHECKS if name == "CHECKS" else getattr(script, name)
    raise AttributeError(f"module 'assistant.lint' has no attribute {name!r}")
