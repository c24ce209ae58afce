"""Hostile input to `assistant lint` (from a tester's report): every file ends in
findings or in one UserError line, never a traceback or a hang; through the
library and through the command line (`lint`, `ask --script`)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

from assistant.cli import main
from assistant.errors import ExitCode, UserError
from assistant.lint import lint_script, lint_source
from assistant.lint.model import MAX_NODES, MAX_SCRIPT_BYTES, parse_script
from assistant.lint.tracer import MAX_TRACED_CALLS_PER_FILE, trace_script

HEADER = "import torch\nimport torch.distributed as dist\n"


def deep_parentheses() -> str:
    return "x = " + "(" * 5000 + "1" + ")" * 5000 + "\n"


def long_sum() -> str:
    return "x = a" + "+a" * 100_000 + "\n"


def call_chain(length: int = 5000) -> str:
    """f1 calls f2 ... calls f<length>, whose barrier only rank 0 reaches."""
    functions = "".join(f"def f{i}(rank):\n    f{i + 1}(rank)\n\n" for i in range(1, length))
    last = f"def f{length}(rank):\n    if rank == 0:\n        dist.barrier()\n\n"
    start = "dist.init_process_group('gloo')\nf1(dist.get_rank())\n"
    return HEADER + functions + last + start


def line_of(source: str, text: str) -> int:
    return next(n for n, line in enumerate(source.splitlines(), 1) if text in line)


def write(tmp_path: Path, content: str | bytes, name: str = "train.py") -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def one_line_error(call) -> str:
    with pytest.raises(UserError) as caught:
        call()
    message = str(caught.value)
    assert message and "\n" not in message
    return message


# ---------------------------------------------------------------- through lint_script


def test_deep_parentheses_are_a_user_error(tmp_path: Path) -> None:
    path = write(tmp_path, deep_parentheses())
    assert "not valid Python: too many nested parentheses" in one_line_error(
        lambda: lint_script(path)
    )


def test_a_sum_too_deep_for_the_parser_is_a_user_error(tmp_path: Path) -> None:
    path = write(tmp_path, long_sum())
    assert "nested too deeply" in one_line_error(lambda: lint_script(path))


def test_a_deep_expression_that_parses_is_linted_through(tmp_path: Path) -> None:
    # 2,000 levels: deeper than Python's recursion limit, within its parser's.
    source = (
        HEADER
        + "dist.init_process_group('gloo')\nrank = dist.get_rank()\n"
        + "t = torch.zeros(rank"
        + " + 1" * 2000
        + ")\ndist.all_reduce(t)\n"
    )
    findings = lint_script(write(tmp_path, source))
    assert [(f.cause_id, f.line) for f in findings] == [("collective-mismatch", 6)]


def test_a_deep_expression_is_named_by_its_line_in_a_message() -> None:
    module = "m" + " + m" * 2000
    source = (
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        f"model = DDP({module}, device_ids=[local_rank])\n"
    )
    findings = lint_source(source)
    assert [f.cause_id for f in findings] == ["ddp-device-ids-cpu-module"]
    assert "<expression on line 2>" in findings[0].message


def test_a_5000_function_call_chain_is_followed_to_its_end(tmp_path: Path) -> None:
    source = call_chain(5000)
    findings = lint_script(write(tmp_path, source))
    assert [(f.cause_id, f.line) for f in findings] == [
        ("collective-mismatch", line_of(source, "dist.barrier()"))
    ]


def test_recursion_between_functions_ends(tmp_path: Path) -> None:
    source = HEADER + (
        "def ping(rank, n):\n"
        "    pong(rank, n - 1)\n"
        "def pong(rank, n):\n"
        "    ping(rank, n - 1)\n"
        "    if rank == 0:\n"
        "        dist.barrier()\n"
        "dist.init_process_group('gloo')\n"
        "ping(dist.get_rank(), 10)\n"
    )
    findings = lint_script(write(tmp_path, source))
    assert [(f.cause_id, f.line) for f in findings] == [("collective-mismatch", 8)]


def test_a_call_graph_that_doubles_at_each_level_is_traced_within_the_budget() -> None:
    # 2**40 paths from f0 to f40; the trace stops stepping in, but records every call it walks.
    functions = "".join(f"def f{i}():\n    f{i + 1}()\n    f{i + 1}()\n" for i in range(40))
    uncalled = "".join(f"def g{i}():\n    f0()\n" for i in range(200))
    source = HEADER + functions + "def f40():\n    dist.barrier()\n" + uncalled + "f0()\n"
    script = parse_script(source)
    traces = trace_script(script)
    calls_in_file = len(script.call_names)
    assert sum(len(t) for t in traces) <= MAX_TRACED_CALLS_PER_FILE + len(traces) * calls_in_file
    assert [f.cause_id for f in lint_source(source)] == ["process-group-not-initialized"]


def test_thousands_of_rank_guarded_collectives_are_each_judged() -> None:
    lonely = "if dist.get_rank() == 0:\n    dist.barrier()\n" * 3000
    paired = "if dist.get_rank() == 0:\n    dist.barrier()\nif dist.get_rank() != 0:\n    dist.barrier()\n"
    start = HEADER + "dist.init_process_group('gloo')\n"
    assert len(lint_source(start + lonely)) == 3000
    assert lint_source(start + paired * 1500) == []


def test_prose_is_not_python(tmp_path: Path) -> None:
    path = write(tmp_path, "Dear team, the training hangs at step 5 (see log).\n")
    assert one_line_error(lambda: lint_script(path)).startswith(f"{path}:1: not valid Python")


def test_binary_and_utf16_files_are_not_python(tmp_path: Path) -> None:
    binary = write(tmp_path, bytes(range(256)) * 4, "model.pt")
    utf16 = write(tmp_path, "import torch\n".encode("utf-16"), "utf16.py")
    for path in (binary, utf16):
        assert "not valid Python" in one_line_error(lambda path=path: lint_script(path))


def test_a_byte_order_mark_is_fine(tmp_path: Path) -> None:
    path = write(tmp_path, b"\xef\xbb\xbfimport torch\nx = torch.device('cuda:0')\n")
    assert [(f.cause_id, f.line) for f in lint_script(path)] == [("hardcoded-device", 2)]


def test_an_empty_file_has_no_findings(tmp_path: Path) -> None:
    assert lint_script(write(tmp_path, "")) == []


def test_a_pipe_is_refused_instead_of_read_forever(tmp_path: Path) -> None:
    fifo = tmp_path / "train.py"
    os.mkfifo(fifo)
    assert "not a regular file" in one_line_error(lambda: lint_script(fifo))


def test_a_file_too_big_for_a_training_script_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bundle.py"
    with path.open("wb") as out:
        out.truncate(MAX_SCRIPT_BYTES + 1)  # sparse: no need to write it
    assert "too big for a training script" in one_line_error(lambda: lint_script(path))


def test_a_file_of_too_many_expressions_is_refused_after_parsing() -> None:
    source = "x = [" + "1," * MAX_NODES + "]\n"  # under the size limit, over the node limit
    assert len(source) < MAX_SCRIPT_BYTES
    assert "syntax nodes is too many" in one_line_error(lambda: lint_source(source))


def test_a_symlink_loop_is_a_user_error(tmp_path: Path) -> None:
    loop = tmp_path / "train.py"
    loop.symlink_to(loop)
    assert one_line_error(lambda: lint_script(loop)).startswith(f"{loop}: cannot read")


# ---------------------------------------------------------------- through the command line

HOSTILE_FILES = {
    "deep_parentheses.py": deep_parentheses(),
    "long_sum.py": long_sum(),
    "prose.py": "this is not python at all {{{\n",
    "binary.py": bytes(range(256)) * 4,
}


@pytest.mark.parametrize("name", sorted(HOSTILE_FILES))
def test_cli_lint_of_hostile_input_is_one_line_and_exit_2(tmp_path: Path, name: str) -> None:
    path = write(tmp_path, HOSTILE_FILES[name], name)
    result = CliRunner().invoke(main, ["lint", str(path)])
    assert result.exit_code == ExitCode.USAGE
    assert result.stderr.startswith("assistant: error: ")
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


@pytest.mark.parametrize("what", ["missing", "directory", "too big"])
def test_cli_lint_of_no_script_is_one_line_and_exit_2(tmp_path: Path, what: str) -> None:
    path = tmp_path / "train.py" if what != "directory" else tmp_path
    if what == "too big":
        with path.open("wb") as out:
            out.truncate(MAX_SCRIPT_BYTES + 1)
    result = CliRunner().invoke(main, ["lint", str(path)])
    assert result.exit_code == ExitCode.USAGE
    assert len(result.stderr.strip().splitlines()) == 1


def test_cli_lint_of_a_long_call_chain_reports_the_finding(tmp_path: Path) -> None:
    source = call_chain(5000)
    path = write(tmp_path, source)
    result = CliRunner().invoke(main, ["lint", str(path)])
    assert result.exit_code == ExitCode.FAILED
    line = line_of(source, "dist.barrier()")
    assert f"{path}:{line}: [collective-mismatch]" in result.stdout
    assert result.stdout.strip().endswith("1 finding(s)")


def test_cli_ask_with_a_hostile_script_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = write(tmp_path, long_sum())
    result = CliRunner().invoke(
        main, ["ask", "--no-probe", "--script", str(path), "NCCL timeout in all_reduce"]
    )
    assert result.exit_code == ExitCode.USAGE
    assert "nested too deeply" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_chat_lints_through_the_same_function_and_gets_one_line(tmp_path: Path) -> None:
    # The chat's worker shows any exception as one line; it must be the UserError.
    from assistant.tui import services

    path = write(tmp_path, long_sum())
    assert "nested too deeply" in one_line_error(lambda: services.lint_script(str(path)))


def test_thousands_of_skips_in_one_training_loop_are_each_judged() -> None:
    # each skip's "what comes after it" is read once per block, not once per skip
    start = (
        HEADER
        + "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        + "dist.init_process_group('gloo')\nmodel = DDP(torch.nn.Linear(2, 2))\n"
        + "for batch in range(10):\n    loss = model(batch)\n"
    )
    skips = "".join(f"    if torch.isnan(loss{i}):\n        continue\n" for i in range(3000))
    findings = lint_source(start + skips + "    loss.backward()\n")
    assert [f.cause_id for f in findings] == ["uneven-inputs"] * 3000


def test_an_argparse_default_that_names_its_own_dest_is_linted_not_looped() -> None:
    """`add_argument("--bs", default=CFG.bs)` and a loader of `args.bs`: the default
    names the dest it defines; resolving it must end (a blind script looped here)."""
    source = (
        "import argparse\nimport torch\nimport torch.distributed as dist\n"
        "from torch.utils.data import DataLoader\n"
        "ap = argparse.ArgumentParser()\nap.add_argument('--bs', type=int, default=CFG.bs)\n"
        "args = ap.parse_args()\ndist.init_process_group('nccl')\n"
        "loader = DataLoader(ds, batch_size=args.bs, shuffle=True)\n"
        "model = torch.nn.parallel.DistributedDataParallel(net)\n"
    )
    assert {f.cause_id for f in lint_source(source)} <= {
        "missing-distributed-sampler",
        "set-device-order",
    }


def test_a_class_whose_fields_are_assigned_from_each_other_is_linted_quickly() -> None:
    """Rank tests read through fields assigned in many places from other such
    fields (torchmetrics' Metric) were worked out again at every use: exponential."""
    fields = "\n".join(
        f"        self.f{i} = self.f{i - 1} or self.f{(i * 7) % 40} and self.f{(i * 3) % 40}"
        for i in range(1, 40)
    )
    checks = "\n".join(f"        if self.f{i}:\n            dist.barrier()" for i in range(40))
    source = (
        "import torch.distributed as dist\nclass M:\n    def __init__(self, rank):\n"
        f"        self.f0 = rank == 0\n{fields}\n    def step(self):\n{checks}\n"
    )

    def too_slow(*_args: object) -> None:
        raise TimeoutError("linting 40 cross-assigned fields took over 20 s")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(20)  # before the fix this ran for minutes; now well under a second
    try:
        lint_source(source)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------- a check that fails


@pytest.fixture
def a_failing_check(monkeypatch):
    """One more registered check that raises on every file, as a check with a bug
    would on a shape of file nobody foresaw; failures are skipped, as for users."""
    from assistant.lint import registry, script

    def explodes(_script):
        yield from ()
        raise KeyError("a node nobody foresaw")

    monkeypatch.setattr(script, "RAISE_CHECK_ERRORS", False)
    monkeypatch.setattr(
        registry, "CHECKS", [*registry.CHECKS, registry.RegisteredCheck(("x",), explodes)]
    )
    monkeypatch.setattr(script, "CHECKS", registry.CHECKS)
    return "explodes"


def test_a_check_that_fails_is_skipped_and_named_while_the_others_still_run(
    a_failing_check,
) -> None:
    source = call_chain(3)
    findings = lint_source(source)
    assert [f.cause_id for f in findings] == ["collective-mismatch"]
    assert len(findings.skipped_checks) == 1
    assert a_failing_check in findings.skipped_checks[0]
    assert "KeyError: 'a node nobody foresaw'" in findings.skipped_checks[0]


def test_cli_lint_names_the_failed_check_on_one_line_and_never_says_clean(
    tmp_path: Path, a_failing_check
) -> None:
    path = write(tmp_path, HEADER + "dist.init_process_group('gloo')\n")
    result = CliRunner().invoke(main, ["lint", str(path)])
    assert result.exit_code == ExitCode.FAILED
    assert "Traceback" not in result.output
    assert result.stdout.strip().endswith("0 finding(s)")
    [note] = result.stderr.strip().splitlines()
    assert note.startswith("assistant lint: not checked, the check failed here: ")
    assert a_failing_check in note


def test_a_tracer_that_fails_is_one_user_error_line(monkeypatch) -> None:
    from assistant.lint import script

    def broken_tracer(_script):
        raise TypeError("unexpected node")

    monkeypatch.setattr(script, "RAISE_CHECK_ERRORS", False)
    monkeypatch.setattr(script, "trace_script", broken_tracer)
    message = one_line_error(lambda: lint_source(HEADER, "train.py"))
    assert message == "train.py: the linter failed to read this file (TypeError: unexpected node)"


def test_the_tests_see_a_failing_check_raise() -> None:
    from assistant.lint import script

    assert script.RAISE_CHECK_ERRORS, "tests/conftest.py sets ASSISTANT_LINT_RAISE=1"
