"""`assistant lint`: static checks of a training script (assistant.lint); never runs it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from assistant.errors import ExitCode


@click.command("lint")
@click.argument("script", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print findings as JSON.")
def lint(script, as_json):
    """Check a training script statically (never runs it); exit 1 on findings
    or when a check failed on the file (it is named on stderr).

    \b
    assistant lint train.py
    assistant lint --json train.py
    """
    from assistant.lint import lint_script  # imported late: `lint --help` stays cheap

    findings = lint_script(script)
    if as_json:
        click.echo(json.dumps([f.to_json() for f in findings], indent=2))
    else:
        for f in findings:
            click.echo(f"{f.path or script}:{f.line}: [{f.cause_id}] {f.message}")
        click.echo(f"{len(findings)} finding(s)")
    for skipped in findings.skipped_checks:
        # A check that failed proves nothing either way: say which cause went unchecked.
        click.echo(f"assistant lint: not checked, the check failed here: {skipped}", err=True)
    if findings or findings.skipped_checks:
        sys.exit(int(ExitCode.FAILED))
