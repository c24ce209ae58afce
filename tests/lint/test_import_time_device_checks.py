"""hardcoded-device: a tensor put on the current GPU at module level, in a file whose
processes each set their own GPU afterwards (assistant/lint/checks/devices.py)."""

from __future__ import annotations

import pytest
from snippets import lint_snippet

PRELUDE = """
import os
import torch
import torch.distributed as dist
"""
MAIN = """
def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
"""


def reported(constant: str, main: str = MAIN, prelude: str = PRELUDE) -> list[int]:
    body = constant + "\n" + main
    found = lint_snippet(prelude, body, ["hardcoded-device"])
    return [line for line, finding in found if "import time" in finding.message]


@pytest.mark.parametrize(
    "constant",
    [
        "MEAN = torch.tensor([0.5, 0.5, 0.5]).view(1, 3, 1, 1).cuda()",
        "MEAN = torch.tensor([0.5, 0.5, 0.5]).cuda() * 255.0",
        'MEAN = torch.ones(3, device="cuda")',
        'MEAN: torch.Tensor = torch.zeros(3).to("cuda")',
        "MEAN = -torch.tensor([0.5]).cuda()",
    ],
)
def test_a_tensor_on_the_gpu_at_import_is_cuda0_in_every_process(constant):
    assert reported(constant) == [1]


@pytest.mark.parametrize(
    ("constant", "main", "prelude"),
    [
        # made on the CPU: moved where it is used
        ("MEAN = torch.tensor([0.5, 0.5, 0.5])", MAIN, PRELUDE),
        # an explicit GPU is hardcoded-device's other check, not this one's message
        ("MEAN = torch.tensor([0.5]).cuda(0)", MAIN, PRELUDE),
        # inside main, after set_device
        ("", MAIN + "    mean = torch.tensor([0.5]).cuda()\n", PRELUDE),
        # no rank sets its GPU: one process (or current_device_uses' business)
        ("MEAN = torch.tensor([0.5]).cuda()", "def main():\n    pass\n", PRELUDE),
        # each process sees its own GPU as cuda:0
        (
            "MEAN = torch.tensor([0.5]).cuda()",
            MAIN,
            PRELUDE + 'os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["LOCAL_RANK"]\n',
        ),
    ],
)
def test_cpu_constants_explicit_gpus_and_one_gpu_per_process_are_quiet(constant, main, prelude):
    assert reported(constant, main, prelude) == []
