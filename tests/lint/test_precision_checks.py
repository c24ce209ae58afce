"""mixed-precision-dtype: float16 weights under a GradScaler, float16 with no scaler."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"

HEADER = """
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("nccl")
"""


def reported_lines(body: str) -> list[int]:
    return [line for line, _ in lint_snippet(HEADER, body, ["mixed-precision-dtype"])]


@pytest.mark.slow
def test_the_half_model_fails_at_the_scalers_step_under_torchrun_and_its_twin_runs(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun,
        SCRIPTS / "model_cast_to_half_under_a_grad_scaler.py",
        "Attempting to unscale FP16 gradients",
        SCRIPTS / "correct_amp_with_float32_weights_under_a_grad_scaler.py",
        "trained",
    )


SCALED_STEP = """
scaler = torch.amp.GradScaler()
scaler.scale(loss).backward()
scaler.step(optimizer)
"""


@pytest.mark.parametrize(
    ("setup", "lines"),
    [
        # blind set fo's 03: `--amp` casts the trained model to half
        (
            (
                "net = nn.Linear(4, 1).cuda()\nnet = net.half()\nmodel = DDP(net)\n"
                "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)"
            ),
            [2],
        ),
        (
            (
                "model = nn.Linear(4, 1).to('cuda', dtype=torch.float16)\n"
                "optimizer = torch.optim.AdamW(model.parameters())"
            ),
            [1],
        ),
        # a frozen teacher in half: no optimizer gets its parameters
        (
            (
                "teacher = nn.Linear(4, 1).half()\nmodel = DDP(nn.Linear(4, 1))\n"
                "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)"
            ),
            [],
        ),
        # float32 weights, autocast chooses float16 per op
        (
            (
                "model = DDP(nn.Linear(4, 1).cuda())\n"
                "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)"
            ),
            [],
        ),
    ],
    ids=["half-then-ddp", "to-float16", "frozen-teacher", "float32-weights"],
)
def test_weights_in_float16_under_a_grad_scaler(setup: str, lines: list[int]) -> None:
    assert reported_lines(setup + SCALED_STEP) == lines


def test_a_grad_scaler_switched_off_steps_plainly() -> None:
    body = (
        "model = nn.Linear(4, 1).cuda()\nmodel = model.half()\n"
        "optimizer = torch.optim.SGD(model.parameters())\n"
        "scaler = torch.amp.GradScaler(enabled=False)\nscaler.scale(loss).backward()\n"
        "scaler.step(optimizer)\n"
    )
    assert reported_lines(body) == []


def test_a_half_model_trained_without_a_scaler_is_not_this_rule() -> None:
    body = (
        "model = DDP(nn.Linear(4, 1).half())\noptimizer = torch.optim.SGD(model.parameters())\n"
        "loss.backward()\noptimizer.step()\n"
    )
    assert reported_lines(body) == []


LOOP = """
model = DDP(nn.Linear(4, 1).cuda())
optimizer = torch.optim.AdamW(model.parameters())
{setup}
with {context}:
    loss = model(x).mean()
{backward}
optimizer.step()
"""


@pytest.mark.parametrize(
    ("setup", "context", "backward", "reported"),
    [
        ("", "torch.autocast('cuda', dtype=torch.float16)", "loss.backward()", True),
        ("", "torch.cuda.amp.autocast(dtype=torch.half)", "loss.backward()", True),
        # the dtype an option picks, float16 among its values
        (
            "dtype = torch.float16 if fp16 else torch.bfloat16",
            "torch.autocast('cuda', dtype=dtype)",
            "loss.backward()",
            True,
        ),
        ("", "torch.autocast('cuda', dtype=torch.bfloat16)", "loss.backward()", False),
        # the loss is scaled
        (
            "scaler = torch.amp.GradScaler()",
            "torch.autocast('cuda', dtype=torch.float16)",
            "scaler.scale(loss).backward()",
            False,
        ),
        # no backward here: an evaluation
        ("", "torch.autocast('cuda', dtype=torch.float16)", "print(loss)", False),
    ],
    ids=["float16", "half", "by-option", "bfloat16", "scaled", "evaluation"],
)
def test_float16_autocast_with_no_loss_scaler(setup, context, backward, reported) -> None:
    body = LOOP.format(setup=setup, context=context, backward=backward)
    assert bool(reported_lines(body)) is reported


@pytest.mark.parametrize(
    ("extra", "reported"),
    [
        ("", True),
        (
            (
                "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n"
                "scaler = ShardedGradScaler()\n"
            ),
            False,
        ),
    ],
    ids=["no-scaler", "sharded-grad-scaler"],
)
def test_fsdp_in_float16_with_no_loss_scaler(extra: str, reported: bool) -> None:
    # blind set eu's 16: FSDP's MixedPrecision in float16 on V100s, no ShardedGradScaler
    body = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision\n"
        + extra
        + "policy = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16)\n"
        "model = FSDP(nn.Linear(4, 1), mixed_precision=policy)\n"
        "loss = model(x).mean()\nloss.backward()\n"
    )
    assert bool(reported_lines(body)) is reported


TRAIN_AND_EVALUATE = """
def run(model, teacher, loader):
    optimizer = torch.optim.AdamW(model.parameters())
    for x, y in loader:
        {train}
        loss.backward()
        optimizer.step()
    {evaluate}
"""


@pytest.mark.parametrize(
    ("train", "evaluate", "reported"),
    [
        (
            "with torch.autocast('cuda', dtype=torch.float16):\n            loss = model(x).mean()",
            "pass",
            True,
        ),
        # blind sets do's 12, bh's 04, fn's 10: float16 for an evaluation under no_grad,
        # or for a frozen model's features, beside a training step in float32
        (
            "loss = model(x).mean()",
            (
                "with torch.no_grad(), torch.autocast('cuda', dtype=torch.float16):\n"
                "        print(model(x))"
            ),
            False,
        ),
        (
            (
                "with torch.autocast('cuda', dtype=torch.float16):\n            t = teacher(x)\n"
                "        loss = (model(x) - t.float()).pow(2).mean()"
            ),
            "pass",
            False,
        ),
    ],
    ids=["trained-model", "evaluation", "frozen-teacher"],
)
def test_float16_autocast_counts_where_it_runs_the_trained_model(train, evaluate, reported):
    body = TRAIN_AND_EVALUATE.format(train=train, evaluate=evaluate)
    assert bool(reported_lines(body)) is reported


def test_a_framework_that_scales_the_loss_itself_is_quiet() -> None:
    body = (
        "from accelerate import Accelerator\naccelerator = Accelerator()\n"
        "with torch.autocast('cuda', dtype=torch.float16):\n    loss = model(x).mean()\n"
        "loss.backward()\n"
    )
    assert reported_lines(body) == []


def test_the_trained_model_is_found_through_a_parameter_list_and_its_wrapper() -> None:
    # blind set bx's 18: the optimizer gets a list made from model.parameters(), and the
    # loop runs `ddp = DDP(model)` under float16 autocast with a plain backward
    body = (
        "params = [p for p in model.parameters() if p.requires_grad]\n"
        "opt = torch.optim.AdamW(params)\nddp = DDP(model)\n"
        "with torch.autocast('cuda', dtype=torch.float16):\n    loss = ddp(x).loss\n"
        "loss.backward()\n"
    )
    assert reported_lines(body) == [4]
