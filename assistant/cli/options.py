"""Options shared by commands in several CLI modules."""

from __future__ import annotations

from pathlib import Path

import click

from assistant import config


def _use_team_kb(ctx: click.Context, _param, dirs: tuple[Path, ...]):
    """Make --kb folders the team layers of every KB read while this command runs."""
    if dirs:
        config.set_team_kb_dirs(dirs)
        # Undone when the command ends, so an in-process caller (tests, the chat
        # started from `main`) does not keep another command's layers.
        ctx.call_on_close(lambda: config.set_team_kb_dirs(None))
    return dirs


def team_kb_option(func):
    """`--kb DIR` (repeatable): a team KB folder layered over the built-in one."""
    return click.option(
        "--kb",
        "team_kb",
        multiple=True,
        type=click.Path(path_type=Path, file_okay=False, exists=True),
        callback=_use_team_kb,
        expose_value=False,
        is_eager=True,
        metavar="DIR",
        help="Team KB folder (causes/, threads/) layered over the built-in KB; repeatable "
        "(env ASSISTANT_KB_PATH=DIR1:DIR2).",
    )(func)
