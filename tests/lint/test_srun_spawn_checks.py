"""slurm-without-torchrun: the file's sbatch header asks for several tasks per
node, srun starts each without torchrun, and each task spawns one process per
GPU itself (assistant/lint/checks/launch.py, check_srun_tasks_that_spawn)."""

from __future__ import annotations

from pathlib import Path

import pytest

from assistant.lint import lint_script, lint_source

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"

SOURCE = '''"""
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node={tasks}
    {launch}
"""
import torch
import torch.multiprocessing as mp

def worker(i):
    pass

if __name__ == "__main__":
    mp.spawn(worker, nprocs=torch.cuda.device_count())
'''


def causes(tasks: int, launch: str) -> list[str]:
    """This check's findings (srun + torchrun with many tasks is another check's)."""
    source = SOURCE.replace("{tasks}", str(tasks)).replace("{launch}", launch)
    return [f.cause_id for f in lint_source(source) if "spawns its own processes" in f.message]


def test_several_srun_tasks_per_node_that_each_spawn_are_reported():
    assert causes(8, "srun python train.py") == ["slurm-without-torchrun"]


@pytest.mark.parametrize(
    ("tasks", "launch"),
    [
        (1, "srun python train.py"),  # one task per node spawns the node's processes
        (8, "srun torchrun --nproc_per_node=8 train.py"),  # torchrun: another check's
        (8, "python train.py"),  # no srun line
    ],
)
def test_one_task_per_node_or_no_srun_python_line_is_quiet(tasks, launch):
    assert causes(tasks, launch) == []


def test_the_fixture_and_its_twin():
    broken = lint_script(SCRIPTS / "srun_tasks_that_each_spawn_per_gpu.py")
    assert [f.cause_id for f in broken] == ["slurm-without-torchrun"]
    assert "8 tasks per node" in broken[0].message
    assert lint_script(SCRIPTS / "correct_one_srun_task_per_node_that_spawns.py") == []


UNDER_TORCHRUN = '''"""
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=1
    LAUNCH
"""
import os
import torch
import torch.distributed as dist

def dist_env():
BODY
    return rank, world, local_rank

rank, world, local_rank = dist_env()
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl", rank=rank, world_size=world)
'''
SRUN_TORCHRUN = "srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=4 train.py"


@pytest.mark.parametrize(
    ("launch", "body", "reported"),
    [
        # blind set fh's 20: srun's task index taken first, though torchrun starts the workers
        (SRUN_TORCHRUN,
         ('    if "SLURM_PROCID" in os.environ:\n'
         '        rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])\n'
         '        local_rank = int(os.environ.get("LOCAL_RANK", os.environ["SLURM_LOCALID"]))\n'
         '    else:\n'
         '        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])\n'
         '        local_rank = int(os.environ["LOCAL_RANK"])'),
         [("slurm-without-torchrun", 12)]),
        # blind set fh's 03: srun's local index first, torchrun's only its default
        (SRUN_TORCHRUN,
         ('    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])\n'
         '    local_rank = int(os.environ.get("SLURM_LOCALID", os.environ.get("LOCAL_RANK", 0)))'),
         [("duplicate-gpu-per-rank", 12)]),
        # torchrun's variables asked first: srun's only where torchrun did not start it
        (SRUN_TORCHRUN,
         ('    if "RANK" in os.environ:\n'
         '        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])\n'
         '        local_rank = int(os.environ["LOCAL_RANK"])\n'
         '    else:\n'
         '        rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])\n'
         '        local_rank = int(os.environ["SLURM_LOCALID"])'),
         []),
        # srun starts the processes itself: its variables are the right ones
        ("srun python train.py",
         ('    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])\n'
         '    local_rank = int(os.environ["SLURM_LOCALID"])'),
         []),
        # a sentence that names both is no launch line
        ("Started by srun directly, one task per GPU (no torchrun).",
         ('    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])\n'
         '    local_rank = int(os.environ["SLURM_LOCALID"])'),
         []),
    ],
)  # fmt: skip
def test_srun_task_variables_read_first_under_srun_torchrun(launch, body, reported):
    source = UNDER_TORCHRUN.replace("LAUNCH", launch).replace("BODY", body)
    wanted = ("slurm-without-torchrun", "duplicate-gpu-per-rank")
    found = [(f.cause_id, f.line) for f in lint_source(source) if f.cause_id in wanted]
    assert found == reported
