"""A submodule some training steps skip, under a DDP that expects every parameter.

A model whose forward uses a submodule only when an optional input is given
(`if y is not None: c = c + self.y_embed(y)`), called in training with that
input set to None on some steps (classifier-free guidance's dropped label, an
optional mask or text): on those steps the submodule's parameters get no
gradient, and DDP built without find_unused_parameters=True fails at the next
step: "Expected to have finished reduction in the prior iteration before
starting a new one ... parameters that were not used in producing loss".

The same with a flag of forward (`def forward(self, x, return_feat=False)`,
`if return_feat: ... self.proj(f)`, or `x + self.postnet(x) if use_postnet
else x`) that training passes as a value of the step (`use_feat = step % k
== 0`, a random draw, `step >= start`): the submodule is left out on the
other steps.

Three more ways a step leaves submodules out: a forward that runs one member
of a ModuleDict / ModuleList picked by an input (`self.heads[task](x)`, one
task head per step), a submodule under a flag of the model that the script
switches during training (`model.module.use_aux = epoch < warmup`), and a
branch drawn at random in the model or the blocks it builds (a dropped
style encoder, LayerDrop, stochastic depth that skips a block).

Only what the file shows is judged: the model's class and its forward, the
DDP call (quiet with find_unused_parameters=True or static_graph=True), and a
call of the wrapped model whose argument for that input is None, or a name
its function sets to None.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from assistant.lint.model import (
    Function,
    Script,
    bound_arguments,
    called_name,
    enclosing_loop,
    keyword,
    method_of,
    names_in,
    self_attribute,
    source_text,
    truth_at_count,
    unmoved,
    walk,
)
from assistant.lint.ranks import assignments_seen_from
from assistant.lint.registry import check
from assistant.lint.torchapi import is_backward, is_ddp
from assistant.lint.values import decide, option_default
from assistant.results import Finding


@dataclass(frozen=True)
class OptionalBranch:
    """A forward input whose absence skips a submodule."""

    parameter: str
    position: int  # among forward's parameters after self
    submodule: str  # `self.y_embed`
    line: int  # the `if` in forward


@check("unused-parameters")
def check_submodule_skipped_by_a_none_input(script: Script) -> Iterator[Finding]:
    """The wrapped model is called with None for an input its forward needs to
    reach a submodule, under a DDP that does not look for unused parameters."""
    branches = [b for cls in model_classes(script) for b in optional_branches(cls)]
    if not branches:
        return
    for node, nodes, ddp in training_calls(script):
        set_to_none = none_assignments(nodes)
        for branch in branches:
            given = argument_for(node, branch)
            if given is None:
                continue
            where = none_line(given, set_to_none)
            if where is None:
                continue
            yield script.finding(
                "unused-parameters",
                where,
                f"{source_text(given)} is None on some steps, so forward skips "
                f"{branch.submodule} (the `if {branch.parameter} is not None` on line "
                f"{branch.line}) and its parameters get no gradient; DDP (line "
                f"{ddp.lineno}) expects every parameter each step and fails with "
                '"Expected to have finished reduction in the prior iteration": pass '
                "find_unused_parameters=True, or keep the submodule in the graph (a "
                "learned null input instead of None)",
            )
            break


def training_calls(script: Script) -> Iterator[tuple[ast.Call, list[ast.AST], ast.Call]]:
    """Each call of a model wrapped by a DDP that expects every parameter, outside
    no_grad, with its scope's nodes and that DDP call."""
    strict = strict_ddp_calls(script)
    if not strict:
        return
    wrapped = set().union(*(wrapped_by(script, ddp, set())[0] for ddp in strict))
    for node, nodes in calls_with_gradients(script, wrapped):
        yield node, nodes, strict[0]


def calls_with_gradients(
    script: Script, holders: set[str]
) -> Iterator[tuple[ast.Call, list[ast.AST]]]:
    """Each call of a name in `holders` (`model(x)`) outside no_grad (sampling or
    evaluation: no backward, nothing to reduce), with its scope's nodes."""
    for scope in script.all_scopes:
        if without_gradients(scope):
            continue
        nodes = script.scope_nodes(scope)
        no_grad = inside_no_grad(nodes)
        for node in nodes:
            called = isinstance(node, ast.Call) and source_text(node.func) in holders
            if called and id(node) not in no_grad:
                yield node, nodes


NO_GRAD = frozenset({"no_grad", "inference_mode"})


def without_gradients(scope: ast.AST) -> bool:
    """A function decorated with @torch.no_grad() / @torch.inference_mode()."""
    decorators = getattr(scope, "decorator_list", [])
    return any(names_no_grad(d) for d in decorators)


def names_no_grad(expr: ast.expr) -> bool:
    """`torch.no_grad()`, `torch.no_grad`, `inference_mode()`."""
    if isinstance(expr, ast.Call):
        return called_name(expr) in NO_GRAD
    return isinstance(expr, ast.Attribute) and expr.attr in NO_GRAD  # @torch.no_grad


def inside_no_grad(nodes: list[ast.AST]) -> set[int]:
    """ids of the nodes inside `with torch.no_grad():` blocks of the scope."""
    inside: set[int] = set()
    for node in nodes:
        if isinstance(node, ast.With) and any(names_no_grad(i.context_expr) for i in node.items):
            inside.update(id(n) for statement in node.body for n in walk(statement))
    return inside


def strict_ddp_calls(script: Script) -> list[ast.Call]:
    """The DDP calls that expect a gradient for every parameter each step."""
    return [node for node, name in script.call_names if is_ddp(name) and expects_all(node)]


def expects_all(ddp: ast.Call) -> bool:
    """DDP without find_unused_parameters=True or static_graph=True."""
    for flag in ("find_unused_parameters", "static_graph"):
        value = keyword(ddp, flag)
        if value is not None and not (isinstance(value, ast.Constant) and value.value is False):
            return False
    return not any(given.arg is None for given in ddp.keywords)  # **options may set them


def model_classes(script: Script) -> list[ast.ClassDef]:
    return [
        node
        for node in script.of_type(ast.ClassDef)
        if any(isinstance(s, ast.FunctionDef) and s.name == "forward" for s in node.body)
    ]


def optional_branches(cls: ast.ClassDef) -> Iterator[OptionalBranch]:
    """`def forward(self, x, y=None)` ... `if y is not None: ... self.y_embed(y)`."""
    forward = forward_of(cls)
    positional, optional = parameters_defaulting(forward, lambda value: value is None)
    for node in walk(forward):
        if not isinstance(node, ast.If):
            continue
        parameter = not_none_test(node.test)
        if parameter not in optional or parameter not in positional:
            continue
        submodule = next(
            (source_text(c.func) for s in node.body for c in walk(s) if self_call(c)), None
        )
        if submodule is not None:
            yield OptionalBranch(parameter, positional.index(parameter), submodule, node.lineno)


def parameters_defaulting(
    forward: ast.FunctionDef, wanted: Callable[[object], bool]
) -> tuple[list[str], set[str]]:
    """forward's parameters after self, and those whose constant default is `wanted`."""
    positional = [a.arg for a in forward.args.args[1:]]
    defaults = forward.args.defaults
    with_defaults = forward.args.args[len(forward.args.args) - len(defaults) :]
    chosen = {
        arg.arg
        for arg, default in zip(with_defaults, defaults, strict=True)
        if isinstance(default, ast.Constant) and wanted(default.value)
    }
    return positional, chosen


def not_none_test(test: ast.expr) -> str | None:
    """`y is not None` -> "y"."""
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.IsNot)
        and isinstance(test.left, ast.Name)
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value is None
    ):
        return test.left.id
    return None


def self_call(node: ast.AST) -> bool:
    """`self.y_embed(...)`: a submodule (or a method) of the model."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    )


def argument_for(call: ast.Call, branch: OptionalBranch) -> ast.expr | None:
    given = keyword(call, branch.parameter)
    if given is None and len(call.args) > branch.position:
        given = call.args[branch.position]
    return given


def none_assignments(nodes: list[ast.AST]) -> dict[str, int]:
    """name -> the line of an `name = None` in the scope."""
    found: dict[str, int] = {}
    for node in nodes:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and node.value.value is None
        ):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, node.lineno)
    return found


def none_line(given: ast.expr, set_to_none: dict[str, int]) -> int | None:
    """Where the argument is None: the literal itself, or its name's `= None`."""
    if isinstance(given, ast.Constant) and given.value is None:
        return given.lineno
    if isinstance(given, ast.Name):
        return set_to_none.get(given.id)
    return None


def turn_values(given: ast.expr, nodes: list[ast.AST]) -> list[object]:
    """The constants a name takes in turn (`for task in ("count", "disease")`)."""
    for loop in (n for n in nodes if isinstance(n, ast.For)):
        if (
            isinstance(given, ast.Name)
            and isinstance(loop.target, ast.Name)
            and loop.target.id == given.id
            and takes_turns(loop)
        ):
            return [item.value for item in loop.iter.elts]  # type: ignore[attr-defined]
    return []


def takes_turns(loop: ast.For) -> bool:
    """`for task in ("count", "disease"):` with a backward in its body: a list of
    constants the loop takes one at a time, each pass its own step."""
    items = loop.iter
    return (
        isinstance(items, ast.Tuple | ast.List)
        and len({source_text(item) for item in items.elts}) >= 2
        and all(isinstance(item, ast.Constant) for item in items.elts)
        and any(is_backward(n) for statement in loop.body for n in walk(statement))
    )


def varying_line(
    given: ast.expr,
    nodes: list[ast.AST],
    batch_names: frozenset[str] = frozenset(),
    around: ast.AST | None = None,
) -> int | None:
    """Where an argument is decided per step: a modulo, a random draw, a
    comparison of a step counter (a loop variable, a name `+=`'d, a trainer's
    `self.step` / `self.global_step` field), or any read of
    a name that holds the step's batch (`batch_names`), in it or in what the scope
    assigns to a name it reads. With `around` (the model's call), only the loops
    around it count steps: a loop inside the step runs alike every step."""
    values = [given]
    read = {n.id for n in walk(given) if isinstance(n, ast.Name)}  # `aux_w > 0` reads aux_w
    values += [
        node.value
        for node in nodes
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id in read for t in node.targets)
    ]
    counters = {
        target.id
        for node in nodes
        if isinstance(node, ast.AugAssign)
        or (isinstance(node, ast.For) and (around is None or encloses(node, around)))
        for target in walk(node.target)
        if isinstance(target, ast.Name)
    }
    for loop in (n for n in nodes if isinstance(n, ast.For)):
        if read & names_in(loop.target) and takes_turns(loop):
            return loop.lineno  # `for task in ("count", "disease"):` a backward each
    for value in values:
        for node in walk(value):
            modulo = isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod)
            drawn = isinstance(node, ast.Call) and draws_random(node)
            counted = isinstance(node, ast.Compare) and any(
                (isinstance(n, ast.Name) and n.id in counters) or step_field(n) for n in walk(node)
            )
            batch_read = isinstance(node, ast.Name) and node.id in batch_names
            if modulo or drawn or counted or batch_read:
                return value.lineno
    return None


# A trainer's progress kept in a field (`self.step`, Lightning's `self.global_step`,
# `self.current_epoch`): compared, it decides per step, as a loop's counter does.
STEP_FIELD = re.compile(r"^(global_|current_)?(step|steps|iter|iters|iteration|epoch)$")


def step_field(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and bool(STEP_FIELD.match(node.attr))
    )


RANDOM_SKIP = (
    "this `if` draws a random number to decide which submodules run (a dropped branch, "
    "LayerDrop, stochastic depth): on the steps it skips one, that submodule's parameters "
    "get no gradient"
)
DRAWN_FLAG_SKIP = (
    "this `if` tests a flag that a random draw sets in the same method (modality "
    "dropout, a dropped branch): on the steps the draw turns it off, the submodule it "
    "guards gets no gradient"
)
EMPTY_SKIP = (
    "this `if` skips a member of the model's loop when the data routed to it is empty (an "
    "expert that got no tokens this step): on such a step that member's parameters get no "
    "gradient"
)
EMPTY_FIX = ", or run it on the empty input (its gradient is then zero, but it is there)"


@check("unused-parameters")
def check_submodules_a_step_leaves_out(script: Script) -> Iterator[Finding]:
    """A wrapped model's forward that runs one member of a ModuleDict / ModuleList
    picked by an input (`self.heads[task](x)`: one task head per step), or a
    submodule under a flag of the model that the script switches during
    training (`model.module.use_aux = epoch < warmup`), under a DDP that
    expects a gradient for every parameter each step."""
    strict = strict_ddp_calls(script)
    if not strict:
        return
    classes = {cls.name: cls for cls in model_classes(script)}
    reported: set[int] = set()
    for ddp in strict:
        names, built = wrapped_by(script, ddp, set(classes))
        why = (
            f"DDP (line {ddp.lineno}) expects a gradient for every parameter each step and "
            'fails with "Expected to have finished reduction in the prior iteration": pass '
            "find_unused_parameters=True"
        )
        for name in sorted(built):
            forward = forward_of(classes[name])
            # (where, what the step leaves out, how else to fix it), each place once
            skips = [
                *(
                    (
                        call,
                        f"forward runs {picked}: the others get no gradient that step",
                        ", or run every member each step",
                    )
                    for call, picked in members_some_steps_leave_out(script, forward, names, ddp)
                ),
                *(
                    (
                        call,
                        (
                            f"{inner.name}.forward runs {picked}: the others get no gradient "
                            "that step"
                        ),
                        ", or run every member each step",
                    )
                    for inner, call, picked in members_picked_inside(classes, name)
                ),
                *(
                    (test, RANDOM_SKIP if draws_random(test.test) else DRAWN_FLAG_SKIP, "")
                    for test in random_branches(classes, name)
                ),
                *((test, EMPTY_SKIP, EMPTY_FIX) for test in empty_selection_skips(classes, name)),
            ]
            for node, what, fix in skips:
                if id(node) in reported:
                    continue
                reported.add(id(node))
                yield script.finding("unused-parameters", node, f"{what}; {why}{fix}")
            for flag, test_line, assignment in switched_flags(script, classes[name], names):
                yield script.finding(
                    "unused-parameters",
                    assignment,
                    f"this switches self.{flag} during training, and forward uses a submodule "
                    f"only when it holds (the `if` on line {test_line}): from then on its "
                    f"parameters get no gradient; {why}",
                )


@check("unused-parameters")
def check_output_the_step_throws_away(script: Script) -> Iterator[Finding]:
    """`mlm_logits, _ = model(x)` where forward returns (mlm_logits, nsp_logits)
    and nsp_logits alone runs self.pooler and self.nsp_head: under a DDP that
    expects every parameter, those heads' parameters never get a gradient."""
    classes = {cls.name: cls for cls in model_classes(script)}
    if not classes:
        return
    calls = list(training_calls(script))
    for call, nodes, ddp in calls:
        unpacked = discarded_positions(call, nodes)
        if not unpacked:
            continue
        # the other calls of the same model in the same step keep what they keep
        # (DANN: `cls_s, dom_s = model(xs)` then `_, dom_t = model(xt)`)
        others = [
            o
            for o, o_nodes, o_ddp in calls
            if o is not call
            and o_ddp is ddp
            and o_nodes is nodes
            and source_text(o.func) not in classes  # `Encoder()` builds, it does not step
            # the same step: the same loop runs both (PPG's policy and auxiliary phases,
            # two loops of one function, are different steps)
            and enclosing_loop(o, script.parents) is enclosing_loop(call, script.parents)
        ]
        _, built = wrapped_by(script, ddp, set(classes))
        for name in sorted(built):
            returned = returned_elements(forward_of(classes[name]))
            if returned is None or len(returned) != len(unpacked[1]):
                continue
            kept = set().union(*(used for i, used in enumerate(returned) if i not in unpacked[0]))
            for other in others:
                thrown = discarded_positions(other, nodes)
                dropped = thrown[0] if thrown else set()
                kept |= set().union(*(used for i, used in enumerate(returned) if i not in dropped))
            only_discarded = sorted(set().union(*(returned[i] for i in unpacked[0])) - kept)
            if not only_discarded:
                continue
            shown = ", ".join(f"self.{member}" for member in only_discarded[:3])
            yield script.finding(
                "unused-parameters",
                unpacked[2],
                f"the step throws away what forward returns in position "
                f"{min(unpacked[0]) + 1} (`_`), the only output that runs {shown}: their "
                "parameters never get a gradient, and DDP (line "
                f"{ddp.lineno}) expects one for every parameter each step and fails with "
                '"Expected to have finished reduction in the prior iteration"; drop those '
                "heads (or skip them in training), or pass find_unused_parameters=True",
            )
            break


@check("unused-parameters")
def check_output_the_loss_takes_on_some_steps(script: Script) -> Iterator[Finding]:
    """`graph_logits, atom_logits = model(batch)` where only atom_logits runs
    self.atom_head, and the loss takes atom_logits only under `if step >= aux_start:`
    (a step count, a modulo, a random draw): on the other steps the head's
    parameters get no gradient, under a DDP that expects every parameter."""
    classes = {cls.name: cls for cls in model_classes(script)}
    if not classes:
        return
    reported: set[int] = set()
    for call, nodes, ddp in training_calls(script):
        assigned = unpacked_assignment(call, nodes)
        if assigned is None:
            continue
        targets, assign = assigned
        _, built = wrapped_by(script, ddp, set(classes))
        for name in sorted(built):
            returned = returned_elements(forward_of(classes[name]))
            if returned is None or len(returned) != len(targets):
                continue
            for position, target in enumerate(targets):
                others = set().union(*(r for i, r in enumerate(returned) if i != position))
                only_here = sorted(returned[position] - others)
                if not (isinstance(target, ast.Name) and target.id != "_" and only_here):
                    continue
                gate = per_step_gate(target.id, nodes, assign, batch_names(nodes, assign))
                where = ""
                if gate is None:
                    gate, where = gate_in_a_loss_function(script, target.id, nodes, assign)
                if gate is None:
                    left_out = left_out_by_the_default_option(script, target.id, nodes, assign)
                    if left_out is not None and left_out[0].lineno not in reported:
                        reported.add(left_out[0].lineno)
                        yield default_option_finding(script, target.id, only_here, ddp, *left_out)
                        continue
                    off = gate_off_by_default(script, target.id, nodes, assign)
                    if off is not None and off[0].lineno not in reported:
                        reported.add(off[0].lineno)
                        yield default_gate_finding(script, target.id, only_here, ddp, *off)
                    continue
                if gate.lineno in reported:
                    continue
                reported.add(gate.lineno)
                shown = ", ".join(f"self.{member}" for member in only_here[:3])
                yield script.finding(
                    "unused-parameters",
                    gate,
                    f"{target.id} (the output of forward that alone runs {shown}) reaches the "
                    f"loss{where} only on the steps where `{source_text(gate.test)}` holds: on the "
                    "others those parameters get no gradient, and DDP (line "
                    f"{ddp.lineno}) expects one for every parameter each step and fails with "
                    '"Expected to have finished reduction in the prior iteration"; add the '
                    "term every step with weight 0 while it is off, or pass "
                    "find_unused_parameters=True",
                )


@check("unused-parameters")
def check_output_entry_the_default_loss_leaves_out(script: Script) -> Iterator[Finding]:
    """`out = model(x)` where forward returns {"quantiles": self.quantile_head(h),
    "point": self.point_head(h)}, and the step reads out["point"] only under the
    `else` of `if args.loss == "quantile":` (`--loss` defaulting to "quantile"): with
    the defaults point_head's parameters never get a gradient, under a DDP that
    expects every parameter."""
    classes = {cls.name: cls for cls in model_classes(script)}
    if not classes:
        return
    reported: set[int] = set()
    for call, nodes, ddp in training_calls(script):
        assign = named_assignment(call, nodes)
        if assign is None:
            continue
        name = assign.targets[0].id
        reads = reads_after(name, nodes, assign)
        keys = {id(read): entry_read(read, script.parents) for read in reads}
        if not reads or None in keys.values():
            continue  # `out` handed on whole: what reads its entries is not in the step
        _, built = wrapped_by(script, ddp, set(classes))
        for cls in sorted(built):
            entries = returned_entries(forward_of(classes[cls])) or {}
            for key, runs in entries.items():
                others = set().union(*(r for k, r in entries.items() if k != key))
                only_here = sorted(runs - others)
                key_reads = [read for read in reads if keys[id(read)] == key]
                if not (only_here and key_reads):
                    continue
                off = default_gate_around(script, key_reads, nodes, assign)
                if off is not None and off[0].lineno not in reported:
                    reported.add(off[0].lineno)
                    yield default_gate_finding(script, f'{name}["{key}"]', only_here, ddp, *off)


def named_assignment(call: ast.Call, nodes: list[ast.AST]) -> ast.Assign | None:
    """`out = model(x)`: the assignment of the call to one name."""
    for node in nodes:
        if (
            isinstance(node, ast.Assign)
            and node.value is call
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            return node
    return None


def entry_read(read: ast.Name, parents: dict[int, ast.AST]) -> str | None:
    """The key of `out["point"]` for the name `out` in it; None for any other read."""
    parent = parents.get(id(read))
    if (
        isinstance(parent, ast.Subscript)
        and parent.value is read
        and isinstance(parent.slice, ast.Constant)
        and isinstance(parent.slice.value, str)
    ):
        return parent.slice.value
    return None


# Library models built with an auxiliary classifier: torchvision's segmentation models
# (`aux_loss=True`: output["aux"]) and Inception / GoogLeNet (`aux_logits=True`).
AUX_SWITCHES = ("aux_loss", "aux_logits")
AUX_OUTPUTS = frozenset({"aux", "aux_logits", "aux_logits1", "aux_logits2", "aux1", "aux2"})


@check("unused-parameters")
def check_library_aux_head_the_loss_takes_on_some_steps(script: Script) -> Iterator[Finding]:
    """`deeplabv3_resnet50(aux_loss=True)` under DDP, with `outputs["aux"]` in the
    loss only under `if use_aux:` (`use_aux = epoch < aux_epochs`): the auxiliary
    classifier runs every step, but on the other steps its parameters get no gradient."""
    strict = strict_ddp_calls(script)
    if not strict:
        return
    reported: set[int] = set()
    for call, nodes, ddp in training_calls(script):
        if not builds_an_aux_head(script, ddp):
            continue
        assigned = next(
            (
                n.targets[0].id
                for n in nodes
                if isinstance(n, ast.Assign)
                and n.value is call
                and len(n.targets) == 1
                and isinstance(n.targets[0], ast.Name)
            ),
            None,
        )
        if assigned is None:
            continue
        reads = [n for n in nodes if aux_read(n, assigned)]
        gate = gate_around(reads, nodes)
        if gate is None or gate.lineno in reported:
            continue
        reported.add(gate.lineno)
        yield script.finding(
            "unused-parameters",
            gate,
            f"the model was built with an auxiliary classifier ({source_text(reads[0])}), "
            f"which reaches the loss only on the steps where `{source_text(gate.test)}` holds: "
            f"on the others its parameters get no gradient, and DDP (line {ddp.lineno}) "
            'expects one for every parameter each step and fails with "Expected to have '
            'finished reduction in the prior iteration"; add the term every step with weight 0 '
            "while it is off, or pass find_unused_parameters=True",
        )


# A library model's options that skip whole layers at random in training (Hugging
# Face's wav2vec2 / HuBERT / Whisper / BART / OPT: LayerDrop).
LAYER_DROPS = frozenset({"layerdrop", "encoder_layerdrop", "decoder_layerdrop"})


@check("unused-parameters")
def check_library_model_built_with_layerdrop(script: Script) -> Iterator[Finding]:
    """`Wav2Vec2ForCTC.from_pretrained(..., layerdrop=0.1)` (a constant, or an option /
    config entry at its default) wrapped by a DDP that expects every parameter each
    step: each step skips some layers at random, and their parameters get no gradient."""
    for ddp in strict_ddp_calls(script):
        for value in wrapped_values(script, ddp):
            for node in walk(value):
                if not isinstance(node, ast.Call):
                    continue
                for option in sorted(LAYER_DROPS):
                    given = keyword(node, option)
                    rate = drop_rate(script, given) if given is not None else None
                    if not rate:
                        continue
                    shown = source_text(given)
                    how = f"{option}={shown}" + (
                        "" if shown == repr(rate) else f" ({rate!r} by default)"
                    )
                    yield script.finding(
                        "unused-parameters",
                        given,
                        f"{how} skips whole layers at random at each training step: on that "
                        f"step their parameters get no gradient, and DDP (line {ddp.lineno}) "
                        'expects one for every parameter and fails with "Expected to have '
                        'finished reduction in the prior iteration"; pass '
                        f"find_unused_parameters=True, or {option}=0.0",
                    )


def drop_rate(script: Script, given: ast.expr) -> float | None:
    """The rate a layer-drop option holds: a number, or an option's default."""
    if isinstance(given, ast.Constant):
        value = given.value
    else:
        known, value = option_default(script, given)
        if not known:
            return None
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def wrapped_values(script: Script, ddp: ast.Call) -> list[ast.expr]:
    """What one DDP call wraps: its argument and every value the names holding
    the model are assigned (`model = Net(...)` ... `DDP(model)`)."""
    if not ddp.args:
        return []  # `DDP(module=model)`, `DDP(**options)`: not followed
    names, _ = wrapped_by(script, ddp, set())
    return [ddp.args[0], *(v for name in names for v in script.assigned_values.get(name, []))]


def builds_an_aux_head(script: Script, ddp: ast.Call) -> bool:
    """What the DDP call wraps was built with `aux_loss=True` / `aux_logits=True`."""
    values = wrapped_values(script, ddp)
    return any(
        isinstance(node, ast.Call)
        and any(
            isinstance(flag := keyword(node, switch), ast.Constant) and flag.value is True
            for switch in AUX_SWITCHES
        )
        for value in values
        for node in walk(value)
    )


def aux_read(node: ast.AST, outputs: str) -> bool:
    """`outputs["aux"]` or `outputs.aux_logits`."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        key = node.slice
        return (
            node.value.id == outputs and isinstance(key, ast.Constant) and key.value in AUX_OUTPUTS
        )
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == outputs
        and node.attr in AUX_OUTPUTS
    )


def gate_around(reads: list[ast.AST], nodes: list[ast.AST]) -> ast.If | None:
    """The `if` decided per step (varying_line) whose body holds every one of the reads."""
    if not reads:
        return None
    for node in nodes:
        if not (isinstance(node, ast.If) and varying_line(node.test, nodes) is not None):
            continue
        inside = {id(n) for statement in node.body for n in walk(statement)}
        if all(id(read) in inside for read in reads):
            return node
    return None


def unpacked_assignment(
    call: ast.Call, nodes: list[ast.AST]
) -> tuple[list[ast.expr], ast.Assign] | None:
    """`a, b = model(x)`: the targets and the assignment."""
    for node in nodes:
        if isinstance(node, ast.Assign) and node.value is call and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Tuple | ast.List):
                return target.elts, node
    return None


def per_step_gate(
    name: str,
    nodes: list[ast.AST],
    assign: ast.AST,
    batch: frozenset[str] = frozenset(),
) -> ast.If | None:
    """The `if` deciding per step (varying_line, `batch` the names holding the
    step's batch) inside whose body every later read of `name` sits; None when a
    read is outside such an `if`, or there is none."""
    # An `if` around the model's call too decides whether the step runs forward at
    # all, not which outputs reach the loss (an update that starts after warm-up).
    gates = [
        node
        for node in nodes
        if isinstance(node, ast.If)
        and varying_line(node.test, nodes, batch, around=assign) is not None
        and not encloses(node, assign)
    ]
    inside = {id(n): gate for gate in gates for s in gate.body for n in walk(s)}
    reads = reads_after(name, nodes, assign)
    if not reads or any(id(read) not in inside for read in reads):
        return None
    return inside[id(reads[0])]


def batch_names(nodes: list[ast.AST], around: ast.AST) -> frozenset[str]:
    """The names that hold the step's batch where `around` (the model's call) runs:
    the targets of the loops around it over anything but range() (`for i, batch
    in enumerate(loader)`), and names the scope assigns from them (`batch = {k:
    v.cuda() for k, v in batch.items()}`). A test that reads one is decided by the
    data of the step (`if batch["has3d"].any():`); a loop inside the step (`for k,
    v in losses.items()`) runs the same way every step and holds no batch."""
    names = {
        target.id
        for node in nodes
        if isinstance(node, ast.For) and not counts_steps(node.iter) and encloses(node, around)
        for target in walk(node.target)
        if isinstance(target, ast.Name)
    }
    for node in nodes:
        if isinstance(node, ast.Assign) and names_in(node.value) & names:
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return frozenset(names)


def encloses(block: ast.If | ast.For, node: ast.AST) -> bool:
    """`node` sits in the block's body."""
    return any(n is node for statement in block.body for n in walk(statement))


def counts_steps(iterable: ast.expr) -> bool:
    """`range(n)`: a loop over step or epoch numbers, not over data."""
    return isinstance(iterable, ast.Call) and called_name(iterable) == "range"


def gate_in_a_loss_function(
    script: Script, name: str, nodes: list[ast.AST], assign: ast.Assign
) -> tuple[ast.If | None, str]:
    """`loss = pose_loss(hm, depth, batch)` where the file's pose_loss reads its
    `depth_pred` only under `if has3d.any():`, has3d taken from the batch it is
    given: the `if` deciding per step, and " (in pose_loss)"."""
    found = the_loss_function_call(script, name, nodes, assign)
    if found is None:
        return None, ""
    call, function, parameter = found
    in_batch = batch_names(nodes, call)
    bound = bound_arguments(function, call)
    batch = frozenset(p for p, argument in bound if p and names_in(argument) & in_batch)
    gate = per_step_gate(parameter, script.scope_nodes(function), function, batch)
    return gate, f" (in {function.name})"


def the_loss_function_call(
    script: Script, name: str, nodes: list[ast.AST], assign: ast.Assign
) -> tuple[ast.Call, Function, str] | None:
    """`loss = compute_loss(verb_logits, noun_logits, y, args.task)`: the one call
    of a file function that every later read of `name` is an argument of, that
    function, and the parameter the name is bound to."""
    reads = reads_after(name, nodes, assign)
    parents = script.parents
    calls = {id(parents.get(id(read))): parents.get(id(read)) for read in reads}
    if not reads or len(calls) != 1:
        return None
    call = next(iter(calls.values()))
    function = script.function_called(call)
    if function is None:
        return None
    bound = bound_arguments(function, call)
    parameters = {p for p, arg in bound if isinstance(arg, ast.Name) and arg.id == name}
    if len(parameters) != 1 or None in parameters:
        return None
    return call, function, parameters.pop()


def left_out_by_the_default_option(
    script: Script, name: str, nodes: list[ast.AST], assign: ast.Assign
) -> tuple[ast.If, str, object, Function] | None:
    """`compute_loss(verb_logits, noun_logits, ..., args.task)` where compute_loss
    reads noun_logits only past `if task == "verb": return ...`, and `--task`
    defaults to "verb": with the default, the output never reaches the loss. The
    `if` that decides, the option, its default and the function."""
    found = the_loss_function_call(script, name, nodes, assign)
    if found is None:
        return None
    call, function, parameter = found
    options: dict[str, tuple[str, object]] = {}
    for bound_to, argument in bound_arguments(function, call):
        known, value = option_default(script, argument)
        if bound_to and known:
            options[bound_to] = (source_text(argument), value)
    if not options:
        return None
    walk = DefaultPath(options, parameter)
    walk.run(function.body)
    if walk.reached or walk.decided is None:
        return None
    option, value = options[walk.decided[1]]
    return walk.decided[0], option, value, function


def gate_off_by_default(
    script: Script, name: str, nodes: list[ast.AST], assign: ast.AST
) -> tuple[ast.If, dict[str, object], bool] | None:
    """`if args.exist_weight > 0: loss = loss + ... exist_out ...` in the step, every
    later read of `name` under it, and the options it tests (argparse defaults, a
    config's) make it false when the run leaves them: with the defaults the output
    never reaches the loss. The `if`, the options it read, and the branch the reads
    sit in (True: its body, False: its `else`)."""
    return default_gate_around(script, reads_after(name, nodes, assign), nodes, assign)


def default_gate_around(
    script: Script, reads: list[ast.AST], nodes: list[ast.AST], assign: ast.AST
) -> tuple[ast.If, dict[str, object], bool] | None:
    """The `if` of the step (not around the model's call) one branch of which holds
    every read in `reads`, when the options its test reads take, at their defaults,
    the other branch: the `if`, the options and the branch that holds the reads."""
    if not reads:
        return None
    gates = [n for n in nodes if isinstance(n, ast.If) and not any(a is assign for a in walk(n))]
    inside: dict[int, tuple[ast.If, bool]] = {}
    for gate in gates:  # the scope's order: an inner `if` (an `elif`) overwrites its outer one
        for branch, block in ((True, gate.body), (False, gate.orelse)):
            for node in (n for statement in block for n in walk(statement)):
                inside[id(node)] = (gate, branch)
    held = {inside.get(id(read)) for read in reads}
    if len(held) != 1 or None in held:
        return None
    gate, branch = held.pop()
    options: dict[str, object] = {}
    for node in walk(gate.test):
        if isinstance(node, ast.Attribute | ast.Subscript):
            known, value = option_default(script, node)
            if known:
                options[source_text(node)] = value
    if not options or decide(gate.test, options) is not (not branch):
        return None
    return gate, options, branch


def default_gate_finding(
    script: Script,
    name: str,
    only_here: list[str],
    ddp: ast.Call,
    gate: ast.If,
    options: dict[str, object],
    branch: bool,
) -> Finding:
    shown = ", ".join(f"self.{member}" for member in only_here[:3])
    defaults = ", ".join(f"{option}={value!r}" for option, value in options.items())
    where = "under it" if branch else "under its `else`"
    return script.finding(
        "unused-parameters",
        gate,
        f"with the defaults ({defaults}) `{source_text(gate.test)}` is "
        f"{'false' if branch else 'true'}, and {name} (the output of forward that alone runs "
        f"{shown}) is read only {where}: it never reaches the loss, those parameters get no "
        f"gradient, and DDP (line {ddp.lineno}) expects one for every parameter each step and "
        'fails with "Expected to have finished reduction in the prior '
        'iteration"; build the head only when its term is on, or pass find_unused_parameters=True',
    )


class DefaultPath:
    """The statements a function runs when its option parameters hold their
    defaults: whether one that reads `parameter` is among them, and the first
    `if` on an option that turned the path (the `if` and the option)."""

    def __init__(self, options: dict[str, tuple[str, object]], parameter: str):
        self.options = options
        self.parameter = parameter
        self.reached = False
        self.decided: tuple[ast.If, str] | None = None

    def run(self, body: list[ast.stmt]) -> bool:
        """Walk `body`; True when it surely returns (or raises) on this path."""
        for statement in body:
            if isinstance(statement, ast.If):
                held = self.holds(statement.test)
                if held is None:
                    self.reached |= reads_name(statement.test, self.parameter)
                    ends_body = self.run(statement.body)
                    ends_else = self.run(statement.orelse)
                    if ends_body and ends_else:
                        return True
                    continue
                if self.decided is None:
                    self.decided = (statement, held[1])
                if self.run(statement.body if held[0] else statement.orelse):
                    return True
                continue
            self.reached |= reads_name(statement, self.parameter)
            if isinstance(statement, ast.Return | ast.Raise):
                return True
        return False

    def holds(self, test: ast.expr) -> tuple[bool, str] | None:
        """(whether `test` holds, the option it reads) for `task == "verb"`,
        `task != "noun"`, `task in ("a", "b")`, `use_aux`, `not use_aux`."""
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            inner = self.holds(test.operand)
            return None if inner is None else (not inner[0], inner[1])
        if isinstance(test, ast.Name) and test.id in self.options:
            return bool(self.options[test.id][1]), test.id
        if not (
            isinstance(test, ast.Compare)
            and len(test.ops) == 1
            and isinstance(test.left, ast.Name)
            and test.left.id in self.options
        ):
            return None
        value = self.options[test.left.id][1]
        op, right = test.ops[0], test.comparators[0]
        if isinstance(right, ast.Constant) and isinstance(op, ast.Eq | ast.NotEq):
            return (value == right.value) == isinstance(op, ast.Eq), test.left.id
        if isinstance(right, ast.Tuple | ast.List | ast.Set) and isinstance(op, ast.In | ast.NotIn):
            if not all(isinstance(e, ast.Constant) for e in right.elts):
                return None
            inside = any(isinstance(e, ast.Constant) and value == e.value for e in right.elts)
            return inside == isinstance(op, ast.In), test.left.id
        return None


def reads_name(node: ast.AST, name: str) -> bool:
    return any(
        isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) for n in walk(node)
    )


def default_option_finding(
    script: Script,
    name: str,
    only_here: list[str],
    ddp: ast.Call,
    decided: ast.If,
    option: str,
    value: object,
    function: Function,
) -> Finding:
    shown = ", ".join(f"self.{member}" for member in only_here[:3])
    return script.finding(
        "unused-parameters",
        decided,
        f"with {option} at its default ({value!r}), {function.name} never reads {name} "
        f"(the output of forward that alone runs {shown}): those parameters get no "
        f"gradient, and DDP (line {ddp.lineno}) expects one for every parameter each step "
        'and fails with "Expected to have finished reduction in the prior iteration"; '
        "build only the heads the run trains, or pass find_unused_parameters=True",
    )


def reads_after(name: str, nodes: list[ast.AST], assign: ast.AST) -> list[ast.Name]:
    """The reads of `name` among the scope's nodes that come after `assign`."""
    return [
        node
        for node in nodes
        if isinstance(node, ast.Name)
        and node.id == name
        and isinstance(node.ctx, ast.Load)
        and position_after(node, assign)
    ]


def position_after(node: ast.AST, assign: ast.AST) -> bool:
    return (node.lineno, node.col_offset) > (assign.lineno, assign.col_offset)


def discarded_positions(
    call: ast.Call, nodes: list[ast.AST]
) -> tuple[set[int], list[ast.expr], ast.Assign] | None:
    """`a, _ = model(x)`: the positions bound to `_`, the targets, the assignment."""
    assigned = unpacked_assignment(call, nodes)
    if assigned is None:
        return None
    targets, node = assigned
    dropped = {i for i, t in enumerate(targets) if isinstance(t, ast.Name) and t.id == "_"}
    return (dropped, targets, node) if dropped and len(dropped) < len(targets) else None


def returned_elements(forward: ast.FunctionDef) -> list[set[str]] | None:
    """For forward's one `return a, b`: the submodules (`self.x(...)`) each element's
    value runs, following the names assigned in forward. None if it returns otherwise."""
    returns = [n for n in walk(forward) if isinstance(n, ast.Return)]
    if len(returns) != 1 or not isinstance(returns[0].value, ast.Tuple):
        return None
    assigned = names_assigned_in(forward)
    return [submodules_run(element, assigned) for element in returns[0].value.elts]


def returned_entries(forward: ast.FunctionDef) -> dict[str, set[str]] | None:
    """For forward's one `return {"logits": a, "aux": b}` (or `dict(logits=a, aux=b)`):
    the submodules each entry's value runs. None if it returns otherwise."""
    returns = [n for n in walk(forward) if isinstance(n, ast.Return)]
    if len(returns) != 1:
        return None
    value = returns[0].value
    if isinstance(value, ast.Dict) and all(
        isinstance(k, ast.Constant) and isinstance(k.value, str) for k in value.keys
    ):
        pairs = [(k.value, v) for k, v in zip(value.keys, value.values, strict=True)]
    elif (
        isinstance(value, ast.Call)
        and called_name(value) == "dict"
        and not value.args
        and all(k.arg for k in value.keywords)
    ):
        pairs = [(k.arg, k.value) for k in value.keywords]
    else:
        return None
    assigned = names_assigned_in(forward)
    return {key: submodules_run(entry, assigned) for key, entry in pairs}


def names_assigned_in(function: ast.FunctionDef) -> dict[str, list[ast.expr]]:
    """Each name the function assigns, with every value it is given."""
    assigned: dict[str, list[ast.expr]] = {}
    for node in walk(function):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name in (n.id for n in walk(target) if isinstance(n, ast.Name)):
                    assigned.setdefault(name, []).append(node.value)
    return assigned


def submodules_run(expr: ast.expr, assigned: dict[str, list[ast.expr]]) -> set[str]:
    """`self.x` fields called (or whose weights are read) in the value of `expr`."""
    found: set[str] = set()
    seen: set[str] = set()
    pending = [expr]
    while pending:
        current = pending.pop()
        for node in walk(current):
            if isinstance(node, ast.Call) and (member := self_attribute(node.func)):
                found.add(member)
            elif isinstance(node, ast.Attribute) and (member := self_attribute(node.value)):
                found.add(member)  # self.word_embeddings.weight, self.bias
            elif isinstance(node, ast.Name) and node.id not in seen:
                seen.add(node.id)
                pending += assigned.get(node.id, [])
    return found


# Calls that draw a random number: `random.random()`, `np.random.rand()`, `torch.rand(1)`.
RANDOM_DRAWS = frozenset(
    {
        "random",
        "uniform",
        "randint",
        "rand",
        "randn",
        "rand_like",
        "bernoulli",
        "choice",
        # a random subset or order: `random.sample(idx, k)`, `torch.randperm(n)[:k]`
        "sample",
        "randperm",
        "permutation",
        "multinomial",
    }
)
# How many model classes are followed into from the wrapped one (blocks, their layers).
MAX_CLASSES = 32


def random_branches(classes: dict[str, ast.ClassDef], wrapped: str) -> Iterator[ast.If]:
    """`if random.random() < p:` in the methods of the wrapped model, or of the
    model classes it builds, where a branch (or the rest of the method, after a
    `return` in the branch) calls a submodule; also an `if` on a flag such a draw
    sets (`if random.random() < p: use_video = False` ... `if use_video: v =
    self.visual(video)`: modality dropout)."""
    for cls in built_classes(classes, wrapped):
        for method in (s for s in cls.body if isinstance(s, ast.FunctionDef)):
            drawn = flags_set_by_a_draw(method)
            for block in statement_lists(method):
                for position, statement in enumerate(block):
                    if isinstance(statement, ast.If) and (
                        draws_random(statement.test) or names_in(statement.test) & drawn
                    ):
                        skipped = [*statement.body, *statement.orelse]
                        if leaves_the_block(statement.body):
                            skipped += block[position + 1 :]
                        members = member_loop_names(method)
                        if any(
                            self_call(n) or member_call(n, members)
                            for s in skipped
                            for n in walk(s)
                        ):
                            yield statement


# What reads how much of a selection there is: `idx.numel()`, `len(idx)`, `mask.any()`.
SELECTION_SIZES = frozenset({"numel", "len", "any", "sum", "count_nonzero", "nelement", "size"})


def empty_selection_skips(classes: dict[str, ast.ClassDef], wrapped: str) -> Iterator[ast.If]:
    """`for e, expert in enumerate(self.experts): ... if idx.numel() == 0: continue`
    (or `for e, n in enumerate(counts): if n == 0: continue` then `self.experts[e](...)`)
    in the wrapped model or a model class it builds: the loop leaves out a member
    whenever the data sent to it is empty, which routing decides per step."""
    for cls in built_classes(classes, wrapped):
        for method in (s for s in cls.body if isinstance(s, ast.FunctionDef)):
            for loop in (n for n in walk(method) if isinstance(n, ast.For)):
                members = member_loop_names_of(loop)
                bound = {t.id for t in walk(loop.target) if isinstance(t, ast.Name)}
                for position, statement in enumerate(loop.body):
                    if not (
                        isinstance(statement, ast.If)
                        and isinstance(statement.body[-1], ast.Continue)
                        and tests_for_empty(statement.test, bound)
                    ):
                        continue
                    if keeps_the_member(statement.body, members, bound):
                        continue  # `y = y + sum(p.sum() for p in expert.parameters()) * 0.0`
                    rest = loop.body[position + 1 :]
                    if any(
                        member_call(n, members) or member_picked_by(n, bound)
                        for s in rest
                        for n in walk(s)
                    ):
                        yield statement


def keeps_the_member(skip: list[ast.stmt], members: set[str], bound: set[str]) -> bool:
    """The skip's own statements run the member or read its parameters
    (`sum(p.sum() for p in expert.parameters()) * 0.0`, `self.experts[e](x[:0])`): it
    stays in the graph with a zero gradient."""

    def is_member(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id in members) or (
            isinstance(node, ast.Subscript)
            and self_attribute(node.value) is not None
            and isinstance(node.slice, ast.Name)
            and node.slice.id in bound
        )

    return any(
        (isinstance(n, ast.Call) and is_member(n.func))
        or (isinstance(n, ast.Attribute) and n.attr in PARAMETER_READS and is_member(n.value))
        for statement in skip
        for n in walk(statement)
    )


# What reads a module's parameters into the graph.
PARAMETER_READS = frozenset({"parameters", "named_parameters", "weight", "bias"})


def member_picked_by(node: ast.AST, names: set[str]) -> bool:
    """`self.experts[e](x)` with `e` one of `names` (a loop's index)."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Subscript)
        and self_attribute(node.func.value) is not None
        and isinstance(node.func.slice, ast.Name)
        and node.func.slice.id in names
    )


def member_loop_names_of(loop: ast.For) -> set[str]:
    """The names `loop` binds to the model's own members (member_loop_names, one loop)."""
    if not any(self_attribute(part) for part in walk(loop.iter)):
        return set()
    return {target.id for target in walk(loop.target) if isinstance(target, ast.Name)}


def tests_for_empty(test: ast.expr, counts: set[str] = frozenset()) -> bool:
    """`idx.numel() == 0`, `len(idx) == 0`, `not mask.any()`, `x.size(0) < 1`, and
    `n == 0` / `not n` of a name in `counts` (a loop's count of routed tokens): the
    test holds when nothing is selected."""

    def is_count(expr: ast.expr) -> bool:
        return reads_selection_size(expr) or (isinstance(expr, ast.Name) and expr.id in counts)

    return truth_at_count(test, is_count, 0) is True


def reads_selection_size(expr: ast.expr) -> bool:
    return (
        isinstance(expr, ast.Call)
        and called_name(expr) in SELECTION_SIZES
        or (
            isinstance(expr, ast.Subscript)
            and isinstance(expr.value, ast.Attribute)
            and expr.value.attr == "shape"
        )
    )


def built_classes(classes: dict[str, ast.ClassDef], wrapped: str) -> list[ast.ClassDef]:
    """The wrapped model's class and the file's model classes its methods build, transitively."""
    found = [wrapped]
    for name in found:
        if len(found) >= MAX_CLASSES:
            break
        for node in walk(classes[name]):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in classes
                and node.func.id not in found
            ):
                found.append(node.func.id)
    return [classes[name] for name in found]


def statement_lists(function: ast.AST) -> Iterator[list[ast.stmt]]:
    """Every statement list (body, else) under `function` (or a module)."""
    for node in walk(function):
        for field in ("body", "orelse"):
            block = getattr(node, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block


def flags_set_by_a_draw(method: ast.FunctionDef) -> set[str]:
    """Names an `if` on a random draw assigns a constant (`use_video = False`)."""
    return {
        target.id
        for test in walk(method)
        if isinstance(test, ast.If) and draws_random(test.test)
        for statement in [*test.body, *test.orelse]
        for node in walk(statement)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def draws_random(test: ast.expr) -> bool:
    return any(
        isinstance(node, ast.Call) and called_name(node) in RANDOM_DRAWS for node in walk(test)
    )


def member_loop_names(method: ast.FunctionDef) -> set[str]:
    """Names a loop of the method binds to the model's own members: `layer` in
    `for layer, p in zip(self.layers, self.drop_probs):`, `for blk in self.blocks:`."""
    loops = (node for node in walk(method) if isinstance(node, ast.For))
    return set().union(*(member_loop_names_of(loop) for loop in loops))


def member_call(node: ast.AST, members: set[str]) -> bool:
    """`layer(x)` with `layer` one of the model's members a loop walks."""
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in members
    )


def leaves_the_block(body: list[ast.stmt]) -> bool:
    """The branch ends the statements after it: `return`, or in a loop over the
    blocks `continue` / `break` (stochastic depth: `if self.training and
    torch.rand(()) < p: continue` skips that layer)."""
    return bool(body) and isinstance(body[-1], ast.Return | ast.Continue | ast.Break)


def forward_of(cls: ast.ClassDef) -> ast.FunctionDef:
    return next(s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == "forward")


def wrapped_by(script: Script, ddp: ast.Call, classes: set[str]) -> tuple[set[str], set[str]]:
    """The names that hold what one DDP call wraps (the wrapper it is assigned
    to, the module given to it) and the file's model classes built into it:
    `DDP(Net().cuda())`, or `model = Net()` ... `DDP(model)`."""
    if not ddp.args:
        return set(), set()
    names = {
        source_text(n)
        for n in walk(ddp.args[0])
        if isinstance(n, ast.Name) or self_attribute(n)  # DDP(self.net, ...)
    }
    values = [ddp.args[0], *(v for name in names for v in script.assigned_values.get(name, []))]
    names |= wrapper_names(script, ddp)
    built = {
        node.func.id
        for value in values
        for node in walk(value)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in classes
    }
    return names, built


def wrapper_names(script: Script, ddp: ast.Call) -> set[str]:
    """The names (or fields) the DDP call is assigned to: `model = DDP(net)`,
    `self.model = DDP(...).cuda()`."""
    return {
        source_text(target)
        for node in script.of_type(ast.Assign)
        if unmoved(node.value) is ddp
        for target in node.targets
    }


def picked_members(forward: ast.FunctionDef) -> Iterator[tuple[ast.Call, str]]:
    """`self.heads[task](x)` with `task` an input of forward, or a field of the model
    (`self.heads[self.current_task](x)`: the task being learned, one head a step), or
    a name forward makes of fields alone (`key = "quantile" if self.loss_type ==
    "quantile" else "point"`)."""
    inputs = {a.arg for a in forward.args.args[1:]}
    from_fields = names_made_of_fields(forward)
    present = values_present_in_an_input(forward, inputs)
    for node in walk(forward):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
            continue
        member = node.func
        chooser = member.slice
        if not (
            isinstance(member.value, ast.Attribute)
            and isinstance(member.value.value, ast.Name)
            and member.value.value.id == "self"
        ):
            continue
        if isinstance(chooser, ast.Name) and chooser.id in inputs:
            yield node, chooser.id
        elif isinstance(chooser, ast.Name) and chooser.id in present:
            yield node, f"{chooser.id} in {present[chooser.id]}"
        elif isinstance(chooser, ast.Name) and chooser.id in from_fields:
            yield node, f"{chooser.id} = {source_text(from_fields[chooser.id])}"
        elif self_attribute(chooser):
            yield node, source_text(chooser)


def values_present_in_an_input(function: ast.FunctionDef, inputs: set[str]) -> dict[str, str]:
    """Names a loop binds to the distinct values of an input (`for s in
    site.unique().tolist()`, `torch.unique(task_ids)`): only the values this batch
    holds, so the members they pick change with the batch."""
    present: dict[str, str] = {}
    for loop in walk(function):
        if not (
            isinstance(loop, ast.For | ast.comprehension) and isinstance(loop.target, ast.Name)
        ):
            continue
        values = loop.iter
        while isinstance(values, ast.Call) and called_name(values) in ("tolist", "list", "sorted"):
            values = values.args[0] if values.args else values.func.value  # type: ignore[attr-defined]
        if not (isinstance(values, ast.Call) and called_name(values) == "unique"):
            continue
        if names_in(values) & inputs:
            present[loop.target.id] = source_text(loop.iter)
    return present


def names_made_of_fields(function: ast.FunctionDef) -> dict[str, ast.expr]:
    """Names the function assigns once, from the model's fields and constants alone
    (no input, no loop): the same member every call until a field changes."""
    assigned: dict[str, list[ast.expr]] = {}
    looped: set[str] = set()
    for node in walk(function):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name in walk(target):
                    if isinstance(name, ast.Name):
                        assigned.setdefault(name.id, []).append(node.value)
        elif isinstance(node, ast.For | ast.comprehension | ast.AugAssign):
            looped |= {n.id for n in walk(node.target) if isinstance(n, ast.Name)}
    return {
        name: values[0]
        for name, values in assigned.items()
        if len(values) == 1 and name not in looped and reads_only_fields(values[0])
    }


def reads_only_fields(value: ast.expr) -> bool:
    """Every name the value reads is `self` (a field), with at least one field read."""
    names = [n for n in walk(value) if isinstance(n, ast.Name)]
    return bool(names) and all(n.id == "self" for n in names)


def members_picked_inside(
    classes: dict[str, ast.ClassDef], wrapped: str
) -> Iterator[tuple[ast.ClassDef, ast.Call, str]]:
    """`self.ops[choice](x)` in the forward of a block the wrapped model builds
    (a supernet's choice block), `choice` an input of that forward which the
    model above hands down, differently each step (the sampled path)."""
    for inner in built_classes(classes, wrapped)[1:]:
        if not any(isinstance(s, ast.FunctionDef) and s.name == "forward" for s in inner.body):
            continue  # a container of layers, run by its owner
        forward = forward_of(inner)
        for call, chooser in picked_members(forward):
            if chooser in {a.arg for a in forward.args.args[1:]}:
                member = source_text(call.func.value)  # type: ignore[attr-defined]
                yield inner, call, f"one member of {member} per call, the one `{chooser}` picks"


def members_some_steps_leave_out(
    script: Script, forward: ast.FunctionDef, names: set[str], ddp: ast.Call
) -> Iterator[tuple[ast.Call, str]]:
    """Member calls of a ModuleList / Dict in forward that run for only some members
    each step, with what picks them: an input that names one, or a list drawn per step."""
    for call, chooser in picked_members(forward):
        members = source_text(call.func.value)  # type: ignore[attr-defined]
        yield call, f"one member of {members} per call, the one `{chooser}` picks"
    for call, listed, line in members_of_a_list_drawn_per_step(script, forward, names, ddp):
        members = source_text(call.func.value)  # type: ignore[attr-defined]
        yield (
            call,
            (
                f"the members of {members} that `{listed}` lists, and training passes a list "
                f"decided per step (line {line})"
            ),
        )


def members_of_a_list_drawn_per_step(
    script: Script, forward: ast.FunctionDef, names: set[str], ddp: ast.Call
) -> Iterator[tuple[ast.Call, str, int]]:
    """`[self.token_embeds[v](x[:, j]) for j, v in enumerate(var_idx)]` in forward,
    with `var_idx` an input, and a training call of the wrapped model (through one
    of `names`) that passes for it a list decided per step (`random.sample(...)`):
    (the member call, the input, the line that decides the list)."""
    listed = dict(members_picked_from_an_input_list(forward))
    if not listed:
        return
    for call, nodes, strict in training_calls(script):
        if strict is not ddp or source_text(call.func) not in names:
            continue
        for parameter, argument in bound_arguments(forward, call, self_bound=True):
            line = varying_line(argument, nodes) if parameter in listed.values() else None
            if line is None:
                continue
            for member, input_name in listed.items():
                if input_name == parameter:
                    yield member, input_name, line


def members_picked_from_an_input_list(
    forward: ast.FunctionDef,
) -> Iterator[tuple[ast.Call, str]]:
    """(`self.embeds[v](...)`, "var_idx") where `v` is bound by a loop or a
    comprehension over forward's input `var_idx` (also through enumerate / zip)."""
    inputs = {a.arg for a in forward.args.args[1:]}
    loops = [
        (node.target, node.iter)
        for node in walk(forward)
        if isinstance(node, ast.For | ast.comprehension)
    ]
    for target, iterable in loops:
        sources = (
            iterable.args
            if isinstance(iterable, ast.Call) and called_name(iterable) in ("enumerate", "zip")
            else [iterable]
        )
        listed = [s.id for s in sources if isinstance(s, ast.Name) and s.id in inputs]
        if not listed:
            continue
        bound = {n.id for n in walk(target) if isinstance(n, ast.Name)}
        for node in walk(forward):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Subscript)
                and self_attribute(node.func.value) is not None
                and isinstance(node.func.slice, ast.Name)
                and node.func.slice.id in bound
            ):
                yield node, listed[0]


def switched_flags(
    script: Script, cls: ast.ClassDef, holders: set[str]
) -> Iterator[tuple[str, int, ast.Assign]]:
    """(flag, line of its `if` in forward, where the script sets it) for each `if
    self.flag` (or `if self.training and self.flag`, or `... if self.flag else
    None`) around a submodule call of forward, set outside the class on a name that holds this wrapped model
    (`model.module.use_aux = ...`). Setting it to True keeps the submodule in
    use: only another value counts."""
    for node in walk(forward_of(cls)):
        if isinstance(node, ast.If):
            gated: list[ast.AST] = list(node.body)
        elif isinstance(node, ast.IfExp):  # `aux = self.aux_head(f) if self.use_aux else None`
            gated = [node.body]
        else:
            continue
        if not any(self_call(c) for s in gated for c in walk(s)):
            continue
        for flag in self_flags(node.test):
            assignment = next(
                (a for a in flag_assignments(script, flag) if root_of(a) in holders), None
            )
            if assignment is not None:
                yield flag, node.lineno, assignment
                return


def flag_assignments(script: Script, flag: str) -> Iterator[ast.Assign]:
    """`x.flag = value` anywhere, but `= True`."""
    for node in script.nodes:
        if not isinstance(node, ast.Assign) or (
            isinstance(node.value, ast.Constant) and node.value.value is True
        ):
            continue
        if any(isinstance(t, ast.Attribute) and t.attr == flag for t in node.targets):
            yield node


def root_of(assignment: ast.Assign) -> str | None:
    """`model` for `model.module.use_aux = ...`."""
    target = assignment.targets[0]
    while isinstance(target, ast.Attribute):
        target = target.value
    return target.id if isinstance(target, ast.Name) else None


def self_flags(test: ast.expr) -> list[str]:
    """`self.use_aux`, `self.training and self.use_aux` -> ["use_aux"]."""
    parts = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    return [
        part.attr
        for part in parts
        if isinstance(part, ast.Attribute)
        and isinstance(part.value, ast.Name)
        and part.value.id == "self"
        and part.attr != "training"
    ]


# A library classifier's own head, by the family of model that builds it: a forward
# that runs the backbone piece by piece leaves it out unless it reads it.
TORCHVISION_HEADS = (
    (("resnet", "resnext", "wide_resnet", "regnet", "googlenet", "inception", "shufflenet"), "fc"),
    (
        ("densenet", "vgg", "alexnet", "mobilenet", "efficientnet", "convnext", "mnasnet"),
        "classifier",
    ),
    (("vit_", "swin_", "maxvit"), "heads"),
)


@check("unused-parameters")
def check_library_backbone_run_without_its_head(script: Script) -> Iterator[Finding]:
    """`self.base = torchvision.models.resnet50(...)` in a model whose forward runs
    `b.conv1 ... b.layer4` and never `b.fc`: the backbone's classifier stays a
    parameter of the model and gets no gradient at any step, under a DDP that
    expects one for every parameter."""
    strict = strict_ddp_calls(script)
    if not strict:
        return
    for cls in model_classes(script):
        init = next(
            (s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None
        )
        if init is None:
            continue
        for field, built, head in library_backbones(script, init):
            forward = forward_of(cls)
            used = pieces_run(forward, field)
            if used is None or head in used or head_taken_out(script, field, head):
                continue
            yield script.finding(
                "unused-parameters",
                built,
                f"{cls.name}.forward runs {field} piece by piece ({', '.join(sorted(used)[:4])}"
                f"{', ...' if len(used) > 4 else ''}) and never its {head}: the library's "
                "classifier stays in the model and gets no gradient at any step, and DDP "
                f"(line {strict[0].lineno}) expects one for every parameter and fails with "
                '"Expected to have finished reduction in the prior iteration"; remove it '
                f"({field}.{head} = nn.Identity()) or pass find_unused_parameters=True",
            )


@check("unused-parameters")
def check_timm_model_run_for_its_features(script: Script) -> Iterator[Finding]:
    """`self.backbone = timm.create_model(arch)` (its classifier built: 1000 classes by
    default) in a model that only ever calls `self.backbone.forward_features(x)`:
    the classifier gets no gradient at any step, under a DDP that expects one."""
    strict = strict_ddp_calls(script)
    if not strict:
        return
    for cls in model_classes(script):
        for field, built in timm_models_with_a_head(script, cls):
            runs = pieces_it_runs(cls, field)
            if runs is None or classifier_taken_out(script, field):
                continue
            yield script.finding(
                "unused-parameters",
                built,
                f"{cls.name} {runs} and never the model's classifier, "
                "which timm.create_model builds (num_classes defaults to 1000): its parameters "
                f"get no gradient at any step, and DDP (line {strict[0].lineno}) expects one for "
                'every parameter and fails with "Expected to have finished reduction in the '
                'prior iteration"; build it without one (num_classes=0, or '
                f"{field}.reset_classifier(0)) or pass find_unused_parameters=True",
            )


# A timm model's classifier, by family, and what runs it (besides calling the model).
TIMM_HEADS = ("head", "fc", "classifier", "last_linear")
TIMM_HEAD_READS = frozenset({"forward", "forward_head", "get_classifier", *TIMM_HEADS})


def timm_models_with_a_head(script: Script, cls: ast.ClassDef) -> Iterator[tuple[str, ast.Call]]:
    """(`self.x`, the call) for each `self.x = timm.create_model(...)` that keeps its
    classifier: not told num_classes=0 (or a name for it) nor features_only=True;
    also `self.x = encoder` for an __init__ parameter that every construction of the
    class passes such a model (`encoder = timm.create_model(arch)`; `MAE(encoder)`)."""
    for node in walk(cls):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        for value in timm_models_given(script, cls, unmoved(node.value)):
            if keeps_its_classifier(value) and self_attribute(node.targets[0]):
                yield source_text(node.targets[0]), value


def timm_models_given(script: Script, cls: ast.ClassDef, value: ast.expr) -> list[ast.Call]:
    """The timm.create_model call a field's value is, or, for an __init__ parameter,
    the one every construction of the class passes for it (by a name assigned once)."""
    if isinstance(value, ast.Call):
        return [value] if script.name_of(value.func) == "timm.create_model" else []
    init = method_of(cls, "__init__")
    if not (isinstance(value, ast.Name) and init is not None):
        return []
    passed = [
        argument
        for call, name in script.call_names
        if name == cls.name
        for parameter, argument in bound_arguments(init, call, self_bound=True)
        if parameter == value.id
    ]
    models = []
    for argument in passed:
        if isinstance(argument, ast.Name):
            seen = assignments_seen_from(script, argument).get(argument.id, [])
            argument = unmoved(seen[0]) if len(seen) == 1 else argument
        if not (
            isinstance(argument, ast.Call) and script.name_of(argument.func) == "timm.create_model"
        ):
            return []  # one construction passes something else
        models.append(argument)
    return models[:1]


def keeps_its_classifier(value: ast.Call) -> bool:
    """timm.create_model(...) not told num_classes=0 (or a name for it) nor features_only."""
    classes = keyword(value, "num_classes")
    if classes is not None and not (
        isinstance(classes, ast.Constant) and classes.value not in (0, None)
    ):
        return False  # num_classes=0, or a value the file decides
    features_only = keyword(value, "features_only")
    return features_only is None or (
        isinstance(features_only, ast.Constant) and features_only.value is False
    )


def pieces_it_runs(cls: ast.ClassDef, field: str) -> str | None:
    """How the class's methods run the model in `field` without its classifier:
    "calls self.x.forward_features()", or "runs self.x piece by piece (patch_embed,
    blocks)" through the field or a name for it (`enc = self.encoder`); None when
    they call the model itself or anything that reaches its classifier."""
    aliases = {field} | {
        target.id
        for node in walk(cls)
        if isinstance(node, ast.Assign) and source_text(node.value) == field
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    features = False
    pieces: list[str] = []
    for node in walk(cls):
        if isinstance(node, ast.Call) and source_text(node.func) in aliases:
            return None
        if isinstance(node, ast.Attribute) and source_text(node.value) in aliases:
            if node.attr in TIMM_HEAD_READS:
                return None
            features |= node.attr == "forward_features"
    for node in walk(cls):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and source_text(node.func.value) in aliases
            and node.func.attr != "forward_features"
            and node.func.attr not in pieces
        ):
            pieces.append(node.func.attr)
    if features:
        return f"calls {field}.forward_features()"
    if pieces:
        return f"runs {field} piece by piece ({', '.join(pieces[:3])})"
    return None


def classifier_taken_out(script: Script, field: str) -> bool:
    """The file resets the classifier (`self.backbone.reset_classifier(0)`), or
    replaces, deletes or freezes it or the whole model (head_taken_out)."""
    local = field.removeprefix("self.")
    if any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "reset_classifier"
        and source_text(node.func.value).endswith(local)
        for node in script.nodes
    ):
        return True
    return any(head_taken_out(script, field, head) for head in TIMM_HEADS)


def library_backbones(script: Script, init: ast.FunctionDef) -> Iterator[tuple[str, ast.Call, str]]:
    """(`self.x`, the call, its head's attribute) for each torchvision classifier
    that __init__ keeps as a field, directly or through a local name."""
    locals_built: dict[str, ast.Call] = {}
    for node in walk(init):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], unmoved(node.value)
        if isinstance(value, ast.Name) and value.id in locals_built:
            value = locals_built[value.id]
        if not isinstance(value, ast.Call) or (head := torchvision_head(script, value)) is None:
            continue
        if isinstance(target, ast.Name):
            locals_built[target.id] = value
        elif self_attribute(target):
            yield source_text(target), value, head


def torchvision_head(script: Script, call: ast.Call) -> str | None:
    """The head attribute of a torchvision classifier builder (`resnet50` -> "fc")."""
    name = script.name_of(call.func)
    if not name.startswith("torchvision.models."):
        return None
    builder = name.rsplit(".", 1)[-1]
    for families, head in TORCHVISION_HEADS:
        if builder.startswith(families):
            return head
    return None


def pieces_run(forward: ast.FunctionDef, field: str) -> set[str] | None:
    """The attributes of `field` forward reads (`self.base.conv1`, or `b.conv1` after
    `b = self.base`); None when forward calls the whole model (`self.base(x)`)."""
    aliases = {field}
    for node in walk(forward):
        if isinstance(node, ast.Assign) and source_text(node.value) == field:
            aliases |= {source_text(t) for t in node.targets if isinstance(t, ast.Name)}
    used: set[str] = set()
    for node in walk(forward):
        if isinstance(node, ast.Call) and source_text(node.func) in aliases:
            return None
        if isinstance(node, ast.Attribute) and source_text(node.value) in aliases:
            used.add(node.attr)
    return used or None


def head_taken_out(script: Script, field: str, head: str) -> bool:
    """The file replaces, deletes or freezes the head, or freezes the whole backbone
    (in the class, or on the built model: `model.base.fc = nn.Identity()`)."""
    local = field.removeprefix("self.")
    for node in script.nodes:
        if isinstance(node, ast.Assign | ast.Delete):
            targets = node.targets
            if any(
                isinstance(t, ast.Attribute) and t.attr == head and source_text(t.value) != "self"
                for t in targets
            ):
                return (
                    True  # `base.fc = nn.Identity()`, `del base.fc`; not the class's own `self.fc`
                )
        if isinstance(node, ast.Attribute) and node.attr in ("requires_grad_", "requires_grad"):
            owner = node.value
            if isinstance(owner, ast.Attribute) and owner.attr in (head, local):
                return True  # `base.fc.requires_grad_(False)`, `self.base.requires_grad_(False)`
        if isinstance(node, ast.For) and freezes_parameters_of(node, {head, local}):
            return True
    return False


def freezes_parameters_of(loop: ast.For, owners: set[str]) -> bool:
    """`for p in self.base.parameters(): p.requires_grad = False` (or of the head)."""
    iterated = loop.iter
    if not (isinstance(iterated, ast.Call) and isinstance(iterated.func, ast.Attribute)):
        return False
    owner = iterated.func.value
    named = isinstance(owner, ast.Attribute | ast.Name) and (
        getattr(owner, "attr", None) in owners or getattr(owner, "id", None) in owners
    )
    return named and any(
        isinstance(n, ast.Attribute) and n.attr in ("requires_grad", "requires_grad_")
        for statement in loop.body
        for n in walk(statement)
    )
