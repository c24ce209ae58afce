"""Every rank downloads the same dataset into the same folder at once (dataset-cache-race).

Under torchrun every process runs the whole script, so `MNIST(root,
download=True)` (torchvision, torchaudio, torchtext and the many datasets
that copy their signature) fetches and unpacks the same archive into the
same `root` N times at once, with no lock: a rank that checks or opens the
files while another is still writing them fails with "Dataset not found or
corrupted", a BadZipFile / EOFError, or an MD5 mismatch, and only sometimes.

Quiet where the script already takes turns: the call is on rank 0 only, or
inside a `with ...first(...)` context (`main_process_first`,
`local_main_process_first`, yolov5's `torch_distributed_zero_first`), or
after an earlier download on rank 0 only or a barrier the other ranks wait
in (the hand-written "rank 0 first" pattern), or in a Lightning
`prepare_data` hook (which Lightning runs on one process per node).

The same race, made by the script itself: a cache of parsed annotations or
features built when its file is missing (`if not os.path.exists(cache):
... pickle.dump(items, f)`, or a `build_or_load` helper that returns the
file when it exists and builds and saves it after), which every rank misses
on the first run and writes at once. Quiet in the same turn-taking cases
(also in a helper called only from inside them), and for a file per rank.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator

from assistant.lint.checks.collective_reach import statement_blocks
from assistant.lint.model import (
    Script,
    bound_arguments,
    enclosing_loop,
    files_opened,
    keyword,
    node_fact,
    parameter_names,
    short,
    source_text,
    walk,
)
from assistant.lint.ranks import (
    NO_RANKS,
    OTHER_RANKS,
    RANK_ZERO,
    RankPath,
    compared_rank,
    enclosing_scope,
    inside_rank_zero_branch,
)
from assistant.lint.registry import check
from assistant.lint.torchapi import (
    LIGHTNING_HOOKED,
    SPAWNERS,
    framework_processes,
    is_distributed,
    lightning_classes,
    runs_a_process_per_gpu,
)
from assistant.lint.tracer import Shared, TracedCall, Tracer, once_per_call, same_file_callees
from assistant.lint.values import MAX_HOPS
from assistant.results import Finding

# How many levels of same-file helpers, called only while taking turns, take turns too.
TURN_DEPTH = 3
# Hooks a framework runs on one process only (per node).
ONE_PROCESS_HOOKS = frozenset({"prepare_data"})
# Hooks Lightning calls on every process, out of the file's sight (no call to
# them in the file): what they build, every rank builds at once.
EVERY_PROCESS_HOOKS = frozenset({"setup"})


@check("dataset-cache-race")
def check_download_on_every_rank(script: Script) -> Iterator[Finding]:
    """`Dataset(root, download=True)` that every rank of a distributed run reaches at once."""
    if not is_distributed(script):
        return
    downloads = (call for trace in script.traces for call in every_rank_downloads(trace))
    for call in without_turns(script, downloads):
        yield script.finding(
            "dataset-cache-race",
            call.node,
            f"{short(call.name) or 'this call'}(...{', download=True' * has_flag(call)}) "
            "runs on every rank at once and downloads when its files are missing: N processes "
            "download and unpack into the same folder, and a rank can read "
            'a half-written file ("Dataset not found or corrupted", BadZipFile, EOFError); '
            "download on rank 0 first (or in main_process_first()), barrier, then load",
        )


def without_turns(script: Script, calls: Iterator[TracedCall]) -> Iterator[TracedCall]:
    """`calls`, each once, but those inside a block that takes turns."""
    taking_turns = nodes_taking_turns(script)
    for call in once_per_call(calls, lambda call: call):
        if id(call.node) not in taking_turns:
            yield call


def every_rank_downloads(trace: list[TracedCall]) -> Iterator[TracedCall]:
    """Calls with `download=True` (or of a dataset that downloads when built) that
    every rank reaches before any rank-0-first step."""
    return every_rank_reaches(trace, downloads)


def every_rank_reaches(
    trace: list[TracedCall],
    wanted: Callable[[TracedCall], bool],
    what: Callable[[TracedCall], object] = lambda call: None,
) -> Iterator[TracedCall]:
    """The `wanted` calls of a trace that every rank runs at once: not on rank 0
    only, not after an earlier wanted call of the same `what` (by default: any)
    on rank 0 only or in the parent before it spawned the workers (its result is
    in place), and not while the other ranks wait in a barrier for rank 0 (from
    `if rank != 0: barrier()` to rank 0's own barrier, which releases them all)."""
    others_wait = False
    done_by_rank_zero: set[object] = set()
    parent = parent_only(trace)
    for call in trace:
        if id(call) in parent:
            if wanted(call):  # done once before the workers start
                done_by_rank_zero.add(what(call))
            continue
        if short(call.name) in ("barrier", "monitored_barrier"):
            if OTHER_RANKS in sides(call.rank_path):
                others_wait = True
            elif RANK_ZERO in sides(call.rank_path):
                others_wait = False  # from here every rank runs at once again
        if not wanted(call):
            continue
        if sides(call.rank_path) & {RANK_ZERO, NO_RANKS}:
            done_by_rank_zero.add(what(call))
            continue
        if not (others_wait or what(call) in done_by_rank_zero):
            yield call


def parent_only(trace: list[TracedCall]) -> set[int]:
    """ids of the traced calls that run once, in the parent, before it starts the
    workers (mp.spawn, Process): under the main guard, ahead of the first spawn."""
    spawn = next((i for i, call in enumerate(trace) if call.name in SPAWNERS), None)
    if spawn is None:
        return set()
    return {id(call) for call in trace[:spawn] if call.guarded}


# Datasets that download and process their files when built, with no lock: OGB's
# (ogb.nodeproppred.PygNodePropPredDataset, DglGraphPropPredDataset, ...) and
# PyTorch Geometric's (torch_geometric.datasets.Planetoid, Reddit, ...).
DOWNLOADING_DATASETS = re.compile(
    r"^ogb\.(node|graph|link)proppred\.\w+Dataset$|^torch_geometric\.datasets\.\w+$"
)


def downloads(call: TracedCall) -> bool:
    flag = keyword(call.node, "download")
    if isinstance(flag, ast.Constant) and flag.value is True:
        return True
    return flag is None and bool(DOWNLOADING_DATASETS.match(call.name))


def has_flag(call: TracedCall) -> bool:
    return keyword(call.node, "download") is not None


def sides(path: RankPath) -> set[str]:
    return {branch.side for branch in path}


def nodes_taking_turns(script: Script) -> set[int]:
    """Ids of the nodes inside `with ...first(...):` blocks and one-process hooks,
    and in the same-file functions called only from there (`with
    args.main_process_first(): items = build_cache(...)`)."""
    inside: set[int] = set()
    for node in script.of_type((ast.With, ast.AsyncWith, ast.FunctionDef, ast.AsyncFunctionDef)):
        if isinstance(node, (ast.With, ast.AsyncWith)) and any(
            "first" in short(script.name_of(context_call(item.context_expr))).lower()
            for item in node.items
        ):
            inside.update(id(n) for statement in node.body for n in walk(statement))
        elif (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name in ONE_PROCESS_HOOKS
        ):
            inside.update(id(n) for n in walk(node))
    calls: dict[str, list[ast.Call]] = {}
    for node in script.of_type(ast.Call):
        for callee in same_file_callees(script, node.func, None):
            calls.setdefault(callee, []).append(node)
    rank_zero = {
        id(call) for found in calls.values() for call in found if on_rank_zero(script, call)
    }
    for _ in range(TURN_DEPTH):  # helpers of helpers, a few levels down
        # a helper (a dataset's __init__, the method that builds its cache) every call
        # of which takes turns, or runs on rank 0 alone (the validation set)
        more = {
            id(n)
            for name, function in script.functions.items()
            if calls.get(name)
            and all(id(call) in inside or id(call) in rank_zero for call in calls[name])
            and any(id(call) in inside for call in calls[name])
            for n in walk(function)
        }
        if more <= inside:
            break
        inside |= more
    return inside


def on_rank_zero(script: Script, node: ast.AST) -> bool:
    """Under an `if` of its own function that runs that branch on rank 0 only."""
    scope = enclosing_scope(node, script)
    return scope is not None and inside_rank_zero_branch(node, scope, script, 0)


def context_call(expr: ast.expr) -> ast.expr:
    """The callable of `with f(...):` (the expression itself when it is no call)."""
    return expr.func if isinstance(expr, ast.Call) else expr


# --- a cache file built by every rank ----------------------------------------------

# Calls that write a file: (callable, position of the file or path argument).
# torch.save in a script that starts its own process group is checkpoint.py's
# (it tells a data cache from a checkpoint); here it counts where Accelerate, the
# Trainer or DeepSpeed start the processes.
FILE_WRITERS = {
    "pickle.dump": 1,
    "torch.save": 1,
    "json.dump": 1,
    "numpy.save": 0,
    "numpy.savez": 0,
    "numpy.savez_compressed": 0,
    "soundfile.write": 0,  # decoded or resampled audio kept as a cache
    "torchaudio.save": 0,
}
# Methods that write their object to the path they are given first.
WRITING_METHODS = frozenset({"to_pickle", "to_parquet", "to_feather", "save_to_disk", "tofile"})
# numpy.memmap(path, mode="w+") (or numpy's .npy-format open_memmap) creates the file
# and writes through it.
MEMMAPS = frozenset({"numpy.memmap", "numpy.lib.format.open_memmap"})
MEMMAP_CREATING_MODES = frozenset({"w+"})
HELPER_DEPTH = 3  # same-file functions followed from the building branch
EXISTENCE_TESTS = frozenset({"exists", "isfile", "isdir", "is_file", "is_dir"})


@check("dataset-cache-race")
def check_cache_built_on_every_rank(script: Script) -> Iterator[Finding]:
    """`if not os.path.exists(cache): build it; pickle.dump(items, open(cache, "wb"))`
    that every rank reaches: on the first run all N processes miss the file and
    write it at once, and a rank that starts a moment later finds it half-written
    (EOFError, "Ran out of input", UnpicklingError)."""
    if not runs_a_process_per_gpu(script) or not script.traces:
        return
    # torch.save under a process group of the script's own is checkpoint.py's.
    built = cache_writes(script, torch_save=not is_distributed(script))
    if not built:
        return
    for trace, hook in [(script.traces[0], None), *lightning_hook_traces(script)]:
        writes = every_rank_reaches(trace, lambda call: id(call.node) in built)
        for call in without_turns(script, writes):
            writer = call.name if call.name in FILE_WRITERS else short(call.name)
            where = (
                f" (Lightning runs {hook}() on every process; prepare_data() runs on one "
                "per node, the place to build it)"
                if hook
                else ""
            )
            yield script.finding(
                "dataset-cache-race",
                call.node,
                f"{writer or 'this call'}() writes a cache file, built when the test on line "
                f"{built[id(call.node)]} finds it missing, on every rank at once{where}: on "
                "the first run N processes write it together and one can read it "
                "half-written (EOFError, UnpicklingError, a truncated audio or array file); "
                "build it on rank 0 while the others wait in a barrier, then every rank "
                "loads it",
            )


def lightning_hook_traces(script: Script) -> list[tuple[list[TracedCall], str]]:
    """A trace from each hook Lightning runs on every process (a DataModule's
    setup), with the hook's name, where a Trainer runs a process per GPU."""
    if not framework_processes(script):
        return []
    traces = []
    for cls in lightning_classes(script, LIGHTNING_HOOKED):
        for hook in sorted(EVERY_PROCESS_HOOKS):
            if f"{cls.name}.{hook}" in script.functions:
                trace = Tracer(script, Shared(script)).run_function(f"{cls.name}.{hook}")
                traces.append((trace, hook))
    return traces


def cache_writes(script: Script, torch_save: bool) -> dict[int, int]:
    """ids of the file writes in the branch that builds a cache when its file
    is missing (torch.save among them when `torch_save`), with the line of the
    `if` that tests whether the file exists."""
    writes: dict[int, int] = {}
    for test, branch in build_when_missing(script):
        tested = tested_paths(test.test)
        if not tested or not all(shared_file(script, path) for path in tested):
            continue  # no existence test, or a file per rank (f"cache_{rank}.pkl")
        nodes = [n for statement in branch for n in walk(statement)]
        opened = files_opened(nodes)
        for inner in nodes:
            if not isinstance(inner, ast.Call):
                continue
            if not writes_cache(script, inner, torch_save, HELPER_DEPTH):
                continue
            path = path_of_write(script, inner, opened)
            if path is not None and (
                published_atomically(script, path, nodes) or not shared_file(script, path)
            ):
                # renamed into place, or a file of this rank's own beside the shared
                # cache (`np.save(f"{feat_dir}/{rank}.npy", part)`): no half-written read
                continue
            writes.setdefault(id(inner), test.lineno)
    return writes


# Renames that replace the destination in one step (POSIX rename): a reader sees the
# old file or the whole new one, never half of it.
RENAMES = frozenset({"os.replace", "os.rename", "shutil.move"})
PATH_RENAMES = frozenset({"replace", "rename"})


def published_atomically(script: Script, path: ast.expr, nodes: list[ast.AST]) -> bool:
    """The write goes to a `path` the branch (`nodes`) then renames into place
    (`np.save(tmp, x); os.replace(tmp, dst)`, `tmp.rename(dst)`): however many ranks
    build it at once, a rank that finds the file reads a whole one."""
    written = source_text(path)
    for node in nodes:
        if not isinstance(node, ast.Call):
            continue
        if script.name_of(node.func) in RENAMES and node.args:
            renamed = node.args[0]
        elif (
            isinstance(node.func, ast.Attribute)
            and node.func.attr in PATH_RENAMES
            and len(node.args) == 1
        ):
            renamed = node.func.value  # Path(tmp).replace(dst)
        else:
            continue
        if source_text(renamed) == written:
            return True
    return False


def path_of_write(script: Script, write: ast.Call, opened: dict[str, ast.expr]) -> ast.expr | None:
    """The path a write goes to: np.save's first argument, pickle.dump's file
    through `with open(tmp, "wb") as f` (`opened`: files_opened), df.to_parquet(path)."""
    position = FILE_WRITERS.get(script.name_of(write.func), 0)
    if len(write.args) <= position:
        return None
    target = write.args[position]
    if isinstance(target, ast.Name) and target.id in opened:
        return opened[target.id]
    return target


def writes_cache(script: Script, call: ast.Call, torch_save: bool, depth: int) -> bool:
    """The call writes a file (torch.save only when `torch_save`), or is a function
    of this file that does, itself or through the functions it calls (up to
    `depth` calls deep): `build_token_cache(cache_dir)`, a dataset's
    `self._build_cache(index_file)`, a class whose __init__ writes it."""
    if writes_file(script, call):
        return torch_save or script.name_of(call.func) != "torch.save"
    if depth == 0:
        return False
    return any(
        isinstance(inner, ast.Call) and writes_cache(script, inner, torch_save, depth - 1)
        for callee in same_file_callees(script, call.func, owner=None)
        for inner in walk(script.functions[callee])
    )


def build_when_missing(script: Script) -> Iterator[tuple[ast.If, list[ast.stmt]]]:
    """Each `if` with the statements that run when it tests a file missing.

    Two shapes: the `if` itself (`if not exists(p): build; save` or
    `if exists(p): load else: build; save`), and an early exit (`if
    exists(p): return load(p)`, then the build and the save after it in the
    same block), the way a `build_or_load_cache()` helper is written, or
    `if exists(p): continue` in a loop that builds one cached file per item.
    """
    blocks = statement_blocks(script)
    for node in script.of_type(ast.If):
        branch = [*node.body, *node.orelse]
        if not node.orelse and leaves_the_block(node.body):
            block = blocks.get(id(node), [])
            branch += block[block.index(node) + 1 :]
        yield node, branch


def leaves_the_block(block: list[ast.stmt]) -> bool:
    """The block ends in a return or a continue, also from inside `with open(p) as f:
    return load(f)`: what follows the `if` runs only when its test fails."""
    last = block[-1]
    if isinstance(last, (ast.With, ast.AsyncWith)):
        return leaves_the_block(last.body)
    return isinstance(last, ast.Return | ast.Continue)


def tested_paths(test: ast.expr) -> list[ast.expr]:
    """The paths whose existence `test` checks: `os.path.exists(p)` -> p,
    `not Path(p).is_file()` -> Path(p), `p.exists() and ...` -> p."""
    paths: list[ast.expr] = []
    for node in walk(test):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if node.func.attr in EXISTENCE_TESTS:
            paths.append(node.args[0] if node.args else node.func.value)
    return paths


def writes_file(script: Script, call: ast.Call) -> bool:
    name = script.name_of(call.func)
    if name in FILE_WRITERS:
        return len(call.args) > FILE_WRITERS[name]
    if name in MEMMAPS:
        mode = keyword(call, "mode")
        return isinstance(mode, ast.Constant) and mode.value in MEMMAP_CREATING_MODES
    func = call.func
    return isinstance(func, ast.Attribute) and func.attr in WRITING_METHODS and bool(call.args)


def shared_file(script: Script, target: ast.expr) -> bool:
    """The same file on every rank: no rank in the path, and not an in-memory buffer."""
    for expression in path_values(script, target):
        for node in walk(expression):
            if isinstance(node, (ast.Name, ast.Attribute, ast.Call)) and compared_rank(
                node, script
            ):
                return False  # f"ckpt_rank{rank}.pt": one file per rank
            if isinstance(node, ast.Name) and "rank" in node.id.lower():
                return False
            if isinstance(node, ast.Call) and short(script.name_of(node.func)) in IN_MEMORY:
                return False
    return True


def path_values(script: Script, target: ast.expr) -> list[ast.expr]:
    """The path and what made it, a few names back: the values the file assigns to
    the names in it, and for a parameter of the file's functions what their calls
    pass (`tmp = out_path + ".tmp"` in a helper called with a per-rank `shard`)."""
    found: list[ast.expr] = [target]
    frontier: list[ast.expr] = [target]
    seen: set[str] = set()
    walked = iterated_around(script, target)
    for _ in range(MAX_HOPS):
        names = {
            source_text(node)
            for expression in frontier
            for node in walk(expression)
            if isinstance(node, ast.Name | ast.Attribute)
        } - seen
        seen |= names
        frontier = [
            value
            for name in sorted(names)
            for value in [
                *script.assigned_values.get(name, []),
                *unpacked_values(script).get(name, []),
                *passed_with_their_items(script, name),
                *walked.get(name, []),
            ]
            if builds_a_path(script, value)
        ][:MAX_PATH_VALUES]
        found += frontier
    return found


def unpacked_values(script: Script) -> dict[str, list[ast.expr]]:
    """Name -> the whole value a tuple target unpacks it from (`d, s, _ = clients[i]`:
    d is part of clients[i], a file named after d is as shared as clients[i] is)."""

    def unpacked() -> dict[str, list[ast.expr]]:
        values: dict[str, list[ast.expr]] = {}
        for node in script.of_type(ast.Assign):
            if isinstance(node.value, ast.Tuple | ast.List):
                continue  # `a, b = x, y`: pair by pair, in script.assigned_values
            for target in node.targets:
                if isinstance(target, ast.Tuple | ast.List):
                    for name in walk(target):
                        if isinstance(name, ast.Name):
                            values.setdefault(name.id, []).append(node.value)
        return values

    return node_fact(script.tree, "unpacked values", unpacked)


# How many values a path is followed into: a name assigned in many places is no path's.
MAX_PATH_VALUES = 32
# Built-ins a loop's iterable goes through and keeps its items: `enumerate(objs)`.
ITEM_KEEPING = frozenset({"enumerate", "sorted", "list", "tuple", "reversed"})


def iterated_around(script: Script, node: ast.AST) -> dict[str, list[ast.expr]]:
    """What the loops around `node` walk, by the names they bind (`for k, o in
    enumerate(my_objs)`: o walks my_objs): a file named after each item is as shared
    as the list the items come from. Only the loops around it: another function's
    loop over another list may bind the same name."""
    walked: dict[str, list[ast.expr]] = {}
    loop = enclosing_loop(node, script.parents)
    while loop is not None:
        if isinstance(loop, ast.For):
            items = loop.iter
            while (
                isinstance(items, ast.Call)
                and isinstance(items.func, ast.Name)
                and items.func.id in ITEM_KEEPING
                and items.args
            ):
                items = items.args[0]
            for bound in walk(loop.target):
                if isinstance(bound, ast.Name):
                    walked.setdefault(bound.id, []).append(items)
        loop = enclosing_loop(loop, script.parents)
    return walked


# Calls that build a path or a name from their arguments.
PATH_CALLS = frozenset(
    {"join", "Path", "format", "str", "joinpath", "with_suffix", "abspath", "expanduser"}
)


def builds_a_path(script: Script, value: ast.expr) -> bool:
    """A value a path is made of: text, a name, `a + b`, an f-string, os.path.join(...),
    a slice of a list of names (`objs[rank::world]`), an item picked by a name
    (`clients[i]`, i walking this rank's clients) and a list of them made by a
    comprehension (`[i for i in range(n) if i % world == rank]`); not `ckpt["iter"]`
    of a loaded checkpoint nor another call's result, whose arguments (a map_location
    naming the local rank) say nothing of the file name."""
    if isinstance(value, ast.Call):
        # an in-memory buffer too (`buffer = io.BytesIO()`): shared_file reads it as one
        return short(script.name_of(value.func)) in PATH_CALLS | IN_MEMORY
    if isinstance(value, ast.Subscript):
        return isinstance(value.slice, ast.Slice | ast.Name)
    return isinstance(
        value,
        ast.Constant | ast.Name | ast.Attribute | ast.BinOp | ast.JoinedStr | ast.ListComp,
    )


IN_MEMORY = frozenset({"BytesIO"})


def passed_with_their_items(script: Script, parameter: str) -> list[ast.expr]:
    """What the file's calls pass for a parameter, and for a name passed inside a
    loop what that loop walks (`for name in scenes[rank::world]: fit(name, ...)`:
    the helper's `name` is an item of this rank's share)."""
    passed = passed_for(script, parameter)
    return passed + [
        items
        for argument in passed
        if isinstance(argument, ast.Name)
        for items in iterated_around(script, argument).get(argument.id, [])
    ]


def passed_for(script: Script, parameter: str) -> list[ast.expr]:
    """What the file's calls of its functions pass for a parameter named `parameter`."""
    passed: list[ast.expr] = []
    for qualified, function in script.functions.items():
        if parameter not in parameter_names(function):
            continue
        method = "." in qualified
        for call, name in script.call_names:
            if short(name) != function.name:
                continue
            for bound, argument in bound_arguments(function, call, self_bound=method):
                if bound == parameter:
                    passed.append(argument)
    return passed
