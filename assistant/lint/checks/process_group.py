"""Process-group checks: torch.distributed calls or a DistributedSampler before init."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from assistant.lint.model import Script, keyword, short, walk
from assistant.lint.registry import check
from assistant.lint.torchapi import (
    NEEDS_GROUP,
    external_setup_helpers,
    init_calls,
    is_dist_call,
    is_init,
    makes_a_device_mesh,
)
from assistant.lint.tracer import TracedCall
from assistant.results import Finding

# Library calls that start the default process group themselves.
FRAMEWORK_SETUP = frozenset(
    {
        "deepspeed.init_distributed",
        "deepspeed.initialize",
        "accelerate.Accelerator",
        "accelerate.PartialState",
        "accelerate.state.PartialState",
        # Hugging Face's TrainingArguments.__post_init__ reads self.device (and, with a
        # DeepSpeed config, the world size): that sets up the devices, which under
        # torchrun starts the default group (a traceback of it: microsoft/dp-transformers#6).
        "transformers.TrainingArguments",
        "transformers.Seq2SeqTrainingArguments",
        "transformers.training_args.TrainingArguments",
        "trl.SFTConfig",
        "trl.DPOConfig",
        "trl.RewardConfig",
    }
)


@check("process-group-not-initialized")
def check_process_group_not_initialized(script: Script) -> Iterator[Finding]:
    """torch.distributed calls or DistributedSampler before the process group exists."""
    has_init_anywhere = bool(init_calls(script))
    external = external_setup_calls(script)
    protected = calls_behind_is_initialized(script)
    for index, trace in enumerate(script.traces):
        first = next((i for i, c in enumerate(trace) if starts_group(c, external)), None)
        if first is None:
            # Without an init in this file, the group may come from code not shown:
            # only the module-level path of a file with no setup at all is reported.
            if has_init_anywhere or external or index != 0:
                continue
            before, why = trace, "init_process_group is never called in this file"
        else:
            before = trace[:first]
            setup = trace[first]
            named = setup.name if setup.name in FRAMEWORK_SETUP else short(setup.name)
            plain = short(setup.name) == "init_process_group"
            what = "init_process_group" if plain else f"{named}(), which starts it,"
            why = f"{what} comes later (line {setup.node.lineno})"
        for call in before:
            if needs_group(call, protected):
                yield script.finding(
                    "process-group-not-initialized",
                    call.node,
                    f"{short(call.name)}() needs the default process group, but {why}",
                )


def starts_group(call: TracedCall, external: set[int]) -> bool:
    return (
        is_init(call.name)
        or call.name in FRAMEWORK_SETUP
        or makes_a_device_mesh(call.name)
        or id(call.node) in external
    )


def external_setup_calls(script: Script) -> set[int]:
    """ids of the calls that may start the group in code not shown: a library's
    (deepspeed.initialize, Accelerator()) or an imported helper's."""
    found = {
        id(node)
        for node, name in script.call_names
        if name in FRAMEWORK_SETUP or makes_a_device_mesh(name)
    }
    return found | {id(node) for node in external_setup_helpers(script)}


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
        for node in script.of_type(ast.BoolOp)
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
            for n in walk(guard)
        )
        if checks_group:
            protected.update(id(n) for n in walk(node) if isinstance(n, ast.Call))
    return protected
