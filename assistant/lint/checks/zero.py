"""The model's state_dict read under DeepSpeed ZeRO stage 3 (zero3-partitioned-parameters).

ZeRO-3 partitions every parameter across the ranks and gathers a layer only
while the engine runs it. Outside that, `engine.module.state_dict()` holds a
placeholder of torch.Size([0]) per parameter, on every rank: the weights
saved from it load as "size mismatch ... torch.Size([0])", and a file of a
few megabytes. What DeepSpeed documents instead: `engine.save_16bit_model()`
on every rank (with `stage3_gather_16bit_weights_on_model_save`),
`deepspeed.zero.GatheredParameters` around the read, or `zero_to_fp32` on a
checkpoint saved by `engine.save_checkpoint()` on every rank.

Read only where the file itself says stage 3 (a DeepSpeed config dict with
`"zero_optimization": {"stage": 3}`, or `zero_stage=3`), and only of the
engine `deepspeed.initialize` returned; quiet inside a `with
...GatheredParameters(...)` block.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from assistant.lint.model import Script, short, source_text
from assistant.lint.registry import check
from assistant.results import Finding

STAGE_KEYS = frozenset({"stage", "zero_stage"})
GATHERING_CONTEXTS = frozenset({"GatheredParameters"})


@check("zero3-partitioned-parameters")
def check_state_dict_under_zero3(script: Script) -> Iterator[Finding]:
    """`engine.module.state_dict()` (or the engine's own) in a ZeRO-3 script, outside a gather."""
    stage = zero3_stage(script)
    if stage is None:
        return
    engines = engine_names(script)
    if not engines:
        return
    gathered = gathered_nodes(script)
    for node, _name in script.call_names:
        if not (isinstance(node.func, ast.Attribute) and node.func.attr == "state_dict"):
            continue
        receiver = node.func.value
        if isinstance(receiver, ast.Attribute) and receiver.attr == "module":
            receiver = receiver.value
        if source_text(receiver) not in engines or id(node) in gathered:
            continue
        yield script.finding(
            "zero3-partitioned-parameters",
            node,
            f"{source_text(node)} under ZeRO stage 3 (line {stage.lineno}): each rank holds "
            "only a shard of every parameter, so the state_dict has torch.Size([0]) "
            "placeholders; save with engine.save_16bit_model() on every rank "
            "(stage3_gather_16bit_weights_on_model_save), read inside "
            "deepspeed.zero.GatheredParameters, or convert a save_checkpoint with zero_to_fp32",
        )


def zero3_stage(script: Script) -> ast.AST | None:
    """Where the file sets ZeRO stage 3: `"zero_optimization": {"stage": 3}` in a
    config dict, or `zero_stage=3` (Accelerate's DeepSpeedPlugin)."""
    for node in script.nodes:
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if is_key(key, "zero_optimization") and isinstance(value, ast.Dict):
                    stage = stage_in(value)
                    if stage is not None:
                        return stage
                if is_key(key, "zero_stage") and is_three(value):
                    return value
        if isinstance(node, ast.keyword) and node.arg == "zero_stage" and is_three(node.value):
            return node.value
    return None


def stage_in(config: ast.Dict) -> ast.expr | None:
    for key, value in zip(config.keys, config.values, strict=True):
        if key is not None and is_key(key, "stage") and is_three(value):
            return value
    return None


def is_key(key: ast.expr | None, name: str) -> bool:
    return isinstance(key, ast.Constant) and key.value == name


def is_three(value: ast.expr) -> bool:
    return isinstance(value, ast.Constant) and value.value == 3


def engine_names(script: Script) -> set[str]:
    """Names bound to the engine: the first of `engine, opt, _, _ = deepspeed.initialize(...)`."""
    names: set[str] = set()
    for node in script.nodes:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        if script.name_of(node.value.func) != "deepspeed.initialize":
            continue
        for target in node.targets:
            first = target.elts[0] if isinstance(target, (ast.Tuple, ast.List)) else target
            names.add(source_text(first))
    return names


def gathered_nodes(script: Script) -> set[int]:
    """ids of the nodes inside `with deepspeed.zero.GatheredParameters(...):` blocks."""
    inside: set[int] = set()
    for node in script.nodes:
        if not isinstance(node, ast.With):
            continue
        contexts = [item.context_expr for item in node.items]
        if any(
            isinstance(c, ast.Call) and short(script.name_of(c.func)) in GATHERING_CONTEXTS
            for c in contexts
        ):
            for statement in node.body:
                inside.update(id(part) for part in ast.walk(statement))
    return inside
