"""An evaluation over each rank's share of the data that is never combined (metrics-not-reduced).

With a DistributedSampler (or a loader Accelerate prepared) each rank reads
1/N of the validation set. An accuracy or loss summed over that loop and then
printed, logged or compared with the best so far describes rank 0's quarter:
every rank has another number, the best checkpoint is chosen on a part, and
the figure matches no single-GPU evaluation. Nothing fails.

Reported: a loop over such a loader that trains nothing (no `backward`),
accumulates (`+=`, `.append`, `.extend`, an `evaluate` metric's `add_batch`,
`conf = update(conf, ...)`),
and whose totals, followed through the assignments after the loop and, for an
evaluation function, through what its callers assign from it, reach a print,
a log or an `if` without passing through a collective (torch.distributed's,
Accelerate's `gather_for_metrics` / `reduce`, or an imported helper named
like one). torchmetrics' `update` is left alone: those metrics sync at
`compute()`.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from assistant.lint.checks.cache import FILE_WRITERS, path_of_write, shared_file
from assistant.lint.checks.rank_dependent import tuple_size_returned
from assistant.lint.checks.schedules import PROCESS_COUNT
from assistant.lint.checks.splits import rank_dealing_sampler
from assistant.lint.checks.unused import inside_no_grad, names_no_grad, position_after, wrapped_by
from assistant.lint.model import (
    FILE_READERS,
    Function,
    Script,
    bound_arguments,
    called_name,
    files_opened,
    is_int,
    keyword,
    own_nodes,
    self_attribute,
    short,
    source_text,
    walk,
)
from assistant.lint.ranks import is_rank_expr
from assistant.lint.registry import check
from assistant.lint.torchapi import (
    is_backward,
    is_collective,
    is_ddp,
    is_distributed,
    lightning_classes,
)
from assistant.lint.tracer import own_method_of_an_object
from assistant.results import Finding

V = TypeVar("V")
# Methods that add a batch's result to a running total or list.
ACCUMULATORS = frozenset({"append", "extend", "add_batch"})
# Where a metric is shown or acted on; `report`: a hyperparameter search's trial
# (Optuna's trial.report(value, step), Ray Tune's report), which ranks and prunes on it.
REPORTERS = frozenset(
    {
        "print",
        "log",
        "add_scalar",
        "add_scalars",
        "info",
        "log_metrics",
        "log_dict",
        "write",
        "report",
    }
)
# An imported helper that combines the ranks' values: `utils.reduce_tensor(x)`, `all_gather(x)`.
COMBINING_HELPER = re.compile(r"reduce|gather|sync|all_", re.IGNORECASE)
# Libraries whose functions named like a collective are tensor operations.
TENSOR_LIBRARIES = frozenset({"torch", "numpy", "functools", "operator", "math"})
# Collectives that combine nothing: waiting is not reducing.
WAITS = frozenset({"barrier", "monitored_barrier", "wait_for_everyone"})
# The name of a function that evaluates: `evaluate`, `validate`, `test_epoch`, `compute_metrics`.
EVALUATION_NAME = re.compile(r"eval|valid|test|metric", re.IGNORECASE)
# Assignments followed from a total to what is shown: `acc = correct / total`,
# `t = torch.tensor([acc])`, `metrics = metric.compute()`.
DERIVATION_STEPS = 3


@check("metrics-not-reduced")
def check_shard_metrics_never_combined(script: Script) -> Iterator[Finding]:
    """`for batch in val_loader: correct += ...` then `print(correct / total)`, no all_reduce."""
    if not is_distributed(script) and "Accelerator" not in script.called_short_names:
        return
    owners = owning_functions(script)
    shares = strided_shares(script, owners)
    shares |= sharded_parameters(script, shares, owners)
    sharded = sharded_loaders(script, owners) | shares
    if not sharded:
        return
    for loop in evaluation_loops(script, sharded, owners, shares):
        found = loop.shown_unreduced(script, owners, sharded)
        if found is None:
            continue
        shown, unreduced = found
        fix = (
            " and ".join(f"call {name}.{method}()" for name, method in sorted(loop.syncs.items()))
            + " after the loop"
            if loop.syncs
            else "all_reduce the sums and counts (or gather the predictions, "
            "accelerator.gather_for_metrics) before computing the metric"
        )
        kind, gathers = loop.described
        yield script.finding(
            "metrics-not-reduced",
            loop.node,
            f"this {kind} over {loop.loader}, which gives each rank its own share, "
            f"{gathers} {', '.join(sorted(unreduced))} and line {shown.lineno} shows or compares the result "
            f"without combining the ranks: each rank reports its own part of the data; {fix}",
        )


@check("metrics-not-reduced")
def check_evaluation_of_a_share_of_the_count(script: Script) -> Iterator[Finding]:
    """`per_rank = cfg.eval_episodes // world; rets = run_eval(agent, per_rank, ...)`,
    then `np.mean(rets)` logged (or compared with the best) on rank 0: each rank
    evaluated its own 1/N of the episodes (or prompts, or samples drawn), and
    the figure shown is rank 0's part. An evaluation function of the file that
    trains nothing and combines nothing itself, given a count divided by the
    number of processes, whose result reaches a print, a log or an `if` without a
    collective."""
    if not is_distributed(script):
        return
    models = model_names(script)
    for scope in script.all_scopes:
        nodes = script.scope_nodes(scope)
        shares = share_counts(nodes)
        if not shares or not models:
            continue
        for node in nodes:
            evaluated = share_evaluation(script, node, shares, models)
            if evaluated is None:
                continue
            function, passed = evaluated
            after = [n for n in nodes if hasattr(n, "lineno") and position_after(n, node)]
            derived = derive(script, after, set().union(*map(assigned_names, node.targets)))
            if combined(script, after, derived):
                continue
            shown = first_shown(script, after, derived)
            if shown is None:
                continue
            yield script.finding(
                "metrics-not-reduced",
                node,
                f"{function}() evaluates this rank's share of the count "
                f"({', '.join(sorted(passed))}: divided by the number of processes), and line "
                f"{shown.lineno} shows or compares the result without combining the ranks: "
                "the figure is one rank's part; all_reduce the sums and counts (or "
                "all_gather_object the results) before the mean",
            )


def share_counts(nodes: list[ast.AST]) -> set[str]:
    """Names assigned a count divided by the number of processes (`n // world`)."""
    return {
        target.id
        for node in nodes
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.BinOp)
        and isinstance(node.value.op, ast.FloorDiv | ast.Div)
        and any(PROCESS_COUNT.search(name) for name in names_in(node.value.right))
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def model_names(script: Script) -> set[str]:
    """The names that hold a model DDP wraps: the wrapper, and what it was given."""
    return set().union(
        *(wrapped_by(script, node, set())[0] for node, name in script.call_names if is_ddp(name))
    )


def share_evaluation(
    script: Script, node: ast.AST, shares: set[str], models: set[str]
) -> tuple[str, set[str]] | None:
    """The file's function an assignment calls with the model and a share of the count,
    when that function trains nothing and combines nothing itself, and the shares it
    is given (a schedule sized by a share, handed no model, evaluates nothing)."""
    if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
        return None
    call = node.value
    arguments = all_arguments(call)
    passed = set().union(*(names_in(argument) & shares for argument in arguments))
    if not passed or not any(root_name(argument) in models for argument in arguments):
        return None
    functions = called_functions(script, call)
    if not functions or any(
        runs_backward(script, f, TRAINING_CALL_DEPTH)
        or any(collective_call(script, n) for n in walk(f))
        for f in functions
    ):
        return None
    return functions[0].name, passed


def root_name(expr: ast.expr) -> str | None:
    """`agent` of `agent.module`, of `model.module.eval()`."""
    while isinstance(expr, ast.Attribute | ast.Call | ast.Subscript):
        expr = expr.func if isinstance(expr, ast.Call) else expr.value
    return expr.id if isinstance(expr, ast.Name) else None


# Lightning: where a LightningModule collects its evaluation outputs, and where it
# turns them into an epoch's metric (the 1.x hooks take the outputs as a parameter).
LIGHTNING_STEPS = frozenset({"validation_step", "test_step"})
LIGHTNING_EPOCH_ENDS = frozenset(
    {"on_validation_epoch_end", "on_test_epoch_end", "validation_epoch_end", "test_epoch_end"}
)
LIGHTNING_LOGS = frozenset({"log", "log_dict"})


@check("metrics-not-reduced")
def check_lightning_epoch_metric_of_one_share(script: Script) -> Iterator[Finding]:
    """A LightningModule's epoch-end metric computed from the outputs its
    validation_step collected in a list (each rank's own share of the data) and
    logged with no all_gather and no sync_dist: every rank logs its shard's value,
    and a checkpoint or early stop on it watches part of the data."""
    if one_device_trainers(script):
        return
    for cls in lightning_classes(script):
        methods = {
            m.name: m for m in cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
        collected = collected_outputs([methods[m] for m in LIGHTNING_STEPS if m in methods])
        for name in LIGHTNING_EPOCH_ENDS & methods.keys():
            end = methods[name]
            outputs = collected | {a.arg for a in end.args.args[1:]}  # 1.x: (self, outputs)
            nodes = list(walk(end))
            if not outputs or any(collective_call(script, n) for n in nodes):
                continue
            derived = derive(script, nodes, outputs) - {"self"}
            for node in nodes:
                if not (isinstance(node, ast.Call) and logs_unsynced(node)):
                    continue
                values = logged_values(node)
                read = next((v for v in values if names_in(v) & derived), None)
                if read is None:
                    continue
                yield script.finding(
                    "metrics-not-reduced",
                    node,
                    f"{source_text(read)} is computed in {name} from what each rank's "
                    "validation/test steps collected (its own share of the data) and logged "
                    "with no all_gather and no sync_dist: every rank logs its shard's value, "
                    "and a checkpoint or early stop on it watches part of the data; "
                    "self.all_gather the collected outputs first (or use torchmetrics)",
                )


def one_device_trainers(script: Script) -> bool:
    """Every Trainer the file builds says devices=1 (or gpus=1): one process. Lightning's
    default, devices="auto", takes every GPU of the machine, with DDP."""
    trainers = [node for node, name in script.call_names if short(name) == "Trainer"]
    return bool(trainers) and all(
        any(
            isinstance(v := keyword(t, flag), ast.Constant) and v.value in (1, "1")
            for flag in ("devices", "gpus")
        )
        for t in trainers
    )


def collected_outputs(steps: list[Function]) -> set[str]:
    """`self.x` fields the steps add to (append, extend, an `evaluate` metric's add_batch),
    or sum into in place (`self.confmat += torch.bincount(...)`, `self.hits[c] += 1`)."""
    found = set()
    for step in steps:
        for node in walk(step):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ACCUMULATORS
                and isinstance(node.func.value, ast.Attribute)
            ):
                found.add(source_text(node.func.value))
            elif isinstance(node, ast.AugAssign):
                target = node.target
                while isinstance(target, ast.Subscript):
                    target = target.value
                if isinstance(target, ast.Attribute) and source_text(target.value) == "self":
                    found.add(source_text(target))
    return found


def logged_values(call: ast.Call) -> list[ast.expr]:
    """What `self.log(name, value)` / `self.log_dict(metrics)` logs, by position or keyword."""
    position, name = (1, "value") if call.func.attr == "log" else (0, "dictionary")
    given = call.args[position : position + 1] or [keyword(call, name)]
    return [value for value in given if value is not None]


def logs_unsynced(call: ast.Call) -> bool:
    """`self.log(...)` / `self.log_dict(...)` without sync_dist=True (or rank_zero_only)."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr in LIGHTNING_LOGS):
        return False
    if not (isinstance(func.value, ast.Name) and func.value.id == "self"):
        return False
    for flag in ("sync_dist", "rank_zero_only"):
        value = keyword(call, flag)
        if value is not None and not (isinstance(value, ast.Constant) and not value.value):
            return False
    return True


def sharded_loaders(script: Script, owners: dict[int, str]) -> set[tuple[str | None, str]]:
    """(function, name) of loaders that split the data by rank: given a
    DistributedSampler, built over a dataset cut by rank (`Subset(ds,
    range(rank, n, world))`), or returned by `accelerator.prepare(...)`. A name is
    read in the function that assigns it: `loader` in main is not the
    `loader` parameter of a helper."""
    samplers = {
        (owners.get(id(node)), source_text(target))
        for node in script.of_type(ast.Assign)
        if (is_distributed_sampler(script, built := one_of(node.value)) or given_a_share(built))
        for target in node.targets
    }
    from assistant.lint.checks.data import DataFlow  # data imports the tracer's users

    flow = DataFlow(script)

    def shares(call: ast.Call, owner: str | None) -> bool:
        """A DataLoader given a DistributedSampler's share, a sampler built with a
        share of the count, or a dataset cut by rank already (`Subset(ds,
        range(rank, len(ds), world))`)."""
        if short(script.name_of(call.func)) != "DataLoader":
            return False
        sampler = keyword(call, "sampler") or keyword(call, "batch_sampler")
        dataset = call.args[0] if call.args else keyword(call, "dataset")
        return (
            sampler is not None
            and (
                is_distributed_sampler(script, sampler)
                or given_a_share(sampler)
                or (owner, source_text(sampler)) in samplers
                or any(known(owner, name, samplers) for name in held_names(sampler))
            )
        ) or (dataset is not None and flow.sharded_by_rank(dataset))

    found: set[tuple[str | None, str]] = set()
    for node in script.nodes:
        if not isinstance(node, ast.Assign) or not isinstance(one_of(node.value), ast.Call):
            continue
        call, owner = one_of(node.value), owners.get(id(node))
        if shares(call, owner):  # `val_loaders[t] = DataLoader(...)`: the container
            found.update((owner, name) for t in node.targets for name in assigned_names(t))
        elif isinstance(call.func, ast.Attribute) and call.func.attr == "prepare":
            for target in node.targets:
                elements = target.elts if isinstance(target, ast.Tuple) else [target]
                found.update((owner, source_text(e)) for e in elements)
    for node in script.of_type(ast.Call):  # `test_loaders.append(DataLoader(...))`: the list
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr == "append"
            and isinstance(func.value, ast.Name)
            and len(node.args) == 1
            and isinstance(node.args[0], ast.Call)
            and shares(node.args[0], owners.get(id(node)))
        ):
            found.add((owners.get(id(node)), func.value.id))
    found |= returned_loaders(script, found, owners, shares)
    return found | sharded_parameters(script, found, owners)


def strided_shares(script: Script, owners: dict[int, str]) -> set[tuple[str | None, str]]:
    """(function, name) of lists cut into every rank's strided share by hand
    (`mine = trials[rank::world]`, `games = sorted(splits["val"])[rank::world]`):
    an evaluation over one reads this rank's items only, as one over a
    DistributedSampler's loader does."""
    from assistant.lint.checks.data import DataFlow  # data imports the tracer's users

    flow = DataFlow(script)

    def strided(value: ast.expr) -> bool:
        return flow.strides_from_the_rank(value) and any(
            PROCESS_COUNT.search(name) for name in names_in(value.slice.step)
        )

    named = {
        (owners.get(id(node)), target.id)
        for node in script.of_type(ast.Assign)
        if strided(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    # `for prob in self.problems[self.rank :: self.world]:` walks the share in place
    walked = {
        (owners.get(id(loop)), source_text(loop.iter))
        for loop in script.of_type(ast.For)
        if strided(loop.iter)
    }
    return named | walked


def returned_loaders(
    script: Script,
    sharded: set[tuple[str | None, str]],
    owners: dict[int, str],
    shares: Callable[[ast.Call, str | None], bool],
) -> set[tuple[str | None, str]]:
    """(caller, name) for the sharded loaders a file function returns, by the place
    each holds in what it returns (`return train_loader, val_loader, sampler`, then
    `train_loader, val_loader, sampler = build_loaders(...)` in main; `return
    DataLoader(ds, batch_sampler=sampler)` from a helper nested in main)."""
    positions: dict[str, dict[int, bool]] = {}
    for name, function in script.functions.items():
        for node in walk(function):
            if not (isinstance(node, ast.Return) and node.value is not None):
                continue
            parts = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            for index, part in enumerate(parts):
                if (name, source_text(part)) in sharded or (
                    isinstance(part, ast.Call) and shares(part, owners.get(id(part)))
                ):
                    positions.setdefault(name, {})[index] = True
    found: set[tuple[str | None, str]] = set()
    for node in script.nodes:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        called = script.name_of(node.value.func)
        if called not in positions:
            continue
        for target in node.targets:
            parts = target.elts if isinstance(target, ast.Tuple) else [target]
            for index in positions[called]:
                if index < len(parts):
                    found.add((owners.get(id(node)), source_text(parts[index])))
    return found


def given_a_share(value: ast.expr) -> bool:
    """A sampler built with a count divided by the number of processes
    (`EpisodeSampler(labels, n_episodes // world, ways, shots)`): each rank
    draws its own share of the batches."""
    return isinstance(value, ast.Call) and any(
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.FloorDiv | ast.Div)
        and any(PROCESS_COUNT.search(name) for name in names_in(node.right))
        for argument in all_arguments(value)
        for node in walk(argument)
    )


def one_of(value: ast.expr) -> ast.expr:
    """What each entry of a dict comprehension is (`{f: DataLoader(...) for f in
    splits}`: one loader per split), or the value itself."""
    return value.value if isinstance(value, ast.DictComp) else value


def held_names(expr: ast.expr) -> list[str]:
    """`samplers` of `samplers[f]` (an entry of a dict of them), and `self.x` of itself."""
    if isinstance(expr, ast.Subscript):
        return [source_text(expr.value)]
    return [source_text(expr)] if isinstance(expr, ast.Attribute) else []


def known(owner: str | None, name: str, pairs: set[tuple[str | None, str]]) -> bool:
    """(owner, name) among `pairs`; a field (`self.val_loader`) set in any method of
    the same class counts for every method of it."""
    if (owner, name) in pairs:
        return True
    if not (name.startswith("self.") and owner and "." in owner):
        return False
    cls = owner.split(".")[0]
    return any(other == name and where and where.split(".")[0] == cls for where, other in pairs)


def is_distributed_sampler(script: Script, value: ast.expr) -> bool:
    """DistributedSampler, or a sampler class of the file that deals each rank its
    share (its constructor takes the rank and the number of replicas)."""
    if not isinstance(value, ast.Call):
        return False
    name = script.name_of(value.func)
    return short(name) == "DistributedSampler" or rank_dealing_sampler(script, name) is not None


def owning_functions(script: Script) -> dict[int, str]:
    """id of each node -> the qualified name of the file function it is written in."""
    owner: dict[int, str] = {}
    for name, function in script.functions.items():
        for node in walk(function):
            owner.setdefault(id(node), name)  # nested functions: the outer one walks first
    return owner


@dataclass
class EvaluationLoop:
    """A loop over a sharded loader that adds up results and trains nothing, or an
    assignment of a comprehension over one (`results = [simulate(f) for f in mine]`)."""

    node: ast.For | ast.Assign
    loader: str
    totals: set[str]  # the names the loop accumulates into
    function: str | None  # the file function it is written in
    syncs: dict[str, str]  # an updated object of the file's metric class -> its combining method

    @property
    def described(self) -> tuple[str, str]:
        """What it is and what it does with results, in the finding's words."""
        return (
            ("loop", "adds up") if isinstance(self.node, ast.For) else ("comprehension", "collects")
        )

    def shown_unreduced(
        self,
        script: Script,
        owners: dict[int, str],
        sharded: set[tuple[str | None, str]],
    ) -> tuple[ast.AST, set[str]] | None:
        """Where the totals (or what is computed from them) are shown or compared
        with no collective on them first, and which totals; None when they are combined
        or never shown. Each total is judged on its own: an all-reduced loss beside hypotheses
        scored by rank (`dist.all_reduce(vstats)`, then `corpus_bleu(hyps, refs)`)
        leaves the score one rank's."""
        evaluator = self.evaluator(script)
        scope: ast.AST = script.functions[evaluator] if evaluator else script.tree
        after = walk_after(scope, self.node.end_lineno or self.node.lineno)
        nodes = [*walk(self.node), *after]
        unreduced = {
            total
            for total in self.totals
            if not combined(script, after, derive(script, nodes, {total}))
        }
        if not unreduced:
            return None
        derived = derive(script, nodes, unreduced)
        shown = first_shown(script, after, derived)
        if shown is None and evaluator is not None:
            shown = self.shown_by_callers(script, evaluator, derived, owners, sharded)
        return None if shown is None else (shown, unreduced)

    def shown_by_callers(
        self,
        script: Script,
        evaluator: str,
        derived: set[str],
        owners: dict[int, str],
        sharded: set[tuple[str | None, str]],
    ) -> ast.AST | None:
        function = script.functions[evaluator]
        if not returns_any(function, derived):
            return None
        through = self.loader if self.loader in {a.arg for a in function.args.args} else None
        positions = returned_positions(function, derived)
        caps = cap_parameters(function, self.node)
        return shown_by_callers(script, evaluator, owners, sharded, through, positions, caps)

    def evaluator(self, script: Script) -> str | None:
        """The function whose return hands the totals on: the loop's own function, or
        a function nested in it that holds the loop (`def evaluate():` in main, over
        main's prepared loader), known by its plain name."""
        parent = script.parents.get(id(self.node))
        while parent is not None and not isinstance(
            parent, (ast.FunctionDef, ast.AsyncFunctionDef)
        ):
            parent = script.parents.get(id(parent))
        if (
            parent is not None
            and self.function is not None
            and parent is not script.functions[self.function]
            and script.functions.get(parent.name) is parent
        ):
            return parent.name
        return self.function


def evaluation_loops(
    script: Script,
    sharded: set[tuple[str | None, str]],
    owners: dict[int, str],
    shares: set[tuple[str | None, str]],
) -> Iterator[EvaluationLoop]:
    """Loops over a sharded loader that train nothing and add up results; over a list
    cut by rank (`shares`), only in an evaluation (a list of this rank's files or
    batches is also how data is prepared)."""
    for node in script.of_type(ast.For):
        function = owners.get(id(node))
        if (function, source_text(node.iter)) in shares:
            loader = source_text(node.iter)  # a share walked in place
        else:
            loader = iterated_name(node.iter) or indexed_share(node, function, shares)
        if loader is None:
            continue
        if not known(function, loader, sharded):
            continue
        if not known(function, loader, sharded - shares) and not evaluates(script, node, function):
            continue
        if trains(script, node) or any(collective_call(script, n) for n in walk(node)):
            continue
        syncs = syncable_updates(script, node, function)
        scope = script.functions[function] if function else script.tree
        totals = (
            accumulated_names(node)
            | carried_totals(node, scope)
            | filled_containers(node, scope)
            | set(syncs)
            | accumulating_objects(script, node, scope)
        )
        if totals:
            yield EvaluationLoop(node, loader, totals, function, syncs)
    yield from comprehension_evaluations(script, sharded, owners)


def indexed_share(
    loop: ast.For, function: str | None, shares: set[tuple[str | None, str]]
) -> str | None:
    """`mine` of `for i in range(0, len(mine), bs): batch = mine[i : i + bs]`: a loop
    over a share's positions that reads the share by them."""
    if not (isinstance(loop.iter, ast.Call) and called_name(loop.iter) == "range"):
        return None
    measured = {
        source_text(n.args[0])
        for argument in loop.iter.args
        for n in walk(argument)
        if isinstance(n, ast.Call) and called_name(n) == "len" and len(n.args) == 1
    }
    read = {
        source_text(n.value)
        for statement in loop.body
        for n in walk(statement)
        if isinstance(n, ast.Subscript)
    }
    return next((name for name in sorted(measured & read) if known(function, name, shares)), None)


def evaluates(script: Script, node: ast.AST, function: str | None) -> bool:
    """`node` runs in an evaluation: its function is named as one (`evaluate_fid`,
    `validate`, `closed_loop_eval`), puts a model in eval mode or runs under no_grad /
    inference_mode (decorated, or in a `with` block)."""
    scope = script.functions.get(function) if function else None
    if scope is None:
        return False
    return (
        EVALUATION_NAME.search(scope.name) is not None
        or any(names_no_grad(decorator) for decorator in scope.decorator_list)
        or any(is_eval_mode(n) for n in walk(scope))
        or id(node) in inside_no_grad(list(walk(scope)))
    )


def is_eval_mode(node: ast.AST) -> bool:
    """`model.eval()`."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "eval"
        and not node.args
        and not node.keywords
    )


def comprehension_evaluations(
    script: Script, sharded: set[tuple[str | None, str]], owners: dict[int, str]
) -> Iterator[EvaluationLoop]:
    """`results = np.stack([simulate(planner, f) for f in mine])` in an evaluation: a
    comprehension over a sharded loader or share whose items are each computed by a
    call, assigned to a name, training nothing and combining nothing: the name holds
    this rank's results only."""
    for node in script.of_type(ast.Assign):
        function = owners.get(id(node))
        comprehensions = [
            n
            for n in walk(node.value)
            if isinstance(n, ast.ListComp | ast.GeneratorExp | ast.SetComp | ast.DictComp)
        ]
        loader = next(
            (
                name
                for comprehension in comprehensions
                if any(isinstance(n, ast.Call) for n in walk(comprehension_element(comprehension)))
                for generator in comprehension.generators
                if (name := iterated_name(generator.iter)) is not None
                and known(function, name, sharded)
            ),
            None,
        )
        # the function is read only for a comprehension over a share: not at every assignment
        if loader is None or not evaluates(script, node, function):
            continue
        if trains(script, node) or any(collective_call(script, n) for n in walk(node)):
            continue
        totals = {target.id for target in node.targets if isinstance(target, ast.Name)}
        if totals:
            yield EvaluationLoop(node, loader, totals, function, {})


def comprehension_element(comprehension: ast.expr) -> ast.expr:
    """What a comprehension makes of each item: `elt`, or a dict comprehension's value."""
    return comprehension.value if isinstance(comprehension, ast.DictComp) else comprehension.elt


def sharded_parameters(
    script: Script, sharded: set[tuple[str | None, str]], owners: dict[int, str]
) -> set[tuple[str | None, str]]:
    """(function, parameter) pairs that receive a sharded loader at some call of the
    file, followed from caller to callee a few calls deep."""
    found = set(sharded)
    for _ in range(DERIVATION_STEPS):
        for node, name in script.call_names:
            function = script.functions.get(name)
            if function is None:
                continue
            caller = owners.get(id(node))
            parameters = [a.arg for a in function.args.args]
            for position, argument in enumerate(node.args):
                if (caller, held_in(argument)) in found and position < len(parameters):
                    found.add((name, parameters[position]))
            for given in node.keywords:
                if given.arg and (caller, held_in(given.value)) in found:
                    found.add((name, given.arg))
    return found - sharded


def iterated_name(expr: ast.expr) -> str | None:
    """`loader` in `for b in loader`, `enumerate(loader)`, `tqdm(loader, ...)`;
    `loaders` in `for b in loaders["test"]` or `loaders[task]` (an entry of a
    container of loaders)."""
    while isinstance(expr, ast.Call) and expr.args:
        expr = expr.args[0]
    if isinstance(expr, ast.Subscript):
        expr = expr.value
    return source_text(expr) if isinstance(expr, (ast.Name, ast.Attribute)) else None


def trains(script: Script, loop: ast.For | ast.Assign) -> bool:
    """The loop runs backward, itself or in a function or method of the file it
    calls (`loss = brain.fit_batch(batch)`), a couple of calls deep."""
    return runs_backward(script, loop, TRAINING_CALL_DEPTH)


# How many calls deep a loop's backward is looked for (a Brain's fit_batch, its step).
TRAINING_CALL_DEPTH = 2


def runs_backward(script: Script, node: ast.AST, depth: int) -> bool:
    for part in walk(node):
        if is_backward(part):
            return True
        if (
            depth > 0
            and isinstance(part, ast.Call)
            and any(runs_backward(script, f, depth - 1) for f in called_functions(script, part))
        ):
            return True
    return False


def called_functions(script: Script, call: ast.Call) -> list[Function]:
    """The file's functions a call may run: `fit_batch(x)` by name, `brain.fit_batch(x)`
    as the tracer follows such a call (tracer.own_method_of_an_object)."""
    if isinstance(call.func, ast.Name):
        function = script.function_called(call)
        return [function] if function is not None else []
    if isinstance(call.func, ast.Attribute):
        receiver = source_text(call.func.value)
        methods = own_method_of_an_object(script, receiver, call.func.attr)
        return [script.functions[q] for q in methods]
    return []


def accumulated_names(loop: ast.For) -> set[str]:
    """Names the loop adds to (`total += n`, `preds.append(p)`); a container filled
    only while it is short (`if len(examples) < 5: examples.append(...)`) keeps a
    few examples to show, not a total."""
    shown_few = {id(n) for capped in capped_fills(loop) for n in walk(capped)}
    counters = {id(statement) for statement in loop.body if counts_iterations(statement)}
    totals: set[str] = set()
    for node in walk(loop):
        if id(node) in counters:
            continue
        if isinstance(node, ast.AugAssign) and isinstance(node.target, (ast.Name, ast.Attribute)):
            totals.add(source_text(node.target))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ACCUMULATORS
            and isinstance(node.func.value, ast.Name)
            and id(node) not in shown_few
        ):
            totals.add(node.func.value.id)
    return totals - restarted_each_pass(loop)


def restarted_each_pass(loop: ast.For) -> set[str]:
    """Names the loop's body sets to a constant or an empty container on every pass
    (`tp = 0` before counting one document's matches, `seen = []`), or to any value
    not made from themselves by a statement of the body itself: a scratch value of
    one item, whatever it is later added to, not a total of the share."""
    fresh = {
        target.id
        for node in walk(loop)
        if isinstance(node, ast.Assign) and is_fresh(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    # `remaining = args.n_samples` first thing in each pass, then `remaining -= n`:
    # a countdown of one item, set anew from something other than itself.
    reset = {
        target.id
        for statement in loop.body
        if isinstance(statement, ast.Assign)
        for target in statement.targets
        if isinstance(target, ast.Name) and target.id not in names_in(statement.value)
    }
    return fresh | reset


def is_fresh(value: ast.expr) -> bool:
    """A constant, or an empty list, dict or set (`0`, `[]`, `{}`, `set()`)."""
    if isinstance(value, ast.Constant):
        return True
    if isinstance(value, ast.List | ast.Set | ast.Tuple):
        return not value.elts
    if isinstance(value, ast.Dict):
        return not value.keys
    return (
        isinstance(value, ast.Call)
        and called_name(value) in ("list", "dict", "set")
        and not (value.args or value.keywords)
    )


def counts_iterations(statement: ast.stmt) -> bool:
    """`step += 1` straight in the loop's body: it counts the loop's batches, which a
    sampler that shares the data out gives every rank equally many of (the same
    number on every rank, not a total of this rank's data)."""
    return (
        isinstance(statement, ast.AugAssign)
        and isinstance(statement.op, ast.Add)
        and is_int(statement.value)
    )


def capped_fills(loop: ast.For) -> Iterator[ast.If]:
    """`if len(examples) < 5:` blocks of the loop (a length kept under a bound)."""
    for node in walk(loop):
        test = node.test if isinstance(node, ast.If) else None
        if (
            isinstance(test, ast.Compare)
            and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Lt | ast.LtE)
            and isinstance(test.left, ast.Call)
            and isinstance(test.left.func, ast.Name)
            and test.left.func.id == "len"
        ):
            yield node


def carried_totals(loop: ast.For, scope: ast.AST) -> set[str]:
    """Totals the loop carries by assignment, each step's value computed from the
    last: `total = total + loss`, `conf = update_confusion(conf, pred, target)`,
    `preds = torch.cat([preds, p])`; the name set before the loop (`conf =
    torch.zeros(...)`) and not one the loop binds for each batch."""
    batch = {
        n.id
        for node in walk(loop)
        if isinstance(node, ast.For | ast.comprehension)
        for n in walk(node.target)
        if isinstance(n, ast.Name)
    }
    before = {
        target.id
        for node in walk(scope)
        if isinstance(node, ast.Assign) and node.lineno < loop.lineno
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    return {
        target.id
        for node in walk(loop)
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(target := node.targets[0], ast.Name)
        and target.id in before - batch
        and target.id in names_in(node.value)
    }


def filled_containers(loop: ast.For, scope: ast.AST) -> set[str]:
    """Containers made empty before the loop and filled by key in it, a
    prediction per example (`preds = {}` ... `preds[img_id] = caption`)."""
    empty = {
        target.id
        for node in walk(scope)
        if isinstance(node, ast.Assign)
        and node.lineno < loop.lineno
        and is_empty_container(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    return {
        target.value.id
        for node in walk(loop)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Subscript)
        and isinstance(target.value, ast.Name)
        and target.value.id in empty
    }


def is_empty_container(value: ast.expr) -> bool:
    """`{}`, `[]`, `dict()`, `defaultdict(list)`, `OrderedDict()`."""
    if isinstance(value, ast.Dict | ast.List):
        return not (value.keys if isinstance(value, ast.Dict) else value.elts)
    return (
        isinstance(value, ast.Call)
        and short(source_text(value.func)) in ("dict", "defaultdict", "OrderedDict")
        and not value.args[1:]
        and not value.keywords
    )


def syncable_updates(script: Script, loop: ast.For, function: str | None) -> dict[str, str]:
    """Objects of the file's own metric classes the loop updates (`metric_logger.update(
    loss=...)`, `metric_logger.meters["acc1"].update(...)`): classes with a method named
    like a combining one (`synchronize_between_processes`), which the author meant
    to call before the figures are read (DETR / DeiT / MAE's MetricLogger)."""
    classes = {
        node.name: method.name
        for node in script.tree.body
        if isinstance(node, ast.ClassDef)
        for method in node.body
        if isinstance(method, ast.FunctionDef) and COMBINING_HELPER.search(method.name)
    }
    if not classes:
        return {}
    scope = script.functions[function] if function else script.tree
    objects = instances_in(script, scope, classes)
    updated = {}
    for node in walk(loop):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            root = node.func.value
            while isinstance(root, (ast.Attribute, ast.Subscript)):
                root = root.value
            if node.func.attr == "update" and isinstance(root, ast.Name) and root.id in objects:
                updated[root.id] = objects[root.id]
    return updated


def instances_in(script: Script, scope: ast.AST, classes: dict[str, V]) -> dict[str, V]:
    """Names the scope binds to an object of one of `classes` (`m = Meter()`, or
    `top1, top5 = Meter(), Meter()`), each with what `classes` holds for its class."""
    found: dict[str, V] = {}
    for node in walk(scope):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = (
                zip(target.elts, node.value.elts, strict=True)
                if isinstance(target, ast.Tuple)
                and isinstance(node.value, ast.Tuple)
                and len(target.elts) == len(node.value.elts)
                else [(target, node.value)]
            )
            for name, value in pairs:
                if (
                    isinstance(name, ast.Name)
                    and isinstance(value, ast.Call)
                    and (called := short(script.name_of(value.func))) in classes
                ):
                    found[name.id] = classes[called]
    return found


def accumulating_objects(script: Script, loop: ast.For, scope: ast.AST) -> set[str]:
    """Objects of the file's own classes that the loop calls a method of which adds
    to a field (`metrics.update(y, pred)` with `self.confusion += ...` in it), where
    no method of the class communicates (the running confusion matrix of one
    rank's share, as semantic-segmentation repositories keep it)."""
    adding: dict[str, set[str]] = {}
    for cls in (n for n in script.tree.body if isinstance(n, ast.ClassDef)):
        methods = [m for m in cls.body if isinstance(m, ast.FunctionDef)]
        if any(
            COMBINING_HELPER.search(m.name) or any(collective_call(script, n) for n in walk(m))
            for m in methods
        ):
            continue
        adding[cls.name] = {
            m.name
            for m in methods
            if any(
                isinstance(n, ast.AugAssign) and self_attribute(n.target) is not None
                for n in walk(m)
            )
        }
    if not any(adding.values()):
        return set()
    objects = instances_in(script, scope, adding)
    return {
        node.func.value.id
        for node in walk(loop)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.attr in objects.get(node.func.value.id, ())
    }


def walk_after(scope: ast.AST, line: int) -> list[ast.AST]:
    """The nodes of `scope` that start after `line`, in source order."""
    later = [n for n in walk(scope) if getattr(n, "lineno", 0) > line]
    return sorted(later, key=lambda n: (n.lineno, n.col_offset))  # type: ignore[attr-defined]


def names_in(node: ast.AST) -> set[str]:
    found = {n.id for n in walk(node) if isinstance(n, ast.Name)}
    found |= {source_text(n) for n in walk(node) if isinstance(n, ast.Attribute)}
    return found


def derive(script: Script, nodes: list[ast.AST], totals: set[str]) -> set[str]:
    """The totals and the names assigned from them, a few steps on: `acc = correct / n`,
    `results[key] = dets` (the container), `for t in (correct, n):` (the loop variable),
    the path they are written to (`json.dump(results, f)`, then `coco.loadRes(res_file)`)."""
    derived = set(totals)
    opened = files_opened(nodes)
    for _ in range(DERIVATION_STEPS):
        for node in nodes:
            if isinstance(node, ast.Assign) and names_in(node.value) & derived:
                for target in node.targets:
                    derived |= assigned_names(target)
            elif isinstance(node, ast.For) and names_in(node.iter) & derived:
                derived |= assigned_names(node.target)
            elif isinstance(node, ast.Call) and (
                path := path_written_with(script, node, derived, opened)
            ):
                derived.add(path)
    return derived


def path_written_with(
    script: Script, call: ast.Call, derived: set[str], opened: dict[str, ast.expr]
) -> str | None:
    """The path name a file writer (cache.FILE_WRITERS) writes a derived value to:
    what is read back from that path is the same values. Only a plain name: a path
    made with the rank (`f"part_{rank}.json"`) names no single file."""
    position = FILE_WRITERS.get(script.name_of(call.func))
    if position is None:
        return None
    written = [argument for index, argument in enumerate(call.args) if index != position]
    if not any(names_in(argument) & derived for argument in written):
        return None
    path = path_of_write(script, call, opened)
    return path.id if isinstance(path, ast.Name) else None


def assigned_names(target: ast.expr) -> set[str]:
    """`a, b` -> {a, b}; `results[key]` -> {results}; `self.best` -> {self.best}."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(assigned_names(e) for e in target.elts))
    while isinstance(target, ast.Subscript):
        target = target.value
    return {source_text(target)}


def combined(script: Script, after: list[ast.AST], derived: set[str]) -> bool:
    """A collective after the loop is handed one of the derived values, or is a method
    of one (`metric_logger.synchronize_between_processes()`)."""
    return any(
        isinstance(node, ast.Call)
        and collective_call(script, node)
        and any(names_in(part) & derived for part in (*all_arguments(node), receiver(node)))
        for node in after
    )


def receiver(call: ast.Call) -> ast.AST:
    """What a method is called on (`x` of `x.sync()`); an empty node for a function."""
    return call.func.value if isinstance(call.func, ast.Attribute) else ast.Constant(None)


def all_arguments(call: ast.Call) -> list[ast.expr]:
    return [*call.args, *(k.value for k in call.keywords)]


def collective_call(script: Script, node: ast.AST) -> bool:
    """A call that combines the ranks' values: a collective (not a wait), or an
    imported or method helper named like one (`reduce_tensor`, `gather_for_metrics`)."""
    if not isinstance(node, ast.Call):
        return False
    name = script.name_of(node.func)
    method = node.func.attr if isinstance(node.func, ast.Attribute) else short(name)
    if method in WAITS:
        return False
    if is_collective(name):
        return True
    if name.split(".")[0] in TENSOR_LIBRARIES and not name.startswith("torch.distributed"):
        return False  # torch.gather, torch.scatter_reduce, functools.reduce: no ranks met
    if method == "gather" and (len(node.args) >= 2 or keyword(node, "dim") is not None):
        return False  # Tensor.gather(dim, index), as a kNN monitor picks labels
    return (
        bool(COMBINING_HELPER.search(method or ""))
        or combining_lambda(script, node.func)
        or combining_function(script, node.func)
    )


# How many calls of the file's own functions deep a combining collective is looked for.
HELPER_DEPTH = 2


def combining_function(script: Script, func: ast.expr, depth: int = HELPER_DEPTH) -> bool:
    """A function of the file whose own body runs a collective that combines
    (`def collect(scores, idx, world): dist.all_gather(g_scores, scores) ...`), or one
    such function of the file it calls (`oof_from_shards` through `all_gather_cat`), or
    that reads every rank's file (reads_every_ranks_file)."""
    function = script.functions.get(func.id) if isinstance(func, ast.Name) else None
    return function is not None and (
        any(
            isinstance(n, ast.Call)
            and (
                (
                    is_collective(script.name_of(n.func))
                    and short(script.name_of(n.func)) not in WAITS
                )
                or (depth > 1 and combining_function(script, n.func, depth - 1))
            )
            for n in walk(function)
        )
        or reads_every_ranks_file(function)
    )


def reads_every_ranks_file(function: Function) -> bool:
    """The function loops over the ranks (`for r in range(world)`) and opens or loads
    a path made with the loop's rank (`f"part_{r}.json"`): the collect of results
    through a shared folder that mmcv-style evaluations use (each rank writes its
    part, a barrier, one rank reads them all), which combines them as a gather does."""
    return any(
        isinstance(loop, ast.For)
        and isinstance(loop.iter, ast.Call)
        and called_name(loop.iter) == "range"
        and any(PROCESS_COUNT.search(name) for a in loop.iter.args for name in names_in(a))
        and any(
            isinstance(call, ast.Call)
            and called_name(call) in FILE_READERS
            and names_in(loop.target) & set().union(*map(names_in, all_arguments(call)))
            for call in walk(loop)
        )
        for loop in walk(function)
    )


def combining_lambda(script: Script, func: ast.expr) -> bool:
    """A name bound only to lambdas that combine the ranks' values
    (`g = lambda t: torch.cat(all_gather(t, ws))`, then `feats = g(feats)`);
    a lambda's call of another lambda's name is not followed."""
    lambdas = bound_lambdas(script, func)
    return bool(lambdas) and all(
        any(
            isinstance(n, ast.Call)
            and not bound_lambdas(script, n.func)
            and collective_call(script, n)
            for n in walk(value.body)
        )
        for value in lambdas
    )


def bound_lambdas(script: Script, func: ast.expr) -> list[ast.Lambda]:
    """What a plain name is bound to, when every value is a lambda."""
    values = script.assigned_values.get(func.id, []) if isinstance(func, ast.Name) else []
    return values if values and all(isinstance(v, ast.Lambda) for v in values) else []


def first_shown(script: Script, after: list[ast.AST], derived: set[str]) -> ast.AST | None:
    """The first print / log / `if` that reads a derived value. A print or log that
    also names the rank (`"rank %d wrote %d", rank, n`) shows a per-rank figure
    on purpose, and is passed over."""
    for node in after:
        if (
            isinstance(node, ast.If)
            and names_in(node.test) & derived
            and not guards_against_nothing(node)
        ):
            return node
        if (
            isinstance(node, ast.Call)
            and shows(node)
            and any(names_in(argument) & derived for argument in all_arguments(node))
            and not names_the_rank(script, node)
            and not writes_a_file_of_its_rank(script, node)
        ):
            return node
    return None


def guards_against_nothing(branch: ast.If) -> bool:
    """`if not results: return 0.0`, `if len(results) == 0: continue`: a guard for an
    empty collection that leaves at once, not a look at the figure."""
    test = branch.test
    if not (
        len(branch.body) == 1 and isinstance(branch.body[0], ast.Return | ast.Continue | ast.Raise)
    ):
        return False
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return isinstance(test.operand, ast.Name)
    return (
        isinstance(test, ast.Compare)
        and len(test.comparators) == 1
        and isinstance(test.ops[0], ast.Eq)
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == 0
        and isinstance(test.left, ast.Call)
        and called_name(test.left) == "len"
    )


def writes_a_file_of_its_rank(script: Script, call: ast.Call) -> bool:
    """`f.write(...)` into `with open(path) as f` where the path names the rank,
    itself or through what the callers pass (`final_test(..., f"{rank}.txt")`):
    one part per rank, for a later merge to combine."""
    if not (isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name)):
        return False
    handle = call.func.value.id
    withs = []  # the `with` statements around the call (another `as f` is another file)
    parent = script.parents.get(id(call))
    while parent is not None and not isinstance(parent, ast.FunctionDef | ast.AsyncFunctionDef):
        if isinstance(parent, ast.With):
            withs.append(parent)
        parent = script.parents.get(id(parent))
    opened = [path for node in withs if (path := files_opened([node]).get(handle)) is not None]
    return bool(opened) and not any(shared_file(script, path) for path in opened)


def names_the_rank(script: Script, call: ast.Call) -> bool:
    """An argument of the call is or formats the rank: `rank`, `dist.get_rank()`,
    `f"[rank {rank}] ..."`."""
    return any(
        is_rank_expr(node, script)
        for argument in all_arguments(call)
        for node in walk(argument)
        if isinstance(node, ast.expr)
    )


def shows(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name in REPORTERS


def returns_any(function: Function, derived: set[str]) -> bool:
    return any(
        isinstance(n, ast.Return) and n.value is not None and names_in(n.value) & derived
        for n in walk(function)
    )


def returned_positions(function: Function, derived: set[str]) -> frozenset[int] | None:
    """Which elements of the tuples `function` returns carry a derived value
    (`return math.sqrt(total / n), torch.cat(preds)`, preds unreduced: {1}); None
    when its returns are not all tuples of one size (the whole value carries it)."""
    if tuple_size_returned(function) is None:
        return None
    return frozenset(
        position
        for node in own_nodes(function)
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple)
        for position, element in enumerate(node.value.elts)
        if names_in(element) & derived
    )


def received_names(targets: list[ast.expr], positions: frozenset[int] | None) -> set[str]:
    """The names a caller's assignment binds to the returned elements at `positions`
    (every name it binds when positions is None or the target is no tuple)."""
    found: set[str] = set()
    for target in targets:
        if positions is not None and isinstance(target, ast.Tuple):
            found |= set().union(
                *(names_in(e) for i, e in enumerate(target.elts) if i in positions)
            )
        else:
            found |= names_in(target)
    return found


def shown_by_callers(
    script: Script,
    function: str,
    owners: dict[int, str],
    sharded: set[tuple[str | None, str]],
    loader_parameter: str | None,
    positions: frozenset[int] | None = None,
    caps: frozenset[str] = frozenset(),
) -> ast.AST | None:
    """Where a caller shows what `function` returned, unreduced (the elements at
    `positions` of the tuple it returns; all of it when None). When the loader
    is the function's parameter `loader_parameter`, only the calls that hand it a
    sharded loader count: the same helper run over the whole test set on rank 0
    reports the whole. A call that gives one of the loop's `caps` (`if i >=
    max_batches: break`) a value asks for a sample of the data by design (a
    quick check of a converted model on its first batches), whatever its share."""
    parents = script.parents
    for node, name in script.call_names:
        assigned = parents.get(id(node))
        if not (isinstance(assigned, ast.Assign) and assigned.value is node):
            continue
        caller = owners.get(id(node))
        if name != function and not own_method_call(name, function, caller):
            continue
        if loader_parameter is not None and not passes_a_sharded_loader(
            script.functions[function], node, loader_parameter, caller, sharded
        ):
            continue
        if caps and given_a_value(script.functions[function], node, caps):
            continue
        received = received_names(assigned.targets, positions)
        scope: ast.AST = script.functions[caller] if caller else script.tree
        after = walk_after(scope, assigned.end_lineno or assigned.lineno)
        derived = derive(script, after, received)
        if combined(script, after, derived):
            continue
        shown = first_shown(script, after, derived)
        if shown is not None:
            return shown
    return None


def cap_parameters(function: Function, loop: ast.For | ast.Assign) -> frozenset[str]:
    """The function's parameters the loop stops at: `if i >= max_batches: break`."""
    parameters = {a.arg for a in function.args.args}
    return frozenset(
        name
        for node in walk(loop)
        if isinstance(node, ast.If) and any(isinstance(s, ast.Break) for s in node.body)
        for name in names_in(node.test) & parameters
    )


def given_a_value(function: Function, call: ast.Call, parameters: frozenset[str]) -> bool:
    """The call passes one of `parameters` something other than None."""
    return any(
        parameter in parameters and not (isinstance(given, ast.Constant) and given.value is None)
        for parameter, given in bound_arguments(function, call)
    )


def own_method_call(name: str, function: str, caller: str | None) -> bool:
    """`self.evaluate()` in a method of the class whose `evaluate` is `function`
    ("Trainer.evaluate")."""
    cls, _, method = function.rpartition(".")
    return bool(cls) and name == f"self.{method}" and (caller or "").startswith(f"{cls}.")


def passes_a_sharded_loader(
    function: Function,
    call: ast.Call,
    parameter: str,
    caller: str | None,
    sharded: set[tuple[str | None, str]],
) -> bool:
    """The call hands `parameter` a loader the caller holds as sharded."""
    positions = [a.arg for a in function.args.args]
    given = [
        argument
        for index, argument in enumerate(call.args)
        if index < len(positions) and positions[index] == parameter
    ] + [k.value for k in call.keywords if k.arg == parameter]
    return any((caller, held_in(argument)) in sharded for argument in given)


def held_in(argument: ast.expr) -> str:
    """What an argument is, or the container it is an entry of (`test_loaders[j]`: a
    loader of the list `test_loaders`)."""
    if isinstance(argument, ast.Subscript):
        return source_text(argument.value)
    return source_text(argument)
