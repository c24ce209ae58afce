"""The `assistant` command line: commands (click) and the rich renderer."""

from assistant.cli import kb as kb_commands  # the module stays reachable as assistant.cli.kb
from assistant.cli.commands import main
from assistant.cli.explain import explain
from assistant.cli.feedback import feedback, kb_feedback
from assistant.cli.kbtools import kb_import_thread, kb_new, kb_site
from assistant.cli.lint import lint
from assistant.cli.run import run

main.add_command(kb_commands.kb)
main.add_command(explain)
main.add_command(feedback)
main.add_command(lint)
main.add_command(run)
kb_commands.kb.add_command(kb_feedback)
kb_commands.kb.add_command(kb_new)
kb_commands.kb.add_command(kb_import_thread)
kb_commands.kb.add_command(kb_site)

__all__ = ["main"]
