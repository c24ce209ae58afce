"""fp16 training set up so it cannot work (mixed-precision-dtype).

Two ways a file asks for float16 and trains without what float16 needs:

- The trained model is cast to half (`model.half()`, `model.to(torch.float16)`)
  and a GradScaler steps its optimizer. The gradients are then float16, and
  `scaler.unscale_` / `scaler.step` refuse them on the first step
  ("ValueError: Attempting to unscale FP16 gradients"): AMP keeps float32
  weights and lets autocast choose float16 per op.
- float16 is asked for by name (`torch.autocast(..., dtype=torch.float16)`,
  FSDP's `MixedPrecision(param_dtype=torch.float16)`) and the loss goes through
  a plain `loss.backward()` with no loss scaler anywhere in the file: small
  gradients underflow to zero and large ones overflow to inf, and nothing scales
  them back (bfloat16, with float32's range, needs no scaler).

Quiet where a framework scales the loss itself (DeepSpeed's engine,
Accelerate's `accelerator.backward`, Lightning, apex's amp.scale_loss), and for
a model cast to half whose parameters no optimizer gets (a frozen teacher, a
VAE, an evaluation copy).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from assistant.lint.checks.data import TORCH_WRAPPERS
from assistant.lint.model import Script, keyword, short, source_text, walk
from assistant.lint.registry import check
from assistant.results import Finding

# torch.float16 / torch.half by name; not bfloat16.
HALF = re.compile(r"(?<![\w.])(torch\.)?(float16|half)\b")
SCALERS = frozenset({"GradScaler", "ShardedGradScaler"})
SCALER_METHODS = frozenset({"step", "unscale_"})
# What scales the loss for the file: an engine, Accelerate, Fabric, Lightning, apex.
SCALING_FRAMEWORKS = re.compile(r"deepspeed|accelerate|lightning|apex|fabric", re.IGNORECASE)
OPTIMIZER = re.compile(
    r"(^|\.)(optim\.\w+|SGD|Adam\w*|RMSprop|Adagrad|Adadelta|Lamb|LAMB|Lars|LARS|Lion|"
    r"Fused\w+|\w*Optimizer)$"
)
PARAMETER_LISTS = frozenset({"parameters", "named_parameters"})


@check("mixed-precision-dtype")
def check_half_weights_under_a_grad_scaler(script: Script) -> Iterator[Finding]:
    """`model.half()` of a model whose optimizer a GradScaler steps."""
    if not scaler_steps(script):
        return
    trained = trained_modules(script)
    for node, _name in script.call_names:
        cast = cast_module(script, node)
        if cast is not None and cast in trained:
            yield script.finding(
                "mixed-precision-dtype",
                node,
                f"{cast} is cast to float16 and a GradScaler steps its optimizer: "
                'its gradients are float16, and the first scaler step fails ("Attempting to '
                'unscale FP16 gradients"); keep the weights float32 and let torch.autocast '
                "run the ops in float16",
            )


@check("mixed-precision-dtype")
def check_float16_without_a_loss_scaler(script: Script) -> Iterator[Finding]:
    """float16 named for autocast or FSDP's MixedPrecision, a plain backward, no scaler."""
    if scales_the_loss(script):
        return
    if not any(plain_backward(node) for node, _name in script.call_names):
        return
    trained = trained_modules(script)
    for node, name in script.call_names:
        dtype = asked_dtype(node, name)
        if dtype is None or not HALF.search(resolved_text(script, dtype)):
            continue
        if short(name) == "autocast" and not trains_under(script, node, trained):
            continue  # an evaluation, or features of a frozen model
        yield script.finding(
            "mixed-precision-dtype",
            node,
            f"{short(name)} runs in float16 ({source_text(dtype)}) and the loss goes through a "
            "plain backward() with no loss scaler: small gradients underflow to zero and large "
            "ones overflow; scale the loss (torch.amp.GradScaler, FSDP's ShardedGradScaler) "
            "or use bfloat16",
        )
        return  # one finding says it for the file


def scaler_steps(script: Script) -> bool:
    """A GradScaler is made (not `enabled=False`, which makes its steps plain ones) and
    something steps or unscales an optimizer through it."""
    made = any(
        short(name) in SCALERS
        and not (
            isinstance(enabled := keyword(node, "enabled"), ast.Constant) and enabled.value is False
        )
        for node, name in script.call_names
    )
    return made and any(
        isinstance(node.func, ast.Attribute)
        and node.func.attr in SCALER_METHODS
        and "scaler" in source_text(node.func.value).lower()
        for node, _name in script.call_names
    )


def scales_the_loss(script: Script) -> bool:
    """A loss scaler or a framework that scales the loss itself."""
    return any(short(name) in SCALERS for _node, name in script.call_names) or any(
        SCALING_FRAMEWORKS.search(name) for name in script.aliases.values()
    )


def trained_modules(script: Script) -> set[str]:
    """Text of each module whose parameters go to an optimizer, of what it wraps
    (`model = DDP(net)`, `opt = SGD(model.parameters())`: both `model` and `net`),
    and of what wraps it (`ddp = DDP(model)` with the optimizer over `model`'s)."""
    given = [
        expr
        for node, name in script.call_names
        if OPTIMIZER.search(name)
        for argument in [*node.args, *(k.value for k in node.keywords)]
        # `params = [p for p in model.parameters() if p.requires_grad]`, then AdamW(params)
        for expr in [argument, *script.assigned_values.get(source_text(argument), [])]
    ]
    trained = {
        source_text(argument.func.value)
        for expr in given
        for argument in walk(expr)
        if isinstance(argument, ast.Call)
        and isinstance(argument.func, ast.Attribute)
        and argument.func.attr in PARAMETER_LISTS
    }
    wrappings = [
        (target, source_text(value.args[0]))
        for target, values in script.assigned_values.items()
        for value in values
        if isinstance(value, ast.Call)
        and value.args
        and isinstance(value.args[0], ast.Name | ast.Attribute)
        and is_wrapper(script.name_of(value.func))
    ]
    for wrapper, wrapped in wrappings:  # `model = DDP(net)`, the optimizer over model's
        if wrapper in trained:
            trained.add(wrapped)
    for wrapper, wrapped in wrappings:  # `ddp = DDP(model)`, the optimizer over model's
        if wrapped in trained:
            trained.add(wrapper)
    return trained


# What wraps a model and trains the same parameters: data.py's torch wrappers (DDP,
# FSDP, fully_shard), DataParallel, torch.compile.
WRAPPERS = TORCH_WRAPPERS | {"DataParallel", "compile"}


def is_wrapper(name: str) -> bool:
    return short(name) in WRAPPERS


def cast_module(script: Script, call: ast.Call) -> str | None:
    """What a float16 cast makes half: the name it is assigned to (`model =
    Net().to(device, dtype=torch.half)`), or the module it is called on
    (`model.half()`)."""
    cast = half_cast_of(call)
    if cast is None:
        return None
    parent = script.parents.get(id(call))
    if isinstance(parent, ast.Assign) and len(parent.targets) == 1:
        return source_text(parent.targets[0])
    return source_text(cast) if isinstance(cast, ast.Name | ast.Attribute) else None


def half_cast_of(call: ast.Call) -> ast.expr | None:
    """X of `X.half()`, `X.to(torch.float16)`, `X.to(device, dtype=torch.half)`."""
    if not isinstance(call.func, ast.Attribute):
        return None
    if call.func.attr == "half" and not call.args and not call.keywords:
        return call.func.value
    if call.func.attr == "to":
        given = [*call.args, *(k.value for k in call.keywords if k.arg == "dtype")]
        if any(HALF.search(source_text(a)) for a in given):
            return call.func.value
    return None


def asked_dtype(call: ast.Call, name: str) -> ast.expr | None:
    """The dtype an autocast or FSDP MixedPrecision is given by name."""
    if short(name) == "autocast":
        return keyword(call, "dtype")
    if short(name) == "MixedPrecision":
        return keyword(call, "param_dtype") or (call.args[0] if call.args else None)
    return None


def resolved_text(script: Script, expr: ast.expr) -> str:
    """The expression's text, or of what the name it is was assigned
    (`dtype = torch.float16 if args.fp16 else torch.bfloat16`)."""
    values = script.assigned_values.get(source_text(expr), [])
    return " ".join([source_text(expr), *(source_text(v) for v in values)])


# Contexts that take gradients off: nothing under them is trained.
NO_GRAD = frozenset({"no_grad", "inference_mode"})


def trains_under(script: Script, autocast: ast.Call, trained: set[str]) -> bool:
    """The autocast is a `with` of a function with a plain backward, not under
    no_grad, and runs a module an optimizer trains (`with autocast(...): out =
    model(x)`); not a frozen teacher's or backbone's features."""
    block = script.parents.get(id(script.parents.get(id(autocast))))
    if not isinstance(block, ast.With):
        return False
    scope: ast.AST | None = block
    while scope is not None and not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
        if isinstance(scope, ast.With) and any(
            short(script.name_of(item.context_expr.func)) in NO_GRAD
            for item in scope.items
            if isinstance(item.context_expr, ast.Call)
        ):
            return False
        scope = script.parents.get(id(scope))
    if scope is not None and any(
        short(script.name_of(d.func if isinstance(d, ast.Call) else d)) in NO_GRAD
        for d in scope.decorator_list
    ):
        return False
    if not any(isinstance(n, ast.Call) and plain_backward(n) for n in walk(scope or script.tree)):
        return False
    return any(
        isinstance(call, ast.Call) and bool(runs_module(call) & trained)
        for statement in block.body
        for call in walk(statement)
    )


def runs_module(call: ast.Call) -> set[str]:
    """What a call may run: `model` of `model(x)`, `self.model` of `self.model(x)`,
    and the owner of a method (`model` of `model.encode(x)`)."""
    if isinstance(call.func, ast.Call):
        return set()
    run = {source_text(call.func)}
    if isinstance(call.func, ast.Attribute):
        run.add(source_text(call.func.value))
    return run


def plain_backward(call: ast.Call) -> bool:
    """`loss.backward()` on a tensor, not an engine's `model.backward(loss)`."""
    return isinstance(call.func, ast.Attribute) and call.func.attr == "backward" and not call.args
