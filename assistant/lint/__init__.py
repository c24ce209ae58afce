"""Static checks of a training script (`assistant lint`); never runs it."""

from assistant.lint.script import lint_script

__all__ = ["lint_script"]
