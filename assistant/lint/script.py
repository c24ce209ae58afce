"""`assistant lint train.py`: static checks of a DDP training script; the entry points.

The script is read and parsed (model.py) and never executed: it may start
processes, grab GPUs or hang. The tracer (tracer.py) walks it in a rough
execution order, noting the `if`s on the rank around each call (ranks.py);
then every registered check (registry.py, one module per area in checks/)
yields `Finding`s named by contract cause ids (data/causes.yaml).

Checks prefer silence to guessing: a correct modern torchrun script must
produce no findings (tests/data/scripts/correct_*.py). Hostile input ends in
findings or in one `UserError` line, never a traceback or a hang. A check that
fails on a shape of file nobody foresaw is skipped and named in
`Findings.skipped_checks`, so the person still gets every other check and is
told which cause went unchecked; the tests set RAISE_CHECK_ERRORS to see the bug.
"""

from __future__ import annotations

import os
from pathlib import Path

import assistant.lint.checks  # noqa: F401  (importing it registers every check)
from assistant.errors import UserError
from assistant.lint.model import parse_script, read_script
from assistant.lint.registry import CHECKS
from assistant.lint.tracer import trace_script
from assistant.results import Finding

RAISE_CHECK_ERRORS = os.environ.get("ASSISTANT_LINT_RAISE") == "1"
"""Let a failing check raise instead of being skipped: the tests, and anyone
debugging a check, set ASSISTANT_LINT_RAISE=1."""


class Findings(list):
    """The findings of one file, sorted, and the checks that failed on it."""

    def __init__(self, findings=(), skipped_checks: tuple[str, ...] = ()):
        super().__init__(findings)
        self.skipped_checks = skipped_checks
        """'module.check (Error: message)' for each check that raised and was skipped."""


def lint_script(path: str | Path) -> Findings:
    """Lint a training script on disk; UserError if it is missing, unreadable or not Python."""
    return lint_source(read_script(path), str(path))


def lint_source(
    source: str, path: str = "<string>", assumed_imports: dict[str, str] | None = None
) -> Findings:
    """Lint Python source text; findings sorted by line, then cause id.

    `assumed_imports`: names a fragment uses without importing them (`dist`
    for torch.distributed), resolved so unless the source imports them itself.
    """
    script = parse_script(source, path)
    for name, module in (assumed_imports or {}).items():
        script.aliases.setdefault(name, module)
    try:
        script.traces = trace_script(script)
        findings, skipped = run_checks(script)
    except RecursionError:
        # Every walk here is iterative or bounded; this is the last line of
        # defence for a shape of file nobody foresaw, so it stays one line.
        raise UserError(f"{path}: nested too deeply to lint") from None
    except Exception as exc:  # the tracer itself: nothing could be checked
        if RAISE_CHECK_ERRORS:
            raise
        raise UserError(f"{path}: the linter failed to read this file ({describe(exc)})") from None
    ordered = sorted(findings, key=lambda f: (f.line, f.cause_id, f.message))
    return Findings(ordered, tuple(skipped))


def run_checks(script) -> tuple[list[Finding], list[str]]:
    """Every check's findings, and the checks that raised (their partial findings dropped).

    Two checks that reach the same mistake by different roads (a gather's shape
    read from the rank, and from the data) say it once, in the words of the
    check registered first; one check's findings on one line (two metrics
    printed together) all stay.
    """
    findings: dict[tuple[str, int], set[Finding]] = {}
    skipped: list[str] = []
    for registered in CHECKS:
        try:
            found = list(registered.run(script))
            reached = set(findings)
            for finding in found:
                key = (finding.cause_id, finding.line)
                if key not in reached:
                    findings.setdefault(key, set()).add(finding)
        except RecursionError:
            raise
        except Exception as exc:
            if RAISE_CHECK_ERRORS:
                raise
            skipped.append(f"{registered.name} ({describe(exc)})")
    return [f for same_place in findings.values() for f in same_place], skipped


def describe(exc: Exception) -> str:
    """'ValueError: message', cut to one short line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:120]}" if text else type(exc).__name__
