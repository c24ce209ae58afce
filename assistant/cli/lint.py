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
    """Check a training script statically (never runs it); exit 1 on findings.

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
    if findings:
        sys.exit(int(ExitCode.FAILED))
