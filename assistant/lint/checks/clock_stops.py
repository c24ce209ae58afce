"""A training loop each rank leaves when its own clock says so (uneven-inputs).

`while time.perf_counter() - start < args.seconds: train_step(...)`, or `if
time.time() - t0 > budget: break` in the loop: every process reads its own
clock, and no two stop after the same number of steps. The first to stop goes
on to what follows (a stats all_reduce, a save, the next epoch's barrier) while
the others are still in a step's gradient all-reduce: the collectives pair up
wrongly, and the job hangs or fails. Quiet where the ranks decide together: the
stop tested is a value that went through a collective earlier in the iteration
(rank 0 measures and broadcasts a flag, or the elapsed time is all-reduced with MAX).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from assistant.lint.checks.collective_reach import StepFacts, ends_iteration
from assistant.lint.model import (
    Script,
    enclosing_loop,
    name_value_pairs,
    names_in,
    node_fact,
    short,
    source_text,
    walk,
)
from assistant.lint.ranks import enclosing_scope
from assistant.lint.registry import check
from assistant.lint.torchapi import runs_a_process_per_gpu
from assistant.results import Finding

# The time module's clocks: each process reads its own.
CLOCKS = frozenset({"time", "perf_counter", "monotonic", "process_time", "time_ns"})


@check("uneven-inputs")
def check_loop_left_by_each_ranks_clock(script: Script) -> Iterator[Finding]:
    """A loop of training steps whose end (its test, or a break) reads this process's clock."""
    if not runs_a_process_per_gpu(script):
        return
    steps = StepFacts(script, script.parents)
    for node in script.nodes:
        if isinstance(node, ast.While) and reads_the_clock(script, node.test, node):
            loop, test, where = node, node.test, node
        elif isinstance(node, ast.If) and ends_iteration(node.body) and not node.orelse:
            loop = enclosing_loop(node, script.parents)
            if loop is None or not reads_the_clock(script, node.test, loop):
                continue
            if steps.agreed_before(node, loop):
                continue
            test, where = node.test, node
        else:
            continue
        work = steps.work(loop.body)[0]
        if work is None:
            continue
        yield script.finding(
            "uneven-inputs",
            where,
            f"each rank leaves this loop when its own clock says so (`{source_text(test)}`): "
            "no two processes stop after the same number of steps, and those still "
            f"training wait in {short(script.name_of(work.func)) or 'the step'}() (line "
            f"{work.lineno}), which all-reduces, for a rank that has left; decide the stop "
            "together: rank 0 measures and broadcasts a flag, or all_reduce the elapsed "
            "time with MAX before testing it",
        )


def reads_the_clock(script: Script, test: ast.expr, loop: ast.AST) -> bool:
    """The test calls a clock of the time module, or reads a name the loop (or its
    function before it) sets from one: `elapsed = time.time() - start`."""
    if any(is_clock(script, node) for node in walk(test)):
        return True
    scope = enclosing_scope(loop, script) or script.tree
    clock_names = node_fact(
        scope, "names set from a clock", lambda: set_from_a_clock(script, scope)
    )
    return bool(names_in(test) & clock_names)


def set_from_a_clock(script: Script, scope: ast.AST) -> set[str]:
    """Names the scope assigns a value read from a clock (`elapsed = time.time() - t0`)."""
    found: set[str] = set()
    for node in script.scope_nodes(scope):
        if isinstance(node, ast.Assign):
            pairs = name_value_pairs(node)  # `step, tic = 0, time.time()`: tic alone
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            pairs = [(node.target, node.value)]
        else:
            continue
        found.update(
            name.id for name, value in pairs if any(is_clock(script, n) for n in walk(value))
        )
    return found


def is_clock(script: Script, node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    name = script.name_of(node.func)
    return name.startswith("time.") and short(name) in CLOCKS
