"""zero3-partitioned-parameters: torch.nn.utils.clip_grad_norm_ over a model FSDP's
wrapper shards measures each rank's own shard of the gradients."""

from __future__ import annotations

import pytest
from snippets import lint_snippet

PRELUDE = """
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("nccl")
"""


@pytest.mark.parametrize(
    ("wrap", "clip", "reported"),
    [
        # blind set fo's 01: FSDP's wrapper, clipped by torch's function
        ("model = FSDP(net)", "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)", [3]),
        ("model = FSDP(net)", "nn.utils.clip_grad_norm_(model.parameters(), 1.0)", [3]),
        # FSDP's own clip, DDP (whole gradients), FSDP2's DTensors
        ("model = FSDP(net)", "model.clip_grad_norm_(1.0)", []),
        ("model = DDP(net)", "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)", []),
        (
            "fully_shard(net)\nmodel = net",
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
            [],
        ),
    ],
    ids=["fsdp", "nn-alias", "fsdp-own-clip", "ddp", "fully-shard"],
)
def test_torch_clip_of_fsdp_shards(wrap: str, clip: str, reported: list[int]) -> None:
    body = f"from torch import nn\n{wrap}\n{clip}\n"
    found = lint_snippet(PRELUDE, body, ["zero3-partitioned-parameters"])
    assert [line for line, _ in found] == reported


ZERO3 = """
import deepspeed
import torch
config = {"train_batch_size": 8, "zero_optimization": {"stage": 3}}
engine, optimizer, _, _ = deepspeed.initialize(model=net, config=config)


def export(engine, rank):
    if rank == 0:
        model = MODEL
        torch.save(model.state_dict(), "weights.pt")
"""


@pytest.mark.parametrize(
    ("model", "reported"),
    [
        # blind set gf's 01: the engine's module under a local name, read on rank 0
        ("engine.module", [11]),
        ("engine", [11]),
        # a model of its own, built in the function
        ("build()", []),
    ],
    ids=["module-alias", "engine-alias", "own-model"],
)
def test_a_zero3_state_dict_read_through_a_local_name(model: str, reported: list[int]) -> None:
    found = lint_snippet("", ZERO3.replace("MODEL", model), ["zero3-partitioned-parameters"])
    assert [line for line, _ in found] == reported
