"""A checkpoint kept on one node's own disk, in a job of several nodes.

The file shows a launch of several nodes (`#SBATCH --nodes=2`, `torchrun
--nnodes=4`), global rank 0 saves the checkpoint into a folder that lives on
its own node ($SLURM_TMPDIR, $TMPDIR, /tmp, /dev/shm, a local NVMe such as
/local/nvme or /mnt/nvme0), and every rank loads that path back. The other
nodes' ranks find no file there: FileNotFoundError, or, where the load waits
behind `os.path.exists`, node 0's ranks resume while the rest start again from
scratch and their collectives stop lining up. The checkpoints also go with the
job's scratch space. Reported at the load.

Quiet when the launch shows one node, when the folder is a flag or variable
the launch sets (its value is then not the default read here), when each
node's first rank writes its own copy (`local_rank == 0`), and when only rank 0
loads it (to broadcast the state).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from assistant.lint.launchtext import launched_nodes, logical_lines
from assistant.lint.model import Script, children, keyword, short, source_text, walk
from assistant.lint.ranks import RANK_ZERO, RankPath, environment_variable
from assistant.lint.registry import check
from assistant.lint.tracer import TracedCall
from assistant.lint.values import MAX_HOPS, argparse_flag
from assistant.results import Finding

# Scheduler and system variables that name a folder on the node itself.
NODE_LOCAL_VARIABLES = frozenset(
    {
        "SLURM_TMPDIR",
        "SLURM_JOB_TMP",
        "TMPDIR",
        "TMP",
        "TEMP",
        "LOCAL_SCRATCH",
        "LOCALSCRATCH",
        "LSCRATCH",
        "PBS_JOBFS",
        "JOBTMPDIR",
    }
)
# Absolute paths on the node's own disk or memory: /tmp, /var/tmp, /dev/shm, and a
# first or second component that says local, NVMe or local scratch (/local/nvme,
# /local_nvme/u, /mnt/nvme0, /scratch/local). Plain /scratch is a shared file system.
NODE_LOCAL_PATH = re.compile(
    r"^/(?:tmp|var/tmp|dev/shm)(?:/|$)"
    r"|^/(?:[^/]+/)?(?:local(?:[_-]?(?:nvme|ssd|disk|scratch))?|nvme\d*|local_?scratch|lscratch)"
    r"(?:/|$)",
    re.IGNORECASE,
)
TEMPFILE_FOLDERS = frozenset({"gettempdir", "mkdtemp", "TemporaryDirectory"})
# Calls that write an object to a path, which argument the path is, and the calls
# that read such a file back: a checkpoint, and the fitted models a run keeps
# beside it (a k-means of targets, a scaler) that every rank loads the same way.
SAVES = {"torch.save": 1, "joblib.dump": 1, "numpy.save": 0}
READERS = {
    "torch.save": {"torch.load": 0, "safetensors.torch.load_file": 0},
    "joblib.dump": {"joblib.load": 0},
    "numpy.save": {"numpy.load": 0},
}
# A rank test that names the node's own rank: each node's first process passes it.
LOCAL_RANK_TEST = re.compile(r"local", re.IGNORECASE)


@check("checkpoint-on-node-local-disk")
def check_checkpoint_on_a_node_local_disk(script: Script) -> Iterator[Finding]:
    """Rank 0 saves into a node-local folder and every rank loads from it, on several nodes."""
    nodes = launched_nodes(script.source)
    if nodes is None or not script.traces:
        return
    launch_line, count = nodes
    calls = [call for trace in script.traces for call in trace]
    saved = next(
        (
            (call, folder)
            for call in calls
            if writes_on_global_rank_zero(script, call.rank_path)
            and (folder := node_local_argument(script, call, SAVES))
        ),
        None,
    )
    if saved is None:
        return
    save, folder = saved
    loads = READERS[saving_call(script, save)]
    reported: set[int] = set()
    for call in calls:
        if call.rank_path or id(call.node) in reported:
            continue  # a load under any rank test is not every rank's
        if node_local_argument(script, call, loads):
            reported.add(id(call.node))
            yield script.finding(
                "checkpoint-on-node-local-disk",
                call.node,
                f"the launch runs {count} nodes (line {launch_line}), rank 0 saves "
                f"{saved_object(script, save)} under {folder} (line {save.node.lineno}), a folder on "
                "its own node's disk, and every rank loads it here: the other nodes' ranks "
                "find no file (or an old one) and fail or start from scratch; keep "
                "checkpoints on storage every node mounts (the project or home file system), "
                "or copy them there before any rank loads them",
            )


def saved_object(script: Script, save: TracedCall) -> str:
    """What the save writes, as the finding says it."""
    name = saving_call(script, save)
    return "the checkpoint" if name == "torch.save" else f"a file ({name})"


def writes_on_global_rank_zero(script: Script, path: RankPath) -> bool:
    """Under a rank-0 test of the global rank (`rank == 0`), not of the node's own."""
    tests = [branch.test_if.test for branch in path if branch.side == RANK_ZERO]
    return bool(tests) and not any(names_the_local_rank(script, test) for test in tests)


def names_the_local_rank(script: Script, test: ast.expr) -> bool:
    """The test, or what its names are assigned, says local (local_rank, LOCAL_RANK)."""
    texts = [source_text(test)]
    for node in walk(test):
        if isinstance(node, (ast.Name, ast.Attribute)):
            texts += map(source_text, script.assigned_values.get(source_text(node), []))
    return any(LOCAL_RANK_TEST.search(text) for text in texts)


def node_local_argument(script: Script, call: TracedCall, calls: dict[str, int]) -> str | None:
    """The node-local folder of the file one of `calls` (SAVES, LOADS: the name and
    its path argument) names: in the call itself, or in an argument of a same-file
    helper that makes such a call."""
    if call.name in calls:
        target = path_argument(call.node, calls[call.name])
        return None if target is None else node_local_folder(script, target)
    helper = script.functions.get(call.name)
    if helper is None or not any(
        isinstance(n, ast.Call) and script.name_of(n.func) in calls for n in walk(helper)
    ):
        return None
    arguments = [*call.node.args, *(k.value for k in call.node.keywords)]
    return next(filter(None, (node_local_folder(script, a) for a in arguments)), None)


def saving_call(script: Script, save: TracedCall) -> str:
    """Which of SAVES the save is, itself or inside the same-file helper it calls."""
    if save.name in SAVES:
        return save.name
    helper = script.functions[save.name]
    return next(
        script.name_of(n.func)
        for n in walk(helper)
        if isinstance(n, ast.Call) and script.name_of(n.func) in SAVES
    )


def path_argument(call: ast.Call, position: int) -> ast.expr | None:
    """The path a save or load call is given: by position, or as `f=` (torch's)."""
    return call.args[position] if len(call.args) > position else keyword(call, "f")


def node_local_folder(script: Script, expr: ast.expr, hops: int = MAX_HOPS) -> str | None:
    """How the path names a node-local folder ("$SLURM_TMPDIR", "/local/nvme/u/ckpt"),
    itself or through a name's assigned value or a flag's default; None otherwise."""
    pending = [expr]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if NODE_LOCAL_PATH.search(node.value):
                return node.value
            continue
        variable = environment_variable(node, script)
        if variable is not None:  # its default is not read: the launch may set it
            if variable in NODE_LOCAL_VARIABLES:
                return f"${variable}"
            continue
        if isinstance(node, ast.Call) and short(script.name_of(node.func)) in TEMPFILE_FOLDERS:
            return f"{source_text(node.func)}()"
        if hops > 0 and isinstance(node, (ast.Name, ast.Attribute)):
            found = named_value(script, node, hops)
            if found is not None:
                return found
        if hops > 0 and isinstance(node, ast.Call):
            found = returned_folder(script, node, hops)
            if found is not None:
                return found
        if isinstance(node, ast.JoinedStr) and node.values:
            pending.append(node.values[0])  # f"/tmp/{run}": its start is its folder
            continue
        pending.extend(children(node))
    return None


def returned_folder(script: Script, call: ast.Call, hops: int) -> str | None:
    """The node-local folder a function of the file returns (`def node_local_root():
    return os.path.join("/local_nvme", user, job)`), called for the path."""
    function = script.functions.get(script.name_of(call.func))
    if function is None:
        return None
    for node in walk(function):
        if isinstance(node, ast.Return) and node.value is not None:
            found = node_local_folder(script, node.value, hops - 1)
            if found is not None:
                return found
    return None


def named_value(script: Script, node: ast.Name | ast.Attribute, hops: int) -> str | None:
    """The node-local folder a name is assigned, or an `args.<dest>` flag defaults to
    when the launch line does not pass that flag."""
    for value in script.assigned_values.get(source_text(node), []):
        found = node_local_folder(script, value, hops - 1)
        if found is not None:
            return found
    if isinstance(node, ast.Attribute):
        flag = argparse_flag(script, node.attr)
        default = keyword(flag, "default") if flag is not None else None
        if default is not None and not launch_passes(script, flag):
            return node_local_folder(script, default, hops - 1)
    return None


def launch_passes(script: Script, flag: ast.Call) -> bool:
    """A launch line in the file's text sets the flag (`... train.py --work-dir /proj/x`)."""
    names = [
        a.value
        for a in flag.args
        if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-")
    ]
    option = re.compile("|".join(rf"(?<![\w-]){re.escape(n)}(?![\w-])" for n in names) or "(?!)")
    return any(
        option.search(line)
        for number, line in logical_lines(script.source)
        if number != flag.lineno
    )
