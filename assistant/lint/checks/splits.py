"""Each rank draws its own split or numbers its own classes (rank-divergent-data-split).

Under DDP every process runs the data-setup code itself, and nothing one
process computes reaches the others. A random split drawn from an unseeded
generator (torch's default generator, numpy's and Python's global state are
seeded from the OS in every process) or from one seeded with the rank gives
each rank another train / validation split: the validation samples of one
rank are the training samples of the others, and the metrics look too good.
A class-to-index map built by numbering a set of strings gives each rank its
own order (Python salts string hashes per process), so the same class gets
another label on every rank.

Reported, in a script run as several processes:
- `random_split(ds, lengths)` without `generator=` (torch), sklearn's
  `train_test_split(...)` without `random_state=`, a Hugging Face dataset's
  `.train_test_split(...)` without `seed=`, when the file sets no common seed
  (a `manual_seed` / `seed_everything` / `set_seed` / `np.random.seed` /
  `random.seed` call whose argument involves no rank), or seeds with the rank;
- `enumerate(set(...))` (or of `list(set(...))`, or of a name made so)
  numbering a set into a mapping: `sorted(set(...))` is the fix;
- `hash(f"...") % buckets`: the built-in, salted hash of a string as an index.
- a sampler that deals each rank its share of one shuffled order
  (DistributedSampler, or the file's own taking a rank and a number of
  replicas) given a seed that mixes in the rank: the shares overlap;
- a DistributedSampler over the whole job in a file with a tensor-parallel
  mesh: the ranks of one model replica read different batches.
Quiet on rank 0 only, and where the split is seeded explicitly.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from assistant.lint.checks.data import seed_of
from assistant.lint.model import (
    Function,
    Script,
    bound_arguments,
    called_name,
    keyword,
    method_of,
    name_value_pairs,
    names_in,
    self_attribute,
    short,
    source_text,
    walk,
)
from assistant.lint.ranks import (
    assignments_seen_from,
    enclosing_scope,
    inside_rank_zero_branch,
    is_rank_expr,
)
from assistant.lint.registry import check
from assistant.lint.torchapi import runs_a_process_per_gpu
from assistant.results import Finding

CAUSE = "rank-divergent-data-split"
# Calls that seed a generator every later unseeded draw of the process reads.
SEEDING = frozenset(
    {"manual_seed", "seed_everything", "set_seed", "seed", "manual_seed_all", "set_determinism"}
)
# split call (short name) -> the keyword that seeds it explicitly, and the position it may take
SPLITS = {"random_split": ("generator", 2), "train_test_split": ("random_state", None)}
# sklearn's fold and shuffle splitters: random unless given random_state; the K-fold
# ones only with shuffle=True.
SPLITTERS = frozenset({"ShuffleSplit", "StratifiedShuffleSplit", "GroupShuffleSplit"})
# PyG's transforms that hold out random edges or nodes, drawn from torch's generator.
GRAPH_SPLITS = frozenset({"RandomLinkSplit", "RandomNodeSplit"})
FOLD_SPLITTERS = frozenset({"KFold", "StratifiedKFold", "StratifiedGroupKFold", "RepeatedKFold"})
HF_SPLIT_SEED = "seed"  # datasets.Dataset.train_test_split(test_size=..., seed=42)
# Index permutations (and subsets drawn in a random order) from a global generator;
# torch's take their own with generator=.
PERMUTATIONS = frozenset(
    {"numpy.random.permutation", "torch.randperm", "torch.multinomial", "numpy.random.choice"}
)
# A list shuffled in place by the global generator of `random` or numpy.
IN_PLACE_SHUFFLES = frozenset({"random.shuffle", "numpy.random.shuffle"})
RANDOM_ORDERS = PERMUTATIONS | IN_PLACE_SHUFFLES
# A subset drawn straight from the global generator of `random`: `holdout =
# set(random.sample(names, k))` is the held-out part of a split.
SUBSET_DRAWS = frozenset({"random.sample"})
# Draws that read one library's global generator (seeds_generator_of).
LIBRARY_DRAWS = RANDOM_ORDERS | SUBSET_DRAWS
# What turns a permutation into another container of the same order.
SAME_ORDER = frozenset({"tolist", "numpy", "list", "tuple"})
SEED_THE_SPLIT = (
    "seed the split itself (random_split(..., generator=torch.Generator().manual_seed(42)), "
    "train_test_split(..., random_state=42), KFold(..., shuffle=True, random_state=42))"
)
SEED_THE_SAMPLE = (
    "draw it from a generator seeded alike on every rank (random.Random(42).sample(items, k))"
)
SEED_THE_PERMUTATION = (
    "draw the permutation from a generator seeded alike on every rank "
    "(np.random.default_rng(42).permutation(n), torch.randperm(n, "
    "generator=torch.Generator().manual_seed(42)), random.Random(42).shuffle(items))"
)
# A name that holds one part of a split.
SPLIT_PART = re.compile(r"train|val|test|dev|holdout|fold", re.IGNORECASE)
# Calls that cut an order into parts: np.array_split(idx, k), torch.split(idx, sizes).
CUTTERS = frozenset({"array_split", "split", "tensor_split", "chunk"})


@check(CAUSE)
def check_split_drawn_per_rank(script: Script) -> Iterator[Finding]:
    """An unseeded (or rank-seeded) random split, run by every rank."""
    if not runs_a_process_per_gpu(script):
        return
    common, per_rank = seeds(script)
    for node, name in script.call_names:
        seeded_here = explicitly_seeded(node, name, script)
        if seeded_here is None or seeded_here or on_rank_zero_only(node, script):
            continue
        ranked_seed = draws_seed(script, node, name, common, per_rank)
        if ranked_seed is False:
            continue
        family = [c for c in common if seeds_generator_of(script, c, name)]  # named below
        if ranked_seed is None and family:
            why = (
                f"the file's seed (line {family[0].lineno}) is set only after it runs, so "
                "each process starts from its own random state"
            )
        elif ranked_seed is None:
            why = "no seed is set, so each process starts from its own random state"
        elif enclosing_scope(ranked_seed, script) is enclosing_scope(node, script):
            why = f"the process was just seeded with its rank (line {ranked_seed.lineno})"
        else:
            why = f"the file seeds only with the rank (line {ranked_seed.lineno})"
        if name in RANDOM_ORDERS and cut_into_rank_shares(node, script):
            drawn = "order and takes its share of it, so the shares overlap and some items no rank reads"
        elif name in RANDOM_ORDERS and dealt_out_after(node, script):
            drawn = "partition, so each part (a client's, a fold's) holds other items on each rank"
        else:
            drawn = "split, so one rank's validation samples are the others' training samples"
        yield script.finding(
            CAUSE,
            node,
            f"{short(name)}() runs in every process and {why}: each rank draws another "
            f"{drawn}; "
            f"{advice_for(name)} or split once and save it",
        )
    yield from numbered_sets(script)
    yield from hashed_strings(script)
    yield from samplers_split_over_tensor_parallel_ranks(script)
    yield from samplers_seeded_with_the_rank(script)


def advice_for(draw: str) -> str:
    """How to seed the draw `draw` names, alike on every rank."""
    if draw in RANDOM_ORDERS:
        return SEED_THE_PERMUTATION
    return SEED_THE_SAMPLE if draw in SUBSET_DRAWS else SEED_THE_SPLIT


def seeds(script: Script) -> tuple[list[ast.Call], list[ast.Call]]:
    """(seeding calls with a common value, seeding calls that involve the rank).
    A call of the file's own seeding helper (`seed_all(args.seed + rank)`, whose
    body seeds with its parameter) is a seeding call, judged by what it is given;
    the seeding inside such a helper is its callers' to decide."""
    helpers = seeding_helpers(script)
    inside = {id(n) for function in helpers.values() for n, _ in function[1]}
    common, per_rank = [], []
    for node, name in script.call_names:
        if id(node) in inside:
            continue
        if name in helpers:
            function, calls = helpers[name]
            values = [
                argument
                for parameter, argument in bound_arguments(function, node)
                if parameter in seeding_parameters(calls)
            ]
        elif short(name) not in SEEDING or not (node.args or node.keywords):
            continue
        else:
            values = [*node.args, *(k.value for k in node.keywords)]
        ranked = any(mixes_in_the_rank(script, value, node) for value in values)
        (per_rank if ranked else common).append(node)
    return common, per_rank


def mixes_in_the_rank(script: Script, value: ast.expr, where: ast.AST) -> bool:
    """The value reads the rank, itself or through a name its function (or the
    module) assigns it from (`seed = args.seed + rank; torch.manual_seed(seed)`)."""
    seen = assignments_seen_from(script, where)
    followed = [value, *(v for n in sorted(names_in(value)) for v in seen.get(n, ())[:2])]
    return any(
        is_rank_expr(part, script)
        for each in followed
        for part in walk(each)
        if isinstance(part, ast.expr)
    )


def seeding_helpers(script: Script) -> dict[str, tuple[Function, list[tuple[ast.Call, str]]]]:
    """Top-level functions of the file that seed a generator with one of their
    parameters (`def seed_all(seed): np.random.seed(seed) ...`): name -> (the
    function, its seeding calls with their names)."""
    helpers = {}
    for name, function in script.functions.items():
        if "." in name:
            continue
        parameters = {a.arg for a in function.args.args}
        calls = [
            (node, script.name_of(node.func))
            for node in walk(function)
            if isinstance(node, ast.Call)
            and short(script.name_of(node.func)) in SEEDING
            and any(isinstance(a, ast.Name) and a.id in parameters for a in node.args)
        ]
        if calls:
            helpers[name] = (function, calls)
    return helpers


def seeding_parameters(calls: list[tuple[ast.Call, str]]) -> set[str]:
    """The names a helper's seeding calls are given (`seed` of `np.random.seed(seed)`)."""
    return {a.id for call, _ in calls for a in call.args if isinstance(a, ast.Name)}


def seeds_generator_of(script: Script, seeding: ast.Call, split: str) -> bool:
    """Whether a seeding call seeds the generator the split draws from: a
    permutation reads numpy's or torch's own; the split functions any of them
    (sklearn's reads numpy's, random_split torch's, and files seed them together)."""
    if split not in LIBRARY_DRAWS and not split.startswith(("random.", "numpy.random.")):
        return True  # a split function: any of the generators may feed it
    library = split.split(".")[0]
    seeder = script.name_of(seeding.func)
    helper = seeding_helpers(script).get(seeder)
    if helper is not None:  # the file's own seeding helper: what it seeds
        return any(seeds_library(inner, library) for _, inner in helper[1])
    return seeds_library(seeder, library)


def seeds_library(seeder: str, library: str) -> bool:
    return (
        seeder.startswith(f"{library}.")
        or "." not in seeder
        or short(seeder)
        in (
            "seed_everything",
            "set_seed",
        )
    )


def draws_seed(
    script: Script, node: ast.Call, draw: str, common: list[ast.Call], per_rank: list[ast.Call]
) -> ast.Call | bool | None:
    """seed_in_force for a draw (`draw` names its function) among the file's seeding
    calls (seeds()): a draw reads one library's generator, so only that library's
    seeding (or a helper that seeds them all) counts for it."""
    family = [c for c in common if seeds_generator_of(script, c, draw)]
    ranked = [c for c in per_rank if seeds_generator_of(script, c, draw)]
    return seed_in_force(node, script, family, ranked)


def seed_in_force(
    split: ast.Call, script: Script, common: list[ast.Call], per_rank: list[ast.Call]
) -> ast.Call | bool | None:
    """What seeds the split's draw: False for a common seed (quiet), the per-rank
    seeding call, or None for no seed. The last seeding call before the split in
    its own function decides; without one, the file's: a common seed anywhere
    (set in main before the helpers run) unless it runs only after the split,
    else a per-rank one."""
    scope = enclosing_scope(split, script)
    before = [
        call
        for call in (*common, *per_rank)
        if enclosing_scope(call, script) is scope and call.lineno < split.lineno
    ]
    if before:
        last = max(before, key=lambda call: (call.lineno, call.col_offset))
        return last if last in per_rank else False
    if any(not runs_after(call, split, script) for call in common):
        return False
    return per_rank[0] if per_rank else None


def runs_after(later: ast.AST, earlier: ast.AST, script: Script) -> bool:
    """`later` runs only after `earlier`: in the first function both are reached
    from (each through the one call of its function, up the file), the line
    that leads to `later` comes after the one that leads to `earlier`.

    `main()` calls `make_folds(df)` (a shuffled KFold) and then, per fold,
    `train_fold(...)`, which seeds: that seed decides nothing about the folds.
    False when the two are not found in one such function.
    """
    reached = calling_lines(earlier, script)
    for scope, line in calling_lines(later, script):
        for other_scope, other_line in reached:
            if other_scope is scope:
                return line > other_line
    return False


def calling_lines(node: ast.AST, script: Script, depth: int = 6) -> list[tuple[ast.AST, int]]:
    """(scope, line) from `node`'s own function up through the single call of each
    function in the file (a function called from two places stops the climb)."""
    chain: list[tuple[ast.AST, int]] = []
    scope, line = enclosing_scope(node, script), node.lineno
    while scope is not None and len(chain) < depth:
        chain.append((scope, line))
        name = getattr(scope, "name", None)
        if name is None or script.functions.get(name) is not scope:
            break
        calls = [
            call
            for call, called in script.call_names
            if called == name and isinstance(call.func, ast.Name)
        ]
        if len(calls) != 1:
            break
        scope, line = enclosing_scope(calls[0], script), calls[0].lineno
        if any(seen is scope for seen, _ in chain):
            break
    return chain


def explicitly_seeded(node: ast.Call, name: str, script: Script) -> bool | None:
    """None: not a split; else whether the call seeds its own draw."""
    if name in RANDOM_ORDERS:
        if not sliced_into_a_split(node, script):
            return None
        return keyword(node, "generator") is not None
    if name in SUBSET_DRAWS:
        return False if kept_as_a_split_part(node, script) else None
    called = short(name)
    if name.startswith("torch_geometric.") and called in GRAPH_SPLITS:
        return False  # it takes no seed: torch's generator, as the file seeds it, decides
    if name.startswith("sklearn.") and called in SPLITTERS | FOLD_SPLITTERS:
        shuffle = keyword(node, "shuffle")
        if called in FOLD_SPLITTERS and not (
            isinstance(shuffle, ast.Constant) and shuffle.value is True
        ):
            return None  # folds in the data's order: the same on every rank
        return keyword(node, "random_state") is not None
    if called in SPLITS:
        word, position = SPLITS[called]
        if keyword(node, word) is not None:
            return True
        # A Hugging Face dataset's method (`ds.train_test_split(test_size=0.1)`),
        # unless the name resolves to sklearn's function.
        hf_method = isinstance(node.func, ast.Attribute) and not name.startswith("sklearn")
        if called == "train_test_split" and hf_method:
            return keyword(node, HF_SPLIT_SEED) is not None
        return position is not None and len(node.args) > position
    return None


def sliced_into_a_split(draw: ast.Call, script: Script) -> bool:
    """`idx = np.random.permutation(n)` (or `.tolist()` of it), or `random.shuffle(items)`,
    then in the same scope slices of `idx` / `items` assigned to names of a split's
    parts (`train_idx, val_idx = idx[:k], idx[k:]`), returned together, or handed
    to `Subset`: a split by hand. A permutation that shuffles a batch or an epoch's order is no split."""
    held = names_holding_the_order(draw, script)
    if not held:
        return False
    scope = enclosing_scope(draw, script) or script.tree
    for node in script.scope_nodes(scope):
        if getattr(node, "lineno", draw.lineno) < draw.lineno:
            continue
        if isinstance(node, ast.Assign):
            for target, value in name_value_pairs(node):
                if is_slice_of(value, held) and SPLIT_PART.search(target.id):
                    return True
                if is_rank_share_of(value, held, script):
                    return True  # `shards[rank::world]`: the rank's share of its own order
            if is_cut_of(node.value, held, script) and any(
                SPLIT_PART.search(t.id)
                for t in walk(node)
                if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)
            ):
                return True  # `folds = np.array_split(subjects, k)`, `tr, va = torch.split(idx, n)`
        if (
            isinstance(node, ast.Return)
            and isinstance(node.value, ast.Tuple)
            and sum(is_slice_of(part, held) for part in node.value.elts) >= 2
        ):
            return True  # `return files[k:], files[:k]`: the parts handed to the caller
        if (
            isinstance(node, ast.Return)
            and node.value is not None
            and any(is_cut_of(part, held, script) for part in walk(node.value))
        ):
            return True  # `return [set(c) for c in np.array_split(patients, k)]`: folds
        if collected_into_a_split_part(node, held):
            return True  # `val.extend(records[:n_val])`: the parts gathered by hand
        if isinstance(node, ast.For) and dealt_out_in_parts(node, held, script):
            return True  # `for k, part in enumerate(np.split(idx, cuts)): clients[k] += ...`
        handed_to_subset = (
            isinstance(node, ast.Call) and short(script.name_of(node.func)) == "Subset"
        )
        if handed_to_subset and any(is_slice_of(arg, held) for arg in node.args[1:2]):
            return True
    return False


def collected_into_a_split_part(node: ast.AST, held: set[str]) -> bool:
    """`val.extend(records[:n_val])`, `train += records[n_val:]`: a slice of the order
    added to a list named as a split's part."""
    if isinstance(node, ast.AugAssign):
        target, added = node.target, node.value
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("extend", "append")
        and len(node.args) == 1
    ):
        target, added = node.func.value, node.args[0]
    else:
        return False
    return bool(SPLIT_PART.search(source_text(target))) and is_slice_of(added, held)


def dealt_out_after(draw: ast.Call, script: Script) -> bool:
    """The order the draw makes is dealt out in parts later in its scope."""
    held = names_holding_the_order(draw, script)
    scope = enclosing_scope(draw, script) or script.tree
    return bool(held) and any(
        isinstance(node, ast.For)
        and node.lineno > draw.lineno
        and dealt_out_in_parts(node, held, script)
        for node in script.scope_nodes(scope)
    )


def dealt_out_in_parts(loop: ast.For, held: set[str], script: Script) -> bool:
    """A loop over the cut of the order into parts (`enumerate(np.split(idx_c,
    cuts))`) that adds each part to a list (`client_idx[k].extend(part)`): a
    partition of the items, each part another owner's (a client's, a fold's)."""
    iterated = loop.iter
    if isinstance(iterated, ast.Call) and called_name(iterated) == "enumerate" and iterated.args:
        iterated = iterated.args[0]
    if not is_cut_of(iterated, held, script):
        return False
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("extend", "append")
        for statement in loop.body
        for node in walk(statement)
    )


def is_rank_share_of(expr: ast.expr, names: set[str], script: Script) -> bool:
    """`files[rank::world]`, `idx[rank * n:(rank + 1) * n]`: a slice of a name among
    `names` that starts at a place the rank decides (or `.tolist()` of one)."""
    if (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Attribute)
        and expr.func.attr in SAME_ORDER
        and not expr.args
    ):
        expr = expr.func.value
    return (
        isinstance(expr, ast.Subscript)
        and isinstance(expr.value, ast.Name)
        and expr.value.id in names
        and isinstance(expr.slice, ast.Slice)
        and expr.slice.lower is not None
        and mixes_in_the_rank(script, expr.slice.lower, expr)
    )


def cut_into_rank_shares(draw: ast.Call, script: Script) -> bool:
    """The order the draw makes is cut into the ranks' shares in its scope."""
    held = names_holding_the_order(draw, script)
    scope = enclosing_scope(draw, script) or script.tree
    return bool(held) and any(
        is_rank_share_of(value, held, script)
        for node in script.scope_nodes(scope)
        if isinstance(node, ast.Assign)
        for _target, value in name_value_pairs(node)
    )


def is_cut_of(expr: ast.expr, names: set[str], script: Script) -> bool:
    """`np.array_split(idx, k)` / `torch.split(idx, sizes)` of a name among `names`."""
    return (
        isinstance(expr, ast.Call)
        and short(script.name_of(expr.func)) in CUTTERS
        and bool(expr.args)
        and isinstance(expr.args[0], ast.Name)
        and expr.args[0].id in names
    )


def kept_as_a_split_part(draw: ast.Call, script: Script) -> bool:
    """The draw's subset, kept as it is or in a container (`set(random.sample(...))`),
    is assigned to a name of a split's part (`holdout`, `val_names`)."""
    value: ast.expr = draw
    parent = script.parents.get(id(value))
    while (
        isinstance(parent, ast.Call)
        and called_name(parent) in CONTAINERS
        and parent.args[:1] == [value]
    ):
        value, parent = parent, script.parents.get(id(parent))
    return (
        isinstance(parent, ast.Assign)
        and parent.value is value
        and any(isinstance(t, ast.Name) and SPLIT_PART.search(t.id) for t in parent.targets)
    )


def names_holding_the_order(draw: ast.Call, script: Script) -> set[str]:
    """The list an in-place shuffle reorders, or the names a permutation is assigned
    to, through `.tolist()` / `list(...)`."""
    if script.name_of(draw.func) in IN_PLACE_SHUFFLES:
        items = draw.args[0] if draw.args else None
        return {items.id} if isinstance(items, ast.Name) else set()
    value: ast.expr = draw
    parent = script.parents.get(id(value))
    while same_order_of(parent, value):
        value, parent = parent, script.parents.get(id(parent))
    if not (isinstance(parent, ast.Assign) and parent.value is value):
        return set()
    return {t.id for t in parent.targets if isinstance(t, ast.Name)}


def same_order_of(parent: ast.AST | None, child: ast.expr) -> bool:
    """Whether parent holds child's order: the `.tolist` of `child.tolist()`, then
    its call, or `list(child)`."""
    if isinstance(parent, ast.Attribute):
        return parent.attr in SAME_ORDER
    if not isinstance(parent, ast.Call):
        return False
    if parent.func is child:
        return isinstance(child, ast.Attribute) and not parent.args
    called = parent.func.id if isinstance(parent.func, ast.Name) else None
    return called in SAME_ORDER and parent.args[:1] == [child]


# Containers a slice of the order is kept in: `val_scenes = set(scenes[:n_val])`,
# `np.sort(perm[:k])` (the same members, sorted).
CONTAINERS = frozenset({"set", "frozenset", "list", "tuple", "sorted", "sort", "array", "asarray"})


def is_slice_of(expr: ast.expr, names: set[str]) -> bool:
    """`idx[:k]`, `idx[a:b]` (or `.tolist()` of one, or one kept in a set / list /
    array, both at once, or the rows it picks: `table[idx[k:]].copy()`, or one part of
    a list joined from several: `[(f, 0) for f in good[:k]] + [(f, 1) for f in
    bad[:m]]`) of a name among `names`."""
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        return is_slice_of(expr.left, names) or is_slice_of(expr.right, names)
    while isinstance(expr, ast.Call):
        if isinstance(expr.func, ast.Attribute) and not expr.args:
            expr = expr.func.value  # idx[:k].tolist()
        elif len(expr.args) == 1 and called_name(expr) in CONTAINERS:
            expr = expr.args[0]  # set(scenes[:n_val]), np.array(idx[k:].tolist())
        else:
            break
    if isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Subscript):
        expr = expr.slice  # table[idx[:k]]: the rows the slice of the order picks
    if (
        isinstance(expr, ast.ListComp | ast.SetComp | ast.GeneratorExp)
        and len(expr.generators) == 1
    ):
        expr = expr.generators[0].iter  # [keys[i] for i in perm[:n_val]]: the items it picks
    return (
        isinstance(expr, ast.Subscript)
        and isinstance(expr.slice, ast.Slice)
        and isinstance(expr.value, ast.Name)
        and expr.value.id in names
    )


def on_rank_zero_only(node: ast.AST, script: Script, depth: int = 0) -> bool:
    """Inside a rank-0 branch, or in a function of the file that every call runs on
    rank 0 only (`build_graph()` called under `if rank == 0 and not cached:`), a
    few calls up."""
    scope = enclosing_scope(node, script) or script.tree
    if inside_rank_zero_branch(node, scope, script, 0):
        return True
    if depth >= RANK_ZERO_CALLERS or not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    if script.functions.get(scope.name) is not scope:
        return False  # a method, or a nested function: its calls are not read here
    calls = [
        call
        for call, called in script.call_names
        if called == scope.name and isinstance(call.func, ast.Name)
    ]
    return bool(calls) and all(on_rank_zero_only(call, script, depth + 1) for call in calls)


# How many calls up a split is followed into rank-0 branches.
RANK_ZERO_CALLERS = 2


# A sampler that deals each rank its share of one shuffled order takes these.
SAMPLER_RANK = re.compile(r"^(rank|global_rank|replica_rank)$")
SAMPLER_REPLICAS = re.compile(r"^(num_replicas|world_size|world|replicas|num_ranks)$")


def samplers_seeded_with_the_rank(script: Script) -> Iterator[Finding]:
    """`DistributedSampler(ds, seed=args.seed + rank)`, or the file's own sampler
    that takes the rank and the number of replicas, given a seed that mixes in the
    rank: each rank shuffles the one order another way before taking its share, so
    the shares overlap (some samples trained several times an epoch, others never)."""
    for node, name in script.call_names:
        seed = sampler_seed(script, node, name)
        if seed is None or not mixes_in_the_rank(script, seed, node):
            continue
        shuffle = keyword(node, "shuffle")
        if isinstance(shuffle, ast.Constant) and shuffle.value is False:
            continue
        yield script.finding(
            CAUSE,
            node,
            f"{short(name)} deals each rank its share of one shuffled order, but its seed "
            f"({source_text(seed)}) mixes in the rank: every rank shuffles another way, so the "
            "shares overlap and some samples are never seen in an epoch; give it the same "
            "seed on every rank (it changes the order per epoch through set_epoch)",
        )


def sampler_seed(script: Script, call: ast.Call, name: str) -> ast.expr | None:
    """The seed given to DistributedSampler, or to a sampler class of the file whose
    constructor takes a rank, a number of replicas and a seed."""
    if short(name) == "DistributedSampler":
        return seed_of(call)
    init = rank_dealing_sampler(script, name)
    if init is None:
        return None
    return next(
        (
            argument
            for parameter, argument in bound_arguments(init, call, self_bound=True)
            if parameter == "seed"
        ),
        None,
    )


# Mesh dimensions whose ranks hold parts of one model replica and read the same batch.
MODEL_PARALLEL_DIMS = frozenset({"tp", "cp", "pp", "sp", "tensor", "model", "context"})


def samplers_split_over_tensor_parallel_ranks(script: Script) -> Iterator[Finding]:
    """`DistributedSampler(ds)` (the default group: every rank of the job) in a file
    whose device mesh has a tensor- or context-parallel dimension: the ranks of one
    model replica must read the same batch, but each gets another share."""
    if not tensor_parallel_mesh(script):
        return
    for node, name in script.call_names:
        if short(name) != "DistributedSampler" or len(node.args) > 1:
            continue
        if keyword(node, "num_replicas") is not None or keyword(node, "rank") is not None:
            continue
        yield script.finding(
            CAUSE,
            node,
            "DistributedSampler splits the data over every rank of the job, but the ranks "
            "of one tensor-parallel group hold parts of one model and must read the same "
            "batch: each gets another share; pass num_replicas=mesh['dp'].size(), "
            "rank=mesh['dp'].get_local_rank()",
        )


def tensor_parallel_mesh(script: Script) -> bool:
    """init_device_mesh(..., mesh_dim_names=(..., "tp")) or parallelize_module."""
    for node, name in script.call_names:
        if short(name) == "parallelize_module":
            return True
        names = keyword(node, "mesh_dim_names") if short(name) == "init_device_mesh" else None
        if isinstance(names, ast.Tuple | ast.List) and any(
            isinstance(e, ast.Constant) and e.value in MODEL_PARALLEL_DIMS for e in names.elts
        ):
            return True
    return False


def rank_dealing_sampler(script: Script, name: str) -> ast.FunctionDef | None:
    """The __init__ of a sampler class of the file that takes a rank and a number of
    replicas (`DistributedTokenBucketSampler(lengths, tokens, world, rank)`): it
    deals each rank its share, as DistributedSampler does."""
    cls = script.classes.get(name)
    init = method_of(cls, "__init__") if cls is not None else None
    if init is None:
        return None
    parameters = {a.arg for a in [*init.args.args, *init.args.kwonlyargs]}
    if any(SAMPLER_RANK.match(p) for p in parameters) and any(
        SAMPLER_REPLICAS.match(p) for p in parameters
    ):
        return init
    return None


def numbered_sets(script: Script) -> Iterator[Finding]:
    """`{c: i for i, c in enumerate(set(names))}`: a set's order, numbered."""
    made_of_set = names_in_set_order(script)
    for node in script.nodes:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id != "enumerate" or not node.args:
            continue
        numbered = node.args[0]
        if isinstance(numbered, ast.Name):
            # what the name holds here: its last assignment in this function, when it has one
            # (a `chars` another function builds as a set is not this one)
            local = last_assignment(script, node, numbered.id)
            if local is not None:
                numbered = local
        if is_set_order(numbered, made_of_set):
            if on_rank_zero_only(node, script):
                continue
            yield script.finding(
                CAUSE,
                node,
                "enumerate() numbers a set in its iteration order, which differs between "
                "processes for strings (Python salts their hashes per process): each rank "
                "gives the same class another index; number sorted(set(...)) instead",
            )


def hashed_strings(script: Script) -> Iterator[Finding]:
    """`hash(f"{col}={value}") % buckets`: the built-in hash of a string, made an
    index. Python salts string hashes per process (PYTHONHASHSEED), so every rank
    puts the same feature in another bucket (Wide & Deep's hashed crosses)."""
    if "PYTHONHASHSEED" in script.source:
        return  # the launch fixes the salt (`PYTHONHASHSEED=0 torchrun ...`)
    for node in script.nodes:
        if not (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Mod)
            and isinstance(node.left, ast.Call)
            and called_name(node.left) == "hash"
            and len(node.left.args) == 1
            and is_text(node.left.args[0])
        ):
            continue
        if on_rank_zero_only(node, script):
            continue
        yield script.finding(
            CAUSE,
            node,
            "hash() of a string made an index: Python salts string hashes per process "
            "(PYTHONHASHSEED), so each rank maps the same value to another bucket and trains "
            "another feature-to-row mapping; use a stable hash (zlib.crc32(s.encode()), "
            "hashlib, sklearn's FeatureHasher / mmh3)",
        )


def is_text(expr: ast.expr) -> bool:
    """An f-string, a string literal, `str(...)`, or a sum with one of them."""
    if isinstance(expr, ast.JoinedStr):
        return True
    if isinstance(expr, ast.Constant):
        return isinstance(expr.value, str)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        return is_text(expr.left) or is_text(expr.right)
    return isinstance(expr, ast.Call) and called_name(expr) == "str"


# Passes over the file's assignments: one in source order follows a chain written
# top-down; a few more catch one written out of order, and a hostile chain of ten
# thousand names costs a few linear passes, not one per name.
SET_ORDER_PASSES = 3
# A list joined with a set's order, or sets combined: the result keeps a set's order.
SET_JOINS = (ast.Add, ast.BitOr, ast.BitAnd, ast.Sub, ast.BitXor)


# A dict's views walk it in the order it was filled.
DICT_VIEWS = frozenset({"items", "keys", "values"})


def last_assignment(script: Script, node: ast.AST, name: str) -> ast.expr | None:
    """The value `name` was last given before `node` in the function holding it
    (a parameter: unknown, so the name itself); None when the function never binds it."""
    scope = enclosing_scope(node, script) or script.tree
    if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
        parameters = scope.args.posonlyargs + scope.args.args + scope.args.kwonlyargs
        if any(argument.arg == name for argument in parameters):
            return ast.Name(id=name)
    values = [
        (assign.lineno, value)
        for assign in script.scope_nodes(scope)
        if isinstance(assign, ast.Assign) and assign.lineno <= node.lineno
        for target, value in name_value_pairs(assign)
        if target.id == name
    ]
    return max(values, key=lambda pair: pair[0])[1] if values else None


def names_in_set_order(script: Script) -> set[str]:
    """Names assigned a set's order (`chars = set()`, `itos = [PAD] + list(chars)`,
    `src, tgt = set(), set()`, `self.itos = ...`), followed through the file's
    assignments."""
    assignments = sorted(
        script.of_type(ast.Assign),
        key=lambda node: (node.lineno, node.col_offset),
    )
    found: set[str] = set()
    for _ in range(SET_ORDER_PASSES):
        before = len(found)
        for node in assignments:
            found |= {
                name.id for name, value in name_value_pairs(node) if is_set_order(value, found)
            }
            found |= {  # `self.itos = SPECIALS + list(kept)`: a field of the object
                source_text(target)
                for target in node.targets
                if self_attribute(target) is not None and is_set_order(node.value, found)
            }
        if len(found) == before:
            break
    return found


def is_set_order(expr: ast.expr, made_of_set: set[str] = frozenset()) -> bool:
    """`set(x)`, `{...}` of a comprehension, `list(set(x))` / `tuple(set(x))`, a name
    among `made_of_set`, a list joined with one (`[PAD, SOS] + list(chars)`), or sets
    combined (`set(train_chars) | set(test_chars)`)."""
    if isinstance(expr, ast.SetComp):
        return True
    if isinstance(expr, ast.ListComp | ast.GeneratorExp | ast.DictComp):
        # `[t for t in tags if t != "O"]`: a comprehension keeps the order it walks
        return is_set_order(expr.generators[0].iter, made_of_set)
    if (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Attribute)
        and expr.func.attr in DICT_VIEWS
        and not expr.args
    ):
        return is_set_order(expr.func.value, made_of_set)  # `heads.items()` of a dict so made
    if isinstance(expr, ast.Name):
        return expr.id in made_of_set
    if isinstance(expr, ast.Attribute):
        return self_attribute(expr) is not None and source_text(expr) in made_of_set
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, SET_JOINS):
        return is_set_order(expr.left, made_of_set) or is_set_order(expr.right, made_of_set)
    if not (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name)):
        return False
    if expr.func.id == "set":
        return True
    return (
        expr.func.id in ("list", "tuple")
        and len(expr.args) == 1
        and is_set_order(expr.args[0], made_of_set)
    )
