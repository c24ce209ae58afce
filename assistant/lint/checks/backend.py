"""Backend checks: a tensor created on the CPU handed to a collective on NCCL."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from assistant.lint.model import Script, keyword, short
from assistant.lint.registry import check
from assistant.lint.torchapi import (
    COLLECTIVES,
    TENSOR_FACTORIES,
    backend_of,
    init_calls,
    is_dist_call,
)
from assistant.results import Finding

TORCH_FACTORIES = frozenset(f"torch.{name}" for name in TENSOR_FACTORIES)


@check("nccl-with-cpu-tensors")
def check_nccl_with_cpu_tensors(script: Script) -> Iterator[Finding]:
    """A collective on the nccl backend gets a tensor created on the CPU."""
    if not any((backend_of(c) or "").startswith("nccl") for c in init_calls(script)):
        return
    for scope in [script.tree, *script.functions.values()]:
        nodes = script.scope_nodes(scope)
        cpu_tensors = cpu_tensor_names(script, nodes)
        for node in nodes:
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = script.name_of(node.func)
            tensor = node.args[0]
            if (
                is_dist_call(name, COLLECTIVES - {"barrier", "monitored_barrier"})
                and isinstance(tensor, ast.Name)
                and tensor.id in cpu_tensors
            ):
                yield script.finding(
                    "nccl-with-cpu-tensors",
                    node,
                    f"{short(name)}({tensor.id}) on the nccl backend, but {tensor.id} is "
                    f"created on the CPU (line {cpu_tensors[tensor.id]}): create it with "
                    "device=... or move it with .to(device)",
                )


def cpu_tensor_names(script: Script, nodes: list[ast.AST]) -> dict[str, int]:
    """Names whose every assignment among `nodes` is a torch factory without device=."""
    made_on_cpu: dict[str, int] = {}
    elsewhere: set[str] = set()
    for node in nodes:
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if not isinstance(target, ast.Name):
                continue
            value = node.value
            if (
                isinstance(value, ast.Call)
                and script.name_of(value.func) in TORCH_FACTORIES
                and keyword(value, "device") is None
            ):
                made_on_cpu.setdefault(target.id, node.lineno)
            else:
                elsewhere.add(target.id)
    # In-place moves such as `t = t.cuda()` count as another assignment above.
    return {name: line for name, line in made_on_cpu.items() if name not in elsewhere}
