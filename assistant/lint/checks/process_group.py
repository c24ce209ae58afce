"""Process-group checks: torch.distributed calls or a DistributedSampler before init."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from assistant.lint.model import Script, keyword, short
from assistant.lint.registry import check
from assistant.lint.torchapi import (
    NEEDS_GROUP,
    calls_external_setup,
    init_calls,
    is_dist_call,
    is_init,
)
from assistant.lint.tracer import TracedCall
from assistant.results import Finding


@check("process-group-not-initialized")
def check_process_group_not_initialized(script: Script) -> Iterator[Finding]:
    """torch.distributed calls or DistributedSampler before init_process_group."""
    has_init_anywhere = bool(init_calls(script))
    protected = calls_behind_is_initialized(script)
    for index, trace in enumerate(script.traces):
        first_init = next((i for i, c in enumerate(trace) if is_init(c.name)), None)
        if first_init is None:
            # Without an init in this file, the group may come from an imported
            # helper: only the module-level path of a file with no init at all
            # and no such helper is reported.
            if has_init_anywhere or index != 0 or calls_external_setup(script):
                continue
            before, why = trace, "init_process_group is never called in this file"
        else:
            before = trace[:first_init]
            why = f"init_process_group comes later (line {trace[first_init].node.lineno})"
        for call in before:
            if needs_group(call, protected):
                yield script.finding(
                    "process-group-not-initialized",
                    call.node,
                    f"{short(call.name)}() needs the default process group, but {why}",
                )


def needs_group(call: TracedCall, protected: set[int]) -> bool:
    if id(call.node) in protected:
        return False
    if is_dist_call(call.name, NEEDS_GROUP):
        return True
    if short(call.name) == "DistributedSampler":
        # With both given explicitly, the sampler never asks the process group.
        return keyword(call.node, "num_replicas") is None or keyword(call.node, "rank") is None
    return False


def calls_behind_is_initialized(script: Script) -> set[int]:
    """ids of calls under `if dist.is_initialized()` or `dist.is_initialized() and ...`."""
    protected: set[int] = set()
    if "is_initialized" not in {short(name) for _node, name in script.call_names}:
        return protected
    # `a and (b or c)`: the outer BoolOp covers the inner one; walking both is quadratic.
    inner = {
        id(value)
        for node in script.nodes
        if isinstance(node, ast.BoolOp)
        for value in node.values
        if isinstance(value, ast.BoolOp)
    }
    for node in script.nodes:
        if isinstance(node, (ast.If, ast.IfExp)):
            guard = node.test
        elif isinstance(node, ast.BoolOp) and id(node) not in inner:
            guard = node
        else:
            continue
        checks_group = any(
            isinstance(n, ast.Call) and short(script.name_of(n.func)) == "is_initialized"
            for n in ast.walk(guard)
        )
        if checks_group:
            protected.update(id(n) for n in ast.walk(node) if isinstance(n, ast.Call))
    return protected
