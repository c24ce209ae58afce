"""Checkpoint calls that are collectives, made on rank 0 only (collective-mismatch,
fsdp-state-dict).

A DDP habit, `if rank == 0: save(...)`, hangs when the save is itself a
collective: every rank must enter it, even where only rank 0 writes a file.
- DeepSpeed's `engine.save_checkpoint()` / `load_checkpoint()` /
  `save_16bit_model()`: each rank saves or loads its own partition and they
  synchronise ("all processes must call this method").
- Lightning's `trainer.save_checkpoint()` ends in `strategy.barrier()`, and
  Fabric's `fabric.save()` / `fabric.load()` must be called on every process.
- FSDP (FullyShardedDataParallel) keeps a shard of each parameter per rank: its
  `state_dict()`, `FSDP.optim_state_dict()` and friends all-gather; so do
  torch.distributed.checkpoint's `save` / `load`, and its `get_*_state_dict`
  when they are asked for a full state dict. FSDP2's `fully_shard` state_dict
  is not flagged: it returns the local shards without communicating.
- ZeroRedundancyOptimizer's `consolidate_state_dict(to=0)` sends every rank's
  shard of the optimizer state to one rank: every rank calls it.

Only a receiver the file shows is read: the engine `deepspeed.initialize`
returned, a name bound to `FSDP(...)` or `ZeroRedundancyOptimizer(...)`, a trainer or fabric in a file that
imports Lightning. Who reaches the call, and whether the other ranks make it in
an else or a paired `if`, is collective_reach.py's.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

from assistant.lint.checks.collective_reach import lonely_calls
from assistant.lint.checks.zero import engine_names
from assistant.lint.model import Script, full_text, keyword, names_bound_to, short, source_text
from assistant.lint.registry import check
from assistant.lint.torchapi import imports_package
from assistant.lint.tracer import TracedCall
from assistant.results import Finding

FABRIC_SETUPS = frozenset({"setup", "setup_module"})


def is_fabric_setup(call: ast.Call) -> bool:
    """`fabric.setup(model, ...)` / `fabric.setup_module(model)`."""
    func = call.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr in FABRIC_SETUPS
        and "fabric" in full_text(func.value).lower()
    )


DEEPSPEED_ENGINE_COLLECTIVES = frozenset({"save_checkpoint", "load_checkpoint", "save_16bit_model"})
LIGHTNING_TRAINER = re.compile(r"(^|[._])trainer$", re.IGNORECASE)
FABRIC = re.compile(r"(^|[._])fabric$", re.IGNORECASE)
FABRIC_COLLECTIVES = frozenset({"save", "load"})
# A LightningModule (or a layer of it) as a callback or the trainer reaches it:
# under an FSDP strategy Lightning has wrapped its layers, so their state_dict gathers.
LIGHTNING_MODULE = re.compile(r"^(pl_module|trainer\.lightning_module)(\.\w+)*$")
FSDP_CLASS = "FullyShardedDataParallel"
FSDP_CLASS_GATHERS = frozenset(
    {"optim_state_dict", "full_optim_state_dict", "sharded_optim_state_dict",
     "summon_full_params"}
)  # fmt: skip
# Accelerate under an FSDP plugin: `accelerator.get_state_dict(model)` gathers the shards
# ("must be called on all processes"), like FSDP's own state_dict.
ACCELERATOR = re.compile(r"(^|[._])accelerator$", re.IGNORECASE)
ACCELERATE_GATHERS = frozenset({"get_state_dict"})
# ZeroRedundancyOptimizer shards the optimizer state; consolidate_state_dict(to=0) sends
# every rank's shard to one rank, so every rank calls it.
ZERO_OPTIMIZER = "ZeroRedundancyOptimizer"
ZERO_OPTIMIZER_GATHERS = frozenset({"consolidate_state_dict"})
DCP = "torch.distributed.checkpoint"
DCP_COLLECTIVES = frozenset({"save", "load", "async_save", "save_state_dict", "load_state_dict"})
DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict"
DCP_FULL_GETTERS = frozenset({"get_state_dict", "get_model_state_dict", "get_optimizer_state_dict"})


@dataclass(frozen=True)
class CollectiveSave:
    """A checkpoint call every rank must make: its cause and why, in a few words."""

    cause_id: str
    why: str


@check("collective-mismatch", "fsdp-state-dict")
def check_collective_save_on_some_ranks(script: Script) -> Iterator[Finding]:
    """A checkpoint call that is a collective (DeepSpeed's engine.save_checkpoint,
    Lightning's trainer.save_checkpoint, Fabric's save, FSDP's state_dict) made
    under a rank test: the ranks that skip it leave the others waiting."""
    receivers = Receivers(script)
    if not receivers.any:
        return
    for call, lonely, save in lonely_calls(script, receivers.saving):
        yield script.finding(
            save.cause_id,
            call.node,
            f"{source_text(call.node.func)}() runs on {lonely.side} (the `if` on line "
            f"{lonely.test_if.lineno}), but {save.why}; call it on every rank and keep "
            "only your own file writing under the rank test, or the others hang",
        )


class Receivers:
    """What the file binds that saves collectively: DeepSpeed engines, FSDP-wrapped
    models, and whether Lightning is imported (its trainer and fabric)."""

    def __init__(self, script: Script):
        self.script = script
        self.engines = engine_names(script)
        self.lightning = imports_package(script, "lightning") or imports_package(
            script, "pytorch_lightning"
        )

    @cached_property
    def zero_optimizers(self) -> set[str]:
        return names_bound_to(self.script, ZERO_OPTIMIZER)

    @cached_property
    def fsdp_models(self) -> set[str]:
        """Names bound to `FSDP(...)` (`model = FSDP(model)`, `self.model = FSDP(...)`,
        `model = wrap(model)` where the file's `wrap` returns one),
        or to what Fabric's setup returns under an FSDP strategy (`model, opt =
        fabric.setup(model, opt)`: the model comes first)."""
        bound = names_bound_to(self.script, FSDP_CLASS)
        if not self.fsdp_strategy:
            return bound
        for node in self.script.nodes:
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
                continue
            if is_fabric_setup(node.value):
                for target in node.targets:
                    first = target.elts[0] if isinstance(target, ast.Tuple | ast.List) else target
                    bound.add(source_text(first))
        return bound

    @cached_property
    def fsdp_strategy(self) -> bool:
        """Fabric or Lightning's Trainer runs an FSDP strategy: `FSDPStrategy(...)`, or
        strategy="fsdp"."""
        for node, name in self.script.call_names:
            if short(name) == "FSDPStrategy":
                return True
            if short(name) == "Fabric" or (short(name) == "Trainer" and self.lightning):
                strategy = keyword(node, "strategy")
                if isinstance(strategy, ast.Constant) and "fsdp" in str(strategy.value):
                    return True
        return False

    @cached_property
    def accelerate_fsdp(self) -> bool:
        """Accelerate shards the model with FSDP: a `FullyShardedDataParallelPlugin(...)`
        or an `Accelerator(fsdp_plugin=...)` in the file."""
        return any(
            short(name) == "FullyShardedDataParallelPlugin"
            or (short(name) == "Accelerator" and keyword(node, "fsdp_plugin") is not None)
            for node, name in self.script.call_names
        )

    def under_state_dict_type(self, call: ast.Call, owner: str) -> bool:
        """The call sits in `with FSDP.state_dict_type(owner, ...):`, the file's own
        word that `owner` is an FSDP model (a helper's parameter, say)."""
        node: ast.AST | None = call
        while (node := self.script.parents.get(id(node))) is not None:
            if isinstance(node, ast.With | ast.AsyncWith) and any(
                isinstance(item.context_expr, ast.Call)
                and short(self.script.name_of(item.context_expr.func)) == "state_dict_type"
                and item.context_expr.args
                and source_text(item.context_expr.args[0]) == owner
                for item in node.items
            ):
                return True
        return False

    @cached_property
    def full_state_dict_options(self) -> bool:
        """The file asks for a full state dict: `StateDictOptions(full_state_dict=True)`."""
        for node, name in self.script.call_names:
            if short(name) == "StateDictOptions":
                value = keyword(node, "full_state_dict")
                if isinstance(value, ast.Constant) and value.value is True:
                    return True
        return False

    @property
    def any(self) -> bool:
        names = self.script.called_short_names
        return bool(
            self.engines
            or self.lightning
            or FSDP_CLASS in names
            or any(name.startswith(DCP) for name in self.script.aliases.values())
            or self.accelerate_fsdp
            or ZERO_OPTIMIZER in names
        )

    def saving(self, call: TracedCall) -> CollectiveSave | None:
        """The collective save `call` is, or None."""
        method = short(call.name)
        receiver = call.node.func.value if isinstance(call.node.func, ast.Attribute) else None
        owner = source_text(receiver) if receiver is not None else ""
        module = call.name.rpartition(".")[0]
        if owner in self.engines and method in DEEPSPEED_ENGINE_COLLECTIVES:
            return CollectiveSave(
                "collective-mismatch",
                f"DeepSpeed's {method}() must run on every rank: each rank saves or loads "
                "its own partition and they synchronise",
            )
        if self.lightning and method == "save_checkpoint" and LIGHTNING_TRAINER.search(owner):
            return CollectiveSave(
                "collective-mismatch",
                "Lightning's Trainer.save_checkpoint() ends in a barrier of every rank "
                "(strategy.barrier), and under FSDP or DeepSpeed every rank writes its shard",
            )
        if self.lightning and method in FABRIC_COLLECTIVES and FABRIC.search(owner):
            return CollectiveSave(
                "collective-mismatch",
                f"Fabric's {method}() must run on every rank: the strategy decides who "
                "writes (rank 0 under DDP, every rank under FSDP), then they synchronise",
            )
        if method == "state_dict" and (
            owner in self.fsdp_models
            or (self.fsdp_strategy and LIGHTNING_MODULE.match(owner))
            or self.under_state_dict_type(call.node, owner)
        ):
            return CollectiveSave(
                "fsdp-state-dict",
                "FSDP's state_dict() all-gathers every rank's shard (with "
                "FullStateDictConfig(rank0_only=True, offload_to_cpu=True) only rank 0 "
                "keeps the result)",
            )
        if self.accelerate_fsdp and method in ACCELERATE_GATHERS and ACCELERATOR.search(owner):
            return CollectiveSave(
                "fsdp-state-dict",
                f"under Accelerate's FSDP plugin {method}() all-gathers every rank's shard",
            )
        if owner in self.zero_optimizers and method in ZERO_OPTIMIZER_GATHERS:
            return CollectiveSave(
                "collective-mismatch",
                f"ZeroRedundancyOptimizer's {method}() is a collective: every rank sends its "
                "shard of the optimizer state to the rank `to` names",
            )
        if short(module) == FSDP_CLASS and method in FSDP_CLASS_GATHERS:
            return CollectiveSave("fsdp-state-dict", f"FSDP.{method}() gathers every rank's shard")
        if module == DCP and method in DCP_COLLECTIVES:
            return CollectiveSave(
                "fsdp-state-dict",
                f"torch.distributed.checkpoint's {method}() is a collective: the ranks "
                "agree on a plan, then each reads or writes its own shard",
            )
        if module == DCP_STATE_DICT and method in DCP_FULL_GETTERS and self.full_state_dict_options:
            return CollectiveSave(
                "fsdp-state-dict",
                f"{method}() with full_state_dict=True all-gathers every rank's shard",
            )
        return None
