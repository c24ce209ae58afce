"""Collectives that only some ranks reach: rank 0 waits in a barrier the others never call."""

from __future__ import annotations

import ast
import re
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import TypeVar

from assistant.lint.checks.batchnorm import batch_norm_built, broadcasts_buffers
from assistant.lint.checks.splits import mixes_in_the_rank
from assistant.lint.checks.unused import wrapped_by
from assistant.lint.model import (
    COMPREHENSIONS,
    Script,
    bound_arguments,
    called_name,
    enclosing_loop,
    is_none,
    keyword,
    method_of,
    names_bound_to,
    names_in,
    node_fact,
    own_nodes,
    parameter_names,
    position,
    short,
    source_text,
    truth_at_count,
    unmoved,
    walk,
)
from assistant.lint.ranks import (
    NO_RANKS,
    OTHER_RANKS,
    RANK_ZERO,
    RankBranch,
    assignments_seen_from,
    enclosing_scope,
    is_rank_expr,
    is_rank_stride,
    other_side,
    rank_branch_sides,
    some_rank_runs,
)
from assistant.lint.registry import check
from assistant.lint.torchapi import (
    is_collective,
    is_ddp,
    is_distributed,
    metric_objects,
    runs_a_process_per_gpu,
    syncs_metric,
)
from assistant.lint.tracer import TracedCall, callees_with_forwards, same_file_callees
from assistant.results import Finding

Kind = TypeVar("Kind")


@check("collective-mismatch")
def check_collective_only_some_ranks_reach(script: Script) -> Iterator[Finding]:
    """A collective that only rank 0 (or only the other ranks) reaches: the rest hang."""
    metrics = metric_objects(script) if is_distributed(script) else frozenset()
    wrappers = buffer_broadcasting_wrappers(script)
    communicating = communicating_classes(script)
    parallel_models = instances_by_name(script, communicating)

    def shown_as(call: TracedCall) -> str | None:
        """How the finding names the call, when it is a collective."""
        if is_collective(call.name):
            return f"{short(call.name)}()"
        if syncs_metric(call.name, metrics):
            return (
                f"{call.name}() (a torchmetrics metric gathers every rank's state when it computes)"
            )
        if call.name in wrappers and names_the_wrapper(
            script, call.node, call.name, wrappers, is_ddp_value
        ):
            return (
                f"{call.name}(), the DDP wrapper's forward (after a training step it broadcasts "
                "rank 0's buffers, BatchNorm statistics, to the other ranks: a collective; "
                f"call {call.name}.module instead)"
            )
        if may_hold_a_model(script, call, parallel_models) and names_the_wrapper(
            script,
            call.node,
            call.name,
            frozenset(parallel_models),
            lambda _script, value: instance_of(value, communicating) is not None,
        ):
            # the caller's name for it, when a function takes it as a parameter
            cls = parallel_models.get(call.name) or min(set(parallel_models.values()))
            return (
                f"{call.name}(), a {cls} whose forward issues {communicating[cls]}() (its "
                "layers are split across the ranks: every rank must run each forward together)"
            )
        return None

    for call, lonely, what in lonely_calls(script, shown_as):
        yield script.finding(
            "collective-mismatch",
            call.node,
            f"{what} runs on {lonely.side} (the `if` on line "
            f"{lonely.test_if.lineno}); every rank must call each collective, or the others hang",
        )


def buffer_broadcasting_wrappers(script: Script) -> frozenset[str]:
    """Names assigned a DDP wrapper that broadcasts buffers it surely has: broadcast_buffers
    left True, over a model that builds BatchNorm (running statistics). Its forward
    (the first after a step with gradients, or the first at all) is a collective."""
    names: set[str] = set()
    for node in script.nodes:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        ddp = unmoved(node.value)
        if not (isinstance(ddp, ast.Call) and is_ddp(script.name_of(ddp.func))):
            continue
        if not broadcasts_buffers(ddp):
            continue
        if batch_norm_built(script, ddp, wrapped_by(script, ddp, set())[0]) is None:
            continue
        names |= {source_text(target) for target in node.targets}
    return frozenset(names)


def communicating_classes(script: Script) -> dict[str, str]:
    """Tensor-parallel models written by hand: the file's classes whose forward calls
    a collective (an autograd Function's forward that all-reduces, a layer that
    all-gathers its shards), or that build or apply such a class, transitively; with
    the collective. A forward of one that only some ranks run (an evaluation on
    rank 0) waits in it for the others."""
    classes = {n.name: n for n in script.of_type(ast.ClassDef)}
    issuing: dict[str, str] = {}
    for name, cls in classes.items():
        forward = method_of(cls, "forward")
        calls = (n for n in walk(forward) if isinstance(n, ast.Call)) if forward else ()
        collective = next(
            (script.name_of(c.func) for c in calls if is_collective(script.name_of(c.func))), None
        )
        if collective is not None:
            issuing[name] = short(collective)
    # Outward from those, to the classes that name one (build or apply it): each
    # class's names are read once, so a file of many classes stays linear.
    users: dict[str, set[str]] = {}
    for name, cls in classes.items():
        for used in {n.id for n in walk(cls) if isinstance(n, ast.Name)} & classes.keys():
            users.setdefault(used, set()).add(name)
    pending = sorted(issuing)
    while pending:
        used = pending.pop()
        for name in sorted(users.get(used, ())):
            if name not in issuing:
                issuing[name] = issuing[used]
                pending.append(name)
    return issuing


def may_hold_a_model(script: Script, call: TracedCall, models: dict[str, str]) -> bool:
    """`model(x)` with `model` a name assigned such a model, or a parameter of the
    function the call is in (names_the_wrapper then reads what its callers hand it)."""
    if not models or not isinstance(call.node.func, ast.Name):
        return False
    scope = enclosing_scope(call.node, script)
    return call.name in models or (scope is not None and call.name in parameter_names(scope))


def instances_by_name(script: Script, classes: dict[str, str]) -> dict[str, str]:
    """Names assigned an instance of one of `classes` (`model = TPGPT(args).cuda()`)."""
    found: dict[str, str] = {}
    for node in script.of_type(ast.Assign):
        if cls := instance_of(node.value, classes):
            found.update((source_text(target), cls) for target in node.targets)
    return found


def instance_of(value: ast.expr, classes: dict[str, str]) -> str | None:
    value = unmoved(value)
    if (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id in classes
    ):
        return value.func.id
    return None


def names_the_wrapper(
    script: Script,
    node: ast.Call,
    name: str,
    wrappers: frozenset[str],
    is_value: Callable[[Script, ast.expr], bool],
) -> bool:
    """The name holds the wrapper where this call runs: outward from the call, the
    first scope that binds it either takes it as a parameter every caller hands a
    wrapper (not `model.module`), or last assigned it a wrapper before the call
    (not `model = model.module`); `is_value` tells a wrapper's making."""
    scope = enclosing_scope(node, script)
    while scope is not None:
        if name in parameter_names(scope):
            sites = [site for site, called in script.call_names if short(called) == scope.name]
            given = [
                argument
                for site in sites
                for parameter, argument in bound_arguments(scope, site)
                if parameter == name
            ]
            return bool(given) and all(source_text(a) in wrappers for a in given)
        assigned = [
            n
            for n in own_nodes(scope)
            if isinstance(n, ast.Assign) and any(source_text(t) == name for t in n.targets)
        ]
        if assigned:  # what the name holds when the call runs: the last assignment before it
            before = [n for n in assigned if n.lineno < node.lineno]
            return bool(before) and is_value(script, max(before, key=position).value)
        if isinstance(scope, ast.Module):
            return False
        scope = enclosing_scope(scope, script)
    return False


def is_ddp_value(script: Script, value: ast.expr) -> bool:
    value = unmoved(value)
    return isinstance(value, ast.Call) and is_ddp(script.name_of(value.func))


def lonely_calls(
    script: Script, wanted: Callable[[TracedCall], Kind | None]
) -> Iterator[tuple[TracedCall, RankBranch, Kind]]:
    """Each call that `wanted` tells is a collective (what it returns: True, or the
    kind of collective) and that only some ranks reach, with the rank branch whose
    other side never calls it (a paired `if` or the else would answer it)."""
    blocks: dict[int, list[ast.stmt]] = {}
    graph: CallGraph | None = None  # both built on the first guarded collective
    reaches: dict[str, CollectiveReach] = {}
    for trace in script.traces:
        for call in trace:
            if not call.rank_path:
                continue
            kind = wanted(call)
            if not kind:
                continue
            if not some_rank_runs(call.rank_path):
                continue  # the single-process path, or tests no rank passes together
            collective = short(call.name)
            if collective not in reaches:
                graph = graph or CallGraph(script)
                blocks = blocks or statement_blocks(script)
                reaches[collective] = CollectiveReach(
                    script, collective, graph.reaching(collective), blocks
                )
            reach = reaches[collective]
            # Innermost first: a paired `if` inside can still sit in a rank-0-only caller.
            lonely = next((b for b in reversed(call.rank_path) if not reach.answered(b)), None)
            if lonely is not None:
                yield call, lonely, kind


def statement_blocks(script: Script) -> dict[int, list[ast.stmt]]:
    """id of each statement -> the statement list (body, else, loop body) it is in."""
    blocks: dict[int, list[ast.stmt]] = {}
    for node in script.nodes:
        for _name, value in ast.iter_fields(node):
            if isinstance(value, list) and value and all(isinstance(v, ast.stmt) for v in value):
                blocks.update((id(stmt), value) for stmt in value)
    return blocks


def in_order(block: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The block's statements in the order they run, a try's (body, else, finally, not
    the handlers: the exception's path) and a with's own statements in their place."""
    for stmt in block:
        if isinstance(stmt, ast.Try):
            yield from in_order(stmt.body + stmt.orelse + stmt.finalbody)
        elif isinstance(stmt, ast.With):
            yield from in_order(stmt.body)
        else:
            yield stmt


class CollectiveReach:
    """Which statements reach one collective, directly or through same-file functions.

    Every answer is cached, so a file with thousands of guarded collectives
    costs one pass per statement, not one per pair of them.
    """

    def __init__(
        self,
        script: Script,
        collective: str,
        functions: set[str],
        blocks: dict[int, list[ast.stmt]],
    ):
        self.script = script
        self.collective = collective
        self.blocks = blocks
        self.functions = functions  # the same-file functions that reach it
        self.statement_cache: dict[int, bool] = {}
        self.paired_ifs: dict[int, set[int]] = {}  # id of a block -> ids of its paired ifs

    def answered(self, branch: RankBranch) -> bool:
        """The ranks outside `branch` reach it too: in the other branch, or in a paired `if`."""
        test_if = branch.test_if
        other = test_if.orelse if branch.branch == "body" else test_if.body
        return self.statements(other) or self.paired(test_if)

    def paired(self, test_if: ast.If) -> bool:
        """`if rank != 0: barrier()` ... `if rank == 0: barrier()`: each rank calls it once
        (the second may sit in a `finally:` or a `with` of the same function: a context
        manager's `if not main: barrier()`, `try: yield`, `finally: if main: barrier()`)."""
        block = self.outer_block(test_if)
        if id(block) not in self.paired_ifs:
            self.paired_ifs[id(block)] = self.pairs_in(block)
        return id(test_if) in self.paired_ifs[id(block)]

    def outer_block(self, stmt: ast.stmt) -> list[ast.stmt]:
        """The statement list holding `stmt`, or the one holding the try / with it is in."""
        block = self.blocks.get(id(stmt), [])
        parent = self.script.parents.get(id(stmt))
        while isinstance(parent, ast.Try | ast.With) and id(parent) in self.blocks:
            block = self.blocks[id(parent)]
            parent = self.script.parents.get(id(parent))
        return block

    def pairs_in(self, block: list[ast.stmt]) -> set[int]:
        """ids of the rank `if`s of a block matched with one for the other side."""
        paired: set[int] = set()
        unmatched: dict[str, list[ast.stmt]] = {RANK_ZERO: [], OTHER_RANKS: []}  # stacks
        for stmt in in_order(block):
            side = self.reaching_side(stmt)
            if side is None:
                continue
            partners = unmatched[other_side(side)]
            if not partners:
                unmatched[side].append(stmt)
                continue
            paired.update((id(stmt), id(partners.pop())))  # the nearest one before it
        return paired

    def reaching_side(self, stmt: ast.stmt) -> str | None:
        """For an `if` on the rank that reaches the collective in one branch only: who runs it."""
        if not isinstance(stmt, ast.If):
            return None
        body_side, else_side = rank_branch_sides(stmt.test, self.script)
        in_body, in_else = self.statements(stmt.body), self.statements(stmt.orelse)
        if in_body == in_else:
            return None
        side = body_side if in_body else else_side
        return side if side in (RANK_ZERO, OTHER_RANKS) else None

    def statements(self, stmts: list[ast.stmt]) -> bool:
        return any(self.statement(stmt) for stmt in stmts)

    def statement(self, stmt: ast.stmt) -> bool:
        if id(stmt) not in self.statement_cache:
            self.statement_cache[id(stmt)] = any(
                self.call(node) for node in walk(stmt) if isinstance(node, ast.Call)
            )
        return self.statement_cache[id(stmt)]

    def call(self, node: ast.Call) -> bool:
        if short(self.script.name_of(node.func)) == self.collective:
            return True
        return any(f in self.functions for f in same_file_callees(self.script, node.func, None))


class CallGraph:
    """Who calls whom among the file's functions, and the calls each makes by short name."""

    def __init__(self, script: Script):
        self.callers: dict[str, set[str]] = {}  # callee -> functions that call it
        self.called: dict[str, set[str]] = {}  # function -> short names of what it calls
        for name, func in script.functions.items():
            called = self.called.setdefault(name, set())
            for node in (n for stmt in func.body for n in walk(stmt)):
                if not isinstance(node, ast.Call):
                    continue
                called.add(short(script.name_of(node.func)))
                for callee in same_file_callees(script, node.func, None):
                    self.callers.setdefault(callee, set()).add(name)

    def reaching_any(self, called: frozenset[str]) -> set[str]:
        """Functions that call any of `called` (short names), directly or not."""
        return set().union(*(self.reaching(name) for name in called))

    def reaching(self, collective: str) -> set[str]:
        """Functions that call `collective`, directly or through each other.

        Worked backwards from the direct callers, without recursion: a chain
        of thousands of functions is as cheap as one.
        """
        reaching = {name for name, called in self.called.items() if collective in called}
        pending = list(reaching)
        while pending:
            for caller in self.callers.get(pending.pop(), ()):
                if caller not in reaching:
                    reaching.add(caller)
                    pending.append(caller)
        return reaching


# --- a group only some ranks create ------------------------------------------------

# Calls every process of the default group must make, members of the new group or not.
GROUP_CREATORS = frozenset({"new_group", "new_subgroups", "new_subgroups_by_enumeration"})


@check("collective-mismatch")
def check_group_of_this_ranks_own_members(script: Script) -> Iterator[Finding]:
    """`sp_group = dist.new_group([dp_rank * sp + i for i in range(sp)])`, outside any
    loop over the groups: each rank creates only the group it belongs to, whose members
    its own rank decides, so the ranks call new_group with different lists in the same
    place: every process must create every group, in the same order."""
    for node, name in script.call_names:
        if short(name) != "new_group" or not name.startswith("torch.distributed"):
            continue
        members = keyword(node, "ranks") or (node.args[0] if node.args else None)
        if members is None or enclosing_loop(node, script.parents) is not None:
            continue
        if any(isinstance(n, COMPREHENSIONS) for n in ancestors_in_scope(script, node)):
            continue
        if not mixes_in_the_rank(script, members, node):
            continue
        yield script.finding(
            "collective-mismatch",
            node,
            f"new_group({source_text(members)}) makes only the group this rank belongs to, "
            "its members decided by the rank: every process must call new_group for every "
            "group, in the same order (members or not), so the ranks' calls disagree and "
            "hang or pair the wrong communicators; create all groups in a loop on every "
            "rank and keep this rank's",
        )


def ancestors_in_scope(script: Script, node: ast.AST) -> Iterator[ast.AST]:
    """The nodes around `node`, up to its function."""
    parent = script.parents.get(id(node))
    while parent is not None and not isinstance(parent, ast.FunctionDef | ast.AsyncFunctionDef):
        yield parent
        parent = script.parents.get(id(parent))


@check("collective-mismatch")
def check_group_only_some_ranks_create(script: Script) -> Iterator[Finding]:
    """`if rank in ranks: group = dist.new_group(ranks)`: new_group is collective over
    the whole default group, members or not, so a rank that skips another group's
    creation leaves its members waiting (and the groups' ids disagree)."""
    for node, name in script.call_names:
        if short(name) not in GROUP_CREATORS or not name.startswith("torch.distributed"):
            continue
        test_if = rank_test_around(script, node)
        if test_if is None:
            continue
        yield script.finding(
            "collective-mismatch",
            node,
            f"{short(name)}() runs only where `if {source_text(test_if.test)}` holds (line "
            f"{test_if.lineno}), but every process of the default group must call it for "
            "every group, members or not: the others never enter it, and its members wait "
            "(or the groups' ids disagree); create every group on every rank, then keep the "
            "one this rank belongs to",
        )


def rank_test_around(script: Script, node: ast.AST) -> ast.If | None:
    """The nearest `if` around `node`, in its function, whose test reads the rank."""
    child, parent = node, script.parents.get(id(node))
    while parent is not None and not isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if (
            isinstance(parent, ast.If)
            and child is not parent.test
            and NO_RANKS not in rank_branch_sides(parent.test, script)  # distributed or not
            and any(
                is_rank_expr(part, script)
                for part in walk(parent.test)
                if isinstance(part, ast.expr)
            )
        ):
            return parent
        child, parent = parent, script.parents.get(id(parent))
    return None


# --- a step one rank skips on its own data ---------------------------------------

# Calls whose result is a value of this rank's own tensors: a loss that is NaN
# on one rank is finite on the others.
VALUE_READS = frozenset({"isfinite", "isnan", "isinf", "item"})
# Calls that make DDP all-reduce gradients (or run a collective) in a step.
STEP_COLLECTIVE_METHODS = frozenset({"backward"})


@check("uneven-inputs")
def check_step_skipped_on_local_data(script: Script) -> Iterator[Finding]:
    """`if not torch.isfinite(loss): continue` before `loss.backward()`: the rank
    whose batch gave a NaN loss (or an empty batch) skips the step alone, while
    the others wait in DDP's gradient all-reduce. The same for a loop left on a
    flag this process's own signal handler set (`if _preempted: ... sys.exit()`,
    SIGTERM reaching the preempted node only): the other ranks go on training.
    Quiet when the skip is decided on a value every rank agreed on (a flag
    all-reduced first). Also under a framework that wraps the model out of sight
    (Accelerate's `accelerator.backward`, DeepSpeed, Lightning): its backward
    all-reduces the same way."""
    if not runs_a_process_per_gpu(script):
        return
    steps: StepFacts | None = None
    parents = script.parents
    signalled = signal_flags(script)
    for node in script.nodes:
        if not isinstance(node, ast.If) or not ends_iteration(node.body):
            continue
        loop = enclosing_loop(node, parents)
        if loop is None:
            continue
        own_data = (
            reads_local_value(node.test, step_data_names(script, loop, node))
            or bool(names_in(node.test) & local_value_names(script, loop, node))
            or compares_a_reduction(node.test)
        ) and not tests_the_agreed_gradient_norm(script, node.test, loop)
        own_signal = not own_data and reads_flag(node.test, signalled)
        own_rank = not (own_data or own_signal) and decided_by_rank(script, node, loop)
        if not (own_data or own_signal or own_rank):
            continue
        steps = steps or StepFacts(script, parents)
        if steps.agreed_before(node, loop):
            continue
        leaves = not isinstance(node.body[-1], ast.Continue)
        work = steps.skipped_work(node, loop)
        if work is None and leaves:
            work = steps.work(loop.body)[0]  # left the loop: the next steps are skipped too
        if work is None:
            continue
        decided = (
            "a flag its own signal handler set (a signal reaches some processes only, "
            "at different steps)"
            if own_signal
            else "its rank (the other ranks never take this branch)"
            if own_rank
            else "its own data"
        )
        skips = (
            "leaves the loop"
            if leaves and (own_signal or own_rank)
            else "skips the rest of the step"
        )
        yield script.finding(
            "uneven-inputs",
            node,
            f"this rank {skips} on {decided} (`if {source_text(node.test)}`), but "
            f"{short(script.name_of(work.func)) or 'the step'}() on line {work.lineno} "
            "all-reduces with the other ranks, which wait for it: decide the skip together "
            "(all_reduce a flag first), or zero the loss instead of skipping",
        )


# What a handler catches when a rank runs out of GPU memory.
OUT_OF_MEMORY = re.compile(r"OutOfMemoryError|out of memory|\bOOM\b", re.IGNORECASE)


@check("uneven-inputs")
def check_step_skipped_on_out_of_memory(script: Script) -> Iterator[Finding]:
    """`try: loss.backward() except torch.cuda.OutOfMemoryError: continue` in a loop:
    the rank whose batch ran out of memory skips the step alone, while the others
    wait in (or have started) the gradient all-reduce of that backward; the ranks
    then pair their all-reduces wrong, or hang. Quiet when the handler runs a
    collective (the ranks agree to skip together)."""
    if not runs_a_process_per_gpu(script):
        return
    for node in script.nodes:
        if not isinstance(node, ast.Try) or enclosing_loop(node, script.parents) is None:
            continue
        backward = next(
            (
                call
                for statement in node.body
                for call in walk(statement)
                if isinstance(call, ast.Call) and called_name(call) in STEP_COLLECTIVE_METHODS
            ),
            None,
        )
        if backward is None:
            continue
        for handler in node.handlers:
            if not catches_out_of_memory(handler) or not skips_the_step(handler):
                continue
            if any(
                isinstance(call, ast.Call) and is_collective(script.name_of(call.func))
                for statement in handler.body
                for call in walk(statement)
            ):
                continue
            yield script.finding(
                "uneven-inputs",
                handler,
                "this rank skips the step when its own batch runs out of memory, but "
                f"backward() on line {backward.lineno} all-reduces gradients with the other "
                "ranks, which wait for it (or pair their next all-reduce with this one): "
                "agree on the skip (all_reduce a flag) or size the batches so that none "
                "runs out of memory",
            )


def catches_out_of_memory(handler: ast.ExceptHandler) -> bool:
    """`except torch.cuda.OutOfMemoryError`, or `except RuntimeError as e` whose body
    tests the message for "out of memory"."""
    if handler.type is not None and OUT_OF_MEMORY.search(source_text(handler.type)):
        return True
    tests = [
        node.test
        for statement in handler.body
        for node in walk(statement)
        if isinstance(node, ast.If)
    ]
    return any(
        isinstance(part, ast.Constant)
        and isinstance(part.value, str)
        and OUT_OF_MEMORY.search(part.value)
        for test in tests
        for part in walk(test)
    )


def skips_the_step(handler: ast.ExceptHandler) -> bool:
    """The handler goes on to the next batch: a `continue` in it."""
    return any(
        isinstance(node, ast.Continue) for statement in handler.body for node in walk(statement)
    )


# What returns the norm of the gradients after the backward's all-reduce: the same on
# every rank (DDP's averaged gradients; FSDP's own clip and FSDP2's DTensors reduce
# the shards' norms), so a skip on it is taken by every rank together.
GRADIENT_NORMS = frozenset({"clip_grad_norm_", "get_global_grad_norm"})


def tests_the_agreed_gradient_norm(script: Script, test: ast.expr, loop: ast.AST) -> bool:
    """Every name the test reads holds the gradient norm (`gn = clip_grad_norm_(...)`;
    `if not torch.isfinite(gn): continue`). Not torch's clip over FSDP1's shards, whose
    norm is each rank's own (zero3-partitioned-parameters says so)."""
    read = {n.id for n in walk(test) if isinstance(n, ast.Name) and n.id != "torch"}
    if not read:
        return False
    return read <= node_fact(loop, "gradient norms", lambda: gradient_norms(script, loop))


def gradient_norms(script: Script, loop: ast.AST) -> set[str]:
    """Names the loop assigns the agreed gradient norm (tests_the_agreed_gradient_norm)."""
    fsdp1 = bool(names_bound_to(script, "FullyShardedDataParallel"))
    return {
        target.id
        for assign in walk(loop)
        if isinstance(assign, ast.Assign)
        and any(
            isinstance(call, ast.Call)
            and called_name(call) in GRADIENT_NORMS
            and not (fsdp1 and script.name_of(call.func).startswith("torch.nn.utils"))
            for call in walk(assign.value)
        )
        for target in assign.targets
        if isinstance(target, ast.Name)
    }


def decided_by_rank(script: Script, test_if: ast.If, loop: ast.AST) -> bool:
    """Only some ranks take the branch: its test, or an `if` around it inside the
    loop, runs it on rank 0 alone (`if rank == 0 and early_stopping.early_stop:
    break`) or on the other ranks alone."""
    if rank_branch_sides(test_if.test, script)[0] in (RANK_ZERO, OTHER_RANKS):
        return True
    child, parent = test_if, script.parents.get(id(test_if))
    while parent is not None and parent is not loop:
        if isinstance(parent, ast.If) and child is not parent.test:
            body, orelse = rank_branch_sides(parent.test, script)
            if (body if child in parent.body else orelse) in (RANK_ZERO, OTHER_RANKS):
                return True
        child, parent = parent, script.parents.get(id(parent))
    return False


def signal_flags(script: Script) -> set[str]:
    """Names and attributes that a handler registered with signal.signal sets
    (`global _preempted; _preempted = True`, `self.stop = True`, `STOP.set()`)."""
    handlers: set[str] = set()
    for node, name in script.call_names:
        if name == "signal.signal" and len(node.args) >= 2:
            handler = node.args[1]
            if isinstance(handler, ast.Name | ast.Attribute):
                handlers.add(handler.id if isinstance(handler, ast.Name) else handler.attr)
    flags: set[str] = set()
    for qualified, function in script.functions.items():
        if qualified.rsplit(".", 1)[-1] not in handlers:
            continue
        for node in walk(function):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name | ast.Attribute):
                        flags.add(target.id if isinstance(target, ast.Name) else target.attr)
            elif isinstance(node, ast.Call) and called_name(node) == "set":
                flags |= names_in(node.func)
    return flags


def reads_flag(test: ast.expr, flags: set[str]) -> bool:
    """The test reads one of these names or attributes."""
    return any(
        (isinstance(node, ast.Name) and node.id in flags)
        or (isinstance(node, ast.Attribute) and node.attr in flags)
        for node in walk(test)
    )


# Tensor reductions whose result an `if` compares: `if score.mean() > threshold:`.
TENSOR_READS = frozenset({"mean", "sum", "max", "min", "norm", "any", "all"})


@check("collective-mismatch")
def check_collective_on_local_data(script: Script) -> Iterator[Finding]:
    """A collective inside `if <this rank's own tensor value>:` (`if score.mean() >
    thr: dist.all_gather(...)`, `if torch.isnan(loss).any(): dist.barrier()`):
    only the ranks whose data passes the test call it, and the ranks stop
    matching. Quiet when a name the test reads went through a collective
    earlier in the same function (the ranks agreed on it), and when the else
    branch calls a collective too."""
    if not is_distributed(script):
        return
    for scope in script.all_scopes:
        nodes = script.scope_nodes(scope)
        agreed: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.Call) and is_collective(script.name_of(node.func)):
                agreed |= argument_names(node)
                continue
            if not isinstance(node, ast.If) or not reads_own_tensor(node.test):
                continue
            if names_in(node.test) & agreed or first_collective(script, node.orelse):
                continue
            collective = first_collective(script, node.body)
            if collective is None:
                continue
            yield script.finding(
                "collective-mismatch",
                collective,
                f"{short(script.name_of(collective.func))}() runs only on the ranks whose own "
                f"data passes `if {source_text(node.test)}` (line {node.lineno}); the others "
                "go on without it, and the ranks wait in different collectives (a hang, or "
                "mismatched data); decide the test together (all_reduce the value first) or "
                "call the collective on every rank",
            )


@check("collective-mismatch")
def check_collectives_skipped_on_an_empty_share(script: Script) -> Iterator[Finding]:
    """`if not mine: continue` where `mine` is this rank's share of a list (`[c for c in
    picked if c % world == rank]`, `clients[rank::world]`), ahead of collectives: a rank
    whose share comes out empty (clients sampled anew each round, fewer items than
    ranks) skips the collectives the others wait in, and from there the ranks'
    collectives pair up wrongly (a hang, or one round's sums added to another's).
    Quiet when the skip comes after the collectives, or leaves no collective behind."""
    if not is_distributed(script):
        return
    for test in script.of_type(ast.If):
        if not ends_iteration(test.body):
            continue
        share = emptiness_tested(test.test)
        if share is None:
            continue
        made = assignments_seen_from(script, test).get(share, [])
        if not made or not all(is_rank_share(script, value) for value in made):
            continue
        skipped = first_collective_skipped(script, test)
        if skipped is None:
            continue
        yield script.finding(
            "collective-mismatch",
            test,
            f"`if {source_text(test.test)}` leaves before {short(script.name_of(skipped.func))}() "
            f"(line {skipped.lineno}) on a rank whose own share {share} is empty, while the "
            "other ranks wait in it: from there the ranks' collectives pair up wrongly (a "
            "hang, or sums of different rounds added); let a rank with nothing to do "
            "contribute zeros and still call every collective",
        )


def emptiness_tested(test: ast.expr) -> str | None:
    """`mine` in `not mine`, `len(mine) == 0`, `len(mine) < 1`, `not len(mine)`."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        operand = test.operand
        if isinstance(operand, ast.Call) and called_name(operand) == "len" and operand.args:
            operand = operand.args[0]
        return operand.id if isinstance(operand, ast.Name) else None
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.left, ast.Call)
        and called_name(test.left) == "len"
        and test.left.args
        and isinstance(test.left.args[0], ast.Name)
        and isinstance(test.comparators[0], ast.Constant)
        and (
            (isinstance(test.ops[0], ast.Eq | ast.LtE) and test.comparators[0].value == 0)
            or (isinstance(test.ops[0], ast.Lt) and test.comparators[0].value == 1)
        )
    ):
        return test.left.args[0].id
    return None


def is_rank_share(script: Script, value: ast.expr) -> bool:
    """This rank's share of a list: a strided slice or range from the rank
    (`items[rank::world]`), or a comprehension that keeps the items a test gives this
    rank (`[c for c in picked if c % world == rank]`)."""
    if is_rank_stride(script, value):
        return True
    return isinstance(value, ast.ListComp | ast.GeneratorExp) and any(
        isinstance(compare, ast.Compare)
        and any(isinstance(op, ast.Eq) for op in compare.ops)
        and any(is_rank_expr(side, script) for side in [compare.left, *compare.comparators])
        for generator in value.generators
        for condition in generator.ifs
        for compare in walk(condition)
    )


def first_collective_skipped(script: Script, test: ast.If) -> ast.Call | None:
    """The first collective after the skip that it leaves out: the rest of the loop's
    body for a continue or break, the rest of the function for a return or an exit."""
    leaves_the_loop = isinstance(test.body[-1], ast.Continue | ast.Break)
    region = enclosing_loop(test, script.parents) if leaves_the_loop else None
    if region is None:
        region = enclosing_scope(test, script)
    if region is None:
        return None
    after = (test.end_lineno or test.lineno, test.end_col_offset or 0)
    skipped = [
        node
        for node in walk(region)
        if isinstance(node, ast.Call)
        and (node.lineno, node.col_offset) > after
        and is_collective(script.name_of(node.func))
    ]
    return min(skipped, key=lambda node: (node.lineno, node.col_offset), default=None)


def reads_own_tensor(test: ast.expr) -> bool:
    """The test reads a value of this rank's tensors: isfinite / isnan / .item(),
    or a comparison of a reduction (`score.mean() > thr`, `loss.item() < best`)."""
    return reads_local_value(test, set()) or compares_a_reduction(test)


def compares_a_reduction(test: ast.expr) -> bool:
    """`score.mean() > thr`, `adv.abs().sum() == 0`: a tensor's method (not the
    builtin max(a, b)) reduced and compared, a value of this rank's tensors."""
    for node in walk(test):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                if (
                    isinstance(side, ast.Call)
                    and isinstance(side.func, ast.Attribute)
                    and called_name(side) in TENSOR_READS
                ):
                    return True
    return False


def first_collective(script: Script, block: list[ast.stmt]) -> ast.Call | None:
    for statement in block:
        for node in walk(statement):
            if isinstance(node, ast.Call) and is_collective(script.name_of(node.func)):
                return node
    return None


def argument_names(call: ast.Call) -> set[str]:
    """The names a call is handed, positionally or by keyword."""
    return {name for a in [*call.args, *(k.value for k in call.keywords)] for name in names_in(a)}


class StepFacts:
    """What the statements of each block hold, read once per block, so that a
    loop with thousands of skips costs a pass over it, not one per skip.

    For a block: the first call at or after each statement that talks to the
    other ranks (a backward, a collective, a same-file function that makes
    one), and the names handed to collectives before each statement.
    """

    def __init__(self, script: Script, parents: dict[int, ast.AST]):
        self.script = script
        self.parents = parents
        self.reaching = CallGraph(script).reaching_any(STEP_COLLECTIVE_METHODS)
        self.work_from: dict[int, list[ast.Call | None]] = {}  # id(block) -> per index
        self.agreed_until: dict[int, list[frozenset[str]]] = {}  # id(block) -> per index
        self.agreed_functions = functions_returning_agreed_values(script)
        self.positions: dict[int, dict[int, int]] = {}  # id(block) -> id(statement) -> index

    def enclosing_blocks(
        self, node: ast.AST, loop: ast.AST
    ) -> Iterator[tuple[list[ast.stmt], int]]:
        """(statement list, index of the statement holding `node`) from `node` out to
        the loop body (each list's positions indexed once, not searched per skip)."""
        child, parent = node, self.parents.get(id(node))
        while parent is not None:
            for _name, value in ast.iter_fields(parent):
                if isinstance(value, list):
                    if id(value) not in self.positions:
                        self.positions[id(value)] = {id(v): i for i, v in enumerate(value)}
                    index = self.positions[id(value)].get(id(child))
                    if index is not None:
                        yield value, index
            if parent is loop:
                return
            child, parent = parent, self.parents.get(id(parent))

    def agreed_before(self, test_if: ast.If, loop: ast.AST) -> bool:
        """A name the test reads went through a collective earlier in the iteration
        (`dist.all_reduce(bad)`; `if bad.item(): continue`): every rank agrees."""
        read = names_in(test_if.test)
        return any(
            self.agreed(block)[index] & read
            for block, index in self.enclosing_blocks(test_if, loop)
        )

    def skipped_work(self, test_if: ast.If, loop: ast.AST) -> ast.Call | None:
        """The first call the skip jumps over that talks to the other ranks."""
        for block, index in self.enclosing_blocks(test_if, loop):
            work = self.work(block)[index + 1]
            if work is not None:
                return work
        return None

    def work(self, block: list[ast.stmt]) -> list[ast.Call | None]:
        if id(block) not in self.work_from:
            found: list[ast.Call | None] = [None] * (len(block) + 1)
            for index in range(len(block) - 1, -1, -1):
                found[index] = self.first_work(block[index]) or found[index + 1]
            self.work_from[id(block)] = found
        return self.work_from[id(block)]

    def agreed(self, block: list[ast.stmt]) -> list[frozenset[str]]:
        """Per statement: the names agreed before it, handed to a collective or
        made only of names that were (`dist.all_reduce(counts)`, then `acc =
        counts[0] / counts[1]`; not `scores = q @ gathered.T`, which mixes in
        this rank's own rows)."""
        if id(block) not in self.agreed_until:
            names: list[frozenset[str]] = [frozenset()]
            for statement in block:
                agreed = set(names[-1] | self.collective_arguments(statement))
                for node in walk(statement):
                    if not isinstance(node, ast.Assign | ast.AugAssign):
                        continue
                    for targets, value in pairs_of(node):
                        read = data_names(self.script, value)
                        if read and read <= agreed:
                            agreed |= targets
                names.append(frozenset(agreed))
            self.agreed_until[id(block)] = names
        return self.agreed_until[id(block)]

    def first_work(self, statement: ast.stmt) -> ast.Call | None:
        for node in walk(statement):
            if isinstance(node, ast.Call) and self.talks_to_ranks(node):
                return node
        return None

    def talks_to_ranks(self, call: ast.Call) -> bool:
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr in STEP_COLLECTIVE_METHODS:
            return True
        if is_collective(self.script.name_of(func)):
            return True
        return any(c in self.reaching for c in same_file_callees(self.script, func, None))

    def collective_arguments(self, statement: ast.stmt) -> frozenset[str]:
        """Names handed to a collective, and names assigned what a function of the
        file returns agreed on every rank (`loss = pfc(emb, labels)`)."""
        names: set[str] = set()
        for node in walk(statement):
            if isinstance(node, ast.Call) and is_collective(self.script.name_of(node.func)):
                names |= argument_names(node)
            elif isinstance(node, ast.Assign) and calls_one_of(
                self.script, node.value, self.agreed_functions
            ):
                names |= {name for target in node.targets for name in names_in(target)}
        return frozenset(names)


# Collectives whose first argument holds the same value on every rank after them
# (not reduce_scatter's or all_to_all's output: each rank's own share).
FILLS_ALIKE = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "broadcast",
        "broadcast_object_list",
    }
)


def functions_returning_agreed_values(script: Script) -> set[str]:
    """The file's functions whose every return reads only tensors a collective
    filled alike on every rank (`dist.all_reduce(loss); return loss.log().mean()`),
    or calls such a function (`return DistCrossEntropy.apply(logits, labels)`, a
    module whose forward ends that way): a loss made like that is the same number
    on every rank. A return that mixes in this rank's own rows is not."""
    collected = {
        name: set().union(
            *(
                names_in(n.args[0])
                for n in script.scope_nodes(function)
                if isinstance(n, ast.Call)
                and n.args
                and short(script.name_of(n.func)) in FILLS_ALIKE
                and is_collective(script.name_of(n.func))
            )
        )
        for name, function in script.functions.items()
    }
    returned = {
        name: [
            n.value for n in script.scope_nodes(function) if isinstance(n, ast.Return) and n.value
        ]
        for name, function in script.functions.items()
    }
    agreed: set[str] = set()
    grown = True
    while grown:  # a function returning another's agreed value, a few levels up
        grown = False
        for name, values in returned.items():
            if name in agreed or not values:
                continue
            if all(
                calls_one_of(script, value, agreed)
                or (data_names(script, value) or {""}) <= collected[name]
                for value in values
            ):
                agreed.add(name)
                grown = True
    return agreed


def data_names(script: Script, value: ast.expr) -> set[str]:
    """The names `value` reads as data: not the functions it calls nor the modules
    it names (`F`, `torch`)."""
    called = {id(n.func) for n in walk(value) if isinstance(n, ast.Call)}
    return {
        n.id
        for n in walk(value)
        if isinstance(n, ast.Name) and id(n) not in called and n.id not in script.aliases
    }


def calls_one_of(script: Script, value: ast.expr, functions: set[str]) -> bool:
    """`value` is a call that runs one of `functions`."""
    return isinstance(value, ast.Call) and bool(
        set(callees_with_forwards(script, value.func)) & functions
    )


# Calls that end the process: the block leaves every loop around it.
EXITS = frozenset({"exit", "_exit", "quit"})


def ends_iteration(body: list[ast.stmt]) -> bool:
    """The block leaves the loop's iteration: continue, break, return, or the
    process itself with success (sys.exit(), os._exit(0), raise SystemExit).
    An exit with an error code is no skip: torchrun stops the other ranks."""
    if not body:
        return False
    last = body[-1]
    if isinstance(last, ast.Continue | ast.Break | ast.Return):
        return True
    if isinstance(last, ast.Expr) and isinstance(last.value, ast.Call):
        return called_name(last.value) in EXITS and exits_cleanly(last.value.args)
    if isinstance(last, ast.Raise) and isinstance(last.exc, ast.Name | ast.Call):
        exc = last.exc
        called = exc.func if isinstance(exc, ast.Call) else exc
        arguments = exc.args if isinstance(exc, ast.Call) else []
        return source_text(called) == "SystemExit" and exits_cleanly(arguments)
    return False


def exits_cleanly(arguments: list[ast.expr]) -> bool:
    """sys.exit() / sys.exit(0) / sys.exit(None): the exit status is 0."""
    return not arguments or (
        isinstance(arguments[0], ast.Constant) and arguments[0].value in (0, None)
    )


# A model's own members: the same on every rank, whatever its data (a loop over them
# that skips `param.grad is None` skips the same ones everywhere).
MODEL_MEMBERS = frozenset(
    {"parameters", "named_parameters", "buffers", "named_buffers", "modules", "named_modules",
     "children", "named_children"}
)  # fmt: skip


def batch_names(loop: ast.For | ast.While) -> set[str]:
    """Names a `for` binds to the loader's items (not enumerate's counter, and none
    for a loop over the model's own parameters or modules)."""
    if not isinstance(loop, ast.For):
        return set()
    target = loop.target
    iterated = loop.iter
    if isinstance(iterated, ast.Call) and called_name(iterated) in MODEL_MEMBERS:
        return set()
    if (
        isinstance(iterated, ast.Call)
        and isinstance(iterated.func, ast.Name)
        and iterated.func.id == "enumerate"
        and isinstance(target, ast.Tuple)
        and len(target.elts) == 2
    ):
        target = target.elts[1]
    return {n.id for n in walk(target) if isinstance(n, ast.Name)}


def step_data_names(script: Script, loop: ast.For | ast.While, before: ast.AST) -> set[str]:
    """The loop's batch names and the names its body assigns from them above
    `before`, in source order (`hard_idx, ok = mine(bank, idx)`: what is mined
    from this rank's batch is this rank's own too; `n_correct += ...` too)."""
    joined = node_fact(loop, "batch names joined", lambda: batch_names_joined(script, loop))
    _events, lines = events_of(script, loop)
    above = bisect_left(lines, getattr(before, "lineno", 0))
    return {name for name, event in joined.items() if event < above}


def batch_names_joined(script: Script, loop: ast.For | ast.While) -> dict[str, int]:
    """Each name step_data_names can return, and the index (in loop_events) of the
    assignment that first made it batch data (-1: the loop's own batch names). The
    set only grows down the loop, so one pass serves every statement of it."""
    joined = dict.fromkeys(batch_names(loop), -1)
    if not joined:
        return joined
    events, _lines = events_of(script, loop)
    for index, event in enumerate(events):
        if not isinstance(event, ast.Call) and names_in(event.value) & joined.keys():
            for name in assigned_names(event):
                joined.setdefault(name, index)
    return joined


def loops_within(loop: ast.For | ast.While) -> list[ast.For | ast.While]:
    """The loop and the for loops of its body."""
    return [loop, *(n for s in loop.body for n in walk(s) if isinstance(n, ast.For))]


def assigned_names(assign: ast.Assign | ast.AugAssign) -> set[str]:
    targets = assign.targets if isinstance(assign, ast.Assign) else [assign.target]
    return {
        n.id
        for target in targets
        for n in walk(target)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }


def local_value_names(script: Script, loop: ast.For | ast.While, before: ast.AST) -> set[str]:
    """Names the loop's body assigns, above `before`, a value read from this rank's
    batch (`valid_frac = (y != IGNORE).float().mean().item()`), or made from such a
    name (`n_correct += (out.argmax(1) == y).sum().item()`, then `acc = n_correct /
    n_seen`): a test of one is a test of this rank's own data. Not a row count (`n =
    x.size(0)`), which counts_no_rows judges where it is compared (a short last
    batch is as short on every rank)."""
    line = getattr(before, "lineno", 0)
    # each loop's own batch: the loop's, and an epoch loop's passes over the data
    # inside it (`for x, y in loader:` under `for epoch in ...:`)
    loops = node_fact(loop, "loops within", lambda: loops_within(loop))
    batch_of = {
        id(each): step_data_names(script, each, before) for each in loops if each.lineno < line
    }
    local: set[str] = set()
    for event in assignments_and_agreements_above(script, loop, line):
        if isinstance(event, ast.Call):  # `dist.all_reduce(val)`: val is agreed from here on
            local -= names_in(event.args[0])
            continue
        batch = set().union(*(batch_of.get(id(each), ()) for each in loops_around(event, loops)))
        for targets, value in pairs_of(event):
            if isinstance(value, ast.Call) and called_name(value) in RETURNS_AGREED:
                local -= targets  # `preds = accelerator.gather(preds)`
            elif reads_a_tensor_value(value, batch) or names_in(value) & local:
                local |= targets
    return local


# Calls whose result every rank holds alike (Accelerate's gathers and reduce; torch's
# all_gather_object fills its first argument, FILLS_ALIKE, and returns None).
RETURNS_AGREED = frozenset({"gather", "gather_for_metrics", "reduce"})


def assignments_and_agreements_above(
    script: Script, loop: ast.For | ast.While, line: int
) -> list[ast.Assign | ast.AugAssign | ast.Call]:
    """The loop body's assignments above `line`, and its calls of collectives that
    fill their first argument alike on every rank, in source order."""
    events, lines = events_of(script, loop)
    return events[: bisect_left(lines, line)]


def events_of(script: Script, loop: ast.For | ast.While) -> tuple[list[ast.AST], list[int]]:
    """loop_events of the loop, worked out once per file."""
    return node_fact(loop, "assignments and agreements", lambda: loop_events(loop))


def loop_events(loop: ast.For | ast.While) -> tuple[list[ast.AST], list[int]]:
    """Every assignment of the loop's body and every call of a collective that fills
    its first argument alike, in source order, and their lines."""
    found = [
        n
        for statement in loop.body
        for n in walk(statement)
        if isinstance(n, ast.Assign | ast.AugAssign)
        or (isinstance(n, ast.Call) and n.args and called_name(n) in FILLS_ALIKE)
    ]
    found.sort(key=lambda n: (n.lineno, n.col_offset))
    return found, [n.lineno for n in found]


def pairs_of(assign: ast.Assign | ast.AugAssign) -> list[tuple[set[str], ast.expr]]:
    """(names bound, the value they get): `best, waited = acc, 0` pairs each name with
    its own value (`waited` is not made of `acc`); otherwise all names, the whole value."""
    if (
        isinstance(assign, ast.Assign)
        and len(assign.targets) == 1
        and isinstance(assign.targets[0], ast.Tuple)
        and isinstance(assign.value, ast.Tuple)
        and len(assign.targets[0].elts) == len(assign.value.elts)
    ):
        return [
            ({n.id for n in walk(target) if isinstance(n, ast.Name)}, value)
            for target, value in zip(assign.targets[0].elts, assign.value.elts, strict=True)
        ]
    return [(assigned_names(assign), assign.value)]


def loops_around(node: ast.AST, loops: list[ast.For | ast.While]) -> list[ast.AST]:
    """Those of `loops` whose body holds `node` (by position: loops do not overlap
    otherwise)."""
    return [
        each for each in loops if each.lineno <= node.lineno <= (each.end_lineno or each.lineno)
    ]


def reads_a_tensor_value(value: ast.expr, batch: set[str]) -> bool:
    """`.item()`, isfinite / isnan / isinf, or a reduction (`.mean()`) of the batch
    (not of a flag every rank agreed on: `stop = flag.item() > 0` after its all_reduce)."""
    return any(
        isinstance(node, ast.Call)
        and called_name(node) in VALUE_READS | TENSOR_READS
        and bool(names_in(node) & batch)
        for node in walk(value)
    )


def reads_local_value(test: ast.expr, batch: set[str]) -> bool:
    """The test reads this rank's own tensors: isfinite / isnan / isinf, .item(),
    an empty or missing batch (`batch is None`, `len(targets) == 0`,
    `targets.shape[0] == 0`), or a
    reduction of the batch (`not y_mask.any()`, `(labels != -100).sum() == 0`:
    a batch with no targets)."""
    for node in walk(test):
        if isinstance(node, ast.Call):
            called = called_name(node)
            if called in VALUE_READS:
                return True
            if called in ("len", "numel") and names_in(node) & batch:
                return True
            if called in TENSOR_READS and names_in(node) & batch:
                return True
        if is_none_test(node) and names_in(node.left) & batch:
            return True
        if counts_no_rows(node, batch):
            return True
    return False


# A bound that names the batch size (`args.batch_size`, `bs`, `per_gpu_batch`): a
# row count below it is the short last batch, as short on every rank.
BATCH_SIZE_NAME = re.compile(r"batch|\bbs\b|per_(gpu|device)", re.IGNORECASE)


def counts_no_rows(node: ast.AST, batch: set[str]) -> bool:
    """`targets.shape[0] == 0`, `not boxes.size(0)`, `labels.shape[0] < 1`: the
    batch holds no rows (a detector's batch of background images), or one
    (`batch.x.shape[0] == 1`), or fewer than a minimum of its own
    (`feats.shape[0] < args.min_points`: a point-cloud crop of too few voxels).
    A comparison with a larger number, or with the batch size, is no such
    test: a short last batch is as short on every rank (DistributedSampler pads
    them to the same count)."""
    if (
        isinstance(node, ast.Compare)
        and len(node.ops) == 1
        and isinstance(node.comparators[0], ast.Name | ast.Attribute)
    ):
        bound = source_text(node.comparators[0])
        return (
            not BATCH_SIZE_NAME.search(bound)
            and isinstance(node.ops[0], ast.Lt | ast.LtE)
            and reads_row_count(node.left, batch)
        )

    def is_count(expr: ast.expr) -> bool:
        return reads_row_count(expr, batch)

    # no rows (`== 0`, `< 1`), or a single one (`== 1`, `<= 1`, `< 2`: a graph batch of
    # one node, which BatchNorm cannot train on, as OGB's examples skip); not two
    at = {count: truth_at_count(node, is_count, count) for count in (0, 1, 2)}
    return (at[0] is True or at[1] is True) and at[2] is False


def reads_row_count(value: ast.expr, batch: set[str]) -> bool:
    """`x.shape[0]` or `x.size(0)` of a name the loop binds to the batch."""
    if isinstance(value, ast.Subscript) and isinstance(value.value, ast.Attribute):
        attribute = value.value
        return attribute.attr == "shape" and bool(names_in(attribute.value) & batch)
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
        return value.func.attr == "size" and bool(names_in(value.func.value) & batch)
    return False


def is_none_test(node: ast.AST) -> bool:
    """`x is None`."""
    return (
        isinstance(node, ast.Compare)
        and isinstance(node.ops[0], ast.Is)
        and is_none(node.comparators[0])
    )
