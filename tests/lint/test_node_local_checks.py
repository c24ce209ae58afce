"""checkpoint-on-node-local-disk: rank 0 saves a checkpoint into a folder on its own
node ($SLURM_TMPDIR, /tmp, a local NVMe) that every rank loads back, in a job the
file launches on several nodes (assistant/lint/checks/node_local.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from snippets import free_port, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
BROKEN = SCRIPTS / "best_checkpoint_on_node_local_scratch.py"
FIXED = SCRIPTS / "correct_best_checkpoint_on_shared_storage.py"
AGENT_TIMEOUT_S = 180

TWO_NODES = '"""\n#SBATCH --nodes=2\nsrun torchrun --nnodes=2 --nproc_per_node=8 train.py\n"""\n'
ONE_NODE = '"""\ntorchrun --nnodes=1 --nproc_per_node=8 train.py\n"""\n'
BODY = """
import argparse
import os
import tempfile

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--ckpt-dir", default="/local/nvme/ckpt")
args = p.parse_args()
rank = dist.get_rank()
local_rank = int(os.environ["LOCAL_RANK"])
path = {path}
if {test}:
    torch.save(state, path)
dist.barrier()
{load}
"""


def reported(
    path: str,
    prelude: str = TWO_NODES,
    test: str = "rank == 0",
    load: str = 'state = torch.load(path, map_location="cpu")',
) -> list[int]:
    body = BODY.replace("{path}", path).replace("{test}", test).replace("{load}", load)
    return [line for line, _ in lint_snippet(prelude, body, ["checkpoint-on-node-local-disk"])]


@pytest.mark.parametrize(
    "path",
    [
        'os.path.join(os.environ.get("SLURM_TMPDIR", "/tmp"), "best.pt")',
        'os.path.join(os.environ["TMPDIR"], "ckpt", "last.pt")',
        '"/tmp/run/best.pt"',
        "f\"/local_nvme/{os.environ.get('USER')}/ckpt/latest.pt\"",
        '"/mnt/nvme0/ckpt/latest.pt"',
        '"/dev/shm/best.pt"',
        'os.path.join(args.ckpt_dir, "best.pt")',  # a flag's default the launch keeps
        'os.path.join(tempfile.gettempdir(), "best.pt")',
    ],
)
def test_rank_zero_saves_on_its_node_and_every_rank_loads(path):
    assert reported(path) == [18]


@pytest.mark.parametrize(
    "root, found",
    [('os.path.join("/local_nvme", os.environ.get("USER", "ml"))', [18]), ('"/proj/runs"', [])],
)
def test_a_folder_a_function_of_the_file_returns_is_followed(root, found):
    # blind set bc's 12: `ckpt_dir = os.path.join(node_local_root(), "checkpoints")`
    prelude = TWO_NODES + f"import os\n\ndef node_root():\n    return {root}\n"
    body = BODY.replace("{path}", 'os.path.join(node_root(), "ckpt", "last.pt")')
    body = body.replace("{test}", "rank == 0").replace("{load}", "state = torch.load(path)")
    lines = [line for line, _ in lint_snippet(prelude, body, ["checkpoint-on-node-local-disk"])]
    assert lines == found


def test_a_helper_that_saves_and_one_that_loads_are_followed():
    prelude = TWO_NODES + (
        "import torch\n\n"
        "def save_state(path, state):\n    torch.save(state, path)\n\n"
        "def load_state(path):\n    return torch.load(path)\n"
    )
    body = """
import os
import torch.distributed as dist

rank = int(os.environ["RANK"])
latest = os.path.join(os.environ.get("SLURM_TMPDIR", "/tmp"), "latest.pt")
if os.path.exists(latest):
    state = load_state(latest)
if rank == 0:
    save_state(latest, state)
"""
    found = lint_snippet(prelude, body, ["checkpoint-on-node-local-disk"])
    assert [line for line, _ in found] == [8]


@pytest.mark.parametrize(
    ("path", "prelude", "test", "load"),
    [
        # one node: its own disk is every rank's
        ('"/tmp/run/best.pt"', ONE_NODE, "rank == 0", None),
        # no launch shown: how many nodes is unknown
        ('"/tmp/run/best.pt"', "", "rank == 0", None),
        # storage every node mounts (a relative path, /scratch, the project)
        ('os.path.join("checkpoints", "best.pt")', TWO_NODES, "rank == 0", None),
        ('"/scratch/proj/run/best.pt"', TWO_NODES, "rank == 0", None),
        # each node's first rank writes its own copy
        ('"/tmp/run/best.pt"', TWO_NODES, "local_rank == 0", None),
        # only rank 0 loads it (and broadcasts the state)
        ('"/tmp/run/best.pt"', TWO_NODES, "rank == 0", "if rank == 0:\n    torch.load(path)"),
        # a variable whose default is /tmp: the job may set it
        ('os.environ.get("CKPT_DIR", "/tmp/ckpt")', TWO_NODES, "rank == 0", None),
        # every rank saves (checkpoint-written-by-every-rank's business, not this one's)
        ('"/tmp/run/best.pt"', TWO_NODES, "True", None),
    ],
)
def test_shared_or_single_node_or_per_node_copies_are_quiet(path, prelude, test, load):
    load = load or 'state = torch.load(path, map_location="cpu")'
    assert reported(path, prelude, test, load) == []


def test_a_flag_the_launch_line_passes_is_not_read_as_its_default():
    prelude = TWO_NODES.replace("train.py", "train.py --ckpt-dir /project/ckpt")
    assert reported('os.path.join(args.ckpt_dir, "best.pt")', prelude) == []


def two_nodes(script: Path, folder: Path) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents, one per "node", each with a scratch folder of its own
    ($SLURM_TMPDIR) and one shared working folder, as on a cluster."""
    project = folder / "project"
    project.mkdir()
    port = free_port()
    agents = []
    for node in (0, 1):
        scratch = folder / f"node{node}-scratch"
        scratch.mkdir()
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                   f"--node_rank={node}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                   f"--master_port={port}", str(script)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_TMPDIR": str(scratch)}
        agents.append(subprocess.Popen(command, cwd=project, env=env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       start_new_session=True))  # fmt: skip
    try:
        last = finished(agents[1], AGENT_TIMEOUT_S, command)
        # When node 1 failed, node 0's agent waits out torchrun's exit barrier (300 s)
        # for an agent that left: its worker's output is all there is to read.
        first = finished(agents[0], AGENT_TIMEOUT_S if last.returncode == 0 else 10, command)
        return [first, last]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.communicate()


def finished(agent: subprocess.Popen, seconds: float, command: list[str]):
    """The agent's run once it ends, or what it printed within `seconds` (then killed)."""
    try:
        out, err = agent.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        out, err = agent.communicate()
    return subprocess.CompletedProcess(command, agent.returncode, out, err)


@pytest.mark.slow
def test_the_other_node_finds_no_checkpoint_while_the_twin_loads_on_both(tmp_path):
    broken, fixed = tmp_path / "broken", tmp_path / "fixed"
    broken.mkdir(), fixed.mkdir()
    node0, node1 = two_nodes(BROKEN, broken)
    assert "rank 0 loaded step 1" in node0.stdout, node0.stderr[-2000:]
    assert node1.returncode != 0
    assert "FileNotFoundError" in node1.stderr and "best.pt" in node1.stderr
    results = two_nodes(FIXED, fixed)
    assert all(r.returncode == 0 for r in results), results[1].stderr[-2000:]
    assert [f"rank {n} loaded step 1" in r.stdout for n, r in enumerate(results)] == [True, True]


@pytest.mark.parametrize(
    "save, load, reported_lines",
    [
        # blind set ht's 04: the k-means that makes the targets, fitted by rank 0 and
        # kept on $SLURM_TMPDIR, loaded by every rank on every node
        ("joblib.dump(km, path)", "km = joblib.load(path)", [20]),
        ("np.save(path, centroids)", "centroids = np.load(path)", [20]),
        # loaded by rank 0 only, to broadcast: the file is on its own node
        ("joblib.dump(km, path)", "if rank == 0:\n    km = joblib.load(path)", []),
    ],
    ids=["joblib", "numpy", "rank 0 loads"],
)
def test_a_fitted_model_rank_0_dumps_on_node_local_disk_for_every_rank_to_load(
    save, load, reported_lines
):
    body = BODY.replace("import torch\n", "import joblib\nimport numpy as np\nimport torch\n")
    body = body.replace("torch.save(state, path)", save)
    source = body.replace("{path}", 'os.path.join(os.environ["SLURM_TMPDIR"], "km.bin")')
    source = source.replace("{test}", "rank == 0").replace("{load}", load)
    found = lint_snippet(TWO_NODES, source, ["checkpoint-on-node-local-disk"])
    assert [line for line, _ in found] == reported_lines
    assert all("rank 0 saves a file (" in finding.message for _, finding in found)


def test_a_file_is_read_back_by_its_writers_reader_only():
    # blind set fh's 09: each node's staged statistics (np.load) beside a checkpoint
    # rank 0 torch.saves there: only the checkpoint's load reads what rank 0 wrote
    body = BODY.replace("import torch\n", "import numpy as np\nimport torch\n")
    load = 'stats = np.load(os.path.join(os.environ["SLURM_TMPDIR"], "stats.npz"))'
    source = body.replace("{path}", 'os.path.join(os.environ["SLURM_TMPDIR"], "best.pt")')
    source = source.replace("{test}", "rank == 0").replace("{load}", load)
    assert lint_snippet(TWO_NODES, source, ["checkpoint-on-node-local-disk"]) == []
