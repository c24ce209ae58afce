"""A LightningModule's heads that a training step leaves out, under strategy="ddp":
one that only a loss weight turns on, the weight 0 by default, and the members
of a ModuleList / ModuleDict of which each step runs the one a field or an
input picks (`self.heads[self.current_task](feats)`: one head per task).

    self.node_decoder = nn.Linear(dim, n_atoms)          # built always
    ...
    def training_step(self, batch, batch_idx):
        ...
        if self.hparams.recon_weight > 0:                # --recon-weight, default 0.0
            loss = loss + self.hparams.recon_weight * F.cross_entropy(self.node_decoder(h), y)

    trainer = pl.Trainer(devices=4, strategy="ddp")

With the default weight the head never runs: its parameters get no gradient,
and Lightning's "ddp" strategy builds DDP with find_unused_parameters=False,
so the second step fails ("Expected to have finished reduction in the prior
iteration before starting a new one ... parameters that were not used in
producing loss"; unused-parameters). The fix: build the head only when its
weight is above 0 (or keep the term with weight 0, which still gives every
parameter a gradient), or strategy="ddp_find_unused_parameters_true".

Read within the file: a LightningModule's training_step with an `if` on a
field of the module (`self.hparams.w > 0`, `self.cfg.w`, `self.w != 0`); a
submodule called inside it and nowhere else outside such a test (evaluation
steps do not count: they make no gradient); the field's defaults the file
gives (the module's `__init__` parameter, an argparse flag `--w`, a
dataclass / config field `w: float = 0.0`) all 0 or False; and a Trainer whose
strategy is "ddp" (or "ddp_spawn", or DDPStrategy() without
find_unused_parameters=True / static_graph=True).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from assistant.lint.checks.unused import picked_members
from assistant.lint.model import Script, called_name, keyword, method_of, source_text, walk
from assistant.lint.registry import check
from assistant.lint.torchapi import lightning_classes
from assistant.lint.values import argparse_flag
from assistant.results import Finding

CAUSE = "unused-parameters"
STRICT_STRATEGIES = frozenset({"ddp", "ddp_spawn", "ddp_notebook", "ddp_fork"})
STRATEGY_CLASSES = frozenset({"DDPStrategy"})
NOT_TRAINING = frozenset({"validation_step", "test_step", "predict_step"})


@check(CAUSE)
def check_head_behind_a_zero_loss_weight(script: Script) -> Iterator[Finding]:
    """A LightningModule's submodule that only a loss weight, 0 by default, runs."""
    strategy = strict_strategy(script)
    if strategy is None:
        return
    for cls in lightning_classes(script):
        gates = (n for f in training_methods(cls) for n in walk(f) if isinstance(n, ast.If))
        for gate in gates:
            weight = weight_tested(gate.test)
            if weight is None or not all_defaults_zero(script, cls, weight):
                continue
            for head in gated_heads(script, gate):
                yield script.finding(
                    CAUSE,
                    gate,
                    f"`{head}` runs only under `if {source_text(gate.test)}:`, and every default "
                    f"the file gives {weight} is 0: with it the head's parameters get no "
                    f"gradient, and strategy={source_text(strategy)} (DDP with "
                    'find_unused_parameters=False) fails at the second step ("Expected to '
                    'have finished reduction in the prior iteration"); build the head only '
                    "when the weight is above 0, keep its term with weight 0, or use "
                    'strategy="ddp_find_unused_parameters_true"',
                )


@check(CAUSE)
def check_member_picked_per_step(script: Script) -> Iterator[Finding]:
    """`self.heads[self.current_task](feats)` in a LightningModule's training step: the
    other heads get no gradient, and a strict "ddp" strategy fails at the next step."""
    strategy = strict_strategy(script)
    if strategy is None:
        return
    for cls in lightning_classes(script):
        for method in training_methods(cls):
            for call, chooser in picked_members(method):
                yield script.finding(
                    CAUSE,
                    call,
                    f"the training step runs one member of {source_text(call.func.value)}, "  # type: ignore[attr-defined]
                    f"the one `{chooser}` picks: the others get no gradient that step, and "
                    f"strategy={source_text(strategy)} (DDP with find_unused_parameters=False) "
                    'fails at the next step ("Expected to have finished reduction in the prior '
                    'iteration"); use strategy="ddp_find_unused_parameters_true", or build only '
                    "the members a run trains",
                )


def strict_strategy(script: Script) -> ast.expr | None:
    """The Trainer's strategy when it is DDP expecting every parameter each step."""
    for node, _name in script.call_names:
        if called_name(node) != "Trainer":
            continue
        strategy = keyword(node, "strategy")
        if isinstance(strategy, ast.Constant) and strategy.value in STRICT_STRATEGIES:
            return strategy
        if (
            isinstance(strategy, ast.Call)
            and called_name(strategy) in STRATEGY_CLASSES
            and not any(
                keyword(strategy, flag) is not None
                for flag in ("find_unused_parameters", "static_graph")
            )
            and not any(given.arg is None for given in strategy.keywords)
        ):
            return strategy
    return None


def training_methods(cls: ast.ClassDef) -> list[ast.FunctionDef]:
    """training_step and the module's own methods it calls (`self._step(batch)`),
    and theirs."""
    step = method_of(cls, "training_step")
    found = [step] if step is not None else []
    for function in found:  # grows while it is walked
        for node in walk(function):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and source_text(node.func.value) == "self"
                and (callee := method_of(cls, node.func.attr)) is not None
                and callee not in found
            ):
                found.append(callee)
    return found


def weight_tested(test: ast.expr) -> str | None:
    """`self.hparams.w > 0`, `self.cfg.w != 0`, `self.w` -> "w"; None for other tests."""
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        right = test.comparators[0]
        if not (isinstance(right, ast.Constant) and right.value == 0):
            return None
        if not isinstance(test.ops[0], ast.Gt | ast.NotEq):
            return None
        test = test.left
    if isinstance(test, ast.Attribute) and source_text(test).startswith("self."):
        return test.attr
    return None


def gated_heads(script: Script, gate: ast.If) -> list[str]:
    """Submodules called in the gate's body and nowhere else in training outside
    a gate on the same test."""
    called = {
        source_text(node.func)
        for statement in gate.body
        for node in walk(statement)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and source_text(node.func).startswith("self.")
    }
    built = built_submodules(script)
    return sorted(
        head
        for head in called
        if head.rsplit(".", 1)[-1] in built
        and not called_outside(script, head.rsplit(".", 1)[-1], gate.test)
    )


def built_submodules(script: Script) -> set[str]:
    """Names an `__init__` binds to a layer it builds: `self.head = nn.Linear(...)`."""
    names: set[str] = set()
    for node in script.nodes:
        if not (isinstance(node, ast.FunctionDef) and node.name == "__init__"):
            continue
        for assign in (n for n in walk(node) if isinstance(n, ast.Assign)):
            if not isinstance(assign.value, ast.Call):
                continue
            for target in assign.targets:
                if isinstance(target, ast.Attribute) and source_text(target.value) == "self":
                    names.add(target.attr)
    return names


def called_outside(script: Script, name: str, test: ast.expr) -> bool:
    """`name` called somewhere training runs, outside an `if` on the same test."""
    gated: set[int] = set()
    skipped: set[int] = set()
    for node in script.nodes:
        if isinstance(node, ast.If) and source_text(node.test) == source_text(test):
            gated.update(id(n) for s in node.body for n in walk(s))
        if isinstance(node, ast.FunctionDef) and node.name in NOT_TRAINING:
            skipped.update(id(n) for n in walk(node))
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == name
        and id(node) not in gated | skipped
        for node in script.nodes
    )


def all_defaults_zero(script: Script, cls: ast.ClassDef, weight: str) -> bool:
    """Every default the file gives the weight is 0 / 0.0 / False, and there is one."""
    defaults = list(init_defaults(cls, weight)) + list(flag_defaults(script, weight))
    defaults += list(field_defaults(script, weight))
    return bool(defaults) and all(
        isinstance(value, ast.Constant) and value.value in (0, False) for value in defaults
    )


def init_defaults(cls: ast.ClassDef, weight: str) -> Iterator[ast.expr]:
    init = method_of(cls, "__init__")
    if init is None:
        return
    arguments = init.args
    positional = arguments.posonlyargs + arguments.args
    for argument, default in zip(positional[-len(arguments.defaults) :], arguments.defaults):
        if argument.arg == weight:
            yield default
    for argument, default in zip(arguments.kwonlyargs, arguments.kw_defaults):
        if argument.arg == weight and default is not None:
            yield default


def flag_defaults(script: Script, weight: str) -> Iterator[ast.expr]:
    """`parser.add_argument("--recon-weight", default=0.0)` for `recon_weight`."""
    flag = argparse_flag(script, weight)
    default = keyword(flag, "default") if flag is not None else None
    if default is not None:
        yield default


def field_defaults(script: Script, weight: str) -> Iterator[ast.expr]:
    """`aux_weight: float = 0.0` in a class body (a dataclass or a config class)."""
    for node in script.of_type(ast.AnnAssign):
        if (
            isinstance(node.target, ast.Name)
            and node.target.id == weight
            and node.value is not None
        ):
            yield node.value
