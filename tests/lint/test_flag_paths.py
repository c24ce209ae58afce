"""The tracer follows a call's flags: `if reduce:` in a helper runs on a path only
when that call leaves `reduce` truthy (assistant/lint/tracer.py, falsy_parameters).
A collective under such a flag is judged by the paths that really reach it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from assistant.lint import lint_source
from assistant.lint.tracer import falsy_parameters

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"


def falsy(source: str, method: bool = False) -> set[str]:
    tree = ast.parse(source)
    func = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call))
    return set(falsy_parameters(func, call, method))


@pytest.mark.parametrize(
    ("source", "method", "expected"),
    [
        ("def f(x, reduce=True): pass\nf(1, reduce=False)", False, {"reduce"}),
        ("def f(x, reduce=True): pass\nf(1, False)", False, {"reduce"}),
        ("def f(x, reduce=False): pass\nf(1)", False, {"reduce"}),
        ("def f(x, reduce=False): pass\nf(1, reduce=flag)", False, set()),
        ("def f(self, x, log=True): pass\nobj.f(1, None)", True, {"log"}),
        ("def f(x, reduce=False): pass\nf(1, **options)", False, set()),
        ("def f(x, reduce=False):\n    reduce = reduce or x\nf(1)", False, set()),
        ("def f(x, *, sync=None): pass\nf(1)", False, {"sync"}),
    ],
)
def test_the_parameters_a_call_leaves_falsy(source, method, expected):
    assert falsy(source, method) == expected


def test_a_collective_under_a_flag_is_judged_by_the_calls_that_set_it():
    broken = lint_source((SCRIPTS / "collective_under_a_flag_rank_zero_leaves_on.py").read_text())
    assert [f.cause_id for f in broken] == ["collective-mismatch"]
    twin = (SCRIPTS / "correct_collective_under_a_flag_rank_zero_turns_off.py").read_text()
    assert lint_source(twin) == []


@pytest.mark.slow
def test_the_twin_runs_to_the_end_on_two_ranks(torchrun):
    ran = torchrun(SCRIPTS / "correct_collective_under_a_flag_rank_zero_turns_off.py")
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.count("validation accuracy") == 2 and "test accuracy" in ran.stdout
