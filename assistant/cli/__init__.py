"""The `assistant` command line: commands (click) and the rich renderer."""

from assistant.cli.commands import main
from assistant.cli.explain import explain
from assistant.cli.feedback import feedback, kb_feedback
from assistant.cli.kb import kb

main.add_command(kb)
main.add_command(explain)
main.add_command(feedback)
kb.add_command(kb_feedback)

__all__ = ["main"]
