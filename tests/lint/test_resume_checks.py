"""resume-different-world-size: one checkpoint file per rank, saved and loaded by
rank number, under a launch whose node count may change between restarts
(assistant/lint/checks/resume.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
BROKEN = SCRIPTS / "optimizer_shards_per_rank_under_an_elastic_launch.py"
FIXED = SCRIPTS / "correct_optimizer_consolidated_under_an_elastic_launch.py"

BODY = """
import torch
import torch.distributed as dist

rank = dist.get_rank()
path = {path}
if resume:
    state = torch.load(path, map_location="cpu")
torch.save(state, path)
"""


def reported(launch: str, path: str) -> list[int]:
    prelude = f'"""Launch:\n\n    {launch}\n"""\n'
    body = BODY.replace("{path}", path)
    return [line for line, _ in lint_snippet(prelude, body, ["resume-different-world-size"])]


@pytest.mark.parametrize(
    "launch",
    [
        "torchrun --nnodes=2:8 --nproc_per_node=8 --max-restarts=50 train.py",
        "torchrun --nnodes 1:4 --nproc-per-node 4 train.py",
        # blind set bc's 01: only the words say so
        "Launched with elastic torchrun so that a lost node does not kill the job.",
    ],
)
def test_per_rank_files_under_an_elastic_node_range(launch):
    assert reported(launch, 'f"shard_rank{rank}.pt"') == [8]


@pytest.mark.parametrize(
    ("launch", "path"),
    [
        # a fixed node count: restarts come back with the same world size
        (
            "torchrun --nnodes=4 --nproc_per_node=8 --max-restarts=3 train.py",
            'f"shard_rank{rank}.pt"',
        ),
        ("torchrun --nnodes=2:2 --nproc_per_node=8 train.py", 'f"shard_rank{rank}.pt"'),
        ("Elasticity of the learning rate is tuned per run.", 'f"shard_rank{rank}.pt"'),
        # one file for every rank (written elsewhere under a rank-0 test)
        ("torchrun --nnodes=2:8 --nproc_per_node=8 train.py", '"checkpoint.pt"'),
    ],
)
def test_fixed_world_sizes_or_shared_files_are_quiet(launch, path):
    assert reported(launch, path) == []


@pytest.mark.slow
def test_the_shards_break_a_smaller_restart_and_the_consolidated_state_does_not(torchrun, tmp_path):
    folders = {script: tmp_path / script.stem for script in (BROKEN, FIXED)}
    for folder in folders.values():
        folder.mkdir()
    # the broken fixture and its twin run side by side, each in its own folder
    firsts = [torchrun.start(script, cwd=folder) for script, folder in folders.items()]
    for first in (wait() for wait in firsts):
        assert first.returncode == 0, first.stderr[-2000:]
        assert first.stdout.count("saved") == 2
    # the job came back smaller: one rank
    restarts = [torchrun.start(s, cwd=folder, nproc=1) for s, folder in folders.items()]
    broken, fixed = (wait() for wait in restarts)
    assert broken.returncode != 0
    assert "doesn't match the size of optimizer's group" in broken.stderr
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert "resumed" in fixed.stdout
