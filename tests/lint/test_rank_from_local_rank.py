"""world-size-mismatch: init_process_group given the process's index on its own
node (LOCAL_RANK, SLURM_LOCALID) as its rank (blind set aw: a pipeline x data
parallel job for two nodes). On one node the two agree; on two, both nodes claim
the first ranks. The fixture pair runs as two torchrun agents ("nodes") of one
process each: the broken one never forms its group, the twin's ranks meet."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import lint_snippet
from test_node_local_checks import two_nodes

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
PRELUDE = "import os\nimport torch.distributed as dist\nimport torch.multiprocessing as mp\n"


def reported(body: str) -> list[int]:
    return [line for line, _ in lint_snippet(PRELUDE, body, ["world-size-mismatch"])]


@pytest.mark.parametrize(
    "read",
    [
        'int(os.environ["LOCAL_RANK"])',
        'int(os.environ.get("SLURM_LOCALID", 0))',
        'int(os.getenv("OMPI_COMM_WORLD_LOCAL_RANK"))',
    ],
)
def test_a_rank_read_from_the_node_local_index_is_reported(read):
    direct = (
        f'dist.init_process_group("nccl", rank={read}, world_size=int(os.environ["WORLD_SIZE"]))\n'
    )
    named = f'local = {read}\ndist.init_process_group("nccl", rank=local)\n'
    # blind set fv's 15: the local rank kept in the arguments' namespace
    field = f'args.local_rank = {read}\ndist.init_process_group("nccl", rank=args.local_rank)\n'
    assert reported(direct) == [1]
    assert reported(named) == [2]
    assert reported(field) == [2]


@pytest.mark.parametrize(
    "body",
    [
        'dist.init_process_group("nccl", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))\n',
        'dist.init_process_group("nccl")\n',
        # a spawned worker's index is its rank in a one-node job the file starts itself
        (
            "def worker(local_rank, world):\n"
            '    dist.init_process_group("nccl", rank=local_rank, world_size=world)\n'
            "mp.spawn(worker, args=(4,), nprocs=4)\n"
        ),
        # a name assigned from LOCAL_RANK on one path and RANK on another: not known
        (
            'r = int(os.environ["LOCAL_RANK"])\nr = int(os.environ["RANK"])\n'
            'dist.init_process_group("nccl", rank=r)\n'
        ),
    ],
)
def test_the_job_rank_a_spawned_index_or_an_unknown_name_is_quiet(body):
    assert reported(body) == []


@pytest.mark.slow
def test_two_nodes_claiming_the_same_ranks_never_meet_while_the_twin_does(tmp_path):
    broken, fixed = tmp_path / "broken", tmp_path / "fixed"
    broken.mkdir(), fixed.mkdir()
    results = two_nodes(SCRIPTS / "rank_given_the_local_rank_on_two_nodes.py", broken)
    assert all(r.returncode != 0 for r in results)
    assert any("wait timeout" in r.stderr for r in results), results[0].stderr[-2000:]
    results = two_nodes(SCRIPTS / "correct_rank_given_the_job_rank_on_two_nodes.py", fixed)
    assert all(r.returncode == 0 for r in results), results[1].stderr[-2000:]
    assert [f"rank {n} sees 2 processes" in r.stdout for n, r in enumerate(results)] == [True, True]


@pytest.mark.parametrize(
    "body, lines",
    [
        # blind set bk's 17: two 8-GPU nodes under torchrun, the world sized by one node's GPUs
        (
            (
                'dist.init_process_group("nccl", world_size=torch.cuda.device_count(), '
                'rank=int(os.environ["RANK"]))\n'
            ),
            [1],
        ),
        (
            (
                "world = torch.cuda.device_count()\n"
                'dist.init_process_group("nccl", init_method="env://", world_size=world, '
                'rank=int(os.environ["RANK"]))\n'
            ),
            [2],
        ),
        # the job's own size, or a spawned job on one node the file starts itself
        ('dist.init_process_group("nccl", rank=int(os.environ["RANK"]))\n', []),
        (
            (
                "def worker(i, world):\n"
                '    dist.init_process_group("nccl", rank=i, world_size=world)\n'
                "world = torch.cuda.device_count()\nmp.spawn(worker, args=(world,), nprocs=world)\n"
            ),
            [],
        ),
    ],
    ids=["direct", "named", "from-env", "spawned"],
)
def test_a_world_sized_by_one_nodes_gpus_under_a_launchers_rank_is_reported(body, lines):
    assert reported("import torch\n" + body) == [line + 1 for line in lines]


@pytest.mark.parametrize(
    ("launch", "size", "lines"),
    [
        # blind set fx's 19: a dp x tp mesh of one node's processes on two nodes
        (
            "torchrun --nnodes=2 --nproc_per_node=8 train.py",
            'int(os.environ["LOCAL_WORLD_SIZE"])',
            [5],
        ),
        ("torchrun --nnodes=2 --nproc_per_node=8 train.py", "dist.get_world_size()", []),
        ("torchrun --nproc_per_node=8 train.py", 'int(os.environ["LOCAL_WORLD_SIZE"])', []),
    ],
    ids=["one-node-mesh", "world-mesh", "one-node-job"],
)
def test_a_device_mesh_sized_by_one_nodes_processes(launch, size, lines):
    body = (
        f'"""{launch}"""\n'
        "from torch.distributed.device_mesh import init_device_mesh\n"
        f"n = {size}\n"
        "tp = 2\n"
        'mesh = init_device_mesh("cuda", (n // tp, tp), mesh_dim_names=("dp", "tp"))\n'
    )
    assert reported(body) == lines
