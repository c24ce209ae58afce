"""What the launch command a report shows says about the cause.

People paste the command they ran. `CUDA_VISIBLE_DEVICES=0,1 python
train.py ...` with no launcher anywhere in the report starts ONE process
that sees several GPUs: whatever fails next (HF Trainer falling back to
DataParallel, a model split over "cuda:0 and cuda:1", only GPU 0 busy) is
first of all a job that was never launched one process per GPU. The KB's
signatures only hold text that libraries print, so this reading of the
user's own command lives here and adds a body-level signature hit.
"""

from __future__ import annotations

import re

# Per line, bounded: a pasted log can be long, and these only need the command.
MAX_LINE = 500
MAX_LINES = 2_000
# `python train.py`, `python3 -u src/train_sft.py`, `nohup python x.py`; not `python -m ...`.
PLAIN_PYTHON = re.compile(r"(?:^|[\s;&|(])python[\d.]*(?:\s+-[uOB]+)*\s+[^\s-][^\s]{0,120}\.py\b")
# CUDA_VISIBLE_DEVICES naming two or more GPUs ("0,1", '"0, 1, 2"').
SEVERAL_VISIBLE = re.compile(r"CUDA_VISIBLE_DEVICES\s*=\s*[\"']?\d+(?:\s*,\s*\d+)+")
# Anything that starts one process per GPU, or a framework that does it itself.
LAUNCHERS = re.compile(
    r"torchrun|torch\.distributed\.(?:launch|run)|accelerate\s+launch|deepspeed\s|"
    r"mpirun|srun\s|\bspawn\(|lightning|Trainer\(.*strategy|--nproc[_-]per[_-]node",
    re.IGNORECASE,
)
BODY_HIT = 1.0  # the weight of a signature match outside the root error


def launch_scores(text: str) -> dict[str, float]:
    """Cause scores (signature scale) read from the launch command in `text`.

    A body-level hit, not a root one: the command is context, and the
    root error's own signature still ranks first when it has one (a device
    error under such a command reaches the top three, not the top).
    """
    if shows_single_process_launch(text):
        return {"launched-without-torchrun": BODY_HIT}
    return {}


def shows_single_process_launch(text: str) -> bool:
    """A plain `python x.py` with several GPUs visible, and no launcher in the report."""
    lines = [line[:MAX_LINE] for line in text.splitlines()[:MAX_LINES]]
    if any(LAUNCHERS.search(line) for line in lines):
        return False
    return any(SEVERAL_VISIBLE.search(line) for line in lines) and any(
        PLAIN_PYTHON.search(line) for line in lines
    )
