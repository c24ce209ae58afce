"""Backend checks: a tensor created on the CPU handed to a collective on NCCL, and
NCCL chosen in a file that also runs on an accelerator NCCL does not serve."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from assistant.lint.model import (
    Script,
    bound_arguments,
    keyword,
    name_value_pairs,
    short,
    source_text,
)
from assistant.lint.registry import check
from assistant.lint.torchapi import (
    COLLECTIVES,
    TENSOR_FACTORIES,
    backend_of,
    init_calls,
    is_dist_call,
)
from assistant.results import Finding

TORCH_FACTORIES = frozenset(f"torch.{name}" for name in TENSOR_FACTORIES | {"as_tensor"})
# Constructors that always give a CPU tensor: from a numpy array, or a legacy
# CPU tensor type.
CPU_CONSTRUCTORS = frozenset(
    {
        "torch.from_numpy",
        "torch.Tensor",
        "torch.FloatTensor",
        "torch.DoubleTensor",
        "torch.LongTensor",
        "torch.IntTensor",
    }
)


@check("nccl-with-cpu-tensors")
def check_nccl_with_cpu_tensors(script: Script) -> Iterator[Finding]:
    """A collective on the nccl backend gets a tensor created on the CPU."""
    nccl = any((backend_of(c) or "").startswith("nccl") for c in init_calls(script))
    if not (nccl or ray_trains_on_nccl(script)):
        return
    on_gloo = gloo_groups(script)
    for scope in script.all_scopes:
        nodes = script.scope_nodes(scope)
        made = tensor_origins(script, nodes)
        for node in nodes:
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = script.name_of(node.func)
            if not is_dist_call(name, COLLECTIVES - {"barrier", "monitored_barrier"}):
                continue
            group = keyword(node, "group")
            if group is not None and group_name(group) in on_gloo:
                continue  # a gloo group the file made for CPU tensors
            field = field_sent(node, short(name))
            if field is not None and makes_cpu_tensor(script, field):
                yield script.finding(
                    "nccl-with-cpu-tensors",
                    node,
                    f"{short(name)}({source_text(field)}) on the nccl backend, but every value "
                    f"the file gives {source_text(field)} is made on the CPU: create it with "
                    "device=... or move it with .to(device)",
                )
                continue
            tensor = tensor_sent(node, short(name))
            if tensor is None:
                continue
            cpu_line = made_on_cpu_before(made.get(tensor.id, []), node.lineno)
            if cpu_line is None:
                cpu_line = last_made_on_cpu(script, nodes, made, tensor.id, node)
            why = f"created on the CPU (line {cpu_line})"
            if cpu_line is None and tensor.id not in made:
                cpu_line = passed_on_cpu(script, scope, tensor.id)
                why = f"the CPU tensor the call on line {cpu_line} passes"
            if cpu_line is not None:
                yield script.finding(
                    "nccl-with-cpu-tensors",
                    node,
                    f"{short(name)}({tensor.id}) on the nccl backend, but {tensor.id} is {why}: "
                    "create it with device=... or move it with .to(device)",
                )


def gloo_groups(script: Script) -> set[str]:
    """Names the file binds to a group on gloo (`cpu_group = dist.new_group(backend="gloo")`),
    by their last part (`self.cpu_group` as "cpu_group", a helper's parameter of that name)."""
    found = set()
    for node in script.nodes:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        if short(script.name_of(node.value.func)) != "new_group":
            continue
        backend = keyword(node.value, "backend")
        if isinstance(backend, ast.Constant) and "gloo" in str(backend.value):
            found |= {group_name(target) for target in node.targets} - {None}
    return found


def group_name(expr: ast.expr) -> str | None:
    """`cpu_group` and `self.cpu_group` -> "cpu_group"."""
    if isinstance(expr, ast.Name):
        return expr.id
    return expr.attr if isinstance(expr, ast.Attribute) else None


def passed_on_cpu(script: Script, scope: ast.AST, parameter: str) -> int | None:
    """The line of a call of the file's helper `scope` that passes its `parameter`
    a tensor made on the CPU (`all_gather_cat(torch.cat(feats))` with every
    feature appended `.cpu()`): the helper's collective sends it."""
    if not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    if parameter not in {a.arg for a in scope.args.args}:
        return None
    for caller in script.all_scopes:
        nodes = script.scope_nodes(caller)
        calls = [
            n
            for n in nodes
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == scope.name
        ]
        if not calls:
            continue
        made = tensor_origins(script, nodes)
        appended = appended_items(nodes)
        for call in calls:
            for bound, argument in bound_arguments(scope, call):
                if bound == parameter and on_cpu_at(script, made, appended, argument, call):
                    return call.lineno
    return None


def on_cpu_at(
    script: Script,
    made: dict[str, list[tuple[int, bool]]],
    appended: dict[str, list[ast.expr]],
    value: ast.expr,
    where: ast.AST,
) -> bool:
    """The value, read where `where` stands, is a tensor made on the CPU."""
    line = getattr(where, "lineno", 0)

    def cpu_name(name: str) -> bool:
        return made_on_cpu_before(made.get(name, []), line) is not None

    def list_on_cpu(name: str) -> bool:
        items = appended.get(name, [])
        return bool(items) and all(makes_cpu_tensor(script, item, cpu_name) for item in items)

    if isinstance(value, ast.Name):
        return cpu_name(value.id)
    return makes_cpu_tensor(script, value, cpu_name, list_on_cpu=list_on_cpu)


# Where a collective takes the tensor this rank sends: all_gather(tensor_list,
# tensor) and all_to_all_single(output, input) send their second argument; the
# others their first.
SENT_POSITION = {
    "all_gather": 1,
    "all_gather_into_tensor": 1,
    "reduce_scatter_tensor": 1,
    "all_to_all_single": 1,
}


def field_sent(call: ast.Call, collective: str) -> ast.Attribute | None:
    """The object's field the collective sends (`dist.all_reduce(self.sum)`)."""
    position = SENT_POSITION.get(collective, 0)
    sent = call.args[position] if len(call.args) > position else None
    if isinstance(sent, ast.Attribute) and source_text(sent.value) == "self":
        return sent
    return None


def tensor_sent(call: ast.Call, collective: str) -> ast.Name | None:
    """The tensor the collective sends, when it is given by name and position."""
    position = SENT_POSITION.get(collective, 0)
    if len(call.args) > position and isinstance(call.args[position], ast.Name):
        return call.args[position]
    return None


def tensor_origins(
    script: Script, nodes: list[ast.AST], depth: int = 0
) -> dict[str, list[tuple[int, bool]]]:
    """For each name assigned among `nodes`: (line, made on the CPU) of every
    assignment, in line order. `t = t.cuda()` is an assignment too; a value made
    from a name is on the CPU when that name's last assignment above was.

    `a, b = x, y` pairs each name with its own value. A list being filled
    (`scores = []`, then `scores.append(p.cpu())`) is no tensor yet: it is not
    counted, and joining it (`torch.cat(scores)`) is on the CPU when every item
    appended to it in the scope is.
    """
    origins: dict[str, list[tuple[int, bool]]] = {}
    appended = appended_items(nodes)

    def on_cpu_so_far(name: str) -> bool:
        assignments = origins.get(name)
        return bool(assignments) and assignments[-1][1]

    def list_on_cpu(name: str) -> bool:
        items = appended.get(name, [])
        return bool(items) and all(makes_cpu_tensor(script, item, on_cpu_so_far) for item in items)

    listed: dict[str, list[ast.expr]] = {}  # `local = (a, b)`: the tensors a loop sends
    for node in sorted(
        (n for n in nodes if isinstance(n, ast.Assign | ast.For)), key=lambda n: n.lineno
    ):
        if isinstance(node, ast.For):
            # `for t in local: dist.all_gather(bufs, t)` sends each listed tensor in turn:
            # t is on the CPU when one of them is
            items = sequence_items(node.iter, listed)
            if isinstance(node.target, ast.Name) and items:
                on_cpu = any(
                    makes_cpu_tensor(script, item, on_cpu_so_far, list_on_cpu=list_on_cpu)
                    for item in items
                )
                origins.setdefault(node.target.id, []).append((node.lineno, on_cpu))
            continue
        for target, value in name_value_pairs(node):
            if isinstance(value, ast.Tuple | ast.List) and value.elts:
                listed[target.id] = value.elts
            else:
                listed.pop(target.id, None)
        for target, position in unpacked_from_own_function(script, node, depth):
            # `imp, n = compute_importance(...)`: what the file's function returns there
            on_cpu = returned_on_cpu(script, node.value, position, depth)  # type: ignore[arg-type]
            origins.setdefault(target.id, []).append((node.lineno, on_cpu))
        for target, value in name_value_pairs(node):
            if isinstance(value, ast.List) and not value.elts:
                continue  # a list to fill, not a tensor
            on_cpu = makes_cpu_tensor(script, value, on_cpu_so_far, list_on_cpu=list_on_cpu)
            if on_cpu and converts_itself(script, target.id, value):
                # `cm = torch.from_numpy(cm)`: whatever cm held before (a numpy
                # confusion matrix), from here on it is this CPU tensor
                origins[target.id] = []
            origins.setdefault(target.id, []).append((node.lineno, on_cpu))
    return origins


def sequence_items(iterable: ast.expr, listed: dict[str, list[ast.expr]]) -> list[ast.expr]:
    """The items of a literal list or tuple a loop walks, itself or by the name it
    was assigned to."""
    if isinstance(iterable, ast.Tuple | ast.List):
        return iterable.elts
    return listed.get(iterable.id, []) if isinstance(iterable, ast.Name) else []


# How many helpers deep a returned tensor is followed (a helper calling a helper).
MAX_HELPERS = 2


def unpacked_from_own_function(
    script: Script, node: ast.Assign, depth: int
) -> list[tuple[ast.Name, int]]:
    """(name, position) for `a, b = helper(...)` with `helper` a function of the file."""
    value = node.value
    if not (
        depth < MAX_HELPERS
        and isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id in script.functions
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Tuple)
    ):
        return []
    return [
        (element, position)
        for position, element in enumerate(node.targets[0].elts)
        if isinstance(element, ast.Name)
    ]


def returned_on_cpu(script: Script, call: ast.Call, position: int, depth: int) -> bool:
    """Every `return a, b` of the called function makes its element at `position`
    on the CPU (a factory with no device, `.cpu()`, or a name last made so there)."""
    function = script.functions[call.func.id]  # type: ignore[attr-defined]
    nodes = script.scope_nodes(function)
    returns = [n for n in nodes if isinstance(n, ast.Return)]
    if not returns or any(
        not isinstance(r.value, ast.Tuple) or len(r.value.elts) <= position for r in returns
    ):
        return False
    made = tensor_origins(script, nodes, depth + 1)
    for ret in returns:
        element = ret.value.elts[position]  # type: ignore[union-attr]
        if isinstance(element, ast.Name):
            if made_on_cpu_before(made.get(element.id, []), ret.lineno) is None:
                return False
        elif not makes_cpu_tensor(script, element):
            return False
    return True


def converts_itself(script: Script, name: str, value: ast.expr) -> bool:
    """`t = torch.from_numpy(t)`, `t = torch.tensor(t)`: a CPU constructor or a
    factory given the name's own value."""
    return (
        isinstance(value, ast.Call)
        and script.name_of(value.func) in CPU_CONSTRUCTORS | TORCH_FACTORIES
        and any(isinstance(a, ast.Name) and a.id == name for a in value.args)
    )


def appended_items(nodes: list[ast.AST]) -> dict[str, list[ast.expr]]:
    """What `name.append(item)` puts into each list named among `nodes`."""
    items: dict[str, list[ast.expr]] = {}
    for node in nodes:
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "append"
            and isinstance(node.func.value, ast.Name)
            and len(node.args) == 1
        ):
            items.setdefault(node.func.value.id, []).append(node.args[0])
    return items


# Joining tensors keeps their device (and fails on mixed ones); so do these methods.
JOINS = frozenset({"torch.stack", "torch.cat", "torch.concat", "torch.vstack", "torch.hstack"})
DEVICE_KEEPING_METHODS = frozenset(
    {"sum", "mean", "float", "double", "long", "int", "half", "bfloat16", "clone", "detach"}
    | {"view", "reshape", "flatten", "unsqueeze", "squeeze", "contiguous", "abs", "sqrt"}
)
MAX_DEPTH = 12


def makes_cpu_tensor(
    script: Script,
    value: ast.expr,
    cpu_name=lambda _name: False,
    depth=0,
    list_on_cpu=lambda _name: False,
) -> bool:
    """`torch.zeros(n)` with no device, `torch.from_numpy(a)`, `torch.LongTensor(x)`,
    `t.cpu()`; a stack or cat with such a tensor in it, or of a list `list_on_cpu`
    says holds such tensors; `.sum()` / `.double()` of one; a name `cpu_name` says
    was made so."""
    if depth > MAX_DEPTH:
        return False
    if isinstance(value, ast.Name):
        return cpu_name(value.id)
    if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name):
        # `self.sums`, made in another method (`reset`): on the CPU when every value
        # the file gives that field is made there (a plain field; a module's .to()
        # moves only parameters and registered buffers)
        made = script.assigned_values.get(source_text(value), [])
        return (
            value.value.id == "self"
            and bool(made)
            and all(makes_cpu_tensor(script, given, depth=depth + 1) for given in made)
        )
    if isinstance(value, ast.BinOp):  # `torch.tensor([a, b]) / n`: arithmetic keeps the device
        sides = (value.left, value.right)
        return any(
            makes_cpu_tensor(script, side, cpu_name, depth + 1, list_on_cpu)
            and (is_plain_number(other) or makes_cpu_tensor(script, other, cpu_name, depth + 1))
            for side, other in (sides, sides[::-1])
        )
    if not isinstance(value, ast.Call):
        return False
    name = script.name_of(value.func)
    if name in TORCH_FACTORIES:
        return keyword(value, "device") is None
    if name in CPU_CONSTRUCTORS:
        return True
    if name in JOINS and value.args and isinstance(value.args[0], ast.List | ast.Tuple):
        return any(
            makes_cpu_tensor(script, part, cpu_name, depth + 1, list_on_cpu)
            for part in value.args[0].elts
        )
    if name in JOINS and value.args and isinstance(value.args[0], ast.Name):
        return list_on_cpu(value.args[0].id)
    if isinstance(value.func, ast.Attribute):
        if value.func.attr == "cpu":
            return True
        if value.func.attr in DEVICE_KEEPING_METHODS:
            return makes_cpu_tensor(script, value.func.value, cpu_name, depth + 1, list_on_cpu)
    return False


def is_plain_number(expr: ast.expr) -> bool:
    """A constant or a field (`args.meta_batch_size`, `self.scale`): a number that
    leaves a tensor where it is (a CUDA tensor there would fail on mixed devices)."""
    return isinstance(expr, ast.Constant) or (
        isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name)
    )


def made_on_cpu_before(assignments: list[tuple[int, bool]], line: int) -> int | None:
    """The line of the CPU factory that made the name, if every assignment before
    `line` is one (a branch that makes it elsewhere, or a move, leaves it unknown;
    a later `t = t.tolist()` does not matter)."""
    before = [(at, on_cpu) for at, on_cpu in assignments if at < line]
    if before and all(on_cpu for _at, on_cpu in before):
        return before[0][0]
    return None


def last_made_on_cpu(
    script: Script,
    nodes: list[ast.AST],
    made: dict[str, list[tuple[int, bool]]],
    name: str,
    collective: ast.Call,
) -> int | None:
    """The line of the name's last assignment above the collective, when it makes a
    CPU tensor and always runs before it (in the same block, or one around it):
    DETR's `num_boxes = sum(...)`, then `num_boxes = torch.as_tensor([num_boxes])`,
    then `all_reduce(num_boxes)`; what it held before does not matter."""
    above = [
        n
        for n in nodes
        if isinstance(n, ast.Assign)
        and n.lineno < collective.lineno
        and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
    ]
    if not above:
        return None
    last = max(above, key=lambda n: n.lineno)
    if not any(at == last.lineno and on_cpu for at, on_cpu in made.get(name, [])):
        return None
    block = script.parents.get(id(last))
    ancestor: ast.AST | None = collective
    while ancestor is not None:
        if script.parents.get(id(ancestor)) is block and ancestor in getattr(block, "body", []):
            return last.lineno
        ancestor = script.parents.get(id(ancestor))
    return None


def ray_trains_on_nccl(script: Script) -> bool:
    """Ray Train's workers on GPUs (`ScalingConfig(use_gpu=True)`): its TorchConfig
    starts the process group on NCCL unless the file names another backend."""
    on_gpus = backend_named = False
    for node, name in script.call_names:
        if name.split(".")[0] != "ray":
            continue
        if short(name) == "ScalingConfig":
            use_gpu = keyword(node, "use_gpu")
            on_gpus |= isinstance(use_gpu, ast.Constant) and use_gpu.value is True
        elif short(name) == "TorchConfig":
            backend = keyword(node, "backend")
            backend_named |= not (isinstance(backend, ast.Constant) and backend.value == "nccl")
    return on_gpus and not backend_named


# Accelerators with no NCCL: Intel GPUs (xpu, whose backend is ccl / xccl), Ascend
# NPUs (hccl), Apple's mps, Habana's hpu; a file that picks one of them runs there.
OTHER_ACCELERATORS = frozenset({"xpu", "npu", "mps", "hpu"})
OTHER_ACCELERATOR_PACKAGES = {
    "torch_npu": "npu",
    "intel_extension_for_pytorch": "xpu",
    "oneccl_bindings_for_pytorch": "xpu",
    "habana_frameworks": "hpu",
}


@check("nccl-not-available")
def check_nccl_on_another_accelerator(script: Script) -> Iterator[Finding]:
    """`init_process_group("nccl")` in a file that picks a device NCCL does not serve:
    an Intel GPU (`torch.device("xpu", ...)`), an Ascend NPU, mps or hpu. There the
    build has no NCCL ("Distributed package doesn't have NCCL built in") and the
    backend must follow the device (ccl / xccl, hccl, gloo)."""
    nccl = [call for call in init_calls(script) if backend_of(call) == "nccl"]
    other = other_accelerator(script)
    if not nccl or other is None:
        return
    for call in nccl:
        yield script.finding(
            "nccl-not-available",
            call,
            f"the backend is NCCL, but the file also runs on {other}, whose PyTorch has no "
            'NCCL ("Distributed package doesn\'t have NCCL built in"): choose the backend '
            "with the device (xccl / ccl on xpu, hccl on npu, gloo on the CPU), or let "
            "init_process_group() pick it",
        )


def other_accelerator(script: Script) -> str | None:
    """The first non-CUDA accelerator the file names as a device or imports the
    support of (`torch.device("xpu", rank)`, `torch.xpu.set_device`, `import torch_npu`)."""
    for node in script.nodes:
        if (
            isinstance(node, ast.Attribute)
            and node.attr in OTHER_ACCELERATORS
            and source_text(node.value) == "torch"
        ):
            return node.attr
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.split(":")[0] in OTHER_ACCELERATORS
        ):
            return node.value.split(":")[0]
    imported = {name.split(".")[0] for name in script.aliases.values()}
    return next(
        (device for package, device in OTHER_ACCELERATOR_PACKAGES.items() if package in imported),
        None,
    )
