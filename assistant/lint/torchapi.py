"""What the linter knows about PyTorch's API: names of collectives, spawners,
tensor factories, and tests on resolved call names ("torch.distributed.barrier")."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from assistant.lint.model import Script, called_name, is_int, keyword, short

# Anything that names the number of processes or asks the framework for the count.
PROCESS_COUNT = re.compile(
    r"world|num_devices|devices|num_gpus|n_gpus|ngpus|gpus|num_processes|nprocs|"
    r"replicas|stepping_batches|num_nodes|"
    # the data-parallel size of a tensor- or pipeline-parallel run (Megatron's dp_size)
    r"dp_size|dp_world|dp_degree|data_parallel",
    re.IGNORECASE,
)
DIST = "torch.distributed"

COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "monitored_barrier",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
    }
)
# torch.distributed calls that need the default process group.
NEEDS_GROUP = COLLECTIVES | {"get_rank", "get_world_size", "get_backend", "new_group"}

SPAWNERS = frozenset(
    {
        "torch.multiprocessing.spawn",
        "torch.multiprocessing.start_processes",
        "torch.multiprocessing.Process",
        "torch.multiprocessing.Pool",
        "multiprocessing.Process",
        "multiprocessing.Pool",
    }
)
TENSOR_FACTORIES = frozenset(
    {"tensor", "zeros", "ones", "empty", "full", "rand", "randn", "arange"}
)
LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")
LOCAL_RANK_NAME = re.compile(r"^(local_rank|localrank|local_rank_id|lrank)$", re.IGNORECASE)
FIXED_CUDA = re.compile(r"^cuda:\d+$")
# True on rank 0 only, called or read as a property: `is_main_process()`,
# Accelerate's `accelerator.is_main_process` / `is_local_main_process`,
# Lightning's `trainer.is_global_zero`, the HF Trainer's `is_world_process_zero()`.
MAIN_PROCESS_HELPERS = frozenset(
    {
        "is_main_process",
        "is_local_main_process",
        "is_master",
        "is_rank_zero",
        "is_rank0",
        "is_global_zero",
        "is_world_process_zero",
        "is_local_process_zero",
    }
)
# Collectives of the libraries most scripts train with, called as methods; each
# waits for every rank like its torch.distributed twin. Hugging Face Accelerate:
# `accelerator.wait_for_everyone()`, `accelerator.gather(x)`; Lightning:
# `self.all_gather(x)` in a LightningModule, `fabric.barrier()`,
# `trainer.strategy.barrier()`. `gather` and friends count only on an object
# named like an accelerator, and Lightning's only on `self`, a fabric or a
# strategy: `torch.gather`, `x.reduce` and `pool.broadcast` are not.
WAITS_FOR_EVERY_RANK = "wait_for_everyone"
ACCELERATOR_COLLECTIVES = frozenset(
    {"gather", "gather_for_metrics", "reduce", "pad_across_processes"}
)
LIGHTNING_COLLECTIVES = frozenset({"all_gather", "all_reduce", "barrier", "broadcast"})
LIGHTNING_OWNERS = re.compile(r"^(self|fabric|strategy|\w*_strategy)$")


# Frameworks that start the processes themselves (framework_processes).
LIGHTNING_PACKAGES = frozenset({"lightning", "pytorch_lightning", "lightning_fabric"})
LIGHTNING_LAUNCHERS = frozenset({"Trainer", "Fabric"})
# (package, function) of the calls that start them.
RAY_TRAIN = frozenset(
    {("ray", "TorchTrainer"), ("ray", "prepare_model"), ("ray", "prepare_data_loader")}
)
COMPOSER = frozenset({("composer", "Trainer")})
OTHER_LAUNCHERS = RAY_TRAIN | COMPOSER
# What runs backward: `loss.backward()`, `scaler.scale(loss).backward()`,
# `accelerator.backward(loss)`, Lightning's `self.manual_backward(loss)`.
BACKWARDS = frozenset({"backward", "manual_backward"})


# A torchmetrics metric (or MetricCollection) gathers every rank's state when
# it computes (sync_on_compute, on by default once a process group exists):
# `metric.compute()` is a collective, and under `if rank == 0:` rank 0 waits for
# ranks that never call it (the torchmetrics docs ask for compute on every rank).
METRIC_LIBRARY = "torchmetrics"
METRIC_SYNC = "compute"


def metric_objects(script: Script) -> frozenset[str]:
    """The names and attributes a file assigns a torchmetrics object to
    (`auroc = BinaryAUROC(...)`, `self.acc = torchmetrics.Accuracy(...)`)."""
    if not any(name.split(".")[0] == METRIC_LIBRARY for name in script.aliases.values()):
        return frozenset()  # nothing imported from torchmetrics: no assignment to read
    return frozenset(
        target
        for target, values in script.assigned_values.items()
        if any(constructed_by(script, value).split(".")[0] == METRIC_LIBRARY for value in values)
    )


def constructed_by(script: Script, value: ast.expr) -> str:
    """What made `value`: the call at the start of a chain (`BinaryAUROC().to(device)`
    is BinaryAUROC's), resolved through imports; "" when it is not a call."""
    while isinstance(value, ast.Call):
        name = script.name_of(value.func)
        if name or not isinstance(value.func, ast.Attribute):
            return name
        value = value.func.value
    return ""


def syncs_metric(name: str, metrics: frozenset[str]) -> bool:
    """`name` is `<a torchmetrics object>.compute`, which all-gathers its state."""
    owner, _, method = name.rpartition(".")
    return method == METRIC_SYNC and owner in metrics


def is_dist_call(name: str, functions: frozenset[str] | set[str]) -> bool:
    """`torch.distributed.<one of functions>` (not a method of a submodule)."""
    return name.startswith(DIST + ".") and short(name) in functions and name.count(".") == 2


def is_collective(name: str) -> bool:
    """A call every rank must make: torch.distributed's, Accelerate's or Lightning's."""
    if is_dist_call(name, COLLECTIVES):
        return True
    owner, _, method = name.rpartition(".")
    owner = short(owner).lower()
    if not owner:
        return False
    if method == WAITS_FOR_EVERY_RANK:
        return True
    if "accelerator" in owner:
        return method in ACCELERATOR_COLLECTIVES | LIGHTNING_COLLECTIVES
    return method in LIGHTNING_COLLECTIVES and bool(LIGHTNING_OWNERS.match(owner))


# DeepSpeed's own start of the default group (torch.distributed's, under its comm layer).
DEEPSPEED_INITS = frozenset({"deepspeed.init_distributed", "deepspeed.comm.init_distributed"})
# DeepSpeed's engine: it starts the group itself when none is, and trains data-parallel.
DEEPSPEED_ENGINE = "deepspeed.initialize"


def is_init(name: str) -> bool:
    return short(name) == "init_process_group" or name in DEEPSPEED_INITS


def is_set_device(name: str) -> bool:
    return name.endswith("cuda.set_device")


def is_ddp(name: str) -> bool:
    return short(name) == "DistributedDataParallel"


def init_calls(script: Script) -> list[ast.Call]:
    """Every init_process_group call of the file, in source order."""
    return [node for node, name in script.call_names if is_init(name)]


# Making a device mesh starts the default process group when none exists
# (DeviceMesh's constructor calls init_process_group), so a script may never call it.
MESH_BUILDERS = frozenset({"init_device_mesh", "DeviceMesh"})


def makes_a_device_mesh(name: str) -> bool:
    return name.startswith("torch.distributed") and short(name) in MESH_BUILDERS


def is_distributed(script: Script) -> bool:
    """The script starts a process group (itself, or by making a device mesh) or wraps
    a model in DDP (or DeepSpeed's engine)."""
    return bool(init_calls(script)) or any(
        is_ddp(name) or name == DEEPSPEED_ENGINE or makes_a_device_mesh(name)
        for _node, name in script.call_names
    )


def runs_a_process_per_gpu(script: Script) -> bool:
    """The script is written to run as several processes: it starts a process
    group or wraps in DDP itself, or leaves that to a framework and says so (an
    `Accelerator()`, a DeepSpeed import, a `local_rank` it reads from the
    launcher, a Lightning Trainer or Fabric not pinned to one device, Ray
    Train, Composer)."""
    if is_distributed(script) or uses_deepspeed(script) or framework_processes(script):
        return True
    if "Accelerator" in script.called_short_names:
        return True
    return reads_env(script, "LOCAL_RANK") or any(
        isinstance(node, ast.Attribute) and node.attr == "local_rank" for node in script.nodes
    )


def framework_processes(script: Script) -> bool:
    """A framework starts one process per device and wraps the model out of
    sight: Lightning's Trainer or Fabric not pinned to one device (their default
    takes every GPU, with DDP), Ray Train's TorchTrainer / prepare_model,
    Composer's Trainer (run by `composer -n N`)."""
    for node, name in script.call_names:
        package, function = name.split(".")[0], short(name)
        if package in LIGHTNING_PACKAGES and function in LIGHTNING_LAUNCHERS:
            if not pinned_to_one_device(node):
                return True
        elif (package, function) in OTHER_LAUNCHERS:
            return True
    return False


def calls_any(script: Script, calls: frozenset[tuple[str, str]]) -> bool:
    """The file calls one of `calls`, each (package, function): `ray.train.torch.TorchTrainer`
    is ("ray", "TorchTrainer")."""
    return any((name.split(".")[0], short(name)) in calls for _node, name in script.call_names)


def saved_file(save: ast.Call) -> ast.expr | None:
    """The file a `torch.save(obj, f)` call writes."""
    return save.args[1] if len(save.args) > 1 else keyword(save, "f")


def loaded_file(load: ast.Call) -> ast.expr | None:
    """The file a `torch.load(f)` call reads."""
    return load.args[0] if load.args else keyword(load, "f")


def is_backward(node: ast.AST) -> bool:
    """A call that runs backward (BACKWARDS), on whatever it is called on."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in BACKWARDS
    )


LIGHTNING_MODULES = ("LightningModule",)
LIGHTNING_HOOKED = ("LightningModule", "LightningDataModule")


def lightning_classes(
    script: Script, kinds: tuple[str, ...] = LIGHTNING_MODULES
) -> list[ast.ClassDef]:
    """The file's classes built on Lightning's (`class Net(pl.LightningModule)`):
    Lightning calls their hooks, on every process, out of the file's sight."""
    return [
        node
        for node in script.of_type(ast.ClassDef)
        if any(short(script.name_of(base)).endswith(kinds) for base in node.bases)
    ]


def pinned_to_one_device(launcher: ast.Call) -> bool:
    """`Trainer(devices=1)`, `Fabric(gpus=1)`, or a CPU accelerator: one process."""
    accelerator = keyword(launcher, "accelerator")
    if isinstance(accelerator, ast.Constant) and accelerator.value == "cpu":
        return True
    return any(
        isinstance(value := keyword(launcher, flag), ast.Constant) and value.value in (1, "1")
        for flag in ("devices", "gpus")
    )


def one_process_group(script: Script) -> bool:
    """Every init_process_group says world_size=1: one process, nothing to race."""
    inits = init_calls(script)
    sizes = [keyword(call, "world_size") for call in inits]
    return bool(inits) and all(is_int(size) and size.value == 1 for size in sizes)


def imported_callee(script: Script, call: ast.Call) -> str | None:
    """The resolved name of what `call` calls, when it comes from an import that is
    not torch's own (`utils.init_distributed_mode`, `build_model`); else None."""
    root = call.func
    while isinstance(root, ast.Attribute):
        root = root.value
    if not (isinstance(root, ast.Name) and root.id in script.aliases):
        return None
    name = script.name_of(call.func)
    # `torchtitan.utils.init_distributed` is not torch's own
    return None if name == "torch" or name.startswith("torch.") else name


# Libraries whose `init` / `setup` / `*dist*` calls have nothing to do with
# torch.distributed: experiment trackers (`wandb.init` starts a run, not a process
# group) and numeric libraries (`scipy.spatial.distance.cdist`).
UNRELATED_TO_SETUP = frozenset(
    {
        "wandb",
        "mlflow",
        "neptune",
        "comet_ml",
        "clearml",
        "aim",
        "swanlab",
        "tensorboardX",
        "numpy",
        "scipy",
        "sklearn",
        "math",
        "random",
        "logging",
    }
)


def external_setup_helpers(script: Script) -> list[ast.Call]:
    """Calls to imported, non-torch functions that may set up distributed
    (`utils.init_distributed_mode(args)`, `init_dist(launcher)`, `setup_ddp()`):
    what they do (the process group, set_device) happens in a file not shown."""
    return [
        node
        for node, _name in script.call_names
        if (callee := imported_callee(script, node))
        and callee.split(".")[0] not in UNRELATED_TO_SETUP
        and re.search(r"dist|setup|init", short(callee), re.IGNORECASE)
    ]


def calls_external_setup(script: Script) -> bool:
    """Any call of `external_setup_helpers`."""
    return bool(external_setup_helpers(script))


VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def environment_settings(script: Script, variable: str) -> Iterator[tuple[ast.AST, ast.expr]]:
    """(where, value) of each time the file writes `variable` into an environment:
    `os.environ["MASTER_PORT"] = port`, `{"MASTER_PORT": port}`,
    `env.update(MASTER_PORT=port)`, `dict(os.environ, MASTER_PORT=port)`."""
    for node in script.of_type((ast.Dict, ast.Call, ast.Assign)):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == variable:
                    yield node, value
        elif isinstance(node, ast.Call):
            for given in node.keywords:
                if given.arg == variable:
                    yield node, given.value
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                key = target.slice if isinstance(target, ast.Subscript) else None
                if isinstance(key, ast.Constant) and key.value == variable:
                    yield node, node.value


def visible_device_settings(script: Script) -> Iterator[tuple[ast.AST, ast.expr]]:
    """Each CUDA_VISIBLE_DEVICES the file writes into an environment (environment_settings)."""
    return environment_settings(script, VISIBLE_DEVICES)


def sets_visible_devices_per_process(script: Script) -> bool:
    """CUDA_VISIBLE_DEVICES set to a computed value (visible_device_settings): each
    process then sees its own GPU as cuda:0, so the current device is already its own."""
    return any(
        not isinstance(value, ast.Constant) for _node, value in visible_device_settings(script)
    )


def backend_of(call: ast.Call) -> str | None:
    """The literal backend of an init_process_group call, None if absent or computed;
    DeepSpeed's init_distributed takes `dist_backend`, NCCL unless told."""
    if called_name(call) == "init_distributed":
        given = keyword(call, "dist_backend") or (call.args[0] if call.args else None)
        value = given if given is not None else ast.Constant("nccl")
    else:
        value = keyword(call, "backend") or (call.args[0] if call.args else None)
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        return value.value.lower()
    return None


def reads_env(script: Script, variable: str) -> bool:
    """True if the string `variable` appears as a literal (os.environ[...], getenv)."""
    return variable in script.string_constants


def is_method(node: ast.Call, attr: str) -> bool:
    """`something.attr(...)` where something is not the torch module itself."""
    func = node.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr == attr
        and not (isinstance(func.value, ast.Name) and func.value.id == "torch")
    )


def uses_cuda(script: Script) -> bool:
    """`.cuda(...)`, a "cuda..." device string, or an f"cuda:{...}" string."""
    if any(is_method(node, "cuda") for node, _name in script.call_names):
        return True
    return any(s == "cuda" or s.startswith("cuda:") for s in script.string_constants)


def imports_package(script: Script, package: str) -> bool:
    """The script imports `package` or something from it."""
    return any(module.split(".")[0] == package for module in script.aliases.values())


def uses_deepspeed(script: Script) -> bool:
    """The script imports DeepSpeed, whose launcher passes `--local_rank=N` itself."""
    return imports_package(script, "deepspeed")


def local_rank_arguments(script: Script) -> list[tuple[ast.Call, set[str]]]:
    """parser.add_argument calls for the local rank, with the flags they accept."""
    found = []
    for node, name in script.call_names:
        if short(name) != "add_argument":
            continue
        flags = {a.value for a in node.args if isinstance(a, ast.Constant)}
        if flags & set(LOCAL_RANK_FLAGS):
            found.append((node, flags))
    return found
