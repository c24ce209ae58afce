"""A model whose layers only some ranks add before DDP wraps it (model-differs-across-ranks).

DistributedDataParallel checks at construction that every rank holds the
same parameters (count, shapes, order) and broadcasts rank 0's values; a
layer added, a module registered or an embedding table resized on rank 0
only makes that check fail ("DDP expects same model across all ranks, but
Rank 0 has 3 params, while rank 1 has inconsistent 2 params"), or, when the
counts happen to agree, broadcasts into the wrong shapes.

Reported: under an `if` on the rank (rank 0 only, or every rank but 0),
before `DDP(model)` on the same trace, `model.x = <a call>` or one of the
calls that change a module's parameters. Values the script computes the
same way on every rank are not judged (they need no `if`).

The same mismatch without an `if`: the model's sizes measured from data each
rank reads for itself (`Tagger(len(words), ...)` with the words collected
from `files[rank::world]`), followed back as data.py follows a dataset to a
rank-sharded origin. And a hyper-parameter search every rank runs for itself
(`optuna.create_study()` on every rank, the objective training under DDP):
each rank draws its own width, depth or learning rate.

And a model whose modules are registered walking a set of strings (or a list,
a dict made from one): Python salts string hashes per process, so every rank
registers the same modules in another order (and, where each has its own
size, other shapes at each place).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from assistant.lint.checks.rank_dependent import OWN_RANK_NAME, depends_on_rank, flow_walk
from assistant.lint.checks.splits import (
    draws_seed,
    is_set_order,
    names_in_set_order,
    on_rank_zero_only,
    seeds,
)
from assistant.lint.checks.unused import built_classes, model_classes, wrapped_by
from assistant.lint.model import (
    Script,
    bound_arguments,
    called_name,
    is_int,
    names_in,
    parameter_defaults,
    short,
    sole_name_target,
    source_text,
    walk,
)
from assistant.lint.ranks import (
    NO_RANKS,
    OTHER_RANKS,
    RANK_ZERO,
    RankPath,
    assignments_seen_from,
    enclosing_scope,
)
from assistant.lint.registry import check
from assistant.lint.torchapi import is_ddp, is_distributed
from assistant.lint.tracer import TracedCall, once_per_call
from assistant.lint.values import option_default
from assistant.results import Finding

# Methods that add, drop or reshape a module's parameters.
RESHAPING_METHODS = frozenset(
    {
        "add_module",
        "register_module",
        "register_parameter",
        "resize_token_embeddings",
        "add_adapter",
        "prune_heads",
        "tie_weights",
    }
)


@check("model-differs-across-ranks")
def check_layers_added_on_some_ranks(script: Script) -> Iterator[Finding]:
    """`if rank == 0: model.head = nn.Linear(...)` before `DDP(model)`."""
    if not any(is_ddp(name) for _node, name in script.call_names):
        return
    assigned_attribute = attribute_assignments(script)
    changes = (
        change
        for trace in script.traces
        for change in changes_before_wrapping(trace, assigned_attribute)
    )
    for call, model in once_per_call(changes, lambda change: change[0]):
        yield script.finding(
            "model-differs-across-ranks",
            call.node,
            f"{model} changes its layers on {who(call.rank_path)} only, before DDP wraps it: "
            "the ranks build different models and DDP's check that every rank holds the same "
            "parameters fails; make the change on every rank",
        )


def changes_before_wrapping(
    trace: list[TracedCall], assigned_attribute: dict[int, str]
) -> Iterator[tuple[TracedCall, str]]:
    """(call, model name) for layer changes on some ranks, followed by DDP(model) in the trace."""
    pending: list[tuple[TracedCall, str]] = []
    for call in trace:
        wrapped = wrapped_name(call)
        if wrapped is not None:
            yield from (change for change in pending if change[1] == wrapped)
            pending = [change for change in pending if change[1] != wrapped]
            continue
        if not some_ranks_only(call.rank_path):
            continue
        model = reshaped_model(call, assigned_attribute)
        if model is not None:
            pending.append((call, model))


def reshaped_model(call: TracedCall, assigned_attribute: dict[int, str]) -> str | None:
    """The model name a call changes: `model.add_module(...)`, `model.head = Layer(...)`."""
    func = call.node.func
    if (
        isinstance(func, ast.Attribute)
        and func.attr in RESHAPING_METHODS
        and isinstance(func.value, ast.Name)
    ):
        return func.value.id
    return assigned_attribute.get(id(call.node))


def attribute_assignments(script: Script) -> dict[int, str]:
    """Call id -> model name, for every `model.x = Layer(...)` of the file.

    A layer is what a class builds (`nn.Linear(...)`, `Head(...)`: a
    capitalised name) or anything from torch.nn; `model.tag = str(rank)` is not.
    """
    found: dict[int, str] = {}
    for node in script.nodes:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        if not builds_a_layer(script, node.value):
            continue
        for target in node.targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id != "self"
            ):
                found[id(node.value)] = target.value.id
    return found


def builds_a_layer(script: Script, call: ast.Call) -> bool:
    name = script.name_of(call.func)
    return name.startswith("torch.nn.") or short(name)[:1].isupper()


def wrapped_name(call: TracedCall) -> str | None:
    """`model` for `DDP(model)`, `DDP(model.to(device))`, `DDP(model.cuda(), ...)`."""
    if not is_ddp(call.name) or not call.node.args:
        return None
    argument = call.node.args[0]
    while isinstance(argument, ast.Call) and isinstance(argument.func, ast.Attribute):
        argument = argument.func.value  # model.to(device).float()
    return argument.id if isinstance(argument, ast.Name) else None


def some_ranks_only(path: RankPath) -> bool:
    """Under a rank `if` that some ranks of a distributed run take and others do not."""
    sides = {branch.side for branch in path}
    return bool(sides & {RANK_ZERO, OTHER_RANKS}) and NO_RANKS not in sides


def who(path: RankPath) -> str:
    sides = {branch.side for branch in path}
    return "rank 0" if RANK_ZERO in sides else "every rank but 0"


# Tokenizer methods that grow the vocabulary; a model resized to `len(tokenizer)` follows it.
VOCABULARY_METHODS = frozenset({"add_tokens", "add_special_tokens"})


@check("model-differs-across-ranks")
def check_vocabulary_grown_on_some_ranks(script: Script) -> Iterator[Finding]:
    """`if rank == 0: tok.add_special_tokens(...)`: the other ranks keep the old vocabulary.

    They tokenise the same text into other ids, and an embedding table
    resized to `len(tok)` afterwards has another size on rank 0, which DDP's
    construction-time check rejects. Reported in any distributed script: the
    tokenisation differs even where no resize follows.
    """
    if not is_distributed(script):
        return
    grown = (
        call
        for trace in script.traces
        for call in trace
        if some_ranks_only(call.rank_path) and grows_vocabulary(call.node)
    )
    for call in once_per_call(grown, lambda call: call):
        tokenizer = source_text(call.node.func.value)  # type: ignore[attr-defined]
        yield script.finding(
            "model-differs-across-ranks",
            call.node,
            f"{tokenizer} gets new tokens on {who(call.rank_path)} only: the other ranks keep "
            "the old vocabulary, tokenise the same text into other ids, and a model resized "
            "to len(tokenizer) has another embedding size there, which DDP's check that every "
            "rank holds the same parameters rejects; add the tokens on every rank (save them "
            "on rank 0 only)",
        )


def grows_vocabulary(call: ast.Call) -> bool:
    return isinstance(call.func, ast.Attribute) and call.func.attr in VOCABULARY_METHODS


# --- hyperparameters each rank draws for itself ---------------------------------------

# What an Optuna trial draws: suggest_int, suggest_float, suggest_categorical, ...
SUGGEST_PREFIX = "suggest_"


@check("model-differs-across-ranks")
def check_hyperparameters_each_rank_draws(script: Script) -> Iterator[Finding]:
    """`study = optuna.create_study(); study.optimize(objective)` run by every rank,
    where the objective's `trial.suggest_*()` draws go into training under DDP:
    each rank runs a study of its own and draws its own width, depth or learning
    rate, so the ranks build different models (DDP's check that they hold the
    same parameters fails) or train them differently. Quiet where the draws are
    shared (Optuna's TorchDistributedTrial) or every rank's sampler is seeded alike."""
    if not is_distributed(script) or "TorchDistributedTrial" in script.called_short_names:
        return
    from assistant.lint.checks.collective_reach import CallGraph  # a check module's helper

    training = CallGraph(script).reaching("DistributedDataParallel")
    drawing = {
        owner.name
        for node, name in script.call_names
        if short(name).startswith(SUGGEST_PREFIX)
        and isinstance(owner := enclosing_scope(node, script), ast.FunctionDef)
    }
    if not drawing & training:
        return
    studies = (
        call
        for trace in script.traces
        for call in trace
        if call.name == "optuna.create_study"
        and not {b.side for b in call.rank_path} & {RANK_ZERO, OTHER_RANKS, NO_RANKS}
        and not seeded_sampler(script, call.node)
    )
    for call in once_per_call(studies, lambda call: call):
        yield script.finding(
            "model-differs-across-ranks",
            call.node,
            "every rank creates this Optuna study and runs its trials, whose trial.suggest_*() "
            "draws go into training under DDP: each rank draws its own hyperparameters, so the "
            "ranks build different models (DDP's check that they hold the same parameters "
            "fails) or train them differently; let rank 0 draw and share each trial's values "
            "(optuna.integration.TorchDistributedTrial(trial) on every rank), or seed every "
            "rank's sampler alike",
        )


# Draws from Python's or numpy's global generator: what a random search samples with.
CONFIGURATION_DRAWS = frozenset(
    {
        "random.choice",
        "random.choices",
        "random.uniform",
        "random.randint",
        "random.randrange",
        "random.random",
        "numpy.random.choice",
        "numpy.random.uniform",
        "numpy.random.randint",
    }
)
SHARING_COLLECTIVES = frozenset({"broadcast_object_list", "broadcast", "all_gather_object"})


@check("model-differs-across-ranks")
def check_configuration_drawn_per_rank(script: Script) -> Iterator[Finding]:
    """`cfg = sample_config(space)` (a function of the file that draws with
    random.choice / np.random.uniform), run by every rank and handed to a function
    that builds the DDP model (`run_trial(cfg, ...)`), while the process is seeded
    with its rank (augmentation streams of their own) or not at all: each rank
    draws its own depth, width or learning rate. Quiet where rank 0 draws and
    shares the result (broadcast_object_list), or the seed in force is common."""
    if not is_distributed(script):
        return
    drawing: dict[str, tuple[ast.Call, str]] = {}
    for node, name in script.call_names:
        owner = enclosing_scope(node, script)
        if (
            name in CONFIGURATION_DRAWS
            and isinstance(owner, ast.FunctionDef)
            and script.functions.get(owner.name) is owner
        ):
            drawing.setdefault(owner.name, (node, name))
    if not drawing:
        return
    from assistant.lint.checks.collective_reach import CallGraph  # a check module's helper

    training = CallGraph(script).reaching("DistributedDataParallel")
    common, per_rank = seeds(script)
    for call, called in script.call_names:
        if called not in drawing or not isinstance(call.func, ast.Name):
            continue
        draw, draw_name = drawing[called]
        drawn = drawn_configuration(script, call, training)
        if drawn is None or on_rank_zero_only(call, script):
            continue
        seed = draws_seed(script, call, draw_name, common, per_rank)
        if seed is False:
            continue
        why = (
            "no seed is set, so each process draws from its own random state"
            if seed is None
            else f"the process is seeded with its rank (line {seed.lineno})"
        )
        yield script.finding(
            "model-differs-across-ranks",
            call,
            f"{called}() draws the configuration with {draw_name}() (line "
            f"{draw.lineno}) in every process, and {why}: each rank gets its own "
            f"{drawn[0]}, handed to {drawn[1]}() (line {drawn[2]}), which builds the model "
            "DDP wraps: the ranks build different models (DDP's check that every rank holds "
            "the same parameters fails) or train them differently; draw on rank 0 and share "
            "it (dist.broadcast_object_list), or seed the draws alike on every rank",
        )


def drawn_configuration(
    script: Script, call: ast.Call, training: set[str]
) -> tuple[str, str, int] | None:
    """(the name the draw's result is assigned to, the function of the file that
    builds the DDP model it is handed to, that call's line), unless the scope shares
    the name between the ranks first."""
    name = sole_name_target(script.parents.get(id(call)))
    if name is None:
        return None
    scope = enclosing_scope(call, script) or script.tree
    held = {name}  # the name, and what holds it (`box = [cfg]` for a broadcast)
    handed = None
    later = sorted(
        (n for n in script.scope_nodes(scope) if getattr(n, "lineno", 0) > call.lineno),
        key=lambda n: (n.lineno, n.col_offset),
    )
    for node in later:
        if isinstance(node, ast.Assign) and names_in(node.value) & held:
            held |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        if not isinstance(node, ast.Call):
            continue
        arguments = [*node.args, *(k.value for k in node.keywords)]
        if not any(names_in(argument) & held for argument in arguments):
            continue
        if short(script.name_of(node.func)) in SHARING_COLLECTIVES:
            return None
        if handed is None and isinstance(node.func, ast.Name) and node.func.id in training:
            handed = (name, node.func.id, node.lineno)
    return handed


def seeded_sampler(script: Script, study: ast.Call) -> bool:
    """`create_study(sampler=TPESampler(seed=0))`: every rank draws the same values."""
    sampler = next((k.value for k in study.keywords if k.arg == "sampler"), None)
    if isinstance(sampler, ast.Name):
        sampler = next(iter(script.assigned_values.get(sampler.id, [])), None)
    return isinstance(sampler, ast.Call) and any(k.arg == "seed" for k in sampler.keywords)


# --- parameters sized by the rank itself ------------------------------------------------


@check("model-differs-across-ranks")
def check_parameters_sized_by_the_rank(script: Script) -> Iterator[Finding]:
    """`self.kernel = nn.Parameter(torch.normal(0, 0.01, (self.num_local, d)))` with
    `num_local = base + (1 if rank < extra else 0)`: a classifier sharded over the
    ranks (partial FC, a class-parallel margin head) built inside the module DDP
    wraps. Its parameters differ in shape between ranks, and DDP's check that every
    rank holds the same parameters fails; sharded heads live outside DDP, their
    gradients exchanged by hand."""
    classes = {cls.name: cls for cls in model_classes(script)}
    inits = []
    for ddp in (node for node, name in script.call_names if is_ddp(name)):
        for wrapped in sorted(wrapped_by(script, ddp, set(classes))[1]):
            inits += [
                init
                for cls in built_classes(classes, wrapped)
                for init in cls.body
                if isinstance(init, ast.FunctionDef)
                and init.name == "__init__"
                and not rank_named_size(init)
                and not rank_given_as_a_size(script, cls.name, init)
            ]
    if not inits:
        return
    reported: set[int] = set()
    for flow, node in flow_walk(script, list({id(i): i for i in inits}.values())):
        if not (isinstance(node, ast.Call) and builds_a_parameter(script, node)):
            continue
        sized = next((a for a in node.args if depends_on_rank(flow, a)), None)
        if sized is None or node.lineno in reported:
            continue
        # the name that carries the rank (`self.num_local`), not the whole argument
        sized = next(
            (
                n
                for n in walk(sized)
                if isinstance(n, ast.Name | ast.Attribute) and depends_on_rank(flow, n)
            ),
            sized,
        )
        reported.add(node.lineno)
        yield script.finding(
            "model-differs-across-ranks",
            node,
            f"{short(script.name_of(node.func))}(...) is sized by the rank "
            f"({source_text(sized)}) in a module that DDP wraps: each rank holds a "
            "parameter of another shape, and DDP's check that every rank holds the same "
            'parameters fails ("DDP expects same model across all ranks"); keep a head '
            "sharded over the ranks outside DDP and exchange its gradients yourself "
            "(partial FC), or size it the same on every rank",
        )


def rank_named_size(init: ast.FunctionDef) -> bool:
    """A parameter named like a rank whose default is a size (`def __init__(self, d,
    rank=64)`: a low-rank factorisation's inner dimension, not a process's rank)."""
    arguments = init.args.args + init.args.kwonlyargs
    defaults = [None] * (len(init.args.args) - len(init.args.defaults)) + list(init.args.defaults)
    defaults += list(init.args.kw_defaults)
    return any(
        OWN_RANK_NAME.match(argument.arg)
        and isinstance(default, ast.Constant)
        and type(default.value) is int
        and default.value >= 2
        for argument, default in zip(arguments, defaults, strict=True)
    )


def rank_given_as_a_size(script: Script, class_name: str, init: ast.FunctionDef) -> bool:
    """Every construction of the class gives its rank-named parameter a size: an int
    of 2 or more, or a configured value whose default is one (`ComplEx(n_ent, n_rel,
    cfg.rank)` with `rank: int = 1000` in the config: a factorisation's rank)."""
    ranked = {a.arg for a in init.args.args[1:] if OWN_RANK_NAME.match(a.arg)}
    builds = [node for node, _name in script.call_names if called_name(node) == class_name]
    given = [
        argument
        for node in builds
        for parameter, argument in bound_arguments(init, node, self_bound=True)
        if parameter in ranked
    ]
    return bool(ranked and given) and all(is_a_size(script, argument) for argument in given)


def is_a_size(script: Script, value: ast.expr) -> bool:
    if is_int(value):
        return value.value >= 2  # type: ignore[attr-defined]
    default = parameter_default(script, value)
    if default is not None:  # `CrossLayer(d, low_rank)` in `def __init__(..., low_rank=64)`
        return is_int(default) and default.value >= 2  # type: ignore[attr-defined]
    known, default = option_default(script, value)
    if known:
        return type(default) is int and default >= 2
    if not isinstance(value, ast.Attribute):
        return False
    fields = [  # `rank: int = 1000` of a dataclass the file defines
        node.value
        for node in script.of_type(ast.AnnAssign)
        if isinstance(node.target, ast.Name)
        and node.target.id == value.attr
        and node.value is not None
    ]
    return bool(fields) and all(is_int(f) and f.value >= 2 for f in fields)  # type: ignore[attr-defined]


def parameter_default(script: Script, value: ast.expr) -> ast.expr | None:
    """The default of the parameter `value` names, in the function it is read in."""
    if not isinstance(value, ast.Name):
        return None
    function = enclosing_scope(value, script)
    if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    return parameter_defaults(function).get(value.id)


def builds_a_parameter(script: Script, call: ast.Call) -> bool:
    """`nn.Parameter(...)`, or a layer of torch.nn (`nn.Linear(d, num_local)`)."""
    name = script.name_of(call.func)
    return name.startswith("torch.nn.") and short(name) not in LAYER_CONTAINERS


# torch.nn calls whose arguments are modules or options, never a size.
LAYER_CONTAINERS = frozenset(
    {"Sequential", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict", "Dropout"}
)


# --- sizes read from each rank's own shard -------------------------------------------

SIZE_OF = frozenset({"len", "max", "nunique", "size", "numel"})


@check("model-differs-across-ranks")
def check_model_sized_by_the_ranks_own_data(script: Script) -> Iterator[Finding]:
    """`TwoTower(len(user_vocab), ...)` where the vocabulary is built from this
    rank's files (`files[rank::world]`): each rank sizes its embedding tables
    from different data, and DDP's check that the ranks hold the same
    parameters fails ("DDP expects same model across all ranks")."""
    from assistant.lint.checks.data import DataFlow  # data imports the tracer's users

    wrapped = {name for trace in script.traces for c in trace if (name := wrapped_name(c))}
    if not wrapped:
        return
    data = DataFlow(script)
    for name in wrapped:
        for built in map(unmoved, script.assigned_values.get(name, [])):
            if not (isinstance(built, ast.Call) and builds_a_layer(script, built)):
                continue
            # names read where the model is built: main's `rels` (read from a file) is
            # not an evaluation helper's `rels` (gathered from the ranks' shares)
            assigned = assignments_seen_from(script, built)
            measured = size_arguments(built, assigned)
            sized = next(
                (
                    e
                    for e in measured
                    if any(data.sharded_by_rank(v) for v in assigned.get(getattr(e, "id", ""), [e]))
                ),
                None,
            )
            if sized is None:
                continue
            yield script.finding(
                "model-differs-across-ranks",
                built,
                f"{name}'s size comes from {source_text(sized)}, which is read from this "
                "rank's own share of the data: each rank builds layers of another size and "
                "DDP's check that every rank holds the same parameters fails; build the "
                "vocabulary or class count from the whole dataset (or on rank 0 and "
                "broadcast it) before building the model",
            )
            break


def unmoved(expr: ast.expr) -> ast.expr:
    """`Net(...).to(device).float()` -> `Net(...)`."""
    while (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Attribute)
        and isinstance(expr.func.value, ast.Call)
    ):
        expr = expr.func.value
    return expr


# How many assignments back a size argument's name is followed
# (`cards = [df[c].max() + 1 for c in cols]`, then `Model(cards, ...)`).
SIZE_DEPTH = 2


def size_arguments(
    call: ast.Call, assigned: dict[str, list[ast.expr]] | None = None
) -> Iterator[ast.expr]:
    """What `len(x)`, `max(x)`, `x.nunique()`, `x.size(...)` measure among a call's
    arguments, and among the values a name argument was assigned (SIZE_DEPTH back)."""
    arguments = [*call.args, *(k.value for k in call.keywords)]
    seen: set[str] = set()
    for _ in range(SIZE_DEPTH + 1):
        names = []
        for argument in arguments:
            for node in walk(argument):
                if isinstance(node, ast.Name) and node.id not in seen:
                    names.append(node.id)
                    seen.add(node.id)
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                if isinstance(func, ast.Name) and func.id in SIZE_OF and node.args:
                    yield node.args[0]
                elif isinstance(func, ast.Attribute) and func.attr in SIZE_OF:
                    yield func.value
        if assigned is None:
            return
        arguments = [value for name in names for value in assigned.get(name, [])]


# Containers that register the modules (or parameters) they are built from, in order.
MODULE_CONTAINERS = frozenset(
    {"ModuleDict", "ModuleList", "ParameterDict", "ParameterList", "Sequential"}
)
# What registers a module into a container or the model inside a loop.
REGISTERING_METHODS = frozenset({"append", "add_module", "register_module", "update"})


@check("model-differs-across-ranks")
def check_modules_registered_in_a_sets_order(script: Script) -> Iterator[Finding]:
    """`nn.ModuleDict({k: nn.Linear(shapes[k], 32) for k in keys})` where `keys` is a
    set of strings (`{k for k in obs if ...}`), or a model class built with such a set
    (or a list or dict made from one) that registers a module per item: each process
    walks the set in its own order, so the ranks' parameters differ place by place."""
    if "PYTHONHASHSEED" in script.source:
        return  # the launch fixes the salt
    if not any(is_ddp(name) for _node, name in script.call_names):
        return
    made_of_set = names_in_set_order(script)
    reported: set[int] = set()
    for scope in script.all_scopes:
        # empty, a scope may still walk a set it makes in place (`for k in set(targets)`)
        walked = set_ordered_names_of(script, scope, made_of_set)
        for node in script.scope_nodes(scope):
            registration = registration_in_set_order(node, walked)
            if registration is None or registration.lineno in reported:
                continue
            reported.add(registration.lineno)
            yield script.finding(
                "model-differs-across-ranks",
                registration,
                "the model's modules are registered walking a set (or a list or dict made "
                "from one), whose order for strings differs between processes (Python salts "
                "their hashes): each rank holds the same modules in another order, so DDP "
                'finds other shapes at a place ("DDP expects same model across all ranks") '
                "or broadcasts one module's weights into another; walk sorted(...) instead",
            )


def set_ordered_names_of(script: Script, scope: ast.AST, made_of_set: set[str]) -> set[str]:
    """The names a scope walks in a set's order: for a model's __init__, its
    parameters that a construction of the class fills with a set-ordered value; for
    any other scope, the file's names made from a set."""
    if not (isinstance(scope, ast.FunctionDef) and scope.name == "__init__"):
        return made_of_set
    owner = next(
        (name for name, cls in script.classes.items() if any(s is scope for s in cls.body)),
        None,
    )
    if owner is None:
        return set()
    function = script.functions.get(f"{owner}.__init__")
    if function is None:
        return set()
    walked = {
        parameter
        for node in script.of_type(ast.Call)
        if isinstance(node.func, ast.Name) and node.func.id == owner
        for parameter, argument in bound_arguments(function, node, self_bound=True)
        if parameter and is_set_order(argument, made_of_set)
    }
    if walked:  # and the names __init__ makes from them (`layers = {k: ... for k in keys}`)
        for node in script.scope_nodes(scope):
            if isinstance(node, ast.Assign) and is_set_order(node.value, walked):
                walked |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return walked


def registration_in_set_order(node: ast.AST, walked: set[str]) -> ast.AST | None:
    """`nn.ModuleDict({k: ... for k in keys})` / `nn.ModuleList([... for c in cards])`
    built from a comprehension over a set-ordered name, or a loop over one that
    registers a module each pass (`self.heads[name] = nn.Linear(...)`, `.append`)."""
    if isinstance(node, ast.Call) and called_name(node) in MODULE_CONTAINERS and node.args:
        built = node.args[0]
        comprehensions = ast.ListComp | ast.DictComp | ast.GeneratorExp
        if isinstance(built, comprehensions):
            built = built.generators[0].iter
        return node if is_set_order(built, walked) else None
    if isinstance(node, ast.For) and walks_in_set_order(node.iter, walked):
        for inner in (n for statement in node.body for n in walk(statement)):
            if registers_a_module(inner):
                return inner
    return None


def walks_in_set_order(iterable: ast.expr, walked: set[str]) -> bool:
    """`keys`, `heads.items()`, `enumerate(keys)` of a set-ordered name."""
    if isinstance(iterable, ast.Call) and called_name(iterable) == "enumerate" and iterable.args:
        iterable = iterable.args[0]
    return is_set_order(iterable, walked)  # a dict's views too (splits.DICT_VIEWS)


def registers_a_module(node: ast.AST) -> bool:
    """`self.heads[k] = <call>`, `self.heads.append(<call>)`, `self.add_module(k, <call>)`."""
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
        return any(
            isinstance(target, ast.Subscript) and source_text(target.value).startswith("self.")
            for target in node.targets
        )
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in REGISTERING_METHODS
        and source_text(node.func.value).startswith("self")
        and any(isinstance(a, ast.Call) for a in node.args)
    )
