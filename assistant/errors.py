"""The one error type for a user's mistake, and the exit codes the CLI uses."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Exit codes of the `assistant` command."""

    OK = 0
    """Success."""
    FAILED = 1
    """The command ran but its check failed (lint found problems, eval below floor)."""
    USAGE = 2
    """The user's input was unusable: empty question, missing file, bad option."""
    HUNG = 124
    """`assistant run`: the job hung and was ended (as timeout(1) reports a command it killed)."""
    HANGUP = 129
    """SIGHUP (the terminal closed): as Ctrl-C, probes stopped and cleaned up; 128 + 1."""
    INTERRUPTED = 130
    """Ctrl-C: probes were stopped and their processes killed."""
    TERMINATED = 143
    """SIGTERM (timeout, kill): as Ctrl-C, probes stopped and cleaned up; 128 + 15."""


class UserError(Exception):
    """A mistake the user can fix; the CLI prints it as one line, no traceback."""

    def __init__(self, message: str, code: ExitCode = ExitCode.USAGE):
        super().__init__(message)
        self.code = code
