"""Rollouts of whole episodes: each rank's number of optimisation steps is its own.

An RL trainer under DDP collects experience on every rank from its own
environment, episode by episode (`while not done: ... = env.step(a)`), then
cuts the rollout into minibatches and runs a backward per minibatch (`n =
obs.shape[0]`, `for start in range(0, n, minibatch):`). An episode ends when
the environment says so, so each rank's rollout has a length of its own, and
with it a number of minibatches of its own: the rank with more runs a
backward whose gradient all-reduce no other rank joins (a hang until the
timeout, or gloo's size mismatch). uneven-inputs, reported at the loop.

Collected until the episodes end: `while not done:`, or a fixed number of
whole episodes, each `for t in range(max_steps):` left by a `break` when the
step says the episode ended. Quiet when the rollout's size goes through a
collective before the loop (`all_reduce(n_t, op=MIN)`), when the loop's count
does not come from the rollout (a fixed number of minibatches), and when
collection runs a fixed number of steps (`for t in range(T):`, resetting
episodes as they end).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from assistant.lint.model import Script, names_in, short, source_text, walk
from assistant.lint.registry import check
from assistant.lint.torchapi import is_backward, is_collective, is_ddp
from assistant.results import Finding

# An environment step's result unpacked into at least this many names:
# (obs, reward, done, info) in gym, (obs, reward, terminated, truncated, info) in gymnasium.
STEP_RESULTS = 4
SIZE_METHODS = frozenset({"size", "numel"})


@check("uneven-inputs")
def check_minibatches_over_episode_rollouts(script: Script) -> Iterator[Finding]:
    """A backward per minibatch of a rollout collected until its episodes ended."""
    if not any(is_ddp(name) for _node, name in script.call_names):
        return
    collectors = episode_collectors(script)
    if not collectors:
        return
    for scope in script.all_scopes:  # a name means one thing within its own function
        nodes = script.scope_nodes(scope)
        rollouts = names_assigned_from(script, nodes, collectors)
        sizes = size_names(nodes, rollouts)
        for loop in (node for node in nodes if isinstance(node, ast.For)):
            agreed = sizes_through_collectives(script, nodes, sizes, before=loop.lineno)
            count = rollout_count(script, loop.iter, rollouts, sizes - agreed)
            if count is not None and runs_backward(loop):
                yield finding(script, loop, count, collectors)


def finding(script: Script, loop: ast.For, count: str, collectors: set[str]) -> Finding:
    return script.finding(
        "uneven-inputs",
        loop,
        f"the loop runs a backward per minibatch, and its count ({count}) comes from "
        "a rollout each rank collects until its own episodes end "
        f"({' / '.join(sorted(collectors))}): "
        "ranks get different numbers of minibatches, and the rank with more runs a "
        "backward whose gradient all-reduce no other rank joins; agree on the count "
        "first (all_reduce the rollout size with op=MIN and cut to it), or collect a "
        "fixed number of steps per rank",
    )


def episode_collectors(script: Script) -> set[str]:
    """Same-file functions that return, and loop until an environment step ends the
    episode: `while not done:`, or `for t in range(max_steps):` left by a `break`
    when the step says so."""
    return {
        name
        for name, function in script.functions.items()
        if any(isinstance(n, ast.Return) and n.value is not None for n in walk(function))
        and any(runs_until_a_step_ends(n) for n in walk(function))
    }


def runs_until_a_step_ends(loop: ast.AST) -> bool:
    """A `while` whose test reads a name its body sets, or a `for` its body leaves
    (`if term or trunc: break`) on what the step returned, a name made of it
    (`last = term or trunc`) too; the body unpacks a `.step(...)` result into an
    environment's (obs, reward, done, ...) names."""
    if not isinstance(loop, ast.While | ast.For):
        return False
    body = [node for statement in loop.body for node in walk(statement)]
    stepped = step_results(body)
    if not stepped:
        return False
    assigned = [node for node in body if isinstance(node, ast.Assign)]
    set_here = {
        target.id
        for node in assigned
        for target in walk(node.targets[0])
        if isinstance(target, ast.Name)
    }
    if isinstance(loop, ast.While):
        return bool(names_in(loop.test) & set_here)
    ending = stepped | {
        target.id
        for node in assigned
        if names_in(node.value) & stepped
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    return any(
        isinstance(node, ast.If)
        and any(isinstance(s, ast.Break) for s in node.body)
        and bool(names_in(node.test) & ending)
        for node in body
    )


def step_results(body: list[ast.AST]) -> set[str]:
    """The names an environment step's result is unpacked into (`o, r, term, trunc, _ =
    env.step(a)`), none where the body steps no environment."""
    return {
        element.id
        for node in body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Tuple)
        and len(node.targets[0].elts) >= STEP_RESULTS
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute)
        and node.value.func.attr == "step"
        for element in node.targets[0].elts
        if isinstance(element, ast.Name) and element.id != "_"
    }


def names_assigned_from(script: Script, nodes: list[ast.AST], functions: set[str]) -> set[str]:
    """Names bound to what a call of one of `functions` returns (`obs, acts = collect(...)`)."""
    bound: set[str] = set()
    for node in nodes:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        called = script.name_of(node.value.func)
        if called in functions or short(called) in functions:
            bound |= {n.id for t in node.targets for n in walk(t) if isinstance(n, ast.Name)}
    return bound


def size_names(nodes: list[ast.AST], rollouts: set[str]) -> set[str]:
    """Names assigned the length of a rollout (`n = obs.shape[0]`, `n = len(batch["obs"])`)."""
    return {
        source_text(node.targets[0])
        for node in nodes
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and length_of(node.value, rollouts)
    }


def length_of(expr: ast.expr, rollouts: set[str]) -> bool:
    """`x.shape[0]`, `x.size(0)`, `len(x)` of a rollout value (or a field of one)."""
    if isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Attribute):
        measured = expr.value.value if expr.value.attr == "shape" else None
    elif isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
        measured = expr.func.value if expr.func.attr in SIZE_METHODS else None
    elif isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.args:
        measured = expr.args[0] if expr.func.id == "len" else None
    else:
        measured = None
    while isinstance(measured, ast.Subscript):  # batch["obs"], obs[:, 0]
        measured = measured.value
    return isinstance(measured, ast.Name) and measured.id in rollouts


def sizes_through_collectives(
    script: Script, nodes: list[ast.AST], sizes: set[str], before: int
) -> set[str]:
    """The sizes a collective of the same function (`nodes`) above line `before`
    reads, directly or through the tensor built from them (one that only logs them
    after the loop agrees on nothing; one in another function, a running mean's
    own count, agrees on another `n`)."""
    agreed: set[str] = set()
    for node in nodes:
        if not isinstance(node, ast.Call) or node.lineno >= before:
            continue
        if not is_collective(script.name_of(node.func) or ""):
            continue
        read = {n for a in node.args for n in names_in(a)}
        built_from = [v for n in read for v in script.assigned_values.get(n, [])]
        agreed |= sizes & read.union(*map(names_in, built_from))
    return agreed


def rollout_count(
    script: Script, items: ast.expr, rollouts: set[str], sizes: set[str]
) -> str | None:
    """What a loop's `range(...)` counts when a rollout's length decides it, else None."""
    if not (isinstance(items, ast.Call) and short(script.name_of(items.func)) == "range"):
        return None
    for argument in items.args:
        if names_in(argument) & sizes or length_of(argument, rollouts):
            return source_text(argument)
    return None


def runs_backward(loop: ast.For) -> bool:
    return any(is_backward(n) for n in walk(loop))
