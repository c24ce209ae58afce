"""Code pasted into a question (assistant.lint.pasted): found in fences and in
plain runs of code, linted with the checks that hold on a fragment, its line
numbers the question's own; prose, logs and hostile text find nothing fast."""

from __future__ import annotations

import pytest

from assistant.lint.pasted import FRAGMENT_CHECKS, lint_pasted, pasted_code

LIGHTNING = """`self.all_gather` in test_epoch_end hangs forever

all_gather and is_global_zero make the program hang forever, no other error.

```python
class DummyModel(pl.LightningModule):
    def test_epoch_end(self, outputs):
        if self.trainer.is_global_zero:
            outputs = self.all_gather(outputs)
            return outputs
```
"""

UNFENCED = """Training hangs when it saves, rank 0 never comes back. My loop:

for step, batch in enumerate(loader):
    loss = model(batch)
    if dist.get_rank() == 0:
        save(model)
        dist.barrier()
Traceback (most recent call last):
  File "train.py", line 40, in <module>
RuntimeError: [Rank 1] Watchdog caught collective operation timeout
"""


def test_a_fenced_collective_on_rank_zero_only_is_found_on_the_questions_line():
    findings = lint_pasted(LIGHTNING)
    assert [(f.cause_id, f.line, f.source) for f in findings] == [
        ("collective-mismatch", 9, "question")
    ]
    assert LIGHTNING.splitlines()[8].strip().startswith("outputs = self.all_gather")
    assert "(the `if` on line 8)" in findings[0].message


def test_unfenced_code_is_trimmed_of_the_log_after_it_and_dist_needs_no_import():
    findings = lint_pasted(UNFENCED)
    assert [(f.cause_id, f.line) for f in findings] == [("collective-mismatch", 7)]
    assert UNFENCED.splitlines()[6].strip() == "dist.barrier()"


@pytest.mark.parametrize(
    ("code", "cause", "line"),
    [
        (
            "model = DDP(model, device_ids=[rank])\nout = model.generate(x)\nloss = out.sum()",
            "ddp-wrapper-attribute",
            4,
        ),
        (
            "if rank == 0:\n    model.add_module('head', head)\nmodel = DDP(model)\nout = model(x)",
            "model-differs-across-ranks",
            4,
        ),
        (
            "t = torch.ones(4)\nfor _ in range(rank + 1):\n    dist.all_reduce(t)",
            "uneven-inputs",
            5,
        ),
    ],
)
def test_each_check_that_reads_only_what_is_shown_runs_on_a_fragment(code, cause, line):
    # DDP and dist are read as their usual imports: a fragment rarely shows them.
    findings = lint_pasted(f"what is wrong here?\n```python\n{code}\n```\n")
    assert [(f.cause_id, f.line) for f in findings] == [(cause, line)]
    assert cause in FRAGMENT_CHECKS


def test_only_checks_that_hold_on_a_fragment_run():
    # A hard-coded cuda:0 is a finding in a whole script; in a fragment the
    # set_device that makes it right may simply not be shown.
    text = "my model:\n```\nmodel = Net().to('cuda:0')\nout = model(x.to('cuda:0'))\nloss = out.sum()\n```"
    assert list(pasted_code(text))  # it is code, and it parses
    assert lint_pasted(text) == []
    assert "hardcoded-device" not in FRAGMENT_CHECKS


def test_prose_logs_and_correct_code_find_nothing():
    assert lint_pasted("DDP hangs after the first epoch on 4 GPUs, no error at all") == []
    assert lint_pasted("RuntimeError: NCCL error\n" * 500) == []
    correct = "```\nloss = model(x)\ndist.barrier()\nif rank == 0:\n    save(model)\n```"
    assert lint_pasted(correct) == []


def test_hostile_questions_end_in_nothing_found():
    nested = "```\n" + "x = " + "(" * 5000 + "1" + ")" * 5000 + "\ny = 1\nz = 2\n```"
    many = ("```\nif rank == 0:\n    dist.barrier(\n```\n" + "words\n") * 2000
    long_run = "\n".join(f"x{n} = f({n}" for n in range(50_000))
    for text in (nested, many, long_run, "```" * 10_000, "\x00```\n\x00\n```"):
        assert lint_pasted(text) == []  # parses are bounded (MAX_PARSES): no minutes-long walk


def test_a_launch_line_that_starts_more_ranks_than_it_shows_gpus_is_found():
    text = (
        "training fails on the second rank\n"
        "CUDA_VISIBLE_DEVICES=1,2 python -m torch.distributed.launch --nproc_per_node=4 train.py\n"
        "RuntimeError: CUDA error: invalid device ordinal\n"
    )
    findings = lint_pasted(text)
    assert [(f.cause_id, f.line, f.source) for f in findings] == [
        ("world-size-exceeds-devices", 2, "question")
    ]
    assert "4 ranks per node" in findings[0].message and "2 GPUs" in findings[0].message


def test_launch_lines_that_fit_or_set_the_gpus_elsewhere_find_nothing():
    fits = "CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nproc-per-node 4 train.py"
    fewer = "CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node=1 train.py"
    # An export may be from another shell or node than the launch: not judged.
    exported = "export CUDA_VISIBLE_DEVICES=0,1\ntorchrun --nproc_per_node=4 train.py"
    automatic = "CUDA_VISIBLE_DEVICES=0 torchrun --nproc_per_node=gpu train.py"
    for text in (fits, fewer, exported, automatic):
        assert lint_pasted(text) == [], text


def test_a_launch_split_by_backslashes_is_read_as_one_line_from_its_first() -> None:
    text = "Launch:\nCUDA_VISIBLE_DEVICES=0,1 \\\n    torchrun --standalone \\\n    --nproc_per_node=4 train.py\n"
    assert [(f.cause_id, f.line) for f in lint_pasted(text)] == [("world-size-exceeds-devices", 2)]


@pytest.mark.parametrize(
    "tasks, srun, flagged",
    [
        ("#SBATCH --ntasks-per-node=8", "srun torchrun --nproc_per_node=8 train.py", True),
        ("", "srun --ntasks-per-node=2 python -m torch.distributed.run train.py", True),
        ("#SBATCH --ntasks-per-node=1", "srun torchrun --nproc_per_node=8 train.py", False),
        ("#SBATCH --ntasks-per-node=8", "srun python train.py", False),
        ("", "srun torchrun --nproc_per_node=8 train.py", False),
    ],
)
def test_srun_tasks_per_node_times_torchrun_processes(tasks, srun, flagged) -> None:
    # The nearest tasks-per-node above (or on) the srun line counts: an sbatch may
    # show both ways of starting, each with its own.
    text = f"#!/bin/bash\n#SBATCH --nodes=2\n{tasks}\n{srun}\n"
    found = [(f.cause_id, f.line) for f in lint_pasted(text)]
    assert found == ([("slurm-without-torchrun", 4)] if flagged else [])
