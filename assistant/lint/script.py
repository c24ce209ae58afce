"""`assistant lint train.py`: static checks of a DDP training script; the entry points.

The script is read and parsed (model.py) and never executed: it may start
processes, grab GPUs or hang. The tracer (tracer.py) walks it in a rough
execution order, noting the `if`s on the rank around each call (ranks.py);
then every registered check (registry.py, one module per area in checks/)
yields `Finding`s named by contract cause ids (data/causes.yaml).

Checks prefer silence to guessing: a correct modern torchrun script must
produce no findings (tests/data/scripts/correct_*.py). Hostile input ends in
findings or in one `UserError` line, never a traceback or a hang.
"""

from __future__ import annotations

from pathlib import Path

import assistant.lint.checks  # noqa: F401  (importing it registers every check)
from assistant.errors import UserError
from assistant.lint.model import parse_script, read_script
from assistant.lint.registry import CHECKS
from assistant.lint.tracer import trace_script
from assistant.results import Finding


def lint_script(path: str | Path) -> list[Finding]:
    """Lint a training script on disk; UserError if it is missing, unreadable or not Python."""
    return lint_source(read_script(path), str(path))


def lint_source(
    source: str, path: str = "<string>", assumed_imports: dict[str, str] | None = None
) -> list[Finding]:
    """Lint Python source text; findings sorted by line, then cause id.

    `assumed_imports`: names a fragment uses without importing them (`dist`
    for torch.distributed), resolved so unless the source imports them itself.
    """
    script = parse_script(source, path)
    for name, module in (assumed_imports or {}).items():
        script.aliases.setdefault(name, module)
    try:
        script.traces = trace_script(script)
        findings = {finding for check in CHECKS for finding in check.run(script)}
    except RecursionError:
        # Every walk here is iterative or bounded; this is the last line of
        # defence for a shape of file nobody foresaw, so it stays one line.
        raise UserError(f"{path}: nested too deeply to lint") from None
    return sorted(findings, key=lambda f: (f.line, f.cause_id, f.message))
