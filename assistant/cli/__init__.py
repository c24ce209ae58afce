"""The `assistant` command line: commands (click) and the rich renderer."""

from assistant.cli.commands import main
from assistant.cli.kb import kb

main.add_command(kb)

__all__ = ["main"]
