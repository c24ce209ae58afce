"""The experiment logger started on every rank (experiment-logger-ddp).

Under torchrun (or `accelerate launch`) every process runs the whole script,
so a bare `wandb.init(...)` starts N runs, N background wandb services and
N login prompts: the dashboard shows N copies of one curve, and the services
time out ("Run initialization has timed out", "Error communicating with
wandb process"). A `SummaryWriter()` on every rank writes N event files into
one run folder. The reverse mistake is as common: `wandb.init` guarded to
rank 0, but `wandb.log` left on every rank, which the other ranks answer with
"You must call wandb.init() before wandb.log()". MLflow's `start_run`, Neptune's
`init_run`, Comet's `Experiment`, ClearML's `Task.init` and Aim's `Run` start a
run on every process that calls them, as wandb.init does.

Quiet where the script does what wandb documents for DDP: init on rank 0
only (in an `if` or a conditional expression), or one run per rank joined
by `group=`; where `mode=` is chosen per
call (`mode="disabled"` on the other ranks); and for a SummaryWriter whose
folder or comment names the rank. Framework loggers (Lightning's
WandbLogger, `accelerator.init_trackers`) handle the ranks themselves and
are not read here, nor a method nothing in the file calls, nor a process
group of one process (`world_size=1`).

One logging call is a collective itself: Lightning's `self.log(...,
sync_dist=True)` all-reduces the value across ranks, so under `if
self.trainer.is_global_zero:` rank 0 waits for ranks that never call it and
the epoch's end hangs.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from assistant.lint.model import Script, children, keyword, short, source_text, walk
from assistant.lint.ranks import (
    OTHER_RANKS,
    RANK_ZERO,
    is_rank_expr,
    rank_branch_sides,
    some_rank_runs,
)
from assistant.lint.registry import check
from assistant.lint.torchapi import is_distributed, lightning_classes, one_process_group
from assistant.lint.tracer import TracedCall
from assistant.results import Finding

WANDB_INIT = "wandb.init"
WANDB_LOG = "wandb.log"
WRITERS = frozenset({"SummaryWriter"})
# Other trackers' calls that start one run of the experiment (each process that
# calls one starts a run of its own).
RUN_STARTERS = frozenset(
    {
        "mlflow.start_run",
        "neptune.init_run",
        "neptune.init",
        "comet_ml.Experiment",
        "clearml.Task.init",
        "aim.Run",
    }
)
LIGHTNING_LOGS = frozenset({"log", "log_dict"})
# What makes a script run once per rank without a process group of its own.
LAUNCHING_OBJECTS = frozenset({"Accelerator"})


@check("experiment-logger-ddp")
def check_synced_log_on_one_rank(script: Script) -> Iterator[Finding]:
    """`if self.trainer.is_global_zero: self.log("val/mae", mae, sync_dist=True)`."""
    for cls in lightning_classes(script):
        for method in (m for m in cls.body if isinstance(m, ast.FunctionDef)):
            for call, test in synced_logs_on_one_side(script, method):
                yield script.finding(
                    "experiment-logger-ddp",
                    call,
                    f"self.{call.func.attr}(..., sync_dist=True) all-reduces the value over "
                    f"every rank, but only some ranks reach it here (the `if` on line "
                    f"{test.lineno}): they wait in that all-reduce for ranks that never call it, "
                    "and the job hangs at the end of the epoch; log on every rank with "
                    "sync_dist=True, or keep the branch and pass rank_zero_only=True instead",
                )


def synced_logs_on_one_side(
    script: Script, method: ast.FunctionDef
) -> Iterator[tuple[ast.Call, ast.If]]:
    """`self.log(..., sync_dist=True)` calls in a branch only rank 0 (or only the
    other ranks) takes, with that branch's `if`."""
    stack: list[tuple[ast.AST, ast.If | None]] = [(s, None) for s in method.body]
    while stack:
        node, branch = stack.pop()
        if isinstance(node, ast.If):
            body, orelse = rank_branch_sides(node.test, script)
            one_sided = (RANK_ZERO, OTHER_RANKS)
            stack += [(s, node if body in one_sided else branch) for s in node.body]
            stack += [(s, node if orelse in one_sided else branch) for s in node.orelse]
            continue
        if (
            branch is not None
            and isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in LIGHTNING_LOGS
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"
            and isinstance(synced := keyword(node, "sync_dist"), ast.Constant)
            and synced.value is True
        ):
            yield node, branch
        stack += [(child, branch) for child in children(node)]


@check("experiment-logger-ddp")
def check_logger_on_every_rank(script: Script) -> Iterator[Finding]:
    """wandb.init / SummaryWriter / another tracker's run (mlflow.start_run, neptune,
    comet, clearml, aim) on every rank, or wandb.log on every rank after a rank-0 init."""
    if not runs_once_per_rank(script) or one_process_group(script) or not script.traces:
        return
    every_rank, rank_zero = calls_by_ranks(script)
    for call in every_rank.values():
        ranks = ranks_reaching(script, call.node)
        if call.name == WANDB_INIT and not per_rank_run(script, call.node):
            yield script.finding(
                "experiment-logger-ddp",
                call.node,
                f"wandb.init runs on {ranks}: N runs of one experiment and N wandb "
                "services that can time out; call it on rank 0 only (and wandb.log there "
                "too), or give every rank's run the same group=",
            )
        elif call.name in RUN_STARTERS and not names_the_rank(script, call.node):
            yield script.finding(
                "experiment-logger-ddp",
                call.node,
                f"{call.name} runs on {ranks}: N runs of one experiment, every metric "
                "and artifact logged N times (and N clients on the tracking server); start "
                "the run and log on rank 0 only",
            )
        elif short(call.name) in WRITERS and not names_the_rank(script, call.node):
            yield script.finding(
                "experiment-logger-ddp",
                call.node,
                f"{short(call.name)}() is created on {ranks}: N writers put N event files "
                "into one run folder (every curve N times); create it on rank 0 only, or "
                "give each rank a folder of its own",
            )
    inits = [c for c in [*every_rank.values(), *rank_zero.values()] if c.name == WANDB_INIT]
    if not inits or any(id(c.node) in every_rank for c in inits):
        return
    for call in every_rank.values():
        if call.name == WANDB_LOG:
            yield script.finding(
                "experiment-logger-ddp",
                call.node,
                "wandb.log runs on every rank, but wandb.init only on rank 0: the other "
                'ranks raise "You must call wandb.init() before wandb.log()"; log under '
                "the same rank-0 test",
            )


def ranks_reaching(script: Script, node: ast.AST) -> str:
    """ "every rank", or, under tests the trace does not read as one rank's (`if
    is_last:`, a pipeline's last stage: every rank of it), "every rank where `is_last`
    holds": what the finding can say of who runs the call."""
    tests = []
    child, parent = node, script.parents.get(id(node))
    while parent is not None and not isinstance(parent, ast.FunctionDef | ast.AsyncFunctionDef):
        if isinstance(parent, ast.If) and any(child is s for s in parent.body):
            tests.append(source_text(parent.test))
        elif isinstance(parent, ast.If) and any(child is s for s in parent.orelse):
            tests.append(f"not ({source_text(parent.test)})")
        child, parent = parent, script.parents.get(id(parent))
    if not tests:
        return "every rank"
    return f"every rank where `{' and '.join(reversed(tests))}` holds, not on one"


def runs_once_per_rank(script: Script) -> bool:
    """The script is one process of a distributed run: it starts a process
    group, wraps in DDP, or builds an Accelerator."""
    if is_distributed(script):
        return True
    return any(short(name) in LAUNCHING_OBJECTS for _node, name in script.call_names)


def calls_by_ranks(script: Script) -> tuple[dict[int, TracedCall], dict[int, TracedCall]]:
    """Logger calls of the script's own run by node id: those some path runs on
    every rank, and those every path runs on rank 0 only."""
    every_rank: dict[int, TracedCall] = {}
    rank_zero: dict[int, TracedCall] = {}
    chosen_for_rank_zero = rank_zero_choices(script)
    for call in script.traces[0]:  # the script's own run: a method nothing calls is not read
        if not is_logger_call(call) or not some_rank_runs(call.rank_path):
            continue
        sides = {branch.side for branch in call.rank_path}
        if RANK_ZERO in sides or id(call.node) in chosen_for_rank_zero:
            rank_zero.setdefault(id(call.node), call)
        else:
            every_rank.setdefault(id(call.node), call)
    for node in every_rank:
        rank_zero.pop(node, None)
    return every_rank, rank_zero


def rank_zero_choices(script: Script) -> set[int]:
    """ids of the nodes in the rank-0 side of a conditional expression
    (`SummaryWriter(out) if rank == 0 else None`)."""
    chosen: set[int] = set()
    for node in script.of_type(ast.IfExp):
        body, orelse = rank_branch_sides(node.test, script)
        for side, branch in ((body, node.body), (orelse, node.orelse)):
            if side == RANK_ZERO:
                chosen.update(id(part) for part in walk(branch))
    return chosen


def is_logger_call(call: TracedCall) -> bool:
    return (
        call.name in (WANDB_INIT, WANDB_LOG)
        or call.name in RUN_STARTERS
        or (short(call.name) in WRITERS and "tensorboard" in call.name.lower())
    )


def per_rank_run(script: Script, node: ast.Call) -> bool:
    """`wandb.init(group=...)` (one run per rank, grouped) or a `mode=` the call
    chooses (`"disabled"` on the other ranks); a constant "online" mode is no choice.
    A group whose runs every rank names alike (`name=f"{exp}_fold{k}"`, no rank in it)
    is N runs of one name, not one per rank."""
    if keyword(node, "group") is not None:
        name = keyword(node, "name")
        return name is None or any(
            isinstance(part, ast.Name | ast.Attribute | ast.Call) and is_rank_expr(part, script)
            for part in walk(name)
        )
    mode = keyword(node, "mode")
    return mode is not None and not (isinstance(mode, ast.Constant) and mode.value == "online")


def names_the_rank(script: Script, node: ast.Call) -> bool:
    """A writer whose folder or comment mentions the rank (a folder per rank)."""
    given = [*node.args, *(k.value for k in node.keywords)]
    return any(
        isinstance(part, (ast.Name, ast.Attribute, ast.Call)) and is_rank_expr(part, script)
        for value in given
        for part in walk(value)
    )
