"""A training call whose own arguments route forward around a submodule.

`model(feats)` leaving `return_frames=False` where only the frame branch runs
`self.frame_head`; `agent(obs, act, mode="q")` where `if mode == "q": return
self.q1(...), self.q2(...)` returns before the policy; `model(ids,
value_only=True)` returning before the LM head; `model(img, use_refine)`
with `use_refine = epoch >= start` and `if not use_refine: return [hm]`
ahead of `self.refine`. Forward, followed with the call's constant arguments
(or its defaults), never reaches a submodule it runs on other paths: that
step's backward gives its parameters no gradient, and a DDP that expects
every parameter fails at the next step with "Expected to have finished
reduction in the prior iteration".

Only calls in a function that runs a backward (a training step) are judged,
outside no_grad, and only submodules with parameters that are not frozen.
An argument decided per step (a step counter's comparison, a modulo, a
random draw, or the step's batch: a flag read off it, a mode drawn with it from
an iterator) is followed both ways, or, where forward compares the parameter
with constants, with each (`mode == "tail"`: that text and another; `ratio >
0`: 0 and 1). What forward does with a value it
cannot decide (a test of the input, of self.training) is followed both ways
too, so a submodule counts as reached if any path of the call may run it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from assistant.lint.checks.unused import (
    batch_names,
    encloses,
    forward_of,
    inside_no_grad,
    model_classes,
    strict_ddp_calls,
    turn_values,
    varying_line,
    without_gradients,
    wrapped_by,
    wrapper_names,
)
from assistant.lint.model import (
    Script,
    bound_arguments,
    called_name,
    children,
    is_none,
    keyword,
    method_of,
    self_attribute,
    sole_name_target,
    source_text,
    truth_at_count,
    walk,
)
from assistant.lint.ranks import assignments_seen_from
from assistant.lint.registry import check
from assistant.lint.tracer import constant_arguments
from assistant.lint.values import TEST_KEY, decide, option_default
from assistant.results import Finding

# Layers built without parameters: leaving one out costs DDP nothing.
WITHOUT_PARAMETERS = frozenset(
    {
        "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "Identity",
        "ReLU", "ReLU6", "LeakyReLU", "GELU", "SiLU", "ELU", "SELU", "Mish", "Sigmoid",
        "Tanh", "Softmax", "LogSoftmax", "Softplus", "Hardswish", "Hardsigmoid",
        "Flatten", "Unflatten", "Upsample", "PixelShuffle", "PixelUnshuffle",
        "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
        "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
        "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d",
        "CrossEntropyLoss", "MSELoss", "L1Loss", "BCELoss", "BCEWithLogitsLoss",
        "NLLLoss", "SmoothL1Loss", "KLDivLoss", "CosineSimilarity",
    }
)  # fmt: skip
MODEL_FACTORIES = frozenset({"from_pretrained", "from_config", "create_model"})
BACKWARDS = frozenset({"backward", "manual_backward"})
MAX_METHODS = 16  # own methods followed from forward (self.encode(x) ...)


@check("unused-parameters")
def check_submodule_the_call_routes_around(script: Script) -> Iterator[Finding]:
    """A training call of a DDP-wrapped model whose constant (or per-step) arguments
    send forward past a submodule, a branch on how many items the batch holds that
    leaves one out, or a member every call of which leaves one of its own out,
    under a DDP that expects every parameter."""
    strict = strict_ddp_calls(script)
    if not strict:
        return
    classes = {cls.name: cls for cls in model_classes(script)}
    reported: set[int] = set()
    for ddp in strict:
        for where, message in left_out_by_the_steps(script, classes, ddp):
            line = where if isinstance(where, int) else where.lineno
            if line in reported:
                continue
            reported.add(line)
            yield script.finding("unused-parameters", where, message)


def left_out_by_the_steps(
    script: Script, classes: dict[str, ast.ClassDef], ddp: ast.Call
) -> Iterator[tuple[ast.AST | int, str]]:
    """(where, message) for each way a training step of the model `ddp` wraps
    leaves trainable submodules out."""
    fails = (
        f"DDP (line {ddp.lineno}) expects one for every parameter each step and fails with "
        '"Expected to have finished reduction in the prior iteration"'
    )
    holders, built = wrapped_by(script, ddp, set(classes))
    holders -= set(classes) | set(script.functions)  # `Net()` builds, it does not step
    for name in sorted(built):
        cls = classes[name]
        trainable = trainable_submodules(script, cls)
        everywhere = reached(cls, {}) & trainable
        flags = built_flags(script, cls)
        calls = list(training_calls(script, holders))
        for call, nodes in calls:
            for left_out, where, how in routes(script, cls, call, nodes, everywhere, flags):
                yield (
                    where,
                    (
                        f"{how} forward never runs {fields_shown(left_out)}, which it runs on "
                        f"other paths: that step's backward gives their parameters no gradient, "
                        f"and {fails}: pass find_unused_parameters=True, or run them every step "
                        "and weight what they add by zero"
                    ),
                )
        if not calls:
            continue
        eval_only = evaluation_only(cls, everywhere, calls)
        if eval_only:
            yield (
                first_use(forward_of(cls), eval_only),
                (
                    f"forward runs {fields_shown(eval_only)} only when the model is not "
                    "training (self.training False), and the training steps run it in train "
                    "mode: their parameters never get a gradient, and "
                    f"{fails}: pass find_unused_parameters=True, or freeze them "
                    "(requires_grad_(False)) while training them elsewhere"
                ),
            )
        for test, left_out in branches_on_the_batch_size(cls, trainable):
            yield (
                test,
                (
                    f"in training, forward runs {fields_shown(left_out)} only when "
                    f"`{source_text(test.test)}` says the batch holds items for it: a step whose "
                    "batch has none (a batch of background images, no masked instance) gives "
                    f"their parameters no gradient, and {fails}: run them on the empty selection "
                    "too (the gradient is then zero, but it is there), or pass "
                    "find_unused_parameters=True"
                ),
            )
        for gate, method, left_out in side_methods_some_steps_call(
            script, ddp, cls, trainable - everywhere, calls
        ):
            yield (
                gate,
                (
                    f"only {method}() runs {fields_shown(left_out)} (forward does not), and the "
                    f"training step calls it only when `{source_text(gate.test)}` holds: on "
                    f"the other steps their parameters get no gradient, and {fails}: call it "
                    "every step and weight what it adds by zero, or pass "
                    "find_unused_parameters=True"
                ),
            )
        for member_call, member, inner, left_out, shown in inner_members_left_out(
            script, classes, cls
        ):
            yield (
                member_call,
                (
                    f"every call of self.{member} leaves {shown}, so {inner}.forward never runs "
                    f"{fields_shown(left_out)}, which it runs on other paths: those parameters "
                    f"get no gradient, and {fails}: build them only where a call uses them, or "
                    "pass find_unused_parameters=True"
                ),
            )


def evaluation_only(
    cls: ast.ClassDef, everywhere: set[str], calls: list[tuple[ast.Call, list[ast.AST]]]
) -> set[str]:
    """Trainable submodules forward runs only with self.training False (`elif
    early_stop:` after `if self.training:`, an early-exit confidence head), that no
    other method uses, when no training step puts the model in eval mode."""
    if any(
        isinstance(n, ast.Call) and called_name(n) == "eval" for _, nodes in calls for n in nodes
    ):
        return set()
    if "self.training" not in {source_text(n) for n in walk(forward_of(cls))}:
        return set()
    left_out = everywhere - reached(cls, {"self.training": True})
    reached_from_forward = reached(cls, {})
    for method in cls.body:
        if (
            isinstance(method, ast.FunctionDef)
            and method.name not in reached_from_forward
            and method.name not in ("forward", "__init__")
        ):
            left_out -= attributes_in(method)  # a step may call that method itself
    return left_out


def first_use(forward: ast.FunctionDef, fields: set[str]) -> ast.AST:
    """The first `self.<field>` of `fields` in forward."""
    uses = [n for n in walk(forward) if self_attribute(n) in fields]
    return min(uses, key=lambda n: (n.lineno, n.col_offset), default=forward)


def side_methods_some_steps_call(
    script: Script,
    ddp: ast.Call,
    cls: ast.ClassDef,
    outside_forward: set[str],
    calls: list[tuple[ast.Call, list[ast.AST]]],
) -> Iterator[tuple[ast.If, str, set[str]]]:
    """(the gate, the method, the submodules) for a method of the wrapped model
    other than forward that alone runs trainable submodules, called in a training
    step through the wrapper's `.module` (or the unwrapped model's name) only
    under an `if` decided per step that the step's forward call is not under
    (`if has_key.any(): kl = model.module.key_logits(h[has_key])`)."""
    if not outside_forward:
        return
    wrapped = {n.id for n in walk(ddp.args[0]) if isinstance(n, ast.Name)} if ddp.args else set()
    wrappers = wrapper_names(script, ddp)
    reachers = {f"{name}.module" for name in wrappers} | (wrapped - wrappers)
    methods = [
        s.name
        for s in cls.body
        if isinstance(s, ast.FunctionDef) and not s.name.startswith("__") and s.name != "forward"
    ]
    forward_calls: dict[int, tuple[list[ast.AST], list[ast.Call]]] = {}
    for call, nodes in calls:  # the step's forward calls, by the scope they are in
        forward_calls.setdefault(id(nodes), (nodes, []))[1].append(call)
    for nodes, forwards in forward_calls.values():
        for node in nodes:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in methods or source_text(node.func.value) not in reachers:
                continue
            left_out = reached(cls, {}, node.func.attr) & outside_forward
            gate = per_step_gate_around(node, forwards, nodes)
            if left_out and gate is not None:
                yield gate, node.func.attr, left_out


def per_step_gate_around(
    call: ast.Call, forwards: list[ast.Call], nodes: list[ast.AST]
) -> ast.If | None:
    """The innermost `if` around `call`, decided per step (a step count, a random
    draw, the step's batch), that holds none of the step's forward calls (an `if`
    that skips the whole step leaves nothing out alone)."""
    batch = batch_names(nodes, forwards[0])
    gates = [
        node
        for node in nodes
        if isinstance(node, ast.If)
        and any(n is call for statement in node.body for n in walk(statement))
        and not any(n is forward for forward in forwards for n in walk(node))
        and varying_line(node.test, nodes, batch, around=forwards[0]) is not None
    ]
    return max(gates, key=lambda gate: gate.lineno, default=None)


def fields_shown(fields: set[str]) -> str:
    return ", ".join(f"self.{field}" for field in sorted(fields)[:3])


def routes(
    script: Script,
    cls: ast.ClassDef,
    call: ast.Call,
    nodes: list[ast.AST],
    everywhere: set[str],
    flags: dict[str, tuple[object, str]],
) -> Iterator[tuple[set[str], int, str]]:
    """(submodules left out, line to report, how) for the call's constant arguments
    and the flags the model was built with, then for each argument decided per
    step, taken false and true."""
    forward = forward_of(cls)
    decided = decided_in(forward)
    given = constant_arguments(forward, call, method=True)
    given.update({flag: value for flag, (value, _how) in flags.items()})
    # an option passed as it is (`net(x, diagnose=args.train_precip)`): its default
    options = options_passed(script, forward, call, decided - set(given))
    given.update({parameter: value for parameter, (value, _how) in options.items()})
    notes = {
        **{k: how for k, (_v, how) in flags.items()},
        **{k: h for k, (_v, h) in options.items()},
    }
    left_out = everywhere - reached(cls, given)
    if left_out:
        shown = ", ".join(
            f"{k}={v!r}" + (f" ({notes[k]})" if k in notes else "")
            for k, v in given.items()
            if k in decided or k in flags
        )
        yield left_out, call.lineno, f"with {shown or 'these arguments'},"
    for parameter, argument in per_step_arguments(forward, decided, call, nodes):
        tried = turn_values(argument, nodes) or compared_constants(forward, parameter)
        for value in tried or (False, True):
            left_out = everywhere - reached(cls, {**given, parameter: value})
            if left_out:
                line = varying_line(argument, nodes) or call.lineno
                how = f"on the steps where {shown_value(forward, parameter, argument, value)},"
                yield left_out, line, how
                break


def options_passed(
    script: Script, forward: ast.FunctionDef, call: ast.Call, parameters: set[str]
) -> dict[str, tuple[object, str]]:
    """{parameter: (value, how)} for each of `parameters` the call passes an option
    of the run (`args.train_precip`, a config entry) whose default the file says."""
    found: dict[str, tuple[object, str]] = {}
    seen: dict[str, list[ast.expr]] | None = None
    for parameter, argument in bound_arguments(forward, call, self_bound=True):
        if parameter not in parameters:
            continue
        if isinstance(argument, ast.Attribute | ast.Subscript):
            known, value = option_default(script, argument)
            if known:
                found[parameter] = (value, f"{source_text(argument)}, unless the run sets it")
        elif isinstance(argument, ast.Name):
            # `use_dipole = args.dipole_weight > 0` ... `model(..., with_dipole=use_dipole)`
            seen = assignments_seen_from(script, call) if seen is None else seen
            values = seen.get(argument.id, [])
            taken = decided_by_options(script, values[0]) if len(values) == 1 else None
            if taken is not None:
                how = f"{argument.id} = {source_text(values[0])}, unless the run sets it"
                found[parameter] = (taken, how)
    return found


def decided_by_options(script: Script, value: ast.expr) -> bool | None:
    """The truth of a test made of the run's options at their defaults
    (`args.dipole_weight > 0` with default 0.0: False); None if it is not one."""
    options = [
        node
        for node in walk(value)
        if isinstance(node, ast.Attribute | ast.Subscript) and option_default(script, node)[0]
    ]
    if not options:
        return None
    given = {source_text(node): option_default(script, node)[1] for node in options}
    return decide(value, given)


def per_step_arguments(
    forward: ast.FunctionDef, decided: set[str], call: ast.Call, nodes: list[ast.AST]
) -> Iterator[tuple[str, ast.expr]]:
    """(parameter, argument) for each argument of the call, of a parameter forward
    tests (`decided`), whose value is decided per step: by a counter, a modulo, a
    draw, or by the step's batch (`with_merge=bool(has_span.any())`, a mode drawn
    with the batch from an iterator that alternates loaders)."""
    walked = batch_names(nodes, call) | drawn_with_the_batch(nodes, call)
    batch = walked - constants_walked(nodes, call)
    for parameter, argument in bound_arguments(forward, call, self_bound=True):
        if parameter in decided and (
            varying_line(argument, nodes) is not None
            or varying_line(argument, nodes, batch, around=call) is not None
        ):
            yield parameter, argument


def constants_walked(nodes: list[ast.AST], call: ast.Call) -> frozenset[str]:
    """Names a loop around the call binds to constants (`for task in ("count",
    "disease")`): the same turns every step (a backward in each is takes_turns'
    case), no batch."""
    return frozenset(
        target.id
        for loop in nodes
        if isinstance(loop, ast.For)
        and encloses(loop, call)
        and isinstance(loop.iter, ast.Tuple | ast.List)
        and all(isinstance(item, ast.Constant) for item in loop.iter.elts)
        for target in walk(loop.target)
        if isinstance(target, ast.Name)
    )


def drawn_with_the_batch(nodes: list[ast.AST], call: ast.Call) -> frozenset[str]:
    """Names a loop around the call assigns from `next(iterator)`: the step's batch,
    drawn by hand (`pos, neg, weight, mode = next(train_iterator)`)."""
    return frozenset(
        target.id
        for loop in nodes
        if isinstance(loop, ast.For | ast.While) and encloses(loop, call)
        for node in walk(loop)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and called_name(node.value) == "next"
        for target in walk(node.targets[0])
        if isinstance(target, ast.Name)
    )


def compared_constants(forward: ast.FunctionDef, parameter: str) -> list[object]:
    """Values that route a parameter forward compares with constants each its own way:
    each text it is compared with and one it is not (`mode == "tail-batch"`: a mode
    argument), each number and one above it (`mask_ratio > 0`: a ratio that is 0 on
    some steps)."""
    found: list[object] = []
    for node in walk(forward):
        if not (isinstance(node, ast.Compare) and len(node.ops) == 1):
            continue
        sides = [node.left, node.comparators[0]]
        if not any(isinstance(side, ast.Name) and side.id == parameter for side in sides):
            continue
        for side in sides:
            if not isinstance(side, ast.Constant) or isinstance(side.value, bool):
                continue
            if isinstance(side.value, str):
                found.append(side.value)
            elif isinstance(side.value, int | float):
                found += [side.value, side.value + 1]
    if any(isinstance(value, str) for value in found):
        found.append(None)
    return list(dict.fromkeys(found))


def shown_value(forward: ast.FunctionDef, parameter: str, argument: ast.expr, value: object) -> str:
    """`lab is not None` where forward tests the parameter against None (True or False
    stand for any value given), else the value itself."""
    if isinstance(value, bool) and compared_with_none(forward, parameter):
        return f"{source_text(argument)} is not None"
    return f"{source_text(argument)} is {value!r}"


def compared_with_none(forward: ast.FunctionDef, parameter: str) -> bool:
    return any(
        isinstance(node, ast.Compare)
        and isinstance(node.left, ast.Name)
        and node.left.id == parameter
        and any(is_none(side) for side in node.comparators)
        for node in walk(forward)
    )


def decided_in(forward: ast.FunctionDef) -> set[str]:
    """forward's parameters that some `if` (or `x if c else y`) tests."""
    tests = [n.test for n in walk(forward) if isinstance(n, ast.If | ast.IfExp)]
    return {n.id for test in tests for n in walk(test) if isinstance(n, ast.Name)}


def built_flags(script: Script, cls: ast.ClassDef) -> dict[str, tuple[object, str]]:
    """`self.deep_supervision = deep_supervision` in __init__, and the value every
    construction of the class in the file gives that parameter: passed as a
    constant, left at its default, or an option / config entry left at its
    default (values.option_default): {"self.deep_supervision": (False, how)}.
    A field assigned anywhere else, or a construction passing what the file
    does not say, is no flag."""
    init = method_of(cls, "__init__")
    if init is None:
        return {}
    parameters = {a.arg for a in init.args.args[1:]}
    flags: dict[str, tuple[object, str]] = {}
    for statement in init.body:
        if not (
            isinstance(statement, ast.Assign)
            and len(statement.targets) == 1
            and (field := self_attribute(statement.targets[0]))
            and assignments_of(script, field) == 1
        ):
            continue
        parameter, entry = given_parameter(statement.value, parameters)
        if parameter is None:
            continue
        known, value, how = constructed_value(script, cls, init, parameter, entry)
        if known:
            flags[f"self.{field}"] = (value, how)
    return flags


def given_parameter(value: ast.expr, parameters: set[str]) -> tuple[str | None, str | None]:
    """(parameter, entry) of what __init__ keeps: `mode` (the parameter itself) or
    `cfg.pool` (an entry of a config object it is given); (None, None) otherwise."""
    if isinstance(value, ast.Name) and value.id in parameters:
        return value.id, None
    if (
        isinstance(value, ast.Attribute)
        and isinstance(value.value, ast.Name)
        and value.value.id in parameters
    ):
        return value.value.id, value.attr
    return None, None


def constructed_value(
    script: Script,
    cls: ast.ClassDef,
    init: ast.FunctionDef,
    parameter: str,
    entry: str | None = None,
) -> tuple[bool, object, str]:
    """(known, value, how) of what every construction of `cls` in the file gives
    __init__'s `parameter` (or that argument's `entry`: built_value); unknown when
    there is none, when one passes what the file does not say, or when two disagree."""
    built = [
        built_value(script, init, call, parameter, entry)
        for call, name in script.call_names
        if name == cls.name
    ]
    if not built or not all(known for known, _v, _h in built):
        return False, None, ""
    if len({repr(value) for _k, value, _h in built}) != 1:
        return False, None, ""
    return built[0]


def assignments_of(script: Script, field: str) -> int:
    """How many assignments in the file set a field of this name (`self.x = `, `m.x = `)."""
    return sum(
        1
        for node in script.of_type(ast.Assign | ast.AugAssign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for part in walk(target)
        if isinstance(part, ast.Attribute) and part.attr == field
    )


def built_value(
    script: Script, init: ast.FunctionDef, call: ast.Call, parameter: str, entry: str | None
) -> tuple[bool, object, str]:
    """(known, value, how) of what this construction gives __init__'s `parameter`,
    or the `entry` of the config object it passes there (`Encoder(cfg)`: cfg.pool,
    read as option_default reads an option)."""
    if any(isinstance(a, ast.Starred) for a in call.args) or any(
        k.arg is None for k in call.keywords
    ):
        return False, None, ""
    given = dict(bound_arguments(init, call, self_bound=True)).get(parameter)
    if entry is not None:
        if not isinstance(given, ast.Name | ast.Attribute):
            return False, None, ""
        given = ast.Attribute(value=given, attr=entry, ctx=ast.Load())
        known, value = option_default(script, given)
        how = f"line {call.lineno} passes {source_text(given)}, {value!r} unless the run sets it"
        return known, value, how
    if given is None:
        defaults = constant_arguments(init, call, method=True)
        if parameter not in defaults:
            return False, None, ""
        return True, defaults[parameter], f"line {call.lineno} leaves {parameter} at its default"
    if isinstance(given, ast.Constant):
        return True, given.value, f"line {call.lineno} passes {parameter}={given.value!r}"
    known, value = option_default(script, given)
    how = f"line {call.lineno} passes {source_text(given)}, {value!r} unless the run sets it"
    return known, value, how


def inner_members_left_out(
    script: Script, classes: dict[str, ast.ClassDef], cls: ast.ClassDef
) -> Iterator[tuple[ast.Call, str, str, set[str], str]]:
    """A field of the wrapped model built from another model class of the file
    (`self.discriminator = Encoder(...)`) whose every call in the class leaves
    that class's forward off a path (`return_pooled` at its default False), so
    fields of it that other paths run never run: (first call, field, class,
    the fields left out, the arguments shown). Fields of it the class reads
    directly (`self.discriminator.word.weight`) count as used."""
    for member, built in fields_set_to_calls(cls):
        if not (
            isinstance(built.func, ast.Name)
            and built.func.id in classes
            and built.func.id != cls.name
        ):
            continue
        inner = classes[built.func.id]
        calls = [
            c for c in walk(cls) if isinstance(c, ast.Call) and self_attribute(c.func) == member
        ]
        if not calls:
            continue
        read_directly = {
            n.attr
            for n in walk(cls)
            if isinstance(n, ast.Attribute) and self_attribute(n.value) == member
        }
        forward = forward_of(inner)
        decided = decided_in(forward)
        flags = {flag: value for flag, (value, _how) in built_flags(script, inner).items()}
        left_out = reached(inner, {}) & trainable_submodules(script, inner)
        shown: set[str] = set()
        for call in calls:
            given = {**constant_arguments(forward, call, method=True), **flags}
            left_out -= reached(inner, given)
            shown |= {f"{k}={v!r}" for k, v in given.items() if k in decided or k in flags}
        left_out -= read_directly
        if left_out and shown:
            yield calls[0], member, inner.name, left_out, ", ".join(sorted(shown))


def training_calls(script: Script, holders: set[str]) -> Iterator[tuple[ast.Call, list[ast.AST]]]:
    """Calls of the wrapped model (by a name that holds it) in a function that runs a
    backward, outside no_grad."""
    for scope in script.all_scopes:
        if without_gradients(scope):
            continue
        nodes = script.scope_nodes(scope)
        if not any(isinstance(n, ast.Call) and called_name(n) in BACKWARDS for n in nodes):
            continue
        no_grad = inside_no_grad(nodes)
        for node in nodes:
            if (
                isinstance(node, ast.Call)
                and source_text(node.func) in holders
                and id(node) not in no_grad
            ):
                yield node, nodes


def trainable_submodules(script: Script, cls: ast.ClassDef) -> set[str]:
    """Fields the class's methods set to a built layer or parameter (`self.head =
    nn.Linear(...)`, a model class of the file, a library's model), but those built
    without parameters and those frozen anywhere in the file."""
    built = {
        member
        for node in walk(cls)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
        for target in node.targets
        if (member := self_attribute(target))
        and (builds_parameters(node.value) or built_by_a_file_function(script, node.value))
    }
    return built - frozen(script)


def built_by_a_file_function(script: Script, value: ast.Call) -> bool:
    """A function of the file that returns a layer it builds (`def tower(d, sizes):
    ... return nn.Sequential(*layers)`)."""
    function = script.function_called(value)
    if function is None or function.name[:1].isupper():
        return False
    returned = [n.value for n in walk(function) if isinstance(n, ast.Return) and n.value]
    return any(isinstance(r, ast.Call) and builds_parameters(r) for r in returned)


def builds_parameters(value: ast.Call) -> bool:
    """A layer class (`nn.Linear`, `Head`) but a parameterless one, or a library's model."""
    name = called_name(value)
    return name in MODEL_FACTORIES or (name[:1].isupper() and name not in WITHOUT_PARAMETERS)


def frozen(script: Script) -> set[str]:
    """Fields frozen somewhere: `self.x.requires_grad_(False)`, `model.x.eval()` does
    not count; `for p in self.x.parameters(): p.requires_grad = False` does."""
    found: set[str] = set()
    for node in script.of_type((ast.Call, ast.For)):
        if isinstance(node, ast.Call) and called_name(node) == "requires_grad_":
            found |= attributes_in(node.func)
        elif isinstance(node, ast.For) and any(
            isinstance(n, ast.Attribute) and n.attr == "requires_grad"
            for s in node.body
            for n in walk(s)
        ):
            found |= attributes_in(node.iter)
    return found


def attributes_in(expr: ast.AST) -> set[str]:
    return {n.attr for n in walk(expr) if isinstance(n, ast.Attribute)}


def reached(cls: ast.ClassDef, given: dict[str, object], start: str = "forward") -> set[str]:
    """The `self.x` fields forward (or the method `start`) may use with these
    parameter values (a test it cannot decide is followed both ways), with its own
    methods it calls."""
    methods = {s.name: s for s in cls.body if isinstance(s, ast.FunctionDef)}
    found: set[str] = set()
    walk_block(methods[start].body, given, found)
    pending = sorted(found & set(methods) - {start})
    seen = {start, *pending}
    while pending and len(seen) <= MAX_METHODS:
        method = pending.pop()
        more: set[str] = set()
        fields = {k: v for k, v in given.items() if k.startswith(("self.", TEST_KEY))}
        walk_block(methods[method].body, fields, more)
        found |= more
        for name in more & set(methods):
            if name not in seen:
                seen.add(name)
                pending.append(name)
    return found


# What counts a batch's items: `len(boxes)`, `masks.numel()`, `targets.shape[0]`,
# `sum(b.shape[0] for b in boxes)`, `mask.any()`.
SIZE_READS = frozenset({"len", "numel", "nelement", "size", "sum", "any", "count_nonzero"})


def branches_on_the_batch_size(
    cls: ast.ClassDef, trainable: set[str]
) -> Iterator[tuple[ast.If, set[str]]]:
    """(the `if`, the submodules it leaves out) for each `if` of forward on how many
    items the batch holds (`if n_inst > 0:`, `if not len(boxes): return loss`) whose
    empty side, in training, runs fewer of the trainable submodules."""
    forward = forward_of(cls)
    counts = {
        target.id
        for node in walk(forward)
        if isinstance(node, ast.Assign) and reads_batch_size(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    training = {"self.training": True}
    for node in walk(forward):
        if not isinstance(node, ast.If):
            continue
        empty = truth_on_an_empty_batch(node.test, counts)
        if empty is None:
            continue
        key = TEST_KEY + source_text(node.test)
        left_out = (
            reached(cls, {**training, key: not empty}) - reached(cls, {**training, key: empty})
        ) & trainable
        if left_out:
            yield node, left_out


def truth_on_an_empty_batch(test: ast.expr, counts: set[str]) -> bool | None:
    """The test's value when the batch holds no items: `n > 0` False, `len(x) == 0`
    True, `not x.numel()` True; None for a test of anything else."""
    return truth_at_count(test, lambda expr: is_a_count(expr, counts), 0)


def is_a_count(expr: ast.expr, counts: set[str]) -> bool:
    return (isinstance(expr, ast.Name) and expr.id in counts) or reads_batch_size(expr)


def reads_batch_size(expr: ast.expr) -> bool:
    """A count of what a name of forward holds (not of the model's own fields:
    `len(self.blocks)` is the model's structure, the same every step)."""
    if isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Attribute):
        counted = expr.value.value if expr.value.attr == "shape" else None
    elif isinstance(expr, ast.Call) and called_name(expr) in SIZE_READS:
        counted = expr
    else:
        return False
    return (
        counted is not None
        and not any(self_attribute(n) for n in walk(counted))
        and any(isinstance(n, ast.Name) and n.id != "self" for n in walk(counted))
    )


def walk_block(block: list[ast.stmt], given: dict[str, object], found: set[str]) -> bool:
    """Add the fields the block may use to `found`; True when every path through it
    returns (or raises)."""
    for statement in block:
        if isinstance(statement, ast.If):
            found |= fields_in(statement.test, given)
            taken = decide(statement.test, given)
            ends_body = taken is not False and walk_block(statement.body, given, found)
            ends_else = taken is not True and walk_block(statement.orelse, given, found)
            if (taken is True and ends_body) or (taken is False and ends_else):
                return True
            if taken is None and ends_body and ends_else:
                return True
        elif isinstance(statement, ast.Return | ast.Raise):
            found |= fields_in(statement, given)
            return True
        elif isinstance(statement, ast.For | ast.While | ast.With | ast.Try | ast.Match):
            # loops may not run, a try may leave early: only what they use counts
            for part in children(statement):
                if isinstance(part, ast.stmt):
                    walk_block([part], given, found)
                elif isinstance(part, ast.expr | ast.withitem | ast.match_case):
                    found |= fields_in(part, given)
                elif isinstance(part, ast.excepthandler):
                    walk_block(part.body, given, found)
        else:
            found |= fields_in(statement, given)
    return False


def fields_in(node: ast.AST, given: dict[str, object]) -> set[str]:
    """`self.x` fields in an expression or simple statement, skipping the branch of
    an `a if c else b` that these values rule out."""
    found: set[str] = set()
    pending = [node]
    while pending:
        current = pending.pop()
        if isinstance(current, ast.IfExp):
            taken = decide(current.test, given)
            pending.append(current.test)
            if taken is not False:
                pending.append(current.body)
            if taken is not True:
                pending.append(current.orelse)
            continue
        if member := self_attribute(current):
            found.add(member)
        pending.extend(children(current))
    return found


# Hugging Face base models built with a pooler (a dense layer over the first
# token) unless told `add_pooling_layer=False`; AutoModel builds one for these
# checkpoints' families (not DistilBERT, DeBERTa, ELECTRA, ModernBERT: no pooler).
POOLED_MODELS = frozenset(
    {
        "BertModel", "RobertaModel", "XLMRobertaModel", "AlbertModel", "CamembertModel",
        "ErnieModel", "MPNetModel", "LongformerModel", "BigBirdModel", "ViTModel",
    }
)  # fmt: skip
AUTO_MODELS = frozenset({"AutoModel"})
POOLED_FAMILIES = re.compile(
    r"bert|roberta|albert|ernie|mpnet|longformer|bigbird|vit", re.IGNORECASE
)
UNPOOLED_FAMILIES = re.compile(r"distil|deberta|electra|modern|neo", re.IGNORECASE)
# What reading only the token states looks like: `out.last_hidden_state`, `out[0]`.
TOKEN_STATES = frozenset({"last_hidden_state", "hidden_states", "attentions"})


@check("unused-parameters")
def check_library_pooler_never_read(script: Script) -> Iterator[Finding]:
    """`self.bert = AutoModel.from_pretrained("bert-base-uncased")` in the wrapped
    model, whose forward reads only `.last_hidden_state` of its output: the pooler
    BERT builds gets no gradient, under a DDP that expects one for every parameter."""
    strict = strict_ddp_calls(script)
    if not strict:
        return
    classes = {cls.name: cls for cls in model_classes(script)}
    frozen_fields = frozen(script)
    for ddp in strict:
        _holders, built = wrapped_by(script, ddp, set(classes))
        for name in sorted(built):
            cls = classes[name]
            for field, call, checkpoint in pooled_members(script, cls):
                if field in frozen_fields or not reads_only_token_states(cls, field):
                    continue
                yield script.finding(
                    "unused-parameters",
                    call,
                    f"{source_text(call.func)}({checkpoint}) builds the model with its pooler, and "
                    f"{name} reads only the token states of self.{field}: the pooler's parameters "
                    f"get no gradient, and DDP (line {ddp.lineno}) expects one for every parameter "
                    'each step and fails with "Expected to have finished reduction in the prior '
                    'iteration"; pass add_pooling_layer=False, or find_unused_parameters=True',
                )


def fields_set_to_calls(scope: ast.AST) -> Iterator[tuple[str, ast.Call]]:
    """(field, call) for each `self.field = Something(...)` under `scope`."""
    for node in walk(scope):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and (field := self_attribute(node.targets[0]))
            and isinstance(node.value, ast.Call)
        ):
            yield field, node.value


def pooled_members(script: Script, cls: ast.ClassDef) -> Iterator[tuple[str, ast.Call, str]]:
    """(field, the call that builds it, the checkpoint shown) for each field the
    class sets to a Hugging Face base model built with a pooler."""
    init = method_of(cls, "__init__")
    if init is None:
        return
    for field, call in fields_set_to_calls(init):
        built = call.func.value if isinstance(call.func, ast.Attribute) else call.func
        model = source_text(built).split(".")[-1]
        pooling = keyword(call, "add_pooling_layer")
        if pooling is not None and not (isinstance(pooling, ast.Constant) and pooling.value):
            continue
        if model in POOLED_MODELS:
            yield field, call, "..."
        elif model in AUTO_MODELS and called_name(call) == "from_pretrained" and call.args:
            checkpoint = checkpoint_name(script, cls, init, call.args[0])
            if (
                checkpoint
                and POOLED_FAMILIES.search(checkpoint)
                and not UNPOOLED_FAMILIES.search(checkpoint)
            ):
                yield field, call, repr(checkpoint)


def checkpoint_name(
    script: Script, cls: ast.ClassDef, init: ast.FunctionDef, given: ast.expr
) -> str | None:
    """The checkpoint's name: a literal, an option's default, or what every
    construction of the class passes for __init__'s parameter."""
    if isinstance(given, ast.Constant):
        known, value = True, given.value
    elif isinstance(given, ast.Name) and given.id in {a.arg for a in init.args.args[1:]}:
        known, value, _how = constructed_value(script, cls, init, given.id)
    else:
        known, value = option_default(script, given)
    return value if known and isinstance(value, str) else None


def reads_only_token_states(cls: ast.ClassDef, field: str) -> bool:
    """Every call of self.<field> in the class is read for its token states only:
    `self.bert(...).last_hidden_state`, or `out = self.bert(...)` then only
    `out.last_hidden_state` / `out[0]` (no pooled output, nothing handed on whole)."""
    calls = [n for n in walk(cls) if isinstance(n, ast.Call) and self_attribute(n.func) == field]
    if not calls:
        return False
    parents = {id(child): node for node in walk(cls) for child in children(node)}
    for call in calls:
        parent = parents.get(id(call))
        if token_state_read(parent, call):
            continue
        name = sole_name_target(parent)
        if name is None:
            return False
        reads = [
            n
            for n in walk(cls)
            if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
        ]
        if not reads or not all(token_state_read(parents.get(id(r)), r) for r in reads):
            return False
    return True


def token_state_read(parent: ast.AST | None, child: ast.AST) -> bool:
    """`child.last_hidden_state` or `child[0]`."""
    if isinstance(parent, ast.Attribute) and parent.value is child:
        return parent.attr in TOKEN_STATES
    if isinstance(parent, ast.Subscript) and parent.value is child:
        return isinstance(parent.slice, ast.Constant) and parent.slice.value == 0
    return False
