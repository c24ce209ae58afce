"""The model's state_dict read under DeepSpeed ZeRO stage 3 (zero3-partitioned-parameters).

ZeRO-3 partitions every parameter across the ranks and gathers a layer only
while the engine runs it. Outside that, `engine.module.state_dict()` holds a
placeholder of torch.Size([0]) per parameter, on every rank: the weights
saved from it load as "size mismatch ... torch.Size([0])", and a file of a
few megabytes. A Hugging Face model's `save_pretrained(dir)` reads the same
state_dict, unless one gathered elsewhere is handed in (`state_dict=`). What DeepSpeed documents instead: `engine.save_16bit_model()`
on every rank (with `stage3_gather_16bit_weights_on_model_save`),
`deepspeed.zero.GatheredParameters` around the read, or `zero_to_fp32` on a
checkpoint saved by `engine.save_checkpoint()` on every rank.

Read only where the file itself says stage 3 (a DeepSpeed config dict with
`"zero_optimization": {"stage": 3}`, or `zero_stage=3`), and only of the
engine `deepspeed.initialize` returned; quiet inside a `with
...GatheredParameters(...)` block.

The same sharding makes every forward a collective: ZeRO-3 and FSDP (FSDP1's
wrapper, FSDP2's `fully_shard`) all-gather each layer's parameters from every
rank as it runs. A forward or `generate()` on rank 0 only (printing samples,
a quick evaluation) waits for ranks that never enter it, and hangs.

The placeholders are what a loop over the engine's parameters reads too:
`for name, p in engine.module.named_parameters(): client.update_named_param(name,
p.data)`, an RL trainer pushing its weights to a generation server, sends
torch.Size([0]) tensors unless the loop runs inside GatheredParameters.

FSDP's wrapper shards the gradients the same way: torch.nn.utils.clip_grad_norm_
over its parameters measures each rank's own shard (FSDP's own clip_grad_norm_
all-reduces the norms).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator

from assistant.lint.checks.collective_reach import lonely_calls
from assistant.lint.checks.gather_sizes import caller_arguments
from assistant.lint.model import (
    Script,
    called_name,
    keyword,
    names_bound_to,
    self_attribute,
    short,
    source_text,
    walk,
)
from assistant.lint.ranks import assignments_seen_from, enclosing_scope
from assistant.lint.registry import check
from assistant.lint.tracer import TracedCall
from assistant.results import Finding

STAGE_KEYS = frozenset({"stage", "zero_stage"})
GATHERING_CONTEXTS = frozenset({"GatheredParameters"})
FSDP_WRAPPERS = frozenset({"FullyShardedDataParallel", "FSDP"})
FSDP2_SHARD = "fully_shard"
# What runs the model's forward: calling it, or these methods.
FORWARD_METHODS = frozenset({"forward", "generate"})


@check("zero3-partitioned-parameters")
def check_state_dict_under_zero3(script: Script) -> Iterator[Finding]:
    """`engine.module.state_dict()` (or the engine's own, or `engine.module.save_pretrained()`)
    in a ZeRO-3 script, outside a gather."""
    stage = zero3_stage(script)
    if stage is None:
        return
    engines = engine_names(script)
    if not engines:
        return
    gathered = gathered_nodes(script)
    for node, _name in script.call_names:
        if not reads_own_state_dict(node):
            continue
        if engine_of(node.func.value, script) not in engines or id(node) in gathered:
            continue
        yield script.finding(
            "zero3-partitioned-parameters",
            node,
            f"{source_text(node)} under ZeRO stage 3 (line {stage.lineno}): each rank holds "
            "only a shard of every parameter, so the state_dict it reads has torch.Size([0]) "
            "placeholders; save with engine.save_16bit_model() on every rank "
            "(stage3_gather_16bit_weights_on_model_save), read inside "
            "deepspeed.zero.GatheredParameters, or convert a save_checkpoint with zero_to_fp32",
        )


def reads_own_state_dict(call: ast.Call) -> bool:
    """`x.state_dict()`, or a Hugging Face model's `x.save_pretrained(dir)`, which reads
    its own state_dict unless one is handed in (`state_dict=` gathered elsewhere)."""
    if not isinstance(call.func, ast.Attribute):
        return False
    if call.func.attr == "state_dict":
        return True
    return call.func.attr == "save_pretrained" and keyword(call, "state_dict") is None


PARAMETER_ITERATORS = frozenset({"named_parameters", "parameters"})
# Reading a parameter's values, not its flags: what a weight sync or a copy does.
VALUE_READS = frozenset({"data", "detach", "clone", "cpu", "to", "numpy", "tolist"})


@check("zero3-partitioned-parameters")
def check_parameters_read_under_zero3(script: Script) -> Iterator[Finding]:
    """`for name, p in engine.module.named_parameters(): send(name, p.data)` in a
    ZeRO-3 script, outside a gather: each p is this rank's placeholder."""
    stage = zero3_stage(script)
    engines = engine_names(script) if stage is not None else set()
    if not engines:
        return
    gathered = gathered_nodes(script)
    for loop in (n for n in script.of_type(ast.For) if id(n) not in gathered):
        walked = engine_parameters_walked(script, loop, engines)
        if walked is None:
            continue
        iterated, parameter = walked
        if parameter is None or not reads_values(loop, parameter, gathered):
            continue
        yield script.finding(
            "zero3-partitioned-parameters",
            loop,
            f"{source_text(iterated)} under ZeRO stage 3 (line {stage.lineno}) yields this "
            f"rank's placeholders (torch.Size([0])), and the loop reads {parameter}'s values: "
            "what it copies or sends is empty; run the loop inside "
            "`with deepspeed.zero.GatheredParameters(list(...parameters()), modifier_rank=None):` "
            "on every rank (one parameter or layer at a time for a large model)",
        )


PARAMETER_MAKERS = frozenset({"Parameter"})
# What may be read off a partitioned parameter: its flags and DeepSpeed's own record
# of the full tensor (ds_shape, ds_numel), not its values or shape.
PLACEHOLDER_SAFE = frozenset({"requires_grad", "ds_shape", "ds_numel", "ds_id", "ds_status"})


@check("zero3-partitioned-parameters")
def check_parameter_field_read_under_zero3(script: Script) -> Iterator[Finding]:
    """`engine.module.quantizer.codevectors.view(...)` in a ZeRO-3 script, outside a
    gather and outside the engine's forward: a parameter the file's own class
    declares (`self.codevectors = nn.Parameter(...)`), read straight off the
    engine's module, is this rank's placeholder of torch.Size([0])."""
    stage = zero3_stage(script)
    engines = engine_names(script) if stage is not None else set()
    threshold = persistence_threshold(script)
    fields = declared_parameters(script, threshold) if engines and threshold else set()
    layers = declared_layers(script, threshold) if engines and threshold else set()
    if not (fields or layers):
        return
    gathered = gathered_nodes(script)
    reported: set[int] = set()
    for node in script.of_type(ast.Attribute):
        if not isinstance(node.ctx, ast.Load) or id(node) in gathered:
            continue
        if node.attr in fields:
            owner = node.value
        elif (
            node.attr in LAYER_PARAMETERS
            and isinstance(node.value, ast.Attribute)
            and node.value.attr in layers
        ):
            owner = node.value.value  # engine.module.item_emb.weight
        else:
            continue
        parent = script.parents.get(id(node))
        if isinstance(parent, ast.Attribute) and parent.attr in PLACEHOLDER_SAFE:
            continue
        if engine_of(module_root(owner), script) not in engines or node.lineno in reported:
            continue
        reported.add(node.lineno)
        yield script.finding(
            "zero3-partitioned-parameters",
            node,
            f"{source_text(node)} under ZeRO stage 3 (line {stage.lineno}) is a parameter "
            f"read outside the engine's forward: each rank holds only a shard of it, and "
            "what it reads here is a placeholder of torch.Size([0]) (a view or reshape "
            "fails, statistics are empty); read it inside "
            "`with deepspeed.zero.GatheredParameters(param, modifier_rank=None):` on every rank",
        )


def declared_parameters(script: Script, threshold: int) -> set[str]:
    """Fields the file's classes make parameters (`self.codevectors =
    nn.Parameter(...)`) that ZeRO-3 partitions: not one of a literal size under
    the persistence threshold (a temperature `nn.Parameter(torch.ones([]))` stays
    whole on every rank)."""
    return fields_built(
        script,
        PARAMETER_MAKERS,
        lambda call: (
            bool(call.args) and not under_the_persistence_threshold(call.args[0], threshold)
        ),
    )


# Layers whose weight is a large matrix (an item or vocabulary table, a projection).
LARGE_LAYERS = frozenset({"Embedding", "EmbeddingBag", "Linear", "Bilinear"})
LAYER_PARAMETERS = frozenset({"weight", "bias"})


def declared_layers(script: Script, threshold: int) -> set[str]:
    """Fields the file's classes build as LARGE_LAYERS (`self.item_emb =
    nn.Embedding(n_items, dim)`) whose weight ZeRO-3 partitions: not one of literal
    sizes under the persistence threshold."""
    return fields_built(
        script,
        LARGE_LAYERS,
        lambda call: not sizes_under_the_threshold(call.args[:2], threshold),
    )


def fields_built(
    script: Script, makers: frozenset[str], partitioned: Callable[[ast.Call], bool]
) -> set[str]:
    """`x` of each `self.x = <one of makers>(...)` the file writes whose call
    `partitioned` keeps."""
    return {
        field
        for node in script.of_type(ast.Assign)
        if isinstance(node.value, ast.Call)
        and short(script.name_of(node.value.func)) in makers
        and partitioned(node.value)
        for target in node.targets
        if (field := self_attribute(target)) is not None
    }


PERSISTENCE_THRESHOLD = "stage3_param_persistence_threshold"
DEFAULT_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's default, in elements
# Sizes the file computes (from its data, its options) are read as larger than a
# threshold up to this; a file that keeps more whole is not judged on them.
UNKNOWN_SIZES_ABOVE = 1_000_000
TENSOR_MAKERS = frozenset({"ones", "zeros", "empty", "randn", "rand", "full"})


def persistence_threshold(script: Script) -> int | None:
    """The number of elements under which ZeRO-3 keeps a parameter whole on every
    rank: the config's literal stage3_param_persistence_threshold, DeepSpeed's
    default where the file sets none, None where it sets one the run computes."""
    for node in script.of_type(ast.Dict):
        for key, value in zip(node.keys, node.values, strict=True):
            if is_key(key, PERSISTENCE_THRESHOLD):
                if isinstance(value, ast.Constant) and isinstance(value.value, int | float):
                    return int(value.value)
                return None
    return DEFAULT_PERSISTENCE_THRESHOLD


def sizes_under_the_threshold(sizes: list[ast.expr], threshold: int) -> bool:
    """Sizes whose product ZeRO-3 keeps whole on every rank: literal ones under the
    threshold, or any where the threshold is above what computed sizes are read as."""
    if not all(isinstance(size, ast.Constant) and isinstance(size.value, int) for size in sizes):
        return threshold > UNKNOWN_SIZES_ABOVE
    count = 1
    for size in sizes:
        count *= size.value  # type: ignore[union-attr]
    return count < threshold


def under_the_persistence_threshold(value: ast.expr, threshold: int) -> bool:
    """`torch.tensor(2.0)`, `torch.ones([])`, `torch.zeros(1, 8)`: a literal size
    ZeRO-3 keeps whole on every rank; sizes from names are read as large."""
    value = unmoved_tensor(value)
    if not isinstance(value, ast.Call):
        return False
    name = short(called_name(value))
    if name == "tensor":
        return True  # a literal's values: a scalar or a short list
    if name not in TENSOR_MAKERS:
        return False
    sizes = value.args[:1] if name == "full" else value.args
    if len(sizes) == 1 and isinstance(sizes[0], ast.List | ast.Tuple):
        sizes = sizes[0].elts
    return sizes_under_the_threshold(list(sizes), threshold)  # torch.ones([]): one element


def unmoved_tensor(value: ast.expr) -> ast.expr:
    """`torch.ones(8).uniform_()` -> `torch.ones(8)`: what an in-place fill was called on."""
    while (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr.endswith("_")
    ):
        value = value.func.value
    return value


def module_root(chain: ast.expr) -> ast.expr:
    """`engine.module` of `engine.module.quantizer` (or the chain's first name)."""
    while isinstance(chain, ast.Attribute) and chain.attr != "module":
        chain = chain.value
    return chain


def engine_parameters_walked(
    script: Script, loop: ast.For, engines: set[str]
) -> tuple[ast.Call, str | None] | None:
    """(the engine's parameters() call, the name the loop binds to each parameter) for
    `for n, p in engine.module.named_parameters()`, or for one side of a zip
    (`for p_ema, p in zip(ema.parameters(), model.parameters())`, an EMA update),
    the module also through a parameter of the loop's function that the file's
    callers give the engine (`ema_update(ema, engine.module, decay)`)."""
    sources = [loop.iter]
    targets: list[ast.expr] = [loop.target]
    if isinstance(loop.iter, ast.Call) and called_name(loop.iter) == "zip":
        sources = list(loop.iter.args)
        targets = list(loop.target.elts) if isinstance(loop.target, ast.Tuple) else []
    for position, source in enumerate(sources):
        if not (
            isinstance(source, ast.Call)
            and isinstance(source.func, ast.Attribute)
            and source.func.attr in PARAMETER_ITERATORS
            and holds_the_engine(script, loop, source.func.value, engines)
        ):
            continue
        if len(sources) == 1:
            return source, loop_parameter(loop)
        target = targets[position] if position < len(targets) else None
        return source, target.id if isinstance(target, ast.Name) else None
    return None


def holds_the_engine(script: Script, where: ast.AST, module: ast.expr, engines: set[str]) -> bool:
    """`engine.module`, `engine` or a name assigned one of them; or a parameter of the
    function `where` lies in that every call of it in the file is given the engine."""
    if engine_of(module) in engines:
        return True
    function = enclosing_scope(where, script)
    if not (isinstance(module, ast.Name) and isinstance(function, ast.FunctionDef)):
        return False
    given = [argument for _, _, argument in caller_arguments(script, function, {module.id})]
    return bool(given) and all(engine_of(argument, script) in engines for argument in given)


def engine_of(receiver: ast.expr, script: Script | None = None) -> str:
    """`engine.module` and `engine` both name the engine; so does a name its function
    assigns one of them alone (`model = engine.module`)."""
    if script is not None and isinstance(receiver, ast.Name):
        values = assignments_seen_from(script, receiver).get(receiver.id, [])
        if len(values) == 1 and isinstance(values[0], ast.Name | ast.Attribute):
            receiver = values[0]
    if isinstance(receiver, ast.Attribute) and receiver.attr == "module":
        receiver = receiver.value
    return source_text(receiver)


def loop_parameter(loop: ast.For) -> str | None:
    """`for name, p in ...named_parameters()` -> "p"; `for p in ...parameters()` -> "p"."""
    target = loop.target
    if isinstance(target, ast.Tuple) and len(target.elts) == 2:
        target = target.elts[1]
    return target.id if isinstance(target, ast.Name) else None


def reads_values(loop: ast.For, parameter: str, gathered: set[int]) -> bool:
    """The loop body reads the parameter's values (`p.data`, `p.detach()`) or hands
    the parameter to a call (`send(name, p)`), not only its flags, outside a gather."""
    body = (n for s in loop.body for n in walk(s) if id(n) not in gathered)
    for node in body:
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == parameter
            and node.attr in VALUE_READS
        ):
            return True
        if isinstance(node, ast.Call) and any(
            isinstance(a, ast.Name) and a.id == parameter
            for a in [*node.args, *(k.value for k in node.keywords)]
        ):
            return True
    return False


@check("zero3-partitioned-parameters")
def check_sharded_forward_on_some_ranks(script: Script) -> Iterator[Finding]:
    """A forward or generate() of a sharded model (ZeRO-3, FSDP, fully_shard)
    that only some ranks make: its parameter all-gathers wait for the others."""
    sharded = sharded_models(script)
    if not sharded:
        return

    def runs_sharded(call: TracedCall) -> str | None:
        func = call.node.func
        if isinstance(func, ast.Attribute) and func.attr in FORWARD_METHODS:
            func = func.value
            if isinstance(func, ast.Attribute) and func.attr == "module":
                func = func.value  # engine.module.generate()
        return sharded.get(source_text(func))

    for call, lonely, how in lonely_calls(script, runs_sharded):
        yield script.finding(
            "zero3-partitioned-parameters",
            call.node,
            f"{source_text(call.node.func)}() runs on {lonely.side} (the `if` on line "
            f"{lonely.test_if.lineno}), but the model is sharded ({how}): each layer's "
            "forward all-gathers its parameters from every rank, so this waits for ranks "
            "that never call it and hangs; run it on every rank and print on rank 0",
        )


def sharded_models(script: Script) -> dict[str, str]:
    """Names of the sharded models the file binds, with how they were sharded."""
    sharded: dict[str, str] = {}
    for node in script.of_type(ast.Call):
        name = short(script.name_of(node.func))
        if name == FSDP2_SHARD and node.args:
            sharded[source_text(node.args[0])] = f"fully_shard on line {node.lineno}"
    for node in script.of_type(ast.Assign):
        if isinstance(node.value, ast.Call):
            name = short(script.name_of(node.value.func))
            if name in FSDP_WRAPPERS or name == FSDP2_SHARD:
                for target in node.targets:
                    sharded[source_text(target)] = f"{name} on line {node.lineno}"
    stage = zero3_stage(script)
    if stage is not None:
        for engine in engine_names(script):
            sharded[engine] = f"DeepSpeed ZeRO stage 3, line {stage.lineno}"
    return sharded


def zero3_stage(script: Script) -> ast.AST | None:
    """Where the file sets ZeRO stage 3: `"zero_optimization": {"stage": 3}` in a
    config dict, or `zero_stage=3` (Accelerate's DeepSpeedPlugin)."""
    for node in script.of_type((ast.Dict, ast.keyword)):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if is_key(key, "zero_optimization") and isinstance(value, ast.Dict):
                    stage = stage_in(value)
                    if stage is not None:
                        return stage
                if is_key(key, "zero_stage") and is_three(value):
                    return value
        if isinstance(node, ast.keyword) and node.arg == "zero_stage" and is_three(node.value):
            return node.value
    return None


def stage_in(config: ast.Dict) -> ast.expr | None:
    for key, value in zip(config.keys, config.values, strict=True):
        if key is not None and is_key(key, "stage") and is_three(value):
            return value
    return None


def is_key(key: ast.expr | None, name: str) -> bool:
    return isinstance(key, ast.Constant) and key.value == name


def is_three(value: ast.expr) -> bool:
    return isinstance(value, ast.Constant) and value.value == 3


def engine_names(script: Script) -> set[str]:
    """Names bound to the engine: the first of `engine, opt, _, _ = deepspeed.initialize(...)`."""
    names: set[str] = set()
    for node in script.nodes:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        if script.name_of(node.value.func) != "deepspeed.initialize":
            continue
        for target in node.targets:
            first = target.elts[0] if isinstance(target, (ast.Tuple, ast.List)) else target
            names.add(source_text(first))
    return names


def gathered_nodes(script: Script) -> set[int]:
    """ids of the nodes inside `with deepspeed.zero.GatheredParameters(...):` blocks,
    and of what the gather is given (the parameters it gathers)."""
    inside: set[int] = set()
    for node in script.of_type(ast.With):
        contexts = [item.context_expr for item in node.items]
        if any(
            isinstance(c, ast.Call) and short(script.name_of(c.func)) in GATHERING_CONTEXTS
            for c in contexts
        ):
            for part in (*contexts, *node.body):
                inside.update(id(inner) for inner in walk(part))
    return inside


# torch.nn.utils' gradient clipping, which reads the gradients each rank holds.
CLIP_GRAD_NORM = "clip_grad_norm_"


@check("zero3-partitioned-parameters")
def check_gradients_of_fsdp_shards_clipped_by_torch(script: Script) -> Iterator[Finding]:
    """`torch.nn.utils.clip_grad_norm_(model.parameters(), c)` of a model FSDP (the
    FullyShardedDataParallel wrapper) shards: each rank holds the gradients of its own
    shard only, so the norm is its shard's, every rank clips by another factor and
    the norm logged is no norm of the model. FSDP's own `model.clip_grad_norm_(c)`
    all-reduces the shards' norms first. (FSDP2's fully_shard keeps DTensors, which
    torch's function handles.)"""
    fsdp = names_bound_to(script, "FullyShardedDataParallel")
    if not fsdp:
        return
    for node, name in script.call_names:
        if short(name) != CLIP_GRAD_NORM or not name.startswith("torch.nn.utils") or not node.args:
            continue
        parameters = node.args[0]
        if not (
            isinstance(parameters, ast.Call)
            and isinstance(parameters.func, ast.Attribute)
            and parameters.func.attr == "parameters"
            and source_text(parameters.func.value) in fsdp
        ):
            continue
        model = source_text(parameters.func.value)
        yield script.finding(
            "zero3-partitioned-parameters",
            node,
            f"torch.nn.utils.clip_grad_norm_ over {model}, which FSDP shards: each rank "
            "holds its own shard's gradients, so the norm is the shard's, every rank clips "
            f"by another factor and the norm logged is not the model's; call FSDP's own "
            f"{model}.clip_grad_norm_(max_norm), which all-reduces the shards' norms",
        )
