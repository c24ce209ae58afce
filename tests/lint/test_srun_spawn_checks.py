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
