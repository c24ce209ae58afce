"""A learning-rate schedule sized in one GPU's steps while every GPU runs a
process (effective-batch-size-changed).

`total_steps = len(train_ds) // batch_size * epochs` is how many steps one
process takes over the whole dataset. Under DDP each of N processes reads a
1/N share (its DistributedSampler, or the framework's), so an epoch has N
times fewer steps per process and the schedule stops 1/N of the way through:
OneCycleLR never leaves its warm-up, a cosine never anneals, a linear decay
ends at a high learning rate. Nothing fails; the run converges worse than on
one GPU.

Read within one function: the schedule's length argument (or, for a
LambdaLR, what its function reads: `warmup_step`, `total_step`), back through
the names assigned there (and, for a module's `self.hparams.steps`, what the
file's constructions of its class pass for that parameter), counts `len()`
of a dataset (not of a loader, which is already the process's share), or a
configured count of the dataset's samples (`args.num_image // args.batch_size`,
as face-recognition trainers size their schedules), and divides by nothing
that names the number of processes (world_size, num_devices,
trainer.estimated_stepping_batches...) or a configured batch of all processes
together (`args.global_batch`), in a file written to run as a process per GPU.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from assistant.lint.checks.gather_sizes import scope_values
from assistant.lint.model import (
    Script,
    bound_arguments,
    called_name,
    full_text,
    keyword,
    method_of,
    own_nodes,
    short,
    source_text,
    walk,
)
from assistant.lint.registry import check
from assistant.lint.torchapi import PROCESS_COUNT, is_ddp, runs_a_process_per_gpu
from assistant.results import Finding

# Schedules and the arguments that say how many steps they run, each with its
# position when it is given without its keyword.
SCHEDULE_LENGTHS = {
    "OneCycleLR": (("total_steps", 2), ("steps_per_epoch", 4)),
    "get_linear_schedule_with_warmup": (("num_training_steps", 2),),
    "get_cosine_schedule_with_warmup": (("num_training_steps", 2),),
    "get_polynomial_decay_schedule_with_warmup": (("num_training_steps", 2),),
    "get_scheduler": (("num_training_steps", 3),),
    "CosineAnnealingLR": (("T_max", 1),),
    "LinearLR": (("total_iters", 3),),
    "PolynomialLR": (("total_iters", 1),),
}
# Schedules whose length is in the function they are given (its second argument).
LAMBDA_SCHEDULES = frozenset({"LambdaLR", "MultiplicativeLR"})
# What a dataset is called, and what a loader or its (batch) sampler (already one
# process's share, or missing-distributed-sampler's when not) is.
DATASET_WORDS = re.compile(r"(^|_|\.)(ds|dataset|data|set|samples|examples|items|series)s?$")
LOADER_WORDS = re.compile(r"loader|dl\b|_dl|batches|iterator|sampler", re.IGNORECASE)
# A configured count of the dataset's samples (`args.num_image`, `cfg.num_train_samples`):
# a field of the run's configuration, not of an object (a DistributedSampler's own
# `num_samples` is already one process's share).
SAMPLE_COUNT = re.compile(
    r"^(self\.)?(args|opts?|cfg|config|conf|hparams|hp|params|flags)\."
    r"((num|n)_(train_)?(images?|samples|examples|items)|dataset_size)$",
    re.IGNORECASE,
)
# A configured batch of every process together (`args.global_batch`,
# `cfg.train.total_batch_size`): steps counted in it are already each process's
# steps. Only a configured one: a name the file computes (`total_batch = bs * accum`)
# says no more than what it is computed from, which expand() follows.
CONFIGURED_GLOBAL_BATCH = re.compile(
    r"^(self\.)?(args|opts?|cfg|config|conf|hparams|hp|params|flags)\.(\w+\.)*"
    r"(global|total|effective)_?(train_)?batch(_size)?$",
    re.IGNORECASE,
)
MAX_DEPTH = 5  # assignments followed back from the schedule's argument


@check("effective-batch-size-changed")
def check_schedule_counted_in_one_gpus_steps(script: Script) -> Iterator[Finding]:
    """`OneCycleLR(opt, total_steps=len(train_ds) // bs * epochs)` under DDP."""
    if not runs_a_process_per_gpu(script):
        return
    for scope in script.all_scopes:
        nodes = script.scope_nodes(scope)
        assigned = scope_values(nodes)
        for node in nodes:
            if not isinstance(node, ast.Call):
                continue
            for argument in length_arguments(script, scope, node):
                expanded = expand(argument, assigned)
                if dataset_length(expanded) is None:
                    expanded += constructed_with(script, scope, expanded)
                counted = dataset_length(expanded)
                if counted is None or any(
                    PROCESS_COUNT.search(text) or CONFIGURED_GLOBAL_BATCH.search(text)
                    for text in names_in(expanded)
                ):
                    continue
                if stepped_per_process_by_accelerate(script, nodes, node):
                    continue
                yield script.finding(
                    "effective-batch-size-changed",
                    node,
                    f"{short(script.name_of(node.func))} runs for a step count built from "
                    f"{counted_text(counted)}, the whole dataset: one GPU's steps. Each of "
                    "the N processes reads a 1/N share, so its epochs have N times fewer steps "
                    "and the schedule stops 1/N of the way (a warm-up never left, a decay never "
                    "reached), silently worse than one GPU; count len(train_loader) after its "
                    "DistributedSampler, or divide by the world size (Lightning: "
                    "self.trainer.estimated_stepping_batches)",
                )
                break


def length_arguments(script: Script, scope: ast.AST, schedule: ast.Call) -> list[ast.AST]:
    """What says how many steps a schedule runs: its length arguments, or for a
    LambdaLR the lambda or the function of `scope` it is given (`poly_lr`, which
    reads `warmup_step` and `total_step` of the enclosing function)."""
    name = short(script.name_of(schedule.func))
    if name in SCHEDULE_LENGTHS:
        positional = [] if any(isinstance(a, ast.Starred) for a in schedule.args) else schedule.args
        given = (
            keyword(schedule, k) or (positional[i] if len(positional) > i else None)
            for k, i in SCHEDULE_LENGTHS[name]
        )
        return [argument for argument in given if argument is not None]
    if name not in LAMBDA_SCHEDULES:
        return []
    function = keyword(schedule, "lr_lambda") or (
        schedule.args[1] if len(schedule.args) > 1 else None
    )
    if isinstance(function, ast.Lambda):
        return [function.body]
    if isinstance(function, ast.Name):
        return [
            node
            for node in walk(scope)
            if isinstance(node, ast.FunctionDef) and node.name == function.id and node is not scope
        ][:1]
    return []


def stepped_per_process_by_accelerate(
    script: Script, nodes: list[ast.AST], schedule: ast.Call
) -> bool:
    """The schedule is handed to `accelerator.prepare(...)`: Accelerate then keeps one
    GPU's count (its scheduler steps once per process at each step, or, with
    split_batches=True, each step is one GPU's batch), so a length counted in one
    GPU's steps over the whole dataset is the right one."""
    bound = {
        target.id
        for node in nodes
        if isinstance(node, ast.Assign) and node.value is schedule
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    return any(
        isinstance(node.func, ast.Attribute)
        and node.func.attr == "prepare"
        and any(isinstance(a, ast.Name) and a.id in bound for a in node.args)
        for node, _name in script.call_names
    )


def expand(argument: ast.expr, assigned: dict[str, list[ast.expr]]) -> list[ast.expr]:
    """The argument and, a few assignments back, the values of the names it reads; not
    a loader's making: `len(train_loader)` is the loader's own length, whatever its
    sampler was built from (a whole-set sampler is missing-distributed-sampler's)."""
    found = [argument]
    frontier = [argument]
    for _ in range(MAX_DEPTH):
        frontier = [
            value
            for expr in frontier
            for name in names_in([expr])
            if not LOADER_WORDS.search(name)
            for value in assigned.get(name, [])
            if value not in found
        ]
        found += frontier
        if not frontier:
            break
    return found


def constructed_with(script: Script, scope: ast.AST, exprs: list[ast.expr]) -> list[ast.expr]:
    """For a schedule built in a method that reads `self.hparams.steps` or `self.steps`:
    what the file's constructions of the class pass for that `__init__` parameter,
    expanded in the constructing function (`Model(steps_per_epoch=len(ds) // bs)` in
    main(), a LightningModule's configure_optimizers reading it back)."""
    cls = next(
        (c for c in script.of_type(ast.ClassDef) if scope in c.body),
        None,
    )
    init = method_of(cls, "__init__") if cls is not None else None
    if init is None:
        return []
    read = {
        node.attr
        for expr in exprs
        for node in walk(expr)
        if isinstance(node, ast.Attribute) and source_text(node).startswith("self.")
    }
    found: list[ast.expr] = []
    for caller in script.all_scopes:
        nodes = list(own_nodes(caller))
        calls = [n for n in nodes if isinstance(n, ast.Call) and called_name(n) == cls.name]
        if not calls:
            continue
        assigned = scope_values(nodes)
        for call in calls:
            for parameter, argument in bound_arguments(init, call, self_bound=True):
                if parameter in read:
                    found += expand(argument, assigned)
    return found


def names_in(exprs: list[ast.expr]) -> set[str]:
    """The names and dotted fields read in the expressions (`steps`, `cfg.trainer.devices`)."""
    return {
        source_text(node)
        for expr in exprs
        for node in walk(expr)
        if isinstance(node, ast.Name | ast.Attribute)
    }


def counted_text(counted: ast.expr) -> str:
    """`len(train_ds)` for a dataset measured, `args.num_image` for a configured count."""
    if isinstance(counted, ast.Attribute) and SAMPLE_COUNT.search(full_text(counted)):
        return source_text(counted)
    return f"len({source_text(counted)})"


def dataset_length(exprs: list[ast.expr]) -> ast.expr | None:
    """X in a `len(X)` of the expressions, where X is named like a dataset, not a
    loader; or a configured count of the dataset's samples (`args.num_image`)."""
    for expr in exprs:
        for node in walk(expr):
            if isinstance(node, ast.Attribute) and SAMPLE_COUNT.search(full_text(node)):
                return node
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "len"
                and node.args
            ):
                measured = source_text(node.args[0])
                if LOADER_WORDS.search(measured):
                    continue
                if DATASET_WORDS.search(measured.lower()):
                    return node.args[0]
    return None


# The linear scaling rule's reference batch: `lr = base_lr * batch_size / 256`.
REFERENCE_BATCHES = frozenset({32, 64, 128, 256, 512, 1024, 2048, 4096})
LEARNING_RATE = re.compile(r"(^|_|\.)(lr|learning_rate)$", re.IGNORECASE)
# How many values of the names a scaling reads are looked into (a batch built in a name).
MAX_BATCH_NAMES = 8


@check("effective-batch-size-changed")
def check_lr_scaled_by_one_process_batch(script: Script) -> Iterator[Finding]:
    """`args.lr = args.lr * args.batch_size / 256` where `args.batch_size` is the
    batch each process's DataLoader takes: under DDP a step averages N such
    batches, so the rule meant for the global batch scales by 1/N of it."""
    if not runs_a_process_per_gpu(script):
        return
    per_process = loader_batches(script) - rescaled_by_process_count(script)
    if not per_process:
        return
    for node in script.nodes:
        if not (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Div)
            and isinstance(node.right, ast.Constant)
            and node.right.value in REFERENCE_BATCHES
        ):
            continue
        # `eff_batch = args.batch_size * args.accum_iter`, then `blr * eff_batch / 256`
        counted = expand(node.left, script.assigned_values)[: 1 + MAX_BATCH_NAMES]
        batch = next((t for t in names_in(counted) if t in per_process), None)
        scaled = scaled_learning_rate(script, node)
        if batch is None or scaled is None or PROCESS_COUNT.search(full_text(scaled)):
            continue
        if any(PROCESS_COUNT.search(text) for text in names_in(counted)):
            continue
        yield script.finding(
            "effective-batch-size-changed",
            node,
            f"the learning rate is scaled by {source_text(node)}, which counts {batch}, the "
            "batch of one process (its DataLoader's batch_size): each DDP step averages the "
            "batches of all N processes, so the linear scaling rule counts 1/N of the real "
            "batch and the learning rate comes out N times too small; count the global batch "
            f"({batch} * world_size)",
        )


def loader_batches(script: Script) -> set[str]:
    """The batch_size arguments of the file's DataLoaders, as written (`args.batch_size`)."""
    return {
        source_text(size)
        for node, name in script.call_names
        if short(name) == "DataLoader" and (size := keyword(node, "batch_size")) is not None
    }


def rescaled_by_process_count(script: Script) -> set[str]:
    """Names the file sets from the number of processes (`args.batch_size //= world_size`,
    `args.batch_size = int(args.batch_size / args.world_size)`): a global batch split."""
    found = set()
    for node in script.of_type(ast.AugAssign | ast.Assign):
        if PROCESS_COUNT.search(full_text(node.value)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found |= {source_text(target) for target in targets}
    return found


def scaled_learning_rate(script: Script, node: ast.AST) -> ast.AST | None:
    """The statement or keyword the scaling feeds when it sets a learning rate
    (`args.lr = ...`, `lr=...` of a call), else None."""
    parents = script.parents
    child, parent = node, parents.get(id(node))
    while parent is not None and not isinstance(parent, ast.stmt):
        if isinstance(parent, ast.keyword):
            return parent if parent.arg in ("lr", "learning_rate") else None
        child, parent = parent, parents.get(id(parent))
    if isinstance(parent, ast.Assign | ast.AugAssign | ast.AnnAssign) and child is parent.value:
        targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
        if any(LEARNING_RATE.search(full_text(t)) for t in targets):
            return parent
    return None


# A count of steps to accumulate before an update.
ACCUMULATION = re.compile(r"accum|update_freq|grad_acc|(^|_)accum_steps", re.IGNORECASE)
# A target for the whole update, all processes together: `tokens_per_update`,
# `total_batch_size`, `global_batch`, `effective_batch_size`.
UPDATE_TARGET = re.compile(
    r"per_update|total_batch|global_batch|effective_batch|batch_per_update|target_batch",
    re.IGNORECASE,
)


@check("effective-batch-size-changed")
def check_accumulation_sized_by_one_process(script: Script) -> Iterator[Finding]:
    """`update_freq = tokens_per_update // max_tokens`: how many steps to accumulate
    to reach a target for the whole update, counted as if one process ran them.
    Under DDP each update averages the steps of all N processes, so the update
    holds N times the target, while the learning rate and the warm-up stay those
    tuned for it (nanoGPT divides by the world size: `total_batch_size // (B * T *
    ddp_world_size)`)."""
    if not runs_a_process_per_gpu(script):
        return
    rescaled = rescaled_by_process_count(script)
    for node in script.nodes:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target = source_text(node.targets[0])
        read = names_in([node.value])  # every name: source_text abbreviates long ones
        if not ACCUMULATION.search(target) or any(PROCESS_COUNT.search(n) for n in read):
            continue
        division = next(
            (
                n
                for n in walk(node.value)
                if isinstance(n, ast.BinOp) and isinstance(n.op, ast.FloorDiv | ast.Div)
            ),
            None,
        )
        if division is None:
            continue
        goal = next((t for t in names_in([division.left]) if UPDATE_TARGET.search(t)), None)
        if goal is None or goal in rescaled or names_in([division.right]) & rescaled:
            continue
        yield script.finding(
            "effective-batch-size-changed",
            node,
            f"{target} = {source_text(node.value)} counts the steps of one process to reach "
            f"{goal}, but each DDP update averages the steps of every process: with N "
            f"processes an update holds N times {goal}, while the learning rate and warm-up "
            f"stay those tuned for it; divide by the world size too ({goal} // "
            f"({source_text(division.right)} * world_size))",
        )


# A batch size configured for all processes together by its name, or by the
# comment beside it (detectron2's IMS_PER_BATCH: "images per batch across all
# machines"; other repositories use the same key for one GPU's batch).
GLOBAL_BATCH = re.compile(r"global_batch|total_batch", re.IGNORECASE)
ACROSS_PROCESSES = re.compile(
    r"#.*(across|all (machines|gpus|processes|ranks|workers|nodes)|global|in total)",
    re.IGNORECASE,
)
NAMED_KEY = re.compile(r"[\"']?(\w+)[\"']?\s*[:=]")
# A comment that says the batch is one process's, whatever it says next
# (`# per GPU; the learning rates below are for 8 GPUs (global batch 64)`).
PER_PROCESS = re.compile(
    r"#.*\b(per|each|one|a single)[ _-]?(gpu|device|process|rank|card|replica|worker)\b",
    re.IGNORECASE,
)


@check("effective-batch-size-changed")
def check_global_batch_given_to_one_process(script: Script) -> Iterator[Finding]:
    """`DataLoader(ds, batch_size=cfg.SOLVER.IMS_PER_BATCH)` (or the file's batcher's
    batch_size): the batch all processes share, given to each one, so the real
    batch is N times the configured one while the learning rate, warm-up and
    schedule stay those written for it."""
    if not runs_a_process_per_gpu(script) or not data_parallel(script):
        return
    rescaled = rescaled_by_process_count(script)
    global_keys = keys_said_global(script)
    for node, name in script.call_names:
        for argument in batch_size_arguments(script, node, name):
            read = names_in([argument]) | {full_text(argument)}
            if any(PROCESS_COUNT.search(text) for text in read) or read & rescaled:
                continue
            text = full_text(argument)
            if not (GLOBAL_BATCH.search(text) or any(key in text for key in global_keys)):
                continue
            yield script.finding(
                "effective-batch-size-changed",
                argument,
                f"{source_text(argument)} is the batch of all processes together, and here it "
                "is each process's batch size: with N processes a step averages N times that "
                "many samples, while the learning rate, warm-up and schedule stay those "
                f"written for it; give each process {source_text(argument)} // world_size",
            )


def data_parallel(script: Script) -> bool:
    """Each process trains a replica on its own batches: DDP wraps a model or a
    DistributedSampler splits the data (not a pipeline whose stages all walk the
    one global batch)."""
    return any(
        is_ddp(name) or short(name) == "DistributedSampler" for _node, name in script.call_names
    )


def keys_said_global(script: Script) -> set[str]:
    """Config keys whose line's comment says they count every process
    (`"IMS_PER_BATCH": 16,  # images per batch across all machines`)."""
    keys = (
        NAMED_KEY.findall(line.split("#")[0])
        for line in script.source.splitlines()
        if ACROSS_PROCESSES.search(line) and not PER_PROCESS.search(line)
    )
    return {found[-1] for found in keys if found and "batch" in found[-1].lower()}


def batch_size_arguments(script: Script, call: ast.Call, name: str) -> list[ast.expr]:
    """What a call hands as a batch size: a DataLoader's batch_size, or the
    argument bound to a `batch_size` parameter of the file's function or class."""
    if short(name) == "DataLoader":
        given = keyword(call, "batch_size") or (call.args[1] if len(call.args) > 1 else None)
        return [given] if given is not None else []
    callee = called_name(call)
    function = script.functions.get(callee) or script.functions.get(f"{callee}.__init__")
    if function is None:
        return []
    constructor = callee not in script.functions
    if splits_over_processes(function, "batch_size"):
        return []  # `self.mini_batch = batch_size // world_size`: it takes the global batch
    return [
        argument
        for parameter, argument in bound_arguments(function, call, self_bound=constructor)
        if parameter == "batch_size"
    ]


def splits_over_processes(function: ast.AST, parameter: str) -> bool:
    """The function divides its parameter by the number of processes itself."""
    return any(
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.FloorDiv | ast.Div)
        and isinstance(node.left, ast.Name)
        and node.left.id == parameter
        and any(PROCESS_COUNT.search(text) for text in names_in([node.right]))
        for node in walk(function)
    )
