"""Device checks: a fixed GPU, set_device missing or late, DDP device_ids on a CPU module."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from assistant.lint.launchtext import launched_world_size
from assistant.lint.model import (
    Function,
    Script,
    is_int,
    keyword,
    name_value_pairs,
    names_given,
    parameter_names,
    self_attribute,
    short,
    source_text,
    walk,
)
from assistant.lint.ranks import RANK_ZERO, enclosing_scope, is_rank_expr, some_rank_runs
from assistant.lint.registry import check
from assistant.lint.torchapi import (
    COLLECTIVES,
    DEEPSPEED_ENGINE,
    FIXED_CUDA,
    RAY_TRAIN,
    TENSOR_FACTORIES,
    backend_of,
    calls_any,
    calls_external_setup,
    framework_processes,
    imported_callee,
    init_calls,
    is_ddp,
    is_dist_call,
    is_distributed,
    is_init,
    is_method,
    is_set_device,
    lightning_classes,
    sets_visible_devices_per_process,
    uses_cuda,
)
from assistant.lint.tracer import TracedCall
from assistant.lint.values import argparse_flag, option_default
from assistant.results import Finding

CURRENT_DEVICE = (
    "means the current device, which is cuda:0 in every process unless "
    "torch.cuda.set_device(local_rank) ran first"
)


@check("hardcoded-device")
def check_hardcoded_device(script: Script) -> Iterator[Finding]:
    """A fixed GPU ("cuda:0", device_ids=[0]) instead of the rank's own device."""
    if single_process_data_parallel(script):
        return  # one process drives every GPU; DataParallel's home is cuda:0
    if sets_visible_devices_per_process(script):
        return  # each process sees its own GPU alone, as cuda:0
    current_device_is_cuda0 = current_device_left_at_cuda0(script)
    rank_zero_only = rank_zero_only_calls(script)
    per_gpu = runs_a_process_per_gpu(script)
    for node, name in script.call_names:
        if id(node) in rank_zero_only:
            continue  # GPU 0 is rank 0's own (a log, an evaluation, a save)
        fixed = list(fixed_cuda_strings(script, node))
        if fixed and not replaced_by_the_ranks_device(script, node):  # only where one is written
            yield from fixed
        if current_device_is_cuda0:
            yield from current_device_uses(script, node, name)
        if is_torch_device(name) and len(node.args) == 2 and is_int(node.args[1]):
            yield script.finding(
                "hardcoded-device",
                node,
                f"torch.device(..., {node.args[1].value}) is the same GPU on every rank: "
                "pass local_rank",
            )
        if is_method(node, "cuda"):
            index = node.args[0] if node.args else keyword(node, "device")
            fixed_index = constant_index(script, index)
            if fixed_index is not None:
                shown = source_text(index)
                named = (
                    ""
                    if is_int(index)
                    else f" ({shown} = {fixed_index} unless the command line sets it, one "
                    "value for every process)"
                    if isinstance(index, ast.Attribute)
                    else f" ({shown} = {fixed_index} wherever it is set)"
                )
                yield script.finding(
                    "hardcoded-device",
                    node,
                    f".cuda({shown}) is the same GPU on every rank{named}: use .cuda(local_rank)",
                )
        if is_ddp(name):
            yield from fixed_ddp_devices(script, node)
        if per_gpu:
            yield from fixed_gpu_index_keywords(script, node)
            yield from faiss_index_on_a_fixed_gpu(script, node, name)
    yield from fixed_device_variables(script, rank_zero_only)
    yield from fixed_device_fields(script, rank_zero_only)
    yield from fixed_device_parameters(script, rank_zero_only)


# FAISS's copy of an index to a GPU: index_cpu_to_gpu(resources, device, index).
FAISS_TO_GPU = "faiss.index_cpu_to_gpu"


def faiss_index_on_a_fixed_gpu(script: Script, node: ast.Call, name: str) -> Iterator[Finding]:
    """`faiss.index_cpu_to_gpu(res, 0, index)` in a process per GPU: every rank builds
    its index and FAISS's GPU resources on the same device."""
    if name != FAISS_TO_GPU or len(node.args) < 2:
        return
    fixed = constant_index(script, node.args[1])
    if fixed is None:
        return
    yield script.finding(
        "hardcoded-device",
        node,
        f"faiss.index_cpu_to_gpu(..., {source_text(node.args[1])}, ...) puts every rank's "
        f"index and FAISS's GPU resources on GPU {fixed}: one GPU holds every copy (out of "
        "memory, searches queued) while the others idle; pass the rank's local_rank",
    )


# What makes a plain tensor (not a module, which Lightning moves with the model).
TENSOR_MAKERS = TENSOR_FACTORIES | {"as_tensor", "from_numpy", "linspace", "eye", "FloatTensor"}


def constant_index(script: Script, index: ast.expr | None) -> int | None:
    """A GPU index that is the same number on every rank: an int, or a name the file
    only ever sets to one int and no function takes as a parameter (`GPU = 0` left
    from a single-GPU script)."""
    if is_int(index):
        return index.value  # type: ignore[union-attr]
    if isinstance(index, ast.Attribute):
        return option_index(script, index)
    if not isinstance(index, ast.Name) or index.id in script.every_parameter_name:
        return None
    values = script.assigned_values.get(index.id, [])
    numbers = {v.value for v in values if is_int(v)}  # type: ignore[attr-defined]
    return numbers.pop() if values and len(numbers) == 1 and all(map(is_int, values)) else None


def option_index(script: Script, index: ast.Attribute) -> int | None:
    """`args.gpuid` of an option with an int default that the file never sets (a
    single-GPU script's `--gpuid`): every process parses the same command line, so it
    is one GPU for all of them. Not the launcher's own per-process `--local_rank`."""
    if "rank" in index.attr.lower() or script.assigned_values.get(source_text(index)):
        return None
    if argparse_flag(script, index.attr) is None:
        return None
    known, value = option_default(script, index)
    return value if known and isinstance(value, int) and not isinstance(value, bool) else None


@check("hardcoded-device")
def check_tensor_on_the_gpu_in_a_lightning_module(script: Script) -> Iterator[Finding]:
    """`self.pos_weight = torch.tensor([w]).cuda()` in a LightningModule's
    __init__, in a file whose Trainer runs a process per GPU."""
    if not framework_processes(script):
        return
    for cls in lightning_classes(script):
        for init in (
            s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"
        ):
            for node in walk(init):
                if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
                    continue
                field = self_attribute(node.targets[0])
                if field and tensor_on_the_current_gpu(script, node.value):
                    yield script.finding(
                        "hardcoded-device",
                        node,
                        f"self.{field} is a plain tensor put on the GPU in __init__: every "
                        "process builds the module before Lightning gives it its GPU, so on "
                        "every rank it lands on cuda:0, and Lightning moves parameters and "
                        'buffers, not plain tensors; ranks 1+ fail with "Expected all '
                        'tensors to be on the same device": register it as a buffer '
                        f'(self.register_buffer("{field}", ...), without .cuda())',
                    )


@check("hardcoded-device")
def check_tensor_on_the_gpu_at_import(script: Script) -> Iterator[Finding]:
    """`MEAN = torch.tensor([...]).cuda()` at module level, in a file whose processes
    each set their own GPU: import time comes before any set_device, so it is cuda:0."""
    if not is_distributed(script) or sets_visible_devices_per_process(script):
        return
    if not any(is_set_device(name) for _node, name in script.call_names):
        return  # no rank picks a GPU of its own: current_device_uses speaks for `.cuda()`
    for statement in script.tree.body:
        value = statement.value if isinstance(statement, (ast.Assign, ast.AnnAssign)) else None
        if value is None or not any(
            tensor_on_the_current_gpu(script, operand) for operand in operands(value)
        ):
            continue
        name = source_text(
            statement.targets[0] if isinstance(statement, ast.Assign) else statement.target
        )
        yield script.finding(
            "hardcoded-device",
            statement,
            f"{name} is a tensor put on the GPU at import time, before any rank calls "
            "torch.cuda.set_device: it lives on cuda:0 in every process (each holds memory "
            'there, and ranks 1+ fail with "Expected all tensors to be on the same '
            f'device" where it meets their data); make it on the CPU and move it to the '
            f"data's device where it is used (`{name}.to(x.device)`), or create it after "
            "set_device",
        )


def operands(value: ast.expr) -> list[ast.expr]:
    """The value, or the operands of arithmetic on it (`torch.tensor(m).cuda() * 255`)."""
    found, pending = [], [value]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.BinOp):
            pending += [node.left, node.right]
        elif isinstance(node, ast.UnaryOp):
            pending.append(node.operand)
        else:
            found.append(node)
    return found


def tensor_on_the_current_gpu(script: Script, value: ast.expr) -> bool:
    """`torch.tensor(x).cuda()`, `.to("cuda")`, `torch.ones(3, device="cuda")`: a tensor
    made here and placed on the current GPU (cuda:0 until someone sets it)."""
    chain, node = [], value
    while isinstance(node, ast.Call):
        chain.append(node)
        node = node.func.value if isinstance(node.func, ast.Attribute) else None
    if not chain or short(script.name_of(chain[-1].func)) not in TENSOR_MAKERS:
        return False
    for call in chain:
        if is_method(call, "cuda") and not call.args and not call.keywords:
            return True
        target = call.args[0] if is_method(call, "to") and call.args else keyword(call, "device")
        if isinstance(target, ast.Constant) and target.value == "cuda":
            return True
    return False


def places_work_per_process(script: Script) -> bool:
    """A process group or DDP of the file's own, or Ray Train's workers (each on
    its own GPU, from ray.train.torch.get_device())."""
    return is_distributed(script) or calls_any(script, RAY_TRAIN)


def fixed_device_variables(script: Script, rank_zero_only: set[int]) -> Iterator[Finding]:
    """`device = "cuda:0"` (a single-GPU config left in), never set per rank, then
    used to place the model or tensors in a distributed script."""
    if not places_work_per_process(script):
        return
    for name, values in script.assigned_values.items():
        fixed = [fixed_gpu_of(value) for value in values]
        if not name.isidentifier() or not all(fixed):
            continue
        uses = [
            node
            for node, _called in script.call_names
            if places_on(node, name) and id(node) not in rank_zero_only
        ]
        if uses:
            yield script.finding(
                "hardcoded-device",
                values[0],
                f'{name} = "{fixed[0].value}" is never set per rank, and places work on '
                f"line {uses[0].lineno}: every rank uses the same GPU; set {name} = "
                'f"cuda:{local_rank}" once the local rank is known',
            )


def fixed_device_fields(script: Script, rank_zero_only: set[int]) -> Iterator[Finding]:
    """A config field whose default is a fixed GPU (a dataclass or config class
    `device: str = "cuda:0"`, a config dict `{"device": "cuda:0"}`) that places
    work as `cfg.device` / `cfg["device"]` and is never set per rank: every
    process of the launch reads the same default."""
    if not is_distributed(script):
        return
    defaults = fixed_cuda_defaults(script)
    if not defaults:
        return
    reassigned = {field for field in defaults if set_elsewhere(script, field)}
    for node, _called in script.call_names:
        if id(node) in rank_zero_only:
            continue
        field = placing_field(node)
        if field in defaults and field not in reassigned:
            default = defaults.pop(field)
            yield script.finding(
                "hardcoded-device",
                default,
                f'the config field {field} defaults to "{default.value}" and is never set '
                f"per rank, and places work on line {node.lineno}: every rank uses the same "
                f'GPU; set it to f"cuda:{{local_rank}}" once the local rank is known',
            )


def fixed_device_parameters(script: Script, rank_zero_only: set[int]) -> Iterator[Finding]:
    """A plain function of the file whose parameter defaults to a fixed GPU
    (`def move_to_device(batch, device="cuda:0")`), or a class whose __init__'s
    does (`class Meter: def __init__(self, n, device="cuda:0")`, a prefetching
    loader's `local_rank=0`), places work on it, and is called (constructed)
    somewhere without that argument: that call sends every rank's work to the
    same GPU. A bare "cuda" default is GPU 0 too where the file never gives a
    process its own current device (current_device_left_at_cuda0)."""
    if not is_distributed(script):
        return
    bare_cuda_is_gpu0 = current_device_left_at_cuda0(script)
    for name, function in script.functions.items():
        callee, skipped = called_as(name)
        if callee is None:
            continue  # other methods are reached through objects: their calls are not read here
        body = script.classes.get(callee) if skipped else function
        for parameter, position, default, gpu in fixed_gpu_parameters(function, bare_cuda_is_gpu0):
            if position is not None:
                position -= skipped
            held = {parameter} | fields_set_from(function, parameter)
            placing = any(
                isinstance(node, ast.Call) and places_on_any(node, held)
                for node in walk(body or function)
            )
            bare = placing and call_without(script, callee, parameter, position, rank_zero_only)
            if bare:
                shown = gpu if isinstance(gpu, str) else f'"{gpu.value}"'
                yield script.finding(
                    "hardcoded-device",
                    default,
                    f"{callee}()'s {parameter} defaults to {shown}, and line {bare.lineno} "
                    "calls it without one: every rank's work goes to the same GPU; pass the "
                    f"rank's device there (or default {parameter} to None and use the current "
                    "device)",
                )


def fields_set_from(function: Function, parameter: str) -> set[str]:
    """`self.x` for each `self.x = parameter` in the function (the device kept for later)."""
    return {
        source_text(target)
        for node in walk(function)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Name)
        and node.value.id == parameter
        for target in node.targets
        if self_attribute(target)
    }


def called_as(name: str) -> tuple[str | None, int]:
    """The name a function of the file is called by, and how many leading
    parameters a call does not pass: a plain function's own name; a top-level
    class's __init__ is called as the class, `self` passed by Python."""
    if "." not in name:
        return name, 0
    owner, _, method = name.rpartition(".")
    if method == "__init__" and "." not in owner:
        return owner, 1
    return None, 0


# A parameter that holds a GPU's index: `local_rank=0` means GPU 0, not "this rank".
GPU_INDEX_PARAMETER = re.compile(r"^(local_rank|gpu|gpu_id|gpu_index|device|device_id|cuda_id)$")


def fixed_gpu_parameters(
    function: Function, bare_cuda_is_gpu0: bool = False
) -> Iterator[tuple[str, int | None, ast.expr, ast.Constant | str]]:
    """(name, position, default, the GPU it names) of the parameters that default
    to a fixed GPU; position None for a keyword-only one. The GPU is the constant,
    or a description where the default names GPU 0 without saying "cuda:0"."""
    arguments = function.args
    positional = arguments.posonlyargs + arguments.args
    offset = len(positional) - len(arguments.defaults)
    named = [(positional[offset + i], offset + i, d) for i, d in enumerate(arguments.defaults)]
    named += [
        (parameter, None, default)
        for parameter, default in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)
        if default is not None
    ]
    for parameter, position, default in named:
        if gpu := fixed_gpu_of(default) or gpu_zero_of(parameter.arg, default, bare_cuda_is_gpu0):
            yield parameter.arg, position, default, gpu


def gpu_zero_of(parameter: str, default: ast.expr, bare_cuda_is_gpu0: bool) -> str | None:
    """How a default names GPU 0 without "cuda:0": index 0 for a GPU-index
    parameter, or "cuda" where every process's current device stays GPU 0."""
    if not isinstance(default, ast.Constant) or isinstance(default.value, bool):
        return None
    if default.value == 0 and GPU_INDEX_PARAMETER.match(parameter):
        return "0 (GPU 0)"
    if default.value == "cuda" and bare_cuda_is_gpu0:
        return '"cuda" (GPU 0: the file never calls set_device)'
    return None


def call_without(
    script: Script, name: str, parameter: str, position: int | None, rank_zero_only: set[int]
) -> ast.Call | None:
    """A call of the function `name` that every rank may run and that passes no
    value for `parameter` (none at its position, no keyword, no `*` or `**`)."""
    for node, _called in script.call_names:
        if not (isinstance(node.func, ast.Name) and node.func.id == name):
            continue
        if id(node) in rank_zero_only or keyword(node, parameter) is not None:
            continue
        if position is not None and len(node.args) > position:
            continue
        unpacked = any(isinstance(a, ast.Starred) for a in node.args)
        if not unpacked and not any(k.arg is None for k in node.keywords):
            return node
    return None


def fixed_cuda_defaults(script: Script) -> dict[str, ast.Constant]:
    """Config fields given a fixed GPU as their default, by field name."""
    defaults: dict[str, ast.Constant] = {}
    for node in script.nodes:
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                target, value = class_field(statement)
                if target and is_fixed_cuda(value):
                    defaults.setdefault(target, value)
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(key, ast.Constant)
                    and isinstance(key.value, str)
                    and is_fixed_cuda(value)
                ):
                    defaults.setdefault(key.value, value)
    return defaults


def class_field(statement: ast.stmt) -> tuple[str | None, ast.expr | None]:
    """`name: type = value` or `name = value` in a class body."""
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
        return statement.target.id, statement.value
    if (
        isinstance(statement, ast.Assign)
        and len(statement.targets) == 1
        and isinstance(statement.targets[0], ast.Name)
    ):
        return statement.targets[0].id, statement.value
    return None, None


def field_of(expr: ast.expr) -> str | None:
    """`cfg.device` -> "device", `cfg["device"]` -> "device"."""
    if isinstance(expr, ast.Attribute):
        return expr.attr
    if isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant):
        return expr.slice.value if isinstance(expr.slice.value, str) else None
    return None


def set_elsewhere(script: Script, field: str) -> bool:
    """Any `x.field = ...` or `x["field"] = ...` in the file (set per rank, or
    from a command-line flag a launch may set per process)."""
    for node in script.of_type((ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if any(field_of(target) == field for target in targets):
            return True
    return False


def placing_field(node: ast.Call) -> str | None:
    """The config field a placing call is given: `x.to(cfg.device)`,
    `torch.device(cfg.device)`, `device=cfg["device"]`."""
    func = node.func
    placing = isinstance(func, ast.Attribute) and func.attr in ("to", "cuda", "device")
    given = [
        *(node.args[:1] if placing else []),
        *(k.value for k in node.keywords if k.arg == "device"),
    ]
    return next((field for field in map(field_of, given) if field), None)


def fixed_gpu_of(value: ast.expr) -> ast.Constant | None:
    """The fixed GPU a value always names when it names one: `"cuda:0"`, or
    `"cuda:0" if torch.cuda.is_available() else "cpu"` (a CPU fallback is no
    rank's own GPU either); None for anything else."""
    choices = possible_values(value)
    gpus = [choice for choice in choices if is_fixed_cuda(choice)]
    others = [choice for choice in choices if not is_fixed_cuda(choice)]
    if not gpus or not all(is_cpu(choice) for choice in others):
        return None
    return gpus[0]


def is_cpu(value: ast.expr) -> bool:
    return isinstance(value, ast.Constant) and value.value in ("cpu", "mps")


def is_fixed_cuda(value: ast.expr | None) -> bool:
    return isinstance(value, ast.Constant) and bool(FIXED_CUDA.match(str(value.value)))


def places_on(node: ast.Call, name: str) -> bool:
    """`x.to(name)`, `x.cuda(name)`, `torch.device(name)` or `device=name`."""
    return places_on_any(node, {name})


# torch.cuda calls whose first argument is the GPU they use.
GPU_ARGUMENT_CALLS = frozenset({"Stream", "device", "set_device"})


# Keywords that hand a library the index of the GPU to work on (DALI's pipelines).
GPU_INDEX_KEYWORDS = frozenset({"device_id", "gpu_id", "gpu_index"})


def places_on_any(node: ast.Call, names: set[str]) -> bool:
    """`places_on` for any of `names` (a parameter, or the `self.x` that keeps it);
    also `torch.cuda.Stream(name)`, which makes a stream on that GPU, and a keyword
    named like a device (`sw_device=name`) or a GPU index (DALI's `device_id=name`)."""
    if any(  # `device=name`, or a device keyword of a library (MONAI's `sw_device=name`)
        k.arg
        and (k.arg.endswith("device") or k.arg in GPU_INDEX_KEYWORDS)
        and source_text(k.value) in names
        for k in node.keywords
        if isinstance(k.value, ast.Name | ast.Attribute)
    ):
        return True
    first = node.args[:1]
    if not any(isinstance(a, ast.Name | ast.Attribute) and source_text(a) in names for a in first):
        return False
    func = node.func
    placing = isinstance(func, ast.Attribute) and func.attr in ("to", "cuda", "device")
    stream = isinstance(func, ast.Attribute) and func.attr in GPU_ARGUMENT_CALLS
    return placing or stream or keyword(node, "device") is not None


def current_device_left_at_cuda0(script: Script) -> bool:
    """Every rank's current device is visibly left at cuda:0: the file sets up
    the process group itself (init_process_group, or DDP without an imported
    setup helper that may call set_device), never calls set_device and does
    not give each process its own CUDA_VISIBLE_DEVICES. A single-process
    script, Hogwild or DataParallel, or a framework that sets the device
    (Accelerate, Lightning) is left alone: there `.cuda()` is right."""
    names = [name for _node, name in script.call_names]
    if any(is_set_device(name) for name in names) or sets_visible_devices_per_process(script):
        return False
    if init_calls(script):
        return True
    return any(is_ddp(name) for name in names) and not calls_external_setup(script)


def single_process_data_parallel(script: Script) -> bool:
    """nn.DataParallel in a file that starts no process group and no DDP: one
    process, its replicas scattered from cuda:0, where the batch must start."""
    return "DataParallel" in script.called_short_names and not is_distributed(script)


def rank_zero_only_calls(script: Script) -> set[int]:
    """ids of the calls that only rank 0 runs, on every traced path to them."""
    zero: set[int] = set()
    other: set[int] = set()
    for trace in script.traces:
        for call in trace:
            if not some_rank_runs(call.rank_path):
                continue  # the single-process path
            sides = {branch.side for branch in call.rank_path}
            (zero if RANK_ZERO in sides else other).add(id(call.node))
    return zero - other


def is_torch_device(name: str) -> bool:
    return name == "torch.device"


def fixed_cuda_strings(script: Script, node: ast.Call) -> Iterator[Finding]:
    for arg in [*node.args, *(k.value for k in node.keywords)]:
        for value in possible_values(arg):
            if is_fixed_cuda(value):
                yield script.finding(
                    "hardcoded-device",
                    value,
                    f'"{value.value}" puts every rank on the same GPU: use '
                    'torch.device("cuda", local_rank)',
                )


def replaced_by_the_ranks_device(script: Script, call: ast.Call) -> bool:
    """`device = torch.device("cuda:0" if cuda else "cpu")`, a one-process default that
    the same function later replaces with the rank's own (`if LOCAL_RANK != -1:
    device = torch.device("cuda", LOCAL_RANK)`, as YOLOv5's train.py does)."""
    assign = script.parents.get(id(call))
    if not (
        isinstance(assign, ast.Assign)
        and assign.value is call
        and len(assign.targets) == 1
        and isinstance(assign.targets[0], ast.Name)
    ):
        return False
    name, scope = assign.targets[0].id, enclosing_scope(assign, script)
    for node in script.scope_nodes(scope) if scope is not None else ():
        if (
            isinstance(node, ast.Assign)
            and node.lineno > assign.lineno
            and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
            and any(
                is_rank_expr(part, script)
                for part in walk(node.value)
                if isinstance(part, (ast.Name, ast.Attribute, ast.Subscript, ast.Call))
            )
        ):
            return True
    return False


def possible_values(expr: ast.expr) -> list[ast.expr]:
    """The values an argument can take: both sides of `a if test else b`
    (`"cuda:0" if torch.cuda.is_available() else "cpu"`), else itself."""
    if isinstance(expr, ast.IfExp):
        return [*possible_values(expr.body), *possible_values(expr.orelse)]
    return [expr]


def current_device_uses(script: Script, node: ast.Call, name: str) -> Iterator[Finding]:
    """`.cuda()`, `.to("cuda")`, torch.device("cuda"): cuda:0 without set_device."""
    if is_method(node, "cuda") and not node.args and keyword(node, "device") is None:
        yield script.finding("hardcoded-device", node, f".cuda() without an index {CURRENT_DEVICE}")
        return
    bare = [a for a in node.args if isinstance(a, ast.Constant) and a.value == "cuda"]
    device_kw = keyword(node, "device")
    if is_method(node, "to") and bare:
        yield script.finding("hardcoded-device", node, f'.to("cuda") {CURRENT_DEVICE}')
    elif is_torch_device(name) and len(node.args) == 1 and bare:
        yield script.finding("hardcoded-device", node, f'torch.device("cuda") {CURRENT_DEVICE}')
    elif isinstance(device_kw, ast.Constant) and device_kw.value == "cuda":
        yield script.finding("hardcoded-device", node, f'device="cuda" {CURRENT_DEVICE}')


def fixed_gpu_index_keywords(script: Script, node: ast.Call) -> Iterator[Finding]:
    """A library told the index of its GPU as a number (DALI's `device_id=0`, FSDP's,
    `gpu_id=0`) in a script run as a process per GPU: every rank works on that GPU."""
    for given in node.keywords:
        if given.arg in GPU_INDEX_KEYWORDS and is_int(given.value):
            yield script.finding(
                "hardcoded-device",
                given.value,
                f"{given.arg}={given.value.value} is the same GPU on every rank: every process "
                "puts this work on it while its model is on its own; pass the local rank",
            )


def fixed_ddp_devices(script: Script, node: ast.Call) -> Iterator[Finding]:
    ids = keyword(node, "device_ids")
    if isinstance(ids, (ast.List, ast.Tuple)) and any(is_int(e) for e in ids.elts):
        yield script.finding(
            "hardcoded-device",
            ids,
            f"device_ids={source_text(ids)} is the same GPU on every rank: use [local_rank]",
        )
    output = keyword(node, "output_device")
    if is_int(output):
        yield script.finding(
            "hardcoded-device",
            output,
            f"output_device={output.value} is the same GPU on every rank: use local_rank",
        )


@check("set-device-order")
def check_set_device_order(script: Script) -> Iterator[Finding]:
    """set_device missing with NCCL/CUDA, or called after init_process_group."""
    inits = init_calls(script)
    if not inits:
        return
    set_devices = [node for node, name in script.call_names if is_set_device(name)]
    if not set_devices:
        yield from missing_set_device(script, inits[0])
        return
    for trace in script.traces:
        first_init = next((i for i, c in enumerate(trace) if is_init(c.name)), None)
        if first_init is None or any(is_set_device(c.name) for c in trace[:first_init]):
            continue
        device_work = None  # the first call after init that already needs the rank's GPU
        for call in trace[first_init + 1 :]:
            if is_set_device(call.name):
                if device_work is not None:
                    yield late_set_device(script, call, device_work)
                break
            if device_work is None and needs_rank_device(call.name):
                device_work = call


def missing_set_device(script: Script, first_init: ast.Call) -> Iterator[Finding]:
    if keyword(first_init, "device_id") is not None:
        return  # the communicator is bound to an explicit device
    if any(name == DEEPSPEED_ENGINE for _node, name in script.call_names):
        return  # deepspeed.initialize sets each rank's device from its local rank
    if sets_visible_devices_per_process(script):
        return  # each process sees only its own GPU, as cuda:0
    backend = backend_of(first_init)
    needs_gpu = "nccl" in backend if backend else uses_cuda(script)
    if needs_gpu:
        yield script.finding(
            "set-device-order",
            first_init,
            "init_process_group with NCCL/CUDA but torch.cuda.set_device is never "
            "called: every rank's current device is cuda:0; call "
            "torch.cuda.set_device(local_rank) before init_process_group",
        )


def late_set_device(script: Script, call: TracedCall, device_work: TracedCall) -> Finding:
    return script.finding(
        "set-device-order",
        call.node,
        "torch.cuda.set_device comes after init_process_group and after "
        f"{short(device_work.name)} (line {device_work.node.lineno}), which "
        "already ran on cuda:0: set the device before init_process_group",
    )


def needs_rank_device(name: str) -> bool:
    """A call that creates the NCCL communicator (on the current device).

    init_process_group without device_id creates it lazily, at the first
    collective or DDP's first broadcast; setting the device between the two,
    as the PyTorch tutorials do, is early enough.
    """
    return is_dist_call(name, COLLECTIVES) or is_ddp(name)


@check("ddp-device-ids-cpu-module")
def check_ddp_device_ids_cpu_module(script: Script) -> Iterator[Finding]:
    """DDP(module, device_ids=...) on a module that was never moved to a device."""
    moved = Moves(script)
    for node, name in script.call_names:
        if not is_ddp(name) or not node.args:
            continue
        ids = keyword(node, "device_ids")
        if ids is None or (isinstance(ids, ast.Constant) and ids.value is None):
            continue
        module = unwrapped_module(script, node.args[0])
        text = source_text(module)
        if is_move(module) or moved.before(text, node) or built_elsewhere(script, module):
            continue
        if returns_a_moved_module(script, module):
            continue  # `DDP(build_model(n, device), ...)`: the file's factory moves it
        if moved.part_before(text, node):
            continue  # placed part by part (`model.mm_projector.to(device)`, LLaVA's way)
        if holds_moved_modules_only(script, module, moved, node):
            continue  # `DDP(LossWrapper(model, size))`: its parameters are model's
        if moved_by_every_origin(script, module, moved):
            continue  # `compiled = torch.compile(model)` of a model moved before
        when = "only after DDP wraps it" if text in moved else "never"
        yield script.finding(
            "ddp-device-ids-cpu-module",
            node,
            f"DDP gets device_ids but {text} is {when} moved to a device "
            "(.to(device) / .cuda(local_rank)): DDP reads the module's device when it is "
            "built and raises for parameters on the CPU; move it first, or drop device_ids "
            "on CPU",
        )


def moved_by_every_origin(script: Script, module: ast.expr, moved: Moves) -> bool:
    """Every value the name holds (inside device-keeping wrappers) was moved: a name
    moved before, or a call of the file's factory that moves what it returns
    (`student = prune_channels(base, ...)`, then `convert_sync_batchnorm(student)`:
    the name's own earlier value)."""
    text = source_text(module)
    origins = [m for m in wrapped_by_name(script, module) if source_text(m) != text]
    return bool(origins) and all(
        is_move(m) or source_text(m) in moved or returns_a_moved_module(script, m) for m in origins
    )


def returns_a_moved_module(script: Script, value: ast.expr) -> bool:
    """A call of the file's own function that returns the module it moved
    (`return convert_sync_batchnorm(m).to(device)`, or `m = m.cuda(); return m`)."""
    function = script.function_called(value)
    if function is None:
        return False
    nodes = script.scope_nodes(function)
    moved_here = names_given(nodes, is_move)
    returned = [n.value for n in nodes if isinstance(n, ast.Return) and n.value is not None]
    return bool(returned) and all(
        is_move(r) or (isinstance(r, ast.Name) and r.id in moved_here) for r in returned
    )


def holds_moved_modules_only(
    script: Script, module: ast.expr, moved: Moves, wrap: ast.Call
) -> bool:
    """A module of the file's own class, built around a module moved before the wrap,
    whose __init__ builds no layer of its own (a loss wrapper that holds the model)."""
    if not (isinstance(module, ast.Call) and isinstance(module.func, ast.Name)):
        return False
    init = script.functions.get(f"{module.func.id}.__init__")
    if init is None or any(
        isinstance(n, ast.Call) and script.name_of(n.func).startswith("torch.nn.")
        for n in walk(init)
    ):
        return False
    given = [*module.args, *(k.value for k in module.keywords)]
    return any(
        isinstance(a, ast.Name | ast.Attribute) and moved.before(source_text(a), wrap)
        for a in given
    )


# Calls that return their module argument, or one built from its parameters,
# on the device it was on: DDP(convert_sync_batchnorm(model)) is on model's device.
DEVICE_KEEPING_WRAPPERS = (
    "convert_sync_batchnorm",
    "convert_syncbn_model",
    "compile",
    "deepcopy",  # a copy keeps each tensor's device
)


def unwrapped_module(script: Script, module: ast.expr) -> ast.expr:
    """The module inside device-keeping wrappers around DDP's argument."""
    while (
        isinstance(module, ast.Call)
        and module.args
        and short(script.name_of(module.func)) in DEVICE_KEEPING_WRAPPERS
    ):
        module = module.args[0]
    return module


def wrapped_by_name(script: Script, module: ast.expr) -> list[ast.expr]:
    """What a name holds inside device-keeping wrappers, each branch of a conditional
    (`model = torch.compile(raw) if args.compile else raw`: raw, twice), when every
    assignment of it but the DDP wrap wraps or names something else; [] otherwise."""
    values = [
        value
        for value in script.assigned_values.get(source_text(module), [])
        if not (isinstance(value, ast.Call) and is_ddp(script.name_of(value.func)))
    ]
    branches = [
        branch
        for value in values
        for branch in ((value.body, value.orelse) if isinstance(value, ast.IfExp) else (value,))
    ]
    inner = [unwrapped_module(script, branch) for branch in branches]
    if any(
        i is b and not isinstance(i, ast.Name) and not returns_a_moved_module(script, i)
        for i, b in zip(inner, branches, strict=True)
    ):
        return []  # built here by something else: not a wrapper of another name
    return inner


def parameter_not_rebound(script: Script, module: ast.expr) -> bool:
    """`model` in `def train_round(model, ...): ddp = DDP(model, ...)`, never assigned
    in that function: what it holds is whatever each caller passes (assigned_values is
    file-wide, and main's `model = None` is not it)."""
    if not isinstance(module, ast.Name):
        return False
    scope = enclosing_scope(module, script)
    if module.id not in parameter_names(scope):
        return False
    return not any(
        isinstance(node, ast.Name)
        and node.id == module.id
        and isinstance(node.ctx, ast.Store)
        and not is_the_wrap(script, script.parents.get(id(node)))
        for node in script.scope_nodes(scope)
    )


def is_the_wrap(script: Script, statement: ast.AST | None) -> bool:
    """`model = DDP(model, ...)`: the name rebound to its own wrapper."""
    return (
        isinstance(statement, ast.Assign)
        and isinstance(statement.value, ast.Call)
        and is_ddp(script.name_of(statement.value.func))
    )


# Imported model factories (detectron2's build_model(cfg), a repository's
# get_model(args)) may move the model to the device themselves.
FACTORY = re.compile(r"^(build|get|create|make|load|setup|init|prepare)", re.IGNORECASE)


def built_elsewhere(script: Script, module: ast.expr) -> bool:
    """The module comes from code this file does not show: it is never assigned
    here but through device-keeping wrappers of itself (a parameter, `self.model`
    set by a caller, a tuple unpacked from a call), it is a copy of another
    name, or an imported factory builds it."""
    if not isinstance(module, (ast.Name, ast.Attribute)):
        return imported_factory(script, module)  # DDP(build_model(cfg), ...)
    if parameter_not_rebound(script, module):
        return True  # the caller's argument: other functions' same name is not it
    name = source_text(module)
    values = [
        value
        for value in script.assigned_values.get(name, [])
        if not (isinstance(value, ast.Call) and is_ddp(script.name_of(value.func)))
        # `student = convert_sync_batchnorm(student)` keeps student where it was,
        # which its other bindings say (or the file does not show: a tuple unpacked
        # from a helper's return, `student, macs = prune(dense.to(device))`)
        and source_text(unwrapped_module(script, value)) != name
    ]
    if not values:
        return True
    return any(isinstance(value, ast.Name) or imported_factory(script, value) for value in values)


def imported_factory(script: Script, value: ast.expr) -> bool:
    callee = imported_callee(script, value) if isinstance(value, ast.Call) else None
    return callee is not None and bool(FACTORY.match(short(callee)))


# Module methods that return the module itself: `Net().to(device).train()` is moved.
RETURN_THE_MODULE = frozenset(
    {"train", "eval", "requires_grad_", "float", "half", "bfloat16", "double", "apply"}
)


def is_move(expr: ast.expr) -> bool:
    """`x.to(...)`, `x.cuda(...)`, a constructor given device=..., or a Hugging Face
    model placed by from_pretrained's device_map=...; also followed by methods that
    return the module (`.train()`, `.eval()`)."""
    expr = module_returned_by(expr)
    if not isinstance(expr, ast.Call):
        return False
    if isinstance(expr.func, ast.Attribute) and expr.func.attr in ("to", "cuda"):
        return True
    return keyword(expr, "device") is not None or keyword(expr, "device_map") is not None


def module_returned_by(expr: ast.expr) -> ast.expr:
    """`m` of `m.requires_grad_(False)` or `m.eval()`: calls that return their module."""
    while (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Attribute)
        and expr.func.attr in RETURN_THE_MODULE
    ):
        expr = expr.func.value
    return expr


class Moves:
    """Expressions (as source text) moved to a device somewhere in the file, and where."""

    def __init__(self, script: Script):
        self.script = script
        self.where: dict[str, list[ast.AST]] = {}
        for node in script.nodes:
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("to", "cuda")
            ):
                self.add(source_text(node.func.value), node)
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value and is_move(node.value):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    self.add(source_text(target), node)
            if isinstance(node, ast.Assign):  # `G, D = Gen().to(dev), Disc().to(dev)`
                for name, value in name_value_pairs(node):
                    if is_move(value):
                        self.add(name.id, node)
        for node in script.of_type(ast.For):
            self.add_moved_in_turn(node)

    def add_moved_in_turn(self, loop: ast.For) -> None:
        """`for m in (text_encoder, vae, unet): m.requires_grad_(False).to(device)`:
        each module the loop lists is moved, at the loop."""
        if not (isinstance(loop.target, ast.Name) and isinstance(loop.iter, ast.Tuple | ast.List)):
            return
        variable = loop.target.id
        if not any(
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("to", "cuda")
            and source_text(module_returned_by(node.func.value)) == variable
            for node in walk(loop)
        ):
            return
        for element in loop.iter.elts:
            if isinstance(element, ast.Name | ast.Attribute):
                self.add(source_text(element), loop)

    def add(self, text: str, node: ast.AST) -> None:
        self.where.setdefault(text, []).append(node)

    def __contains__(self, text: str) -> bool:
        return text in self.where

    def part_before(self, text: str, wrap: ast.Call) -> bool:
        """A submodule of `text` (`text.x`, `text.x.y`) is moved before the wrap."""
        return any(
            moved.startswith(f"{text}.") and self.before(moved, wrap) for moved in self.where
        )

    def before(self, text: str, wrap: ast.Call) -> bool:
        """`text` is moved somewhere that may run before the wrap: in another function,
        or above it in the wrap's own (`DDP(model, device_ids=[i])` then
        `model.to(i)` on the next line moves too late: the constructor raised)."""
        scope = enclosing_scope(wrap, self.script)
        return any(
            enclosing_scope(node, self.script) is not scope
            or (node.lineno, node.col_offset) < (wrap.lineno, wrap.col_offset)
            for node in self.where.get(text, ())
        )


# --- Hugging Face device_map under one process per GPU --------------------------

# device_map values that spread one model's layers over every visible GPU.
SPREADING_MAPS = frozenset({"auto", "balanced", "balanced_low_0", "sequential"})


@check("device-map-with-ddp")
def check_device_map_with_data_parallel(script: Script) -> Iterator[Finding]:
    """`from_pretrained(..., device_map="auto")` in a script that runs one process per GPU.

    Each process then spreads its own copy over all the GPUs: Accelerate
    refuses to train it, DDP rejects a module on several devices, or the
    copies crowd onto the same cards. A map to the rank's own GPU
    (`device_map={"": local_rank}`) is what data parallelism needs.
    """
    if not runs_a_process_per_gpu(script):
        return
    rank_zero_only = rank_zero_only_calls(script)
    for node, _name in script.call_names:
        spread = keyword(node, "device_map")
        if id(node) in rank_zero_only or not (
            isinstance(spread, ast.Constant) and spread.value in SPREADING_MAPS
        ):
            continue
        yield script.finding(
            "device-map-with-ddp",
            spread,
            f'device_map="{spread.value}" spreads the model over every visible GPU in each '
            "of the processes this script runs (one per GPU): Accelerate refuses to train "
            "it, DDP rejects a module on several devices, or the copies crowd onto the "
            "same cards; load each process's copy onto its own GPU "
            '(device_map={"": local_rank}) or leave device_map out',
        )


@check("hardcoded-device")
def check_device_map_to_one_fixed_gpu(script: Script) -> Iterator[Finding]:
    """`from_pretrained(..., device_map={"": 0})` in a script that runs one process per
    GPU (a single-GPU QLoRA recipe carried over): every process loads its copy onto
    GPU 0, which runs out of memory, while the batches and DDP's device_ids name
    each process's own GPU."""
    if not runs_a_process_per_gpu(script):
        return
    rank_zero_only = rank_zero_only_calls(script)
    for node, _name in script.call_names:
        given = keyword(node, "device_map")
        if id(node) in rank_zero_only or given is None:
            continue
        placed = given
        if isinstance(given, ast.Dict) and len(given.keys) == 1:
            key = given.keys[0]
            if not (isinstance(key, ast.Constant) and key.value == ""):
                continue
            placed = given.values[0]  # {"": 0}: the whole model on one device
        index = fixed_gpu(placed)
        if index is None or (placed is given and isinstance(given.value, str)):
            continue  # device_map="cuda:0" is a device string the literal check reads
        yield script.finding(
            "hardcoded-device",
            given,
            f"device_map={source_text(given)} loads the whole model onto GPU {index} in "
            "every process this script runs (one per GPU): they all crowd onto that card "
            "(out of memory) while their batches and DDP name their own GPUs; map it to "
            'the process\'s own GPU: device_map={"": local_rank} (int(os.environ["LOCAL_RANK"]))',
        )


def fixed_gpu(value: ast.expr) -> int | None:
    """The GPU a literal names: `0`, `"cuda:1"`; None for anything else ("cpu",
    "auto", a name, or "cuda": the current device, each process's own after set_device)."""
    if not isinstance(value, ast.Constant):
        return None
    if type(value.value) is int:
        return value.value
    if isinstance(value.value, str) and value.value.startswith("cuda:"):
        index = value.value.partition(":")[2]
        return int(index) if index.isdigit() else None
    return None


def runs_a_process_per_gpu(script: Script) -> bool:
    """A process group or DDP, or a training loop under Accelerate's `Accelerator`
    (launched one process per GPU; one process alone may spread a model to infer),
    or a launch line of the file's own text that starts several processes
    (`torchrun --nproc_per_node=4 train.py` above a Trainer that starts DDP itself)."""
    if is_distributed(script) or {"Accelerator", "backward"} <= script.called_short_names:
        return True
    launched = launched_world_size(script.source)
    return launched is not None and launched > 1
