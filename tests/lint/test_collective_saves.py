"""Checkpoint calls that are collectives, made on rank 0 only (collective-mismatch,
fsdp-state-dict): DeepSpeed's engine.save_checkpoint, Lightning's
trainer.save_checkpoint, Fabric's save, FSDP's state_dict and its kin."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import RANKS_STOPPED_MATCHING, assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
BROKEN = SCRIPTS / "fsdp_state_dict_gathered_on_rank_zero_only.py"
FIXED = SCRIPTS / "correct_fsdp_state_dict_gathered_on_every_rank.py"
CAUSES = ("collective-mismatch", "fsdp-state-dict")

DEEPSPEED = """
import deepspeed
import torch.distributed as dist
engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=params)
rank = dist.get_rank()
"""
LIGHTNING = """
import lightning as L
"""
FSDP = """
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, fully_shard
dist.init_process_group("nccl")
rank = dist.get_rank()
"""


def findings(prelude: str, body: str) -> list[tuple[int, str]]:
    return [(line, f.cause_id) for line, f in lint_snippet(prelude, body, CAUSES)]


@pytest.mark.slow
def test_the_fsdp_fixture_times_out_as_linted_under_torchrun_and_its_twin_saves(torchrun):
    # Rank 0 waits in the state_dict all-gather, rank 1 in the barrier after it.
    assert_broken_fails_and_twin_runs(torchrun, BROKEN, RANKS_STOPPED_MATCHING, FIXED, "saved")


def test_deepspeed_save_and_load_on_rank_zero_only_are_reported():
    body = """
    if rank == 0:
        engine.save_checkpoint("ckpt")
    if rank == 0:
        engine.load_checkpoint("ckpt")
    if rank == 0:
        engine.save_16bit_model("out")
    """
    assert findings(DEEPSPEED, body) == [
        (3, "collective-mismatch"), (5, "collective-mismatch"), (7, "collective-mismatch")
    ]  # fmt: skip


def test_deepspeed_save_on_every_rank_or_in_both_branches_is_quiet():
    body = """
    engine.save_checkpoint("ckpt")
    if rank == 0:
        engine.save_checkpoint("ckpt", tag="best")
    else:
        engine.save_checkpoint("ckpt", tag="best")
    if rank == 0:
        torch.save(engine.module.state_dict(), "plain.pt")
    """
    assert findings(DEEPSPEED, body) == []


def test_a_save_checkpoint_of_anything_but_the_deepspeed_engine_is_quiet():
    body = """
    import torch.distributed as dist
    rank = dist.get_rank()
    if rank == 0:
        engine.save_checkpoint("ckpt")
        saver.save_checkpoint("ckpt")
    """
    assert findings("", body) == []


def test_lightning_trainer_and_fabric_saves_on_global_zero_are_reported():
    body = """
    def on_validation_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            trainer.save_checkpoint("last.ckpt")

    def save(fabric, state):
        if fabric.global_rank == 0:
            fabric.save("state.ckpt", state)
    """
    assert findings(LIGHTNING, body) == [(4, "collective-mismatch"), (8, "collective-mismatch")]


def test_lightning_names_in_a_file_without_lightning_are_quiet():
    body = """
    import torch.distributed as dist
    if dist.get_rank() == 0:
        trainer.save_checkpoint("last.ckpt")
        fabric.save("state.ckpt", {})
    """
    assert findings("", body) == []


def test_fsdp_gathers_on_rank_zero_only_are_reported():
    body = """
    model = FSDP(net)
    if rank == 0:
        state = model.state_dict()
        optim = FSDP.optim_state_dict(model, optimizer)
        dcp.save({"model": state}, checkpoint_id="ckpt")
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    """
    assert findings(FSDP, body) == [
        (4, "fsdp-state-dict"), (5, "fsdp-state-dict"), (6, "fsdp-state-dict"),
        (7, "fsdp-state-dict"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("guard", "reported"),
    [
        # blind set fp's 05: the sharded optimizer state consolidated on rank 0 only
        ("if rank == 0:\n    ", [(4, "collective-mismatch")]),
        ("", []),
    ],
    ids=["rank-zero", "every-rank"],
)
def test_zero_redundancy_optimizers_consolidation_on_rank_zero(guard, reported):
    body = (
        "from torch.distributed.optim import ZeroRedundancyOptimizer\n"
        "optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)\n"
        f"{guard}optimizer.consolidate_state_dict(to=0)\n"
        "if rank == 0:\n    torch.save(optimizer.state_dict(), 'opt.pt')\n"
    )
    assert findings(FSDP, body) == reported


@pytest.mark.parametrize(
    ("guard", "reported"),
    [
        # blind set eo's 10: a helper's parameter, named FSDP by the `with` around its state_dict
        ("if rank == 0:\n        ", [(5, "fsdp-state-dict")]),
        ("", []),
    ],
)
def test_a_state_dict_under_fsdps_state_dict_type_is_fsdps(guard, reported):
    body = """
    def save_full(model, path):
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save(state, path)
    GUARDsave_full(policy, "final.pt")
    """.replace("GUARD", guard)
    prelude = FSDP + "from torch.distributed.fsdp import FullStateDictConfig, StateDictType\n"
    assert findings(prelude, body) == reported


ACCELERATE_FSDP = """
from accelerate import Accelerator, FullyShardedDataParallelPlugin
"""


@pytest.mark.parametrize(
    ("built", "guard", "reported"),
    [
        # blind set es's 08: Accelerate's FSDP plugin, the state gathered on the main process only
        (
            "Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())",
            "if accelerator.is_main_process:\n        ",
            [5],
        ),
        ("Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())", "", []),
        # no FSDP plugin: under DDP get_state_dict is rank 0's own copy
        ("Accelerator()", "if accelerator.is_main_process:\n        ", []),
    ],
)
def test_accelerates_get_state_dict_under_an_fsdp_plugin_on_the_main_process(
    built, guard, reported
):
    body = f"""
    accelerator = {built}
    model = accelerator.prepare(model)
    {guard}state = accelerator.get_state_dict(model)
    """
    found = findings(ACCELERATE_FSDP, body)
    assert [line for line, _ in found] == reported
    assert all(cause == "fsdp-state-dict" for _, cause in found)


def test_fsdp2_local_shards_and_a_sharded_get_on_rank_zero_are_quiet():
    # FSDP2's state_dict and get_model_state_dict without full_state_dict return
    # the local shards: no communication, so rank 0 alone may take them.
    body = """
    fully_shard(net)
    if rank == 0:
        local = net.state_dict()
        sharded = get_model_state_dict(net)
    """
    assert findings(FSDP, body) == []


def test_the_message_names_the_call_its_rank_test_and_why():
    body = """
    model = FSDP(net)
    if rank == 0:
        torch.save(model.state_dict(), "model.pt")
    """
    (finding,) = [f for _line, f in lint_snippet(FSDP, body, CAUSES)]
    assert "model.state_dict() runs on rank 0 only (the `if` on line" in finding.message
    assert "all-gathers every rank's shard" in finding.message
    assert "call it on every rank" in finding.message


@pytest.mark.parametrize(
    ("strategy", "reported"),
    [
        ('"fsdp"', True),
        ('L.pytorch.strategies.FSDPStrategy(sharding_strategy="FULL_SHARD")', True),
        ('"ddp"', False),  # every rank holds the whole model: its state_dict gathers nothing
    ],
)
def test_a_callbacks_state_dict_of_the_module_on_global_zero_under_fsdp(strategy, reported):
    # Lightning wrapped the module's layers in FSDP: their state_dict all-gathers
    body = f"""
    class Export(L.Callback):
        def on_train_end(self, trainer, pl_module):
            if trainer.is_global_zero:
                weights = pl_module.model.state_dict()

    trainer = L.Trainer(devices=8, strategy={strategy}, callbacks=[Export()])
    """
    found = findings(LIGHTNING, body)
    assert found == ([(5, "fsdp-state-dict")] if reported else [])


GROUPS = """
import torch.distributed as dist
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
sp = 2
CREATE
"""


@pytest.mark.parametrize(
    ("create", "reported"),
    [
        # blind set gd's 04: only this rank's own sequence-parallel group
        ("group = dist.new_group([rank // sp * sp + i for i in range(sp)])", [6]),
        # every group on every rank, this rank's kept
        (
            (
                "for g in range(world // sp):\n"
                "    members = [g * sp + i for i in range(sp)]\n"
                "    made = dist.new_group(members)\n"
                "    if rank in members:\n"
                "        group = made"
            ),
            [],
        ),
        ("group = dist.new_group([0, 1])", []),
    ],
    ids=["own-group", "every-group", "fixed-members"],
)
def test_a_group_whose_members_this_rank_decides(create, reported):
    found = lint_snippet("", GROUPS.replace("CREATE", create), ["collective-mismatch"])
    assert [line for line, _ in found] == reported
