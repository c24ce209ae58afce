"""Launch checks: the main guard, where the local rank comes from, a fixed world size,
Slurm's rank beside torchrun's local rank, the file's own launch lines."""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Iterator

from assistant.lint.launchtext import (
    TASKS_PER_NODE,
    launch_problems,
    launched_nodes,
    runs_on_several_machines,
    torchrun_under_srun,
)
from assistant.lint.model import Script, is_int, keyword, short, source_text, walk
from assistant.lint.ranks import environment_variable, without_int
from assistant.lint.registry import check
from assistant.lint.torchapi import (
    LOCAL_RANK_FLAGS,
    LOCAL_RANK_NAME,
    SPAWNERS,
    backend_of,
    init_calls,
    is_set_device,
    local_rank_arguments,
    reads_env,
    uses_deepspeed,
)
from assistant.lint.values import MAX_HOPS, dataclass_default, dataclass_fields, is_self
from assistant.results import Finding


@check("missing-main-guard")
def check_missing_main_guard(script: Script) -> Iterator[Finding]:
    """Processes started at import time: spawn children re-run the module.

    mp.spawn always starts its children by spawning. A DataLoader's workers are
    spawned only where Python spawns by default (Windows, macOS) or the file
    chooses it; a script on NCCL runs on Linux, where the workers fork and
    re-import nothing, so its loaders are left alone unless it chose spawn."""
    reported: set[int] = set()  # one finding per top-level line: the spawn, or the loader in it
    workers_spawn = may_spawn_loader_workers(script)
    for call in script.traces[0]:
        if call.guarded or call.top_line in reported:
            continue
        if call.name in SPAWNERS:
            what = f"{short(call.name)}() (line {call.node.lineno})"
        elif short(call.name) == "DataLoader" and positive_workers(call.node) and workers_spawn:
            what = f"a DataLoader with worker processes (line {call.node.lineno})"
        else:
            continue
        reported.add(call.top_line)
        yield script.finding(
            "missing-main-guard",
            call.top_line,
            f"{what} runs at import time; spawned processes re-import the script "
            'and start it again: put it under `if __name__ == "__main__":`',
        )


def may_spawn_loader_workers(script: Script) -> bool:
    """A DataLoader's workers may start by spawning: the file chooses spawn (or
    forkserver) itself, or nothing ties it to Linux (an NCCL process group)."""
    chosen = [
        keyword(node, "multiprocessing_context")
        or keyword(node, "method")
        or (node.args[0] if short(name) == "set_start_method" and node.args else None)
        for node, name in script.call_names
        if short(name) == "set_start_method" or keyword(node, "multiprocessing_context")
    ]
    if any(not (isinstance(c, ast.Constant) and c.value == "fork") for c in chosen):
        return True  # spawn, forkserver, or a choice not written out
    return not any(backend_of(call) == "nccl" for call in init_calls(script))


def positive_workers(call: ast.Call) -> bool:
    workers = keyword(call, "num_workers")
    return is_int(workers) and workers.value > 0


# Packages whose argument classes read LOCAL_RANK themselves.
HF_ARGUMENT_PACKAGES = frozenset({"transformers", "trl"})


@check("local-rank-not-from-env")
def check_local_rank_not_from_env(script: Script) -> Iterator[Finding]:
    """A local rank from an argparse default or a constant: every rank picks one GPU."""
    if reads_the_value_of(script, TORCHRUN_LOCAL_RANK):
        return
    if uses_deepspeed(script) and not documented_torchrun_only(script):
        return  # the `deepspeed` launcher passes --local_rank=N
    for node, _flags in local_rank_arguments(script):
        if not is_required(node) and not flag_value_read(script, node):
            continue  # the flag only swallows the launcher's; the rank comes from elsewhere
        default = keyword(node, "default")
        shown = source_text(default) if default is not None else "None"
        yield script.finding(
            "local-rank-not-from-env",
            node,
            f"local rank comes from a command-line flag (default {shown}); torchrun passes "
            'none, so every process gets the default: use int(os.environ["LOCAL_RANK"])',
        )
    for node in script.of_type(ast.Assign):
        if is_int(node.value):
            for target in node.targets:
                if isinstance(target, ast.Name) and LOCAL_RANK_NAME.match(target.id):
                    yield script.finding(
                        "local-rank-not-from-env",
                        node,
                        f"{target.id} is the constant {node.value.value}: every process "
                        'uses the same GPU; use int(os.environ["LOCAL_RANK"])',
                    )
    yield from local_rank_config_defaults(script)


def local_rank_config_defaults(script: Script) -> Iterator[Finding]:
    """`local_rank: int = 0` in a config dataclass (a Hydra structured config) that the
    file reads (`cfg.dist.local_rank`) and nothing sets: torchrun passes no such
    override, so every process takes the default GPU. A read of `self.local_rank` is
    some class's own field (a Trainer's), not the config's."""
    read = {
        node.attr
        for node in script.of_type(ast.Attribute)
        if isinstance(node.ctx, ast.Load)
        and LOCAL_RANK_NAME.match(node.attr)
        and not is_self(node.value)
    }
    for name in sorted(read):
        known, value = dataclass_default(script, name)
        if not (known and isinstance(value, int)) or isinstance(value, bool):
            continue
        [(cls, field)] = dataclass_fields(script, name)
        yield script.finding(
            "local-rank-not-from-env",
            field,
            f"{cls.name}.{name} defaults to {value} and nothing in the file sets it: "
            "torchrun passes no such option, so every process uses the same GPU; "
            'read int(os.environ["LOCAL_RANK"]) into it',
        )


def reads_the_value_of(script: Script, variable: str) -> bool:
    """The file reads the variable's value somewhere: its name appears other than as
    the target of `os.environ[variable] = ...` or in an `in` / `not in` test (a file
    that only exports the flag's value as LOCAL_RANK still takes the flag's)."""
    parents = script.parents
    for node in script.nodes:
        if not (isinstance(node, ast.Constant) and node.value == variable):
            continue
        parent = parents.get(id(node))
        if isinstance(parent, ast.Subscript) and isinstance(parent.ctx, ast.Store):
            continue
        if isinstance(parent, ast.Compare) and all(
            isinstance(op, (ast.In, ast.NotIn)) for op in parent.ops
        ):
            continue
        return True
    return False


@check("local-rank-arg-mismatch")
def check_local_rank_arg_mismatch(script: Script) -> Iterator[Finding]:
    """Only one spelling of the local-rank flag, or a flag torchrun never passes."""
    if uses_deepspeed(script) or names_the_deepspeed_launcher(script):
        return  # the `deepspeed` launcher passes --local_rank=N, the spelling it expects
    for node, flags in local_rank_arguments(script):
        accepted = flags & set(LOCAL_RANK_FLAGS)
        problems = []
        if accepted == {"--local_rank"} and not launched_by_torchrun_alone(script):
            problems.append(
                "accepts --local_rank only; torch.distributed.launch in PyTorch 2.x passes "
                '--local-rank ("unrecognized arguments: --local-rank=0")'
            )
        elif accepted == {"--local-rank"}:
            problems.append(
                "accepts --local-rank only; launchers before PyTorch 2.0 pass --local_rank"
            )
        if is_required(node):
            problems.append("the flag is required, but torchrun passes none")
        if problems:
            yield script.finding(
                "local-rank-arg-mismatch", node, "; ".join(problems) + arg_fix(script, node)
            )


# A command line the file documents that starts with the `deepspeed` launcher
# (`deepspeed --num_gpus=8 train.py ...`, in its docstring or a comment).
DEEPSPEED_LAUNCH = re.compile(
    r"^[\s#]*(?:[A-Z_]+=\S+\s+)*deepspeed\s+(?:--|\S+\.py\b)", re.MULTILINE
)


# A launch line that starts the script with torchrun (or its module form).
TORCHRUN_LINE = re.compile(
    r"^[\s#]*(?:[A-Z_]+=\S+\s+)*(?:torchrun|python3?\s+-m\s+torch\.distributed\.run)\b",
    re.MULTILINE,
)


def launched_by_torchrun_alone(script: Script) -> bool:
    """The file's own text launches it with torchrun, never with torch.distributed.launch
    or the `deepspeed` launcher: no launcher passes it a local-rank flag of either
    spelling, so a flag's spelling cannot be what goes wrong (that the flag's default
    is read instead of LOCAL_RANK is local-rank-not-from-env's finding)."""
    return documented_torchrun_only(script) and "torch.distributed.launch" not in script.source


def documented_torchrun_only(script: Script) -> bool:
    """The file's own text launches it with torchrun and never with the `deepspeed`
    launcher: a DeepSpeed script so started gets no --local_rank argument."""
    return bool(TORCHRUN_LINE.search(script.source)) and not names_the_deepspeed_launcher(script)


def names_the_deepspeed_launcher(script: Script) -> bool:
    """The file says it is launched by `deepspeed` (a Trainer handed a DeepSpeed
    config, run by that launcher, imports no deepspeed itself)."""
    return bool(DEEPSPEED_LAUNCH.search(script.source))


def arg_fix(script: Script, node: ast.Call) -> str:
    """Where the rank already comes from LOCAL_RANK, only the spellings need fixing."""
    if reads_env(script, "LOCAL_RANK") or not flag_value_read(script, node):
        return ': accept both spellings, optional: add_argument("--local-rank", "--local_rank")'
    return ': read os.environ["LOCAL_RANK"] (or accept both spellings, optional)'


def is_required(node: ast.Call) -> bool:
    required = keyword(node, "required")
    return isinstance(required, ast.Constant) and bool(required.value)


def flag_value_read(script: Script, node: ast.Call) -> bool:
    """The parsed local rank is used in this file: `args.local_rank`, `opt["local_rank"]`;
    not when it only goes to the Hugging Face arguments, which take LOCAL_RANK from
    the environment over it (`TrainingArguments(local_rank=args.local_rank)`)."""
    dest = keyword(node, "dest")
    name = dest.value if isinstance(dest, ast.Constant) else "local_rank"
    overridden = hf_local_rank_values(script)
    return name in script.string_constants or any(
        isinstance(n, ast.Attribute)
        and n.attr == name
        and isinstance(n.ctx, ast.Load)
        and id(n) not in overridden
        for n in script.nodes
    )


def hf_local_rank_values(script: Script) -> set[int]:
    """ids of the values given as local_rank= to TrainingArguments (or trl's
    *Config): its __post_init__ takes LOCAL_RANK from the environment when set."""
    return {
        id(value)
        for node, name in script.call_names
        if name.split(".")[0] in HF_ARGUMENT_PACKAGES
        and (short(name).endswith("TrainingArguments") or short(name).endswith("Config"))
        and (value := keyword(node, "local_rank")) is not None
    }


@check("world-size-mismatch")
def check_world_size_mismatch(script: Script) -> Iterator[Finding]:
    """init_process_group with a hard-coded world_size or rank."""
    constants = module_int_constants(script)
    for node in init_calls(script):
        for name in ("world_size", "rank"):
            value = keyword(node, name)
            if is_int(value):
                fixed, source = value.value, f"{name}={value.value}"
            elif isinstance(value, ast.Name) and value.id in constants:
                fixed = constants[value.id]
                source = f"{name}={value.id}, {value.id} = {fixed}"
            else:
                continue
            yield script.finding(
                "world-size-mismatch",
                value,
                f"hard-coded {source} in init_process_group: "
                + (
                    f"if the launcher starts other than {fixed} processes, rendezvous"
                    if name == "world_size"
                    else f"every process claims rank {fixed}, so rendezvous"
                )
                + " waits and times out; leave it out under torchrun "
                "(env://) or pass the spawned rank and the real world size",
            )


# What a launcher or scheduler sets to the process's index on its own node.
LOCAL_RANK_VARIABLES = frozenset({"LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"})


@check("world-size-mismatch")
def check_rank_given_the_local_rank(script: Script) -> Iterator[Finding]:
    """`init_process_group(rank=local_rank, ...)` where local_rank is read from
    LOCAL_RANK: the index on this node, not in the job. On one node the two agree;
    on two, both nodes claim ranks 0..n-1 and nobody the rest."""
    for node in init_calls(script):
        value = keyword(node, "rank")
        variable = local_rank_variable(script, value) if value is not None else None
        if variable is None:
            continue
        yield script.finding(
            "world-size-mismatch",
            value,
            f"rank={source_text(value)} in init_process_group is the process's index on its "
            f"own node ({variable}), not in the job: on more than one node every node claims "
            "ranks 0..n-1 and no process claims the others, so rendezvous fails or waits; pass "
            'rank=int(os.environ["RANK"]) (or leave rank out under torchrun: env:// reads it)',
        )


@check("world-size-mismatch")
def check_world_sized_by_one_nodes_gpus(script: Script) -> Iterator[Finding]:
    """`init_process_group(world_size=torch.cuda.device_count(), rank=int(os.environ
    ["RANK"]))`: the rank is the launcher's, counted over every node, but the world is
    this node's GPUs. On one node with a process per GPU the two agree; on two, the
    ranks of the second node are outside the world."""
    for node in init_calls(script):
        value, rank = keyword(node, "world_size"), keyword(node, "rank")
        if value is None or rank is None or not counts_this_nodes_gpus(script, value):
            continue
        if environment_variable(without_int(rank), script) != "RANK" and not (
            isinstance(rank, ast.Name) and global_rank_name(script, rank.id)
        ):
            continue
        yield script.finding(
            "world-size-mismatch",
            value,
            f"world_size={source_text(value)} counts this node's GPUs, but rank="
            f"{source_text(rank)} is the launcher's rank over every node: on one node with a "
            "process per GPU they agree; on more nodes (or fewer processes than GPUs) the "
            "ranks past it are outside the world and rendezvous fails or waits; pass "
            'world_size=int(os.environ["WORLD_SIZE"]) (or leave both out under torchrun)',
        )


# What counts one node's processes: LOCAL_WORLD_SIZE, or its GPUs.
NODE_COUNTS = frozenset({"LOCAL_WORLD_SIZE"})


@check("world-size-mismatch")
def check_mesh_sized_by_one_node(script: Script) -> Iterator[Finding]:
    """`init_device_mesh("cuda", (gpus_per_node // tp, tp))` with gpus_per_node read from
    LOCAL_WORLD_SIZE (or the node's GPU count) in a job the file launches on several
    nodes: the mesh covers one node's ranks, not the job's, and the ranks of the
    other nodes have no place in it."""
    nodes = launched_nodes(script.source)
    if nodes is None:
        return
    for node, name in script.call_names:
        if short(name) != "init_device_mesh" or len(node.args) < 2:
            continue
        shape = node.args[1]
        read = shape_sources(script, shape)
        if read & {"WORLD_SIZE", "world"} or not read & (NODE_COUNTS | {"device_count"}):
            continue
        yield script.finding(
            "world-size-mismatch",
            node,
            f"the mesh's shape {source_text(shape)} is counted from one node's processes "
            f"(LOCAL_WORLD_SIZE or its GPU count), but the launch on line {nodes[0]} starts "
            f"{nodes[1]} nodes: the ranks of the others have no place in it; size it from "
            "dist.get_world_size()",
        )


# Calls behind a mesh shape: one node's GPUs, or the job's world.
SIZE_CALLS = {"device_count": "device_count", "get_world_size": "world"}


def shape_sources(script: Script, shape: ast.expr, hops: int = 3) -> set[str]:
    """The environment variables, GPU-count calls and world-size reads behind a mesh
    shape, a few assignments back (`dp = gpus_per_node // tp`)."""
    found: set[str] = set()
    frontier = [shape]
    for _ in range(hops):
        following: list[ast.expr] = []
        for part in (p for expr in frontier for p in walk(expr) if isinstance(p, ast.expr)):
            variable = environment_variable(without_int(part), script)
            if variable is not None:
                found.add(variable)
            if isinstance(part, ast.Call) and short(script.name_of(part.func)) in SIZE_CALLS:
                found.add(SIZE_CALLS[short(script.name_of(part.func))])
            if isinstance(part, ast.Name):
                following += script.assigned_values.get(part.id, [])
        frontier = following
    return found


def counts_this_nodes_gpus(script: Script, value: ast.expr) -> bool:
    """`torch.cuda.device_count()`, directly or through a name (or a field,
    `args.world_size`) every assignment of which is that call."""
    values = (
        script.assigned_values.get(source_text(value), [])
        if isinstance(value, ast.Name | ast.Attribute)
        else [value]
    )
    return bool(values) and all(
        isinstance(v, ast.Call) and script.name_of(v.func) == "torch.cuda.device_count"
        for v in values
    )


def global_rank_name(script: Script, name: str) -> bool:
    """A name every assignment of which reads RANK from the environment."""
    sources = script.assigned_values.get(name, [])
    return bool(sources) and all(
        environment_variable(without_int(v), script) == "RANK" for v in sources
    )


def local_rank_variable(script: Script, value: ast.expr) -> str | None:
    """The node-local variable `value` is read from: directly, through int(...), or
    through a name (or a field, `args.local_rank`) every assignment of which reads it."""
    inner = without_int(value)
    variable = environment_variable(inner, script)
    if variable is not None:
        return variable if variable in LOCAL_RANK_VARIABLES else None
    if not isinstance(inner, ast.Name | ast.Attribute):
        return None
    sources = script.assigned_values.get(source_text(inner), [])
    found = {environment_variable(without_int(v), script) for v in sources}
    if len(found) == 1 and (variable := found.pop()) in LOCAL_RANK_VARIABLES:
        return variable
    return None


@check("world-size-mismatch")
def check_world_size_of_nodes_with_process_ranks(script: Script) -> Iterator[Finding]:
    """In a spawned worker, a rank counted per process (`args.rank * ngpus_per_node +
    gpu`, the ImageNet example's) next to a world_size no line of the file scales by
    the processes per node: --world-size given as the number of nodes."""
    scaled: set[str] | None = None  # worked out at the first rank counted per process
    for worker in spawned_workers(script):
        index = (worker.args.posonlyargs + worker.args.args)[0].arg
        assigned = values_in(script, worker)
        for node in script.scope_nodes(worker):
            if not (
                isinstance(node, ast.Call)
                and short(script.name_of(node.func)) == "init_process_group"
            ):
                continue
            rank, world = keyword(node, "rank"), keyword(node, "world_size")
            if rank is None or world is None or not isinstance(world, (ast.Name, ast.Attribute)):
                continue
            if not counts_processes(rank, index, assigned):
                continue
            scaled = scaled_names(script) if scaled is None else scaled
            from_launcher = node_count_from_launcher(rank, world, assigned)
            if source_text(world) in scaled and not from_launcher:
                continue
            given = (
                "the environment's WORLD_SIZE, which the launcher that set RANK to this "
                "node's (pod's) index set to the number of nodes"
                if from_launcher
                else "the number of nodes (--world-size 1)"
            )
            yield script.finding(
                "world-size-mismatch",
                world,
                f"rank={source_text(rank)} counts processes ({index} is the spawned index), but "
                f"world_size={source_text(world)} is never multiplied by the processes per node: "
                f"given {given}, every rank past it is outside the world, and rendezvous waits "
                f"until it times out; set {source_text(world)} = nodes * processes per node",
            )


def node_count_from_launcher(
    rank: ast.expr, world: ast.expr, assigned: dict[str, list[ast.expr]]
) -> bool:
    """The worker counts its rank from the environment's RANK times the processes per
    node, and takes the environment's WORLD_SIZE as it is: the launcher that set RANK
    to this node's (pod's) index set WORLD_SIZE to the number of nodes, not processes
    (a Kubeflow PyTorchJob whose pods each mp.spawn one process per GPU)."""
    world_values = assigned.get(source_text(world), [])
    if not world_values or not all(names_env_variable(v, "WORLD_SIZE") for v in world_values):
        return False
    if any(
        isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult)
        for v in world_values
        for n in walk(v)
    ):
        return False
    products = [
        part
        for value in [rank, *assigned.get(source_text(rank), [])]
        if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add)
        for part in (value.left, value.right)
        if isinstance(part, ast.BinOp) and isinstance(part.op, ast.Mult)
    ]
    return any(
        names_env_variable(value, "RANK")
        for product in products
        for name in walk(product)
        for value in [name, *assigned.get(source_text(name), [])]
        if isinstance(name, ast.Name | ast.Call | ast.Subscript)
    )


def names_env_variable(expr: ast.expr, variable: str) -> bool:
    """`os.environ["RANK"]`, `os.getenv("RANK")`, `os.environ.get("RANK", 0)` somewhere in expr."""
    return any(isinstance(n, ast.Constant) and n.value == variable for n in walk(expr))


def spawned_workers(script: Script) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The file's functions that mp.spawn (or start_processes) runs, with an index parameter."""
    workers = []
    for node, name in script.call_names:
        if name not in SPAWNERS or not name.endswith(("spawn", "start_processes")):
            continue
        target = node.args[0] if node.args else keyword(node, "fn")
        if isinstance(target, ast.Name) and target.id in script.functions:
            function = script.functions[target.id]
            if function.args.posonlyargs + function.args.args and function not in workers:
                workers.append(function)
    return workers


def values_in(script: Script, scope: ast.AST) -> dict[str, list[ast.expr]]:
    """What each name or attribute (`args.rank`) is assigned in one function."""
    assigned: dict[str, list[ast.expr]] = {}
    for node in script.scope_nodes(scope):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            assigned.setdefault(source_text(node.targets[0]), []).append(node.value)
    return assigned


def counts_processes(rank: ast.expr, index: str, assigned: dict[str, list[ast.expr]]) -> bool:
    """`rank` is, or was assigned, a product plus the spawned index (node_rank * n + index)."""
    values = [rank, *assigned.get(source_text(rank), [])]
    for value in values:
        if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add)):
            continue
        parts = (value.left, value.right)
        has_index = any(isinstance(p, ast.Name) and p.id == index for p in parts)
        has_product = any(isinstance(p, ast.BinOp) and isinstance(p.op, ast.Mult) for p in parts)
        if has_index and has_product:
            return True
    return False


def scaled_names(script: Script) -> set[str]:
    """Names and attributes some line of the file assigns a product, `*=`s, or reads
    from the environment (WORLD_SIZE): such a world size may well count processes."""
    found: set[str] = set()
    for node in script.nodes:
        if isinstance(node, ast.AugAssign):
            found.add(source_text(node.target))
        elif isinstance(node, ast.Assign) and any(
            (isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult))
            or (isinstance(n, ast.Constant) and n.value == "WORLD_SIZE")
            for n in walk(node.value)
        ):
            found.update(source_text(target) for target in node.targets)
    return found


def module_int_constants(script: Script) -> dict[str, int]:
    """Module-level names assigned exactly once, to an int literal (WORLD_SIZE = 4)."""
    values: dict[str, int] = {}
    assigned: Counter[str] = Counter()
    for node in script.nodes:
        targets = list(node.targets) if isinstance(node, ast.Assign) else []
        targets += [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            if isinstance(target, ast.Name):
                assigned[target.id] += 1
    for node in script.tree.body:
        if isinstance(node, ast.Assign) and is_int(node.value):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values[target.id] = node.value.value
    return {name: value for name, value in values.items() if assigned[name] == 1}


# What srun tells each task of the job's layout: a script that reads these for
# its rank or world size is started by srun, not by torchrun (SLURM_JOB_ID and
# the like are read under torchrun too, for names and logs).
SLURM_LAYOUT = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NODEID")
# The local rank as srun sets it, and as only torchrun (or launch.py) sets it.
SLURM_LOCAL_RANK = "SLURM_LOCALID"
TORCHRUN_LOCAL_RANK = "LOCAL_RANK"
# A string that names an environment variable in an `if` test ("RANK", "SLURM_PROCID").
ENV_NAME = re.compile(r"[A-Z][A-Z0-9_]*")


@check("slurm-without-torchrun")
def check_slurm_rank_with_torchrun_local_rank(script: Script) -> Iterator[Finding]:
    """The script takes its rank or world size from srun's variables
    (SLURM_PROCID, SLURM_NTASKS), so srun starts it without torchrun, but its
    GPU from LOCAL_RANK, which only torchrun sets: under srun every task on a
    node falls back to the default (GPU 0), or fails on the key.

    Quiet when the file reads SLURM_LOCALID anywhere, when the LOCAL_RANK read
    sits in a branch that tests an environment variable (the torchrun arm of
    `if "RANK" in os.environ: ... elif "SLURM_PROCID" in os.environ:`), or
    when its default is computed (`get("LOCAL_RANK", rank % gpus)`).
    """
    if reads_env(script, SLURM_LOCAL_RANK):
        return
    layout = next((name for name in SLURM_LAYOUT if reads_env(script, name)), None)
    if layout is None:
        return
    in_launcher_branches = nodes_under_launcher_tests(script)
    for node in script.nodes:
        default = env_default(script, node, TORCHRUN_LOCAL_RANK)
        if default is None or id(node) in in_launcher_branches:
            continue
        if not isinstance(default, ast.Constant):
            continue  # a computed fallback: maybe the Slurm one
        outcome = "fails on the missing key" if default.value is None else "takes the default GPU"
        yield script.finding(
            "slurm-without-torchrun",
            node,
            f"the job's layout comes from {layout} (srun starts the tasks, not torchrun), but the "
            f"GPU from {TORCHRUN_LOCAL_RANK}, which only torchrun sets: under srun every task "
            f"on a node {outcome}; read {SLURM_LOCAL_RANK} there "
            f"(int(os.environ.get('{TORCHRUN_LOCAL_RANK}', os.environ['{SLURM_LOCAL_RANK}']))), "
            "or launch with torchrun",
        )


SLURM_GLOBAL_RANK = "SLURM_PROCID"


@check("slurm-without-torchrun")
def check_gpu_from_the_global_task_index(script: Script) -> Iterator[Finding]:
    """The GPU index is srun's SLURM_PROCID, the task's index in the whole job
    (`args.gpu = args.rank` after `args.rank = int(os.environ["SLURM_PROCID"])`):
    on one node it is also the local index, but on the second node of 8-GPU
    machines task 8 asks for GPU 8 (invalid device ordinal). Quiet when the
    index is taken modulo something (`rank % torch.cuda.device_count()`)."""
    for node, name in script.call_names:
        if not is_set_device(name) or not node.args:
            continue
        index = node.args[0]
        if copies_the_global_task_index(script, index, MAX_HOPS):
            yield script.finding(
                "slurm-without-torchrun",
                node,
                f"the GPU index {source_text(index)} is {SLURM_GLOBAL_RANK}, the task's index "
                "in the whole job: on the first node it matches the GPUs, but from the "
                "second node on the tasks ask for GPUs the node does not have (invalid "
                f"device ordinal); take {SLURM_LOCAL_RANK}, the task's index on its node",
            )


def copies_the_global_task_index(
    script: Script, expr: ast.expr, hops: int, variable: str = SLURM_GLOBAL_RANK
) -> bool:
    """Whether `expr` is SLURM_PROCID (or another `variable`), read directly or through
    a few names (`int(...)` kept; any arithmetic, like `% gpus_per_node`, makes it
    another number); for torchrun's RANK, dist.get_rank() too."""
    while isinstance(expr, ast.Call) and short(script.name_of(expr.func)) == "int" and expr.args:
        expr = expr.args[0]
    if environment_variable(expr, script) == variable:
        return True
    if (
        variable == TORCHRUN_GLOBAL_RANK
        and isinstance(expr, ast.Call)
        and script.name_of(expr.func) == "torch.distributed.get_rank"
    ):
        return True
    if hops == 0 or not isinstance(expr, (ast.Name, ast.Attribute)):
        return False
    return any(
        copies_the_global_task_index(script, value, hops - 1, variable)
        for value in script.assigned_values.get(source_text(expr), [])
    )


TORCHRUN_GLOBAL_RANK = "RANK"


@check("local-rank-not-from-env")
def check_gpu_from_the_global_rank_on_several_machines(script: Script) -> Iterator[Finding]:
    """`torch.cuda.set_device(int(os.environ["RANK"]))` (or dist.get_rank()) in a job
    the file says spans several machines: the rank counts every process of the job,
    so on the second machine it names GPUs that machine does not have (invalid
    device ordinal; with one GPU per machine, rank 1 asks for cuda:1). On one
    machine RANK is LOCAL_RANK, so the file must show the machines."""
    if not runs_on_several_machines(script.source):
        return
    for node, name in script.call_names:
        if not is_set_device(name) or not node.args:
            continue
        index = node.args[0]
        if copies_the_global_task_index(script, index, MAX_HOPS):
            continue  # srun's task index: check_gpu_from_the_global_task_index says it
        if copies_the_global_task_index(script, index, MAX_HOPS, TORCHRUN_GLOBAL_RANK):
            yield script.finding(
                "local-rank-not-from-env",
                node,
                f"the GPU index {source_text(index)} is the process's rank in the whole job, "
                "and this job spans several machines: on the first machine it matches the "
                "GPUs, but on the others the processes ask for GPUs their machine does not "
                'have (invalid device ordinal); use int(os.environ["LOCAL_RANK"]), the '
                "process's index on its own machine",
            )


# A launch line in the file's own text (its docstring) that runs Python under
# srun without torchrun: `srun python train.py ...`.
SRUN_PYTHON = re.compile(r"^[^\n]*\bsrun\b[^\n]*\bpython3?\b[^\n]*$", re.MULTILINE)
TORCHRUN_LAUNCH = re.compile(
    r"\btorchrun\b|\btorch\.distributed\.(run|launch)\b|\baccelerate\s+launch\b|\bdeepspeed\b"
)
TORCHRUN_LAYOUT = ("RANK", "WORLD_SIZE")


@check("slurm-without-torchrun")
def check_srun_start_with_torchrun_variables(script: Script) -> Iterator[Finding]:
    """The file says srun starts it (`srun python train.py` in its docstring) but
    takes its rank and world size from RANK / WORLD_SIZE with defaults, which only
    torchrun sets: under srun every task is rank 0 of a world of one and trains
    alone. Quiet when it reads any SLURM_ variable (it knows srun)."""
    launch = srun_python_line(script)
    if launch is None or any(reads_env(script, name) for name in (*SLURM_LAYOUT, SLURM_LOCAL_RANK)):
        return
    for node in script.nodes:
        for variable in TORCHRUN_LAYOUT:
            default = env_default(script, node, variable)
            if not isinstance(default, ast.Constant) or default.value is None:
                continue
            yield script.finding(
                "slurm-without-torchrun",
                node,
                f"the file's own launch line starts it with srun (`{launch.strip()[:60]}`), but "
                f"{variable} comes from the environment with the default {default.value!r}: only "
                "torchrun sets it, so under srun every task takes the default (rank 0 of a "
                "world of 1) and trains alone, N copies of one run; read SLURM_PROCID / "
                "SLURM_NTASKS / SLURM_LOCALID, or start torchrun from srun",
            )
            return  # one finding: the same launch explains every such read


@check("slurm-without-torchrun")
def check_srun_tasks_that_spawn(script: Script) -> Iterator[Finding]:
    """The file's sbatch header asks for several tasks per node (`--ntasks-per-node=8`)
    and srun starts it without torchrun, yet each task mp.spawns its own processes
    (one per GPU): every node runs tasks x GPUs processes with repeated ranks."""
    launch = srun_python_line(script)
    if launch is None:
        return
    tasks = tasks_per_node(script)
    if tasks is None or tasks < 2:
        return
    for node, name in script.call_names:
        if name in SPAWNERS and name.endswith(("spawn", "start_processes")):
            yield script.finding(
                "slurm-without-torchrun",
                node,
                f"the file's own launch asks Slurm for {tasks} tasks per node "
                f"(--ntasks-per-node={tasks}) and srun starts each (`{launch.strip()[:50]}`), "
                "and each task spawns its own processes here: every node runs "
                f"{tasks} x that many, with the same ranks again and again; either one task "
                "per node that spawns (--ntasks-per-node=1), or one task per GPU without "
                "spawning (rank = SLURM_PROCID)",
            )
            return


def tasks_per_node(script: Script) -> int | None:
    """The tasks per node the file's own text asks Slurm for (an #SBATCH line)."""
    for text in script.string_constants:
        found = TASKS_PER_NODE.search(text)
        if found:
            return int(found.group(1))
    return None


def srun_python_line(script: Script) -> str | None:
    """A line of the file's text that runs Python under srun, not through torchrun."""
    for text in script.string_constants:
        for match in SRUN_PYTHON.finditer(text):
            if not TORCHRUN_LAUNCH.search(match.group(0)):
                return match.group(0)
    return None


def env_default(script: Script, node: ast.AST, variable: str) -> ast.expr | None:
    """What reading `variable` falls back to: None when `node` does not read it, a
    None constant when nothing (`os.environ["X"]`, `os.getenv("X")`), else the
    default of `os.environ.get("X", d)` / `os.getenv("X", d)`."""
    if not isinstance(node, ast.expr) or environment_variable(node, script) != variable:
        return None
    if isinstance(node, ast.Subscript) and not isinstance(node.ctx, ast.Load):
        return None  # os.environ["X"] = ...: a write
    has_default = isinstance(node, ast.Call) and len(node.args) > 1
    return node.args[1] if has_default else ast.Constant(value=None)


# What torchrun sets for each worker: a read of these first means the file asks torchrun.
TORCHRUN_VARIABLES = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"})
# srun's variables for the task it started, and which of them place the GPU.
SLURM_TASK_VARIABLES = frozenset({*SLURM_LAYOUT, SLURM_LOCAL_RANK})


@check("slurm-without-torchrun", "duplicate-gpu-per-rank")
def check_srun_task_variables_under_torchrun(script: Script) -> Iterator[Finding]:
    """The file's launch runs torchrun under srun (one srun task per node, torchrun
    starting a worker per GPU), but takes its rank, world size or GPU from srun's
    variables first: they describe the srun task, so every worker of a node gets the
    node's SLURM_PROCID and SLURM_LOCALID (0), one rank and one GPU for them all.
    Quiet where a torchrun variable is read first (`.get("LOCAL_RANK", <srun's>)`,
    an `if "RANK" in os.environ:` around it)."""
    launch = torchrun_under_srun(script.source)
    if launch is None:
        return
    reported: set[str] = set()  # one finding per cause: the same launch explains the rest
    for node in script.of_type(ast.expr):
        variable = environment_variable(node, script)
        if variable not in SLURM_TASK_VARIABLES:
            continue
        local = variable == SLURM_LOCAL_RANK
        cause = "duplicate-gpu-per-rank" if local else "slurm-without-torchrun"
        if cause in reported or (
            isinstance(node, ast.Subscript) and not isinstance(node.ctx, ast.Load)
        ):
            continue
        if torchrun_asked_first(script, node):
            continue
        reported.add(cause)
        taken = "the same GPU" if local else "one rank (and a world of nodes, not of processes)"
        yield script.finding(
            cause,
            node,
            f"the file's own launch runs torchrun under srun (line {launch[0]}), and {variable} "
            "is read first: srun sets it once per task, and every torchrun worker of a node "
            f"inherits the same value, so they all take {taken}; read torchrun's "
            "LOCAL_RANK / RANK / WORLD_SIZE first",
        )


def torchrun_asked_first(script: Script, read: ast.expr) -> bool:
    """A torchrun variable decides before `read`: it is the default of a `.get` of one
    (`os.environ.get("LOCAL_RANK", os.environ["SLURM_LOCALID"])`), comes after one in
    an `or`, or sits in either arm of an `if` that tests one."""
    child, parent = read, script.parents.get(id(read))
    while parent is not None and not isinstance(parent, ast.FunctionDef | ast.Module):
        default_of = isinstance(parent, ast.Call) and child in parent.args[1:]
        if default_of and environment_variable(parent, script) in TORCHRUN_VARIABLES:
            return True
        if isinstance(parent, ast.BoolOp):
            earlier = parent.values[: parent.values.index(child)] if child in parent.values else []
            if any(names_torchrun_variable(script, value) for value in earlier):
                return True
        in_an_arm = isinstance(parent, ast.If | ast.IfExp) and child is not parent.test
        if in_an_arm and names_torchrun_variable(script, parent.test):
            return True
        child, parent = parent, script.parents.get(id(parent))
    return False


def names_torchrun_variable(script: Script, expr: ast.expr) -> bool:
    """`"RANK" in os.environ`, `os.environ.get("LOCAL_RANK")`: the expression reads or
    names one of torchrun's variables."""
    return any(
        (isinstance(n, ast.Constant) and n.value in TORCHRUN_VARIABLES)
        or (isinstance(n, ast.expr) and environment_variable(n, script) in TORCHRUN_VARIABLES)
        for n in walk(expr)
    )


def nodes_under_launcher_tests(script: Script) -> set[int]:
    """ids of the nodes in either arm of an `if` that tests an environment variable
    (`if "SLURM_PROCID" in os.environ:`, `if "RANK" in os.environ:` ... `elif`): the
    script picks its launcher there, and each arm reads that launcher's variables."""
    inside: set[int] = set()
    for node in script.of_type(ast.If):
        if any(
            isinstance(n, ast.Constant) and isinstance(n.value, str) and ENV_NAME.fullmatch(n.value)
            for n in walk(node.test)
        ):
            for statement in [*node.body, *node.orelse]:
                inside.update(id(n) for n in walk(statement))
    return inside


@check("world-size-exceeds-devices", "slurm-without-torchrun")
def check_the_files_own_launch_lines(script: Script) -> Iterator[Finding]:
    """The launch the file writes down (docstring, comments: `CUDA_VISIBLE_DEVICES=0,1
    torchrun --nproc_per_node=4`, an sbatch header over `srun torchrun`) contradicts
    itself (assistant.lint.launchtext)."""
    for line, cause_id, message in launch_problems(script.source):
        yield script.finding(cause_id, line, f"the file's own launch line: {message}")
