"""Static checks of a training script (`assistant lint`); never runs it.

- script: the entry points, lint_script(path) and lint_source(text);
- model: reading and parsing the file into a `Script`, small AST helpers;
- torchapi: names of PyTorch's collectives, spawners, tensor factories;
- ranks: which ranks run a branch (`if rank == 0:` and its relatives);
- tracer: the rough execution order of calls, stepping into same-file functions;
- registry: `@check("cause-id")` and CHECKS;
- checks/: the checks, one module per area (see its docstring to add one).
"""

from assistant.lint.registry import CHECKS, check
from assistant.lint.script import lint_script, lint_source

__all__ = ["CHECKS", "check", "lint_script", "lint_source"]
