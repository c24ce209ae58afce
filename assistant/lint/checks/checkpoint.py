"""Checkpoints every rank writes or reads alike: the same file saved by every rank at once
(checkpoint-written-by-every-rank; dataset-cache-race when it is preprocessed data), and
a checkpoint every rank loads with no map_location (checkpoint-map-location).

Under torchrun every process runs the whole script, so a `torch.save(state,
"last.pt")` that no rank test guards is written N times at once to one path.
A .pt file is a zip archive whose directory is written last: the file left
is whichever writer finished last, often truncated, and a rank that loads it
meanwhile reads it half-written ("PytorchStreamReader failed reading zip
archive").

Only what the script's own run reaches is read (the trace from module level
and the functions it calls, including an mp.spawn target): a method a
framework calls is not, since who calls it, on which ranks, is not shown.
Quiet where the script takes turns, as for a dataset download (cache.py:
rank 0 saves first while the others wait in a barrier, `with
main_process_first():`), for a path that depends on the rank (one file per
rank, as sharded state dicts are saved), an in-memory buffer, and a process
group of one process (`world_size=1`). The wrapper's state_dict() loaded
into a model not wrapped there is state_dict.py's.

Accelerate starts the processes itself, and its scripts save with Hugging
Face's `save_pretrained(folder)`: one every process reaches (not under
`accelerator.is_main_process`, and not told `is_main_process=`) writes the
same weights and config files N times at once.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from assistant.lint.checks.cache import every_rank_reaches, shared_file, sides, without_turns
from assistant.lint.launchtext import launched_world_size
from assistant.lint.model import (
    Script,
    enclosing_loop,
    full_text,
    keyword,
    names_in,
    short,
    source_text,
    walk,
)
from assistant.lint.ranks import (
    NO_RANKS,
    OTHER_RANKS,
    RANK_ZERO,
    compared_rank,
    enclosing_scope,
    is_rank_expr,
    some_rank_runs,
)
from assistant.lint.registry import check
from assistant.lint.torchapi import (
    LIGHTNING_PACKAGES,
    MAIN_PROCESS_HELPERS,
    is_collective,
    is_distributed,
    is_method,
    one_process_group,
    runs_a_process_per_gpu,
    saved_file,
)
from assistant.lint.tracer import TracedCall, same_file_callees
from assistant.results import Finding

BARRIERS = frozenset({"barrier", "monitored_barrier", "wait_for_everyone"})
# A saved file named like preprocessed data, not a model: HF's load_and_cache_examples.
DATA_CACHE = re.compile(r"cache|features|dataset|processed|examples", re.IGNORECASE)


@check("checkpoint-written-by-every-rank", "dataset-cache-race")
def check_save_on_every_rank(script: Script) -> Iterator[Finding]:
    """`torch.save(..., path)` that every rank of a distributed run reaches."""
    if not is_distributed(script) or one_process_group(script) or not script.traces:
        return
    # A file rank 0 saved first is in place (a cache the others then load); another
    # file is not: `best.pt` on rank 0 excuses no every-rank save of `last.pt`.
    saves = every_rank_reaches(
        script.traces[0], lambda call: every_rank_saves(script, call), saved_path_text
    )
    for call in without_turns(script, saves):
        if saves_a_data_cache(script, call.node):
            yield script.finding(
                "dataset-cache-race",
                call.node,
                "torch.save of preprocessed data runs on every rank: N processes build and "
                "write the same cache file at once, and a rank can load it half-written; "
                "build it on rank 0 while the others wait (if rank != 0: dist.barrier() "
                "before, if rank == 0: dist.barrier() after), then every rank loads it",
            )
            continue
        yield script.finding(
            "checkpoint-written-by-every-rank",
            call.node,
            "torch.save runs on every rank: N processes write the same file at once, and "
            'a rank that loads it can read it half-written ("PytorchStreamReader failed '
            'reading zip archive"); save on rank 0 only (if rank == 0:), then '
            "dist.barrier() before the other ranks load it",
        )


def saved_path_text(call: TracedCall) -> str:
    target = saved_file(call.node)
    return source_text(target) if target is not None else ""


def saves_a_data_cache(script: Script, call: ast.Call) -> bool:
    """The object or the file is named like preprocessed data (`cached_features_file`)."""
    parts = [*call.args[:2], *(k.value for k in call.keywords)]
    named = [source_text(part) for part in parts]
    named += [
        source_text(value)
        for part in parts
        if isinstance(part, (ast.Name, ast.Attribute))
        for value in script.assigned_values.get(source_text(part), [])
    ]
    return any(DATA_CACHE.search(text) for text in named) or returns_its_load(script, call)


def returns_its_load(script: Script, save: ast.Call) -> bool:
    """The save's function returns `torch.load` of the same file where it exists: a
    load-or-build helper of data (`if os.path.exists(path): return torch.load(path)`,
    then extract, save, return); a resume loads its checkpoint without returning it."""
    target = saved_file(save)
    scope = enclosing_scope(save, script)
    if target is None or not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    path = source_text(target)
    return any(
        isinstance(node, ast.Return)
        and isinstance(node.value, ast.Call)
        and script.name_of(node.value.func) == "torch.load"
        and node.value.args
        and source_text(node.value.args[0]) == path
        for node in script.scope_nodes(scope)
    )


def every_rank_saves(script: Script, call: TracedCall) -> bool:
    """torch.save of a file every rank would name alike, on a path some rank runs."""
    if call.name != "torch.save" or not some_rank_runs(call.rank_path):
        return False
    if under_one_ranks_number(script, call.node):
        return False
    target = saved_file(call.node)
    return target is not None and shared_file(script, target)


def under_one_ranks_number(script: Script, node: ast.AST) -> bool:
    """The node runs under `if rank == winner["member"]:`, the rank compared for
    equality with a value that does not read the rank (agreed on by every rank,
    as a gathered winner is): one rank runs it, whichever number that is."""
    child, parent = node, script.parents.get(id(node))
    while parent is not None and not isinstance(parent, ast.FunctionDef | ast.AsyncFunctionDef):
        if isinstance(parent, ast.If) and any(child is s for s in parent.body):
            test = parent.test
            if (
                isinstance(test, ast.Compare)
                and len(test.ops) == 1
                and isinstance(test.ops[0], ast.Eq)
                and one_side_is_the_rank(script, test.left, test.comparators[0])
            ):
                return True
        child, parent = parent, script.parents.get(id(parent))
    return False


def one_side_is_the_rank(script: Script, left: ast.expr, right: ast.expr) -> bool:
    """`rank == x` or `x == rank`, x not a number (rank 0's own test is read elsewhere)
    and not reading the rank."""
    for rank_side, other in ((left, right), (right, left)):
        if not compared_rank(rank_side, script) or isinstance(other, ast.Constant):
            continue
        if not is_this_process_rank(script, other):
            return True
    return False


def is_this_process_rank(script: Script, expr: ast.expr) -> bool:
    """The expression reads this process's rank; a name (`best_rank`) by what its
    function assigns it (`_, best_rank = max(board)`, a gathered winner: not this
    process's rank, whatever its name says)."""
    if isinstance(expr, ast.Name):
        values = [
            node.value
            for node in script.scope_nodes(enclosing_scope(expr, script) or script.tree)
            if isinstance(node, ast.Assign)
            and any(
                isinstance(name, ast.Name) and name.id == expr.id
                for target in node.targets
                for name in walk(target)
            )
        ]  # an unpacked tuple's element: the whole value it came from
        if values:
            return any(
                is_rank_expr(n, script)
                for value in values
                for n in walk(value)
                if isinstance(n, ast.expr)
            )
    return any(is_rank_expr(n, script) for n in walk(expr) if isinstance(n, ast.expr))


@check("checkpoint-written-by-every-rank")
def check_save_pretrained_on_every_process(script: Script) -> Iterator[Finding]:
    """`model.save_pretrained(folder)` that every process of an Accelerate script, or of
    a script that starts the group itself (DDP, DeepSpeed), reaches."""
    accelerate = "Accelerator" in script.called_short_names
    if not script.traces or not (accelerate or is_distributed(script)):
        return
    if one_process_group(script):
        return
    # Not every_rank_reaches: a save on rank 0 earlier (a periodic checkpoint)
    # does not make a later save of every process safe, as it does a download.
    saves = (
        call
        for call in script.traces[0]
        if saves_pretrained_on_every_process(call)
        and not sides(call.rank_path) & {RANK_ZERO, NO_RANKS}
        and not under_one_ranks_number(script, call.node)
    )
    for call in without_turns(script, saves):
        fix = (
            "save under `if accelerator.is_main_process:` after "
            "accelerator.wait_for_everyone(), or pass is_main_process=accelerator.is_main_process"
            if accelerate
            else "save under `if rank == 0:` (gather a sharded model's weights on every rank "
            "first), or pass is_main_process=(rank == 0)"
        )
        yield script.finding(
            "checkpoint-written-by-every-rank",
            call.node,
            f"{source_text(call.node.func)}() runs on every process: each writes the same "
            "weights and config files into one folder at once, and a reader (or an upload) "
            f"can find them half-written; {fix}",
        )


def saves_pretrained_on_every_process(call: TracedCall) -> bool:
    """`x.save_pretrained(...)` on a path some rank runs, not told which process is main."""
    func = call.node.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "save_pretrained"
        and keyword(call.node, "is_main_process") is None
        and some_rank_runs(call.rank_path)
    )


# Names a callback hook reads to tell the processes apart: the HF Trainer's
# `state.is_world_process_zero`, `args.process_index`, Lightning's
# `trainer.is_global_zero` and `@rank_zero_only`, a rank read any other way.
PROCESS_TESTS = MAIN_PROCESS_HELPERS | {
    "process_index",
    "local_process_index",
    "rank",
    "global_rank",
    "local_rank",
    "get_rank",
    "rank_zero_only",
}
# What a hook may write into a folder the processes share.
HOOK_WRITES = frozenset({"save_pretrained", "save_model", "save"})


@check("checkpoint-written-by-every-rank")
def check_save_in_a_callback_hook_of_every_process(script: Script) -> Iterator[Finding]:
    """A Hugging Face TrainerCallback's or a Lightning Callback's hook that saves with
    no test of which process runs it.

    The Trainer calls its callbacks' hooks (`on_save`, `on_train_epoch_end`) in
    every process it runs in: under torchrun or `accelerate launch` each writes
    the same folder at once (a rename or rmtree of one under another's feet:
    FileNotFoundError, a half-written adapter). Only hooks of a run of several
    processes are read: the launch line shown starts several, or the file
    starts them itself."""
    launched = launched_world_size(script.source)
    if not (launched and launched > 1) and not runs_a_process_per_gpu(script):
        return
    for cls in callback_classes(script):
        for method in cls.body:
            if not isinstance(method, ast.FunctionDef) or not method.name.startswith("on_"):
                continue
            if tells_processes_apart(method):
                continue
            save = next(hook_saves(script, method), None)
            if save is None:
                continue
            yield script.finding(
                "checkpoint-written-by-every-rank",
                save,
                f"{cls.name}.{method.name} is a callback hook, which the Trainer calls in "
                f"every process, and {source_text(save.func)}() in it tests no rank: "
                "every process writes the same files at once, and one can move or delete "
                "them under another; save only on the main process (`if "
                "state.is_world_process_zero:` in a TrainerCallback, `if "
                "trainer.is_global_zero:` or @rank_zero_only in a Lightning Callback)",
            )


def callback_classes(script: Script) -> list[ast.ClassDef]:
    """The file's classes built on transformers' TrainerCallback or Lightning's Callback."""
    found = []
    for node in script.tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        for base in node.bases:
            name = script.name_of(base)
            package = name.split(".")[0]
            if (package == "transformers" and short(name) == "TrainerCallback") or (
                package in LIGHTNING_PACKAGES and short(name) == "Callback"
            ):
                found.append(node)
                break
    return found


def tells_processes_apart(method: ast.FunctionDef) -> bool:
    """The hook (or a decorator on it: the walk covers them) reads which process runs it."""
    return any(
        (node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)) in PROCESS_TESTS
        for node in walk(method)
    )


def hook_saves(script: Script, method: ast.FunctionDef) -> Iterator[ast.Call]:
    """torch.save, or a `.save_pretrained` / `.save_model` / `.save` method not told
    which process is main, in the hook's own body."""
    for node in walk(method):
        if not isinstance(node, ast.Call):
            continue
        if script.name_of(node.func) == "torch.save" or (
            isinstance(node.func, ast.Attribute)
            and node.func.attr in HOOK_WRITES
            and keyword(node, "is_main_process") is None
        ):
            yield node


@check("checkpoint-written-by-every-rank", "dataset-cache-race")
def check_load_before_rank_zero_finished_saving(script: Script) -> Iterator[Finding]:
    """`if rank == 0: torch.save(state, best_path)` ... then every rank
    `torch.load(best_path)` with no barrier or other collective between: the
    other ranks open the file while rank 0 may still be writing it."""
    if not runs_a_process_per_gpu(script) or one_process_group(script) or not script.traces:
        return
    pending: dict[str, TracedCall] = {}  # saved path's text -> rank 0's save
    for call in script.traces[0]:
        if is_collective(call.name) or short(call.name) in BARRIERS:
            pending.clear()  # every rank waits here for rank 0, whose save is done
        elif call.name == "torch.save" and len(call.node.args) > 1:
            if RANK_ZERO in sides(call.rank_path):
                pending[source_text(call.node.args[1])] = call
        elif call.name == "torch.load" and call.node.args and every_rank_runs(call):
            save = pending.get(source_text(call.node.args[0]))
            if save is None or loads_before_it_saves(script, call.node, save.node):
                continue
            data = saves_prepared_data(script, save.node)
            yield script.finding(
                "dataset-cache-race" if data else "checkpoint-written-by-every-rank",
                call.node,
                f"every rank loads {source_text(call.node.args[0])} here, right after rank 0 "
                f"saved {'the data it prepared' if data else 'it'} (line {save.node.lineno}), "
                "with no barrier between: the other ranks can open it while rank 0 is still "
                'writing it ("PytorchStreamReader failed reading zip archive"), or find it '
                "missing or the previous version; call dist.barrier() (fabric.barrier(), "
                "accelerator.wait_for_everyone()) after the save",
            )
            del pending[source_text(call.node.args[0])]


# Saved objects that are a model's or a run's state: a checkpoint, not data.
MODEL_STATE = re.compile(
    r"state_dict|model|optim|ckpt|checkpoint|weight|param|net\b", re.IGNORECASE
)


def saves_prepared_data(script: Script, save: ast.Call) -> bool:
    """What rank 0 saved is data it prepared for every rank (named like a cache, or
    a dict of arrays with no model state in it: pseudo-labels, an index, features),
    not a checkpoint of the model or the run."""
    if saves_a_data_cache(script, save):
        return True
    saved = save.args[0]
    values = [saved]
    if isinstance(saved, ast.Name | ast.Attribute):
        values = script.assigned_values.get(source_text(saved), [])
    texts = [full_text(save.args[1]), *(full_text(value) for value in values)]
    return (
        bool(values)
        and all(isinstance(value, ast.Dict) for value in values)
        and not any(MODEL_STATE.search(text) for text in texts)
    )


def loads_before_it_saves(script: Script, load: ast.Call, save: ast.Call) -> bool:
    """The load comes above the save in one function, and no loop runs both: a resume
    at the start of a run, reached after the save only when the trace enters the
    function a second time (`mp.spawn(train, ...)` on one branch, `train(0, ...)` on
    the other), which no run does."""
    scope = enclosing_scope(load, script)
    if scope is None or enclosing_scope(save, script) is not scope or load.lineno > save.lineno:
        return False
    return not loops_around(script, load) & loops_around(script, save)


def loops_around(script: Script, node: ast.AST) -> set[int]:
    """ids of the loops of its function that hold `node`."""
    found: set[int] = set()
    loop = enclosing_loop(node, script.parents)
    while loop is not None:
        found.add(id(loop))
        loop = enclosing_loop(loop, script.parents)
    return found


# How many assignments a loaded checkpoint is followed through before it reaches
# load_state_dict (`ckpt` -> `state = {...ckpt...}` -> `state = strip(state)`).
MADE_FROM_HOPS = 3


@check("checkpoint-map-location")
def check_load_without_map_location(script: Script) -> Iterator[Finding]:
    """`torch.load(checkpoint)` with no map_location that every rank runs, its result
    loaded into a model: each rank puts the tensors back on the GPU they were saved
    from, rank 0's cuda:0, so GPU 0 holds N copies."""
    if not runs_a_process_per_gpu(script) or one_process_group(script) or not script.traces:
        return
    scope_of = {
        id(node): scope for scope in script.all_scopes for node in script.scope_nodes(scope)
    }
    loads = (
        call
        for call in script.traces[0]
        if call.name == "torch.load" and call.node.args and every_rank_runs(call)
    )
    for call in without_turns(script, loads):
        scope = scope_of.get(id(call.node))
        if scope is None or not not_placed(call.node):
            continue
        if knows_map_location(script, scope, call.node):
            continue
        if is_this_process_rank(script, call.node.args[0]):
            continue  # `f"data_rank{rank}.pt"`: the rank's own file, saved from its own GPU
        if not loaded_into_a_model(script, scope, call.node):
            continue
        yield script.finding(
            "checkpoint-map-location",
            call.node,
            "torch.load without map_location on every rank puts the checkpoint's tensors back "
            "on the GPU they were saved from (cuda:0 when rank 0 saved them), so GPU 0 holds "
            'a copy per rank (more memory there, or out of memory): pass map_location="cpu" '
            "or the rank's own device",
        )


def every_rank_runs(call: TracedCall) -> bool:
    sides = {branch.side for branch in call.rank_path}
    return some_rank_runs(call.rank_path) and not sides & {RANK_ZERO, OTHER_RANKS, NO_RANKS}


def not_placed(call: ast.Call) -> bool:
    """No map_location, by keyword or as the second argument."""
    return keyword(call, "map_location") is None and len(call.args) < 2


def knows_map_location(script: Script, scope: ast.AST, load: ast.Call) -> bool:
    """Another torch.load of the same file in the same function passes map_location
    (ImageNet's `if args.gpu is None: torch.load(path) else: torch.load(path,
    map_location=loc)`): the branch without it is the one with no GPU chosen.
    A map_location on another file (pretrained weights) says nothing of this one."""
    path = source_text(load.args[0])
    return any(
        isinstance(node, ast.Call)
        and script.name_of(node.func) == "torch.load"
        and not not_placed(node)
        and node.args
        and source_text(node.args[0]) == path
        for node in script.scope_nodes(scope)
    )


def loaded_into_a_model(script: Script, scope: ast.AST, load: ast.Call) -> bool:
    """The loaded object goes into `load_state_dict(...)`, directly or through the
    names it is bound to (`ckpt = torch.load(p)`, `model.load_state_dict(ckpt["model"])`),
    and the names made from those (`state = {k[7:]: v for k, v in ckpt.items()}`)."""
    nodes = script.scope_nodes(scope)
    assigns = [node for node in nodes if isinstance(node, ast.Assign)]
    bound: set[str] = set()
    for _ in range(MADE_FROM_HOPS):
        grown = {
            target.id
            for node in assigns
            if node.value is load or names_in(node.value) & bound
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        if grown <= bound:
            break
        bound |= grown
    for node in nodes:
        if not isinstance(node, ast.Call):
            continue
        if is_method(node, "load_state_dict") or loads_weights(script, node):
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                for inner in walk(arg):
                    if inner is load or (isinstance(inner, ast.Name) and inner.id in bound):
                        return True
    return False


# What puts a checkpoint's tensors into a model, inside a helper of the file.
WEIGHT_LOADS = frozenset({"load_state_dict", "copy_"})


def loads_weights(script: Script, call: ast.Call) -> bool:
    """A call of the file's own function or method that loads what it is given into
    a model or an optimizer (`load_consolidated(model, ckpt["model"])`, which
    `p.copy_(...)`s each slice; BasicSR's `model.resume_training(resume_state)`)."""
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in WEIGHT_LOADS
        for callee in same_file_callees(script, call.func, None)
        for node in walk(script.functions[callee])
    )
