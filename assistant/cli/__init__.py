"""The `assistant` command line: commands (click) and the rich renderer."""

from assistant.cli.commands import main

__all__ = ["main"]
