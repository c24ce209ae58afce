"""Launch commands written as text: lines pasted into a question, and a script's
own docstring and comments (its `torchrun ...` line, its sbatch header).

People write down how they launch: the launch is often where the mistake is,
and no Python statement shows it. Each reading yields (line number, cause id,
message) for a line the text itself contradicts:
- a launch that starts more ranks per node than GPUs it makes visible
  (`CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node=4`);
- srun starting several tasks per node where each task runs torchrun, which
  starts its own process per GPU (`#SBATCH --ntasks-per-node=8` then
  `srun torchrun --nproc_per_node=8`: 64 processes per node).
It also reads what a launch allows: `elastic_nodes` for a node range
(`torchrun --nnodes=2:8`), under which the world size may change between
restarts, and `launched_nodes` for a job of several nodes (`#SBATCH
--nodes=2`, `torchrun --nnodes=4`), whose nodes do not share their own disks.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

# The GPUs a launch line shows and the ranks it starts on each node.
VISIBLE_DEVICES = re.compile(r"CUDA_VISIBLE_DEVICES\s*=\s*['\"]?(\d+(?:\s*,\s*\d+)*)")
RANKS_PER_NODE = re.compile(r"--nproc[_-]per[_-]node(?:\s*=\s*|\s+)['\"]?(\d+)\b")
# Slurm's tasks per node (an #SBATCH line or srun's own option) and srun running torchrun.
TASKS_PER_NODE = re.compile(r"--ntasks-per-node(?:\s*=\s*|\s+)(\d+)\b")
SRUN_TORCHRUN = re.compile(r"\bsrun\b.*(?:\btorchrun\b|\btorch\.distributed\.(?:run|launch)\b)")

# The processes a launch starts: per node and nodes (torchrun, torch.distributed.launch,
# deepspeed), or in all (accelerate launch --num_processes).
LAUNCHER = re.compile(
    r"\btorchrun\b|\btorch\.distributed\.(?:run|launch)\b|\bdeepspeed\b|\baccelerate\s+launch\b"
)
PER_NODE = re.compile(r"--(?:nproc[_-]per[_-]node|num[_-]gpus)(?:\s*=\s*|\s+)['\"]?(\S+)")
NODES = re.compile(r"--(?:nnodes|num[_-]nodes)(?:\s*=\s*|\s+)['\"]?(\S+)")
IN_ALL = re.compile(r"--num[_-]processes(?:\s*=\s*|\s+)['\"]?(\S+)")

Problem = tuple[int, str, str]


def launch_problems(text: str) -> Iterator[Problem]:
    """Every contradiction in the launch lines of `text`, by the line it starts on."""
    lines = logical_lines(text)
    yield from ranks_beyond_visible_gpus(lines)
    yield from torchrun_under_many_srun_tasks(lines)


def logical_lines(text: str) -> list[tuple[int, str]]:
    """Shell lines with their `\\` continuations joined, each with its first line number.

    Comment markers and indentation stay in: a docstring's or a comment's
    command reads the same through them."""
    joined: list[tuple[int, str]] = []
    first, parts = 0, []
    for number, line in enumerate(text.splitlines(), 1):
        if not parts:
            first = number
        continued = line.rstrip().endswith("\\")
        parts.append(line.rstrip()[:-1] if continued else line)
        if not continued:
            joined.append((first, " ".join(parts)))
            parts = []
    if parts:
        joined.append((first, " ".join(parts)))
    return joined


def ranks_beyond_visible_gpus(lines: list[tuple[int, str]]) -> Iterator[Problem]:
    for number, line in lines:
        visible, ranks = VISIBLE_DEVICES.search(line), RANKS_PER_NODE.search(line)
        if not (visible and ranks):
            continue
        gpus = len(visible.group(1).split(","))
        per_node = int(ranks.group(1))
        if per_node > gpus:
            yield (
                number,
                "world-size-exceeds-devices",
                (
                    f"the launch starts {per_node} ranks per node (--nproc_per_node={per_node}) "
                    f"but CUDA_VISIBLE_DEVICES={visible.group(1).replace(' ', '')} shows them "
                    f"{gpus} GPU{'s' if gpus > 1 else ''}"
                ),
            )


def torchrun_under_many_srun_tasks(lines: list[tuple[int, str]]) -> Iterator[Problem]:
    tasks = None  # the tasks per node last set above (#SBATCH), or on the srun line itself
    for number, line in lines:
        set_here = TASKS_PER_NODE.search(line)
        if set_here:
            tasks = int(set_here.group(1))
        if not SRUN_TORCHRUN.search(line) or tasks is None or tasks < 2:
            continue
        ranks = RANKS_PER_NODE.search(line)
        per_task = f"--nproc_per_node={ranks.group(1)}" if ranks else "its processes"
        total = f" ({tasks * int(ranks.group(1))} processes per node)" if ranks else ""
        yield (
            number,
            "slurm-without-torchrun",
            (
                f"srun starts {tasks} tasks per node (--ntasks-per-node={tasks}) and each runs "
                f"torchrun, which starts {per_task} itself{total}: with torchrun ask Slurm for "
                "one task per node (--ntasks-per-node=1), or drop torchrun and read SLURM_PROCID"
            ),
        )


# srun's command is torchrun: `srun torchrun ...`, `srun --ntasks-per-node=1 -N 2 torchrun`,
# `srun bash -c "torchrun ..."` (a sentence that names both, "srun, not torchrun", is no launch).
SRUN_RUNS_TORCHRUN = re.compile(
    r"\bsrun\b(?:\s+(?:-\S+(?:\s+[^-\s]\S*)?|\w+=\S+))*\s+(?:bash\s+-c\s+['\"]?)?"
    r"(?:torchrun\b|python3?\s+-m\s+torch\.distributed\.(?:run|launch)\b)"
)


def torchrun_under_srun(text: str) -> tuple[int, str] | None:
    """The first launch line of `text` where srun runs torchrun (`srun torchrun
    --nnodes=$SLURM_NNODES ...`, continuations joined): its line number and text."""
    lines = logical_lines(text)
    return next(((n, line) for n, line in lines if SRUN_RUNS_TORCHRUN.search(line)), None)


NODE_RANGE = re.compile(r"--nnodes(?:\s*=\s*|\s+)['\"]?(\d+):(\d+)\b")


def elastic_nodes(text: str) -> tuple[int, str] | None:
    """(line, "2:8") for a launch line whose node count is a range of different
    numbers (torchrun's elastic `--nnodes=MIN:MAX`)."""
    for number, line in logical_lines(text):
        found = NODE_RANGE.search(line)
        if found and found.group(1) != found.group(2):
            return number, f"{found.group(1)}:{found.group(2)}"
    return None


def launched_world_size(text: str) -> int | None:
    """The number of processes the launch lines of `text` start, when every such line
    gives it as digits and they agree (None: no launch line, a variable, or several)."""
    sizes = {
        launch_size(line)
        for _number, line in logical_lines(text)
        if LAUNCHER.search(line) and " --" in line  # a command, not `import deepspeed`
    }
    return sizes.pop() if len(sizes) == 1 else None


def launch_size(line: str) -> int | None:
    in_all, per_node, nodes = IN_ALL.search(line), PER_NODE.search(line), NODES.search(line)
    if in_all:
        return digits(in_all.group(1))
    if per_node is None:
        return None
    count, node_count = digits(per_node.group(1)), digits(nodes.group(1)) if nodes else 1
    return count * node_count if count and node_count else None


def digits(value: str) -> int | None:
    value = value.strip("'\"")
    return int(value) if value.isdigit() else None


# A node count: torchrun's and DeepSpeed's options (`--nnodes=2`, `--nnodes=2:8`,
# `--num_nodes 2`) and Slurm's (`#SBATCH --nodes=2`, `-N 2`, `--nodes=2-4`).
NODE_COUNT = re.compile(
    r"(?:--nnodes|--num[_-]nodes|--nodes)(?:\s*=\s*|\s+)['\"]?(\d+)(?:[:-](\d+))?\b"
    r"|(?:#SBATCH|\bsrun|\bsbatch|\bsalloc)\b.*?\s-N\s*(\d+)\b"
)


def launched_nodes(text: str) -> tuple[int, int] | None:
    """(line, node count) of the first launch line of `text` that starts several nodes
    (the range's top for a range); None when every node count shown is 1, or none is."""
    for number, line in logical_lines(text):
        for found in NODE_COUNT.finditer(line):
            low, high, slurm = found.groups()
            count = int(high or low or slurm)
            if count > 1:
                return number, count
    return None


# What says a job spans several machines: a node's own index or count read (not a
# task's: srun's SLURM_PROCID / SLURM_NTASKS are there on one node too), a launch of
# 2+ nodes, or words a person writes of a job run on several computers by hand ("run
# one copy on each PC", "split over two machines"; not "node": a graph's).
NODE_VARIABLES = re.compile(r"SLURM_(?:NODEID|NNODES)|NODE_RANK|NNODES|NUM_NODES")
SEVERAL_NODES = re.compile(r"--(?:nodes|nnodes)[= ](?:[2-9]|\d{2,})\b|\s-N\s*(?:[2-9]|\d{2,})\b")
SEVERAL_MACHINES = re.compile(
    r"\b(?:each|every|both|two|three|four|second|other|another)\s+"
    r"(?:machines?|pcs?|computers?|box(?:es)?|hosts?|servers?|workstations?)\b",
    re.IGNORECASE,
)


def runs_on_several_machines(text: str) -> bool:
    """The file (its code, docstring and comments) shows a job of several machines."""
    return bool(
        NODE_VARIABLES.search(text) or SEVERAL_NODES.search(text) or SEVERAL_MACHINES.search(text)
    )
