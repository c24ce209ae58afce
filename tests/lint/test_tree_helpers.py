"""The tree helpers every check leans on (assistant/lint/model.py): the cached
walk and the reading of a test on a count of the batch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from assistant.lint.model import truth_at_count, walk

REPO = Path(__file__).parents[2]


def test_walk_yields_what_ast_walk_yields_in_the_same_order():
    tree = ast.parse((REPO / "assistant" / "lint" / "checks" / "unused.py").read_text())
    assert [id(n) for n in walk(tree)] == [id(n) for n in ast.walk(tree)]
    # a second walk reads the children kept on the nodes: the same again
    assert [id(n) for n in walk(tree)] == [id(n) for n in ast.walk(tree)]


def is_count(expr: ast.expr) -> bool:
    """`len(...)` or a name `n` counts the batch here."""
    if isinstance(expr, ast.Name):
        return expr.id == "n"
    return isinstance(expr, ast.Call) and getattr(expr.func, "id", "") == "len"


@pytest.mark.parametrize(
    "test, at_zero, at_one",
    [
        ("n == 0", True, False),
        ("len(x) < 1", True, False),
        ("not n", True, False),
        ("n", False, True),
        ("n > 0", False, True),
        ("not (n >= 1)", True, False),
        ("n == 1", False, True),
        ("n <= 1", True, True),
        ("m == 0", None, None),  # not a count of the batch
        ("n == limit", None, None),  # a bound that is no literal
        ("n in (0, 1)", None, None),  # a comparison it does not read
    ],
)
def test_the_truth_of_a_test_on_a_count(test, at_zero, at_one):
    expr = ast.parse(test, mode="eval").body
    assert truth_at_count(expr, is_count, 0) is at_zero
    assert truth_at_count(expr, is_count, 1) is at_one
