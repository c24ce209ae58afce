"""The tree helpers every check leans on (assistant/lint/model.py, tracer.py): the
cached walk, the reading of a test on a count of the batch, and which of the
file's methods a call runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from assistant.lint.model import parse_script, truth_at_count, walk
from assistant.lint.tracer import classes_built_as, same_file_callees

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


CLASSES = """
class Base:
    def save(self, step): pass
    def log(self): pass

class Plain(Base):
    def __init__(self): super().__init__()
    def log(self): super().log()

class Child(Plain):
    pass

model = Child()
other = Plain() if flag else make_model()
"""


def test_a_method_resolves_through_the_files_own_bases():
    script = parse_script(CLASSES)
    assert script.resolved_method("Child", "save") == "Base.save"
    assert script.resolved_method("Child", "log") == "Plain.log"
    assert script.resolved_method("Child", "state_dict") is None  # a library base's


def test_a_call_on_an_instance_of_the_files_class_runs_its_method_whatever_its_name():
    script = parse_script(CLASSES)
    call = ast.parse("model.save(10)").body[0].value
    assert same_file_callees(script, call.func, None) == ["Base.save"]  # `save` is common
    assert same_file_callees(script, ast.parse("Child()").body[0].value.func, None) == [
        "Plain.__init__"
    ]
    # `other` may be something else: a common name stays unfollowed
    assert same_file_callees(script, ast.parse("other.save(1)").body[0].value.func, None) == []
    assert classes_built_as(script, "other") == []


def test_super_resolves_from_the_callers_class():
    script = parse_script(CLASSES)
    call = ast.parse("super().log()").body[0].value
    assert same_file_callees(script, call.func, "Plain") == ["Base.log"]
    assert same_file_callees(script, call.func, None) == []
