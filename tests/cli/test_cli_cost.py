"""`assistant --help` and `assistant kb lint` must not pay for torch or the model."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "sentence_transformers", "faiss", "textual", "transformers")

PROBE = """
import sys
from assistant.cli import main
try:
    main({args!r}, prog_name="assistant")
except SystemExit:
    pass
heavy = [m for m in {heavy!r} if m in sys.modules]
print("HEAVY=" + ",".join(heavy), file=sys.stderr)
"""


@pytest.mark.parametrize(
    "args", [["--help"], ["kb", "lint"], ["ask", "--help"], ["lint", "--help"]]
)
def test_light_commands_import_nothing_heavy(args):
    code = PROBE.format(args=args, heavy=HEAVY)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    marker = [line for line in done.stderr.splitlines() if line.startswith("HEAVY=")]
    assert marker == ["HEAVY="], done.stderr


def test_every_command_has_help_with_an_example():
    from click.testing import CliRunner

    from assistant.cli import main

    def walk(group, prefix):
        for name, command in group.commands.items():
            yield prefix + [name], command
            if hasattr(command, "commands"):
                yield from walk(command, prefix + [name])

    for path, command in walk(main, []):
        assert command.help, f"{' '.join(path)} has no help"
        if not hasattr(command, "commands"):
            assert "assistant " in command.help, f"{' '.join(path)} help shows no example"
        result = CliRunner().invoke(main, path + ["--help"])
        assert result.exit_code == 0
