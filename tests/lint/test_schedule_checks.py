"""effective-batch-size-changed: a learning-rate schedule sized in one GPU's steps
(len of the whole dataset) while every GPU runs a process that reads a share."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
BROKEN = SCRIPTS / "schedule_counted_in_one_gpus_steps.py"
FIXED = SCRIPTS / "correct_schedule_counted_in_the_loaders_steps.py"

HEADER = """
import torch
import torch.distributed as dist
from transformers import get_linear_schedule_with_warmup
dist.init_process_group("nccl")
"""


def reported(body: str) -> list[int]:
    return [line for line, _ in lint_snippet(HEADER, body, ["effective-batch-size-changed"])]


@pytest.mark.slow
def test_the_fixture_uses_half_its_schedule_on_two_ranks_and_its_twin_all(torchrun):
    wait_broken, wait_fixed = torchrun.start(BROKEN), torchrun.start(FIXED)
    broken = wait_broken()
    assert broken.returncode == 0, broken.stderr[-2000:]
    assert broken.stdout.count("used 50% of the schedule") == 2
    assert broken.stdout.count("scaled the lr for 8 samples a step; a step takes 16") == 2
    fixed = wait_fixed()
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert fixed.stdout.count("used 100% of the schedule") == 2
    assert fixed.stdout.count("scaled the lr for 16 samples a step; a step takes 16") == 2


@pytest.mark.parametrize(
    "body",
    [
        "steps = len(train_dataset) // 32 * 3\nget_linear_schedule_with_warmup(opt, 100, num_training_steps=steps)",
        "torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, epochs=3, steps_per_epoch=len(train_ds) // bs)",
        (
            "per_epoch = len(self.trainer.datamodule.train_set) // cfg.batch_size\n"
            "total = per_epoch * cfg.epochs\ntorch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=total)"
        ),
        # blind set co's 12: the lengths given by position
        (
            "total = math.ceil(len(train_ds) / args.per_device_batch_size) * 3\n"
            "get_linear_schedule_with_warmup(opt, int(0.1 * total), total)"
        ),
        "torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, len(train_ds) // bs * 3)",
        "torch.optim.lr_scheduler.CosineAnnealingLR(opt, len(train_ds) // bs * 3)",
        "get_scheduler('cosine', opt, 100, len(train_ds) // bs * 3)",
    ],
    ids=[
        "hf-warmup",
        "steps-per-epoch",
        "through-names",
        "hf-positional",
        "onecycle-positional",
        "cosine-positional",
        "get-scheduler-positional",
    ],
)
def test_a_schedule_counted_from_the_whole_dataset_is_reported(body: str):
    assert len(reported(body)) == 1


@pytest.mark.parametrize(
    "body",
    [
        # the loader's length: already this process's share
        "torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=len(train_loader) * 3)",
        # divided by the number of processes
        (
            "steps = len(train_ds) // (bs * dist.get_world_size())\n"
            "torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=steps)"
        ),
        "steps = len(train_ds) // bs // world_size\ntorch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=steps)",
        # a count of epochs, not of steps
        "torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)",
        # the loader's length, whatever its sampler was built from (a sampler that
        # draws the whole set on every rank is missing-distributed-sampler's)
        (
            "sampler = WeightedRandomSampler(w, num_samples=len(train_ds))\n"
            "train_loader = DataLoader(train_ds, batch_size=bs, sampler=sampler)\n"
            "torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, epochs=3, steps_per_epoch=len(train_loader))"
        ),
        # a warm-up counted from the dataset is not the schedule's length
        "get_linear_schedule_with_warmup(opt, len(train_ds) // bs, len(train_loader) * 3)",
        # blind set dv's 12: the batch sampler's own count of batches, whatever it
        # was built from (one that never splits by rank is missing-distributed-sampler's)
        (
            "lengths = [len(train_ds[i]) for i in range(len(train_ds))]\n"
            "batch_sampler = BucketBatchSampler(lengths, max_tokens)\n"
            "total = 3 * len(batch_sampler)\n"
            "torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=total)"
        ),
    ],
    ids=[
        "loader",
        "world-size",
        "world-name",
        "epochs",
        "loader-of-a-whole-set-sampler",
        "warm-up-positional",
        "batch-sampler",
    ],
)
def test_quiet_where_the_count_is_the_process_share(body: str):
    assert reported(body) == []


@pytest.mark.parametrize(
    ("steps", "reported_"),
    [
        # blind set fp's 18: the steps of a configured batch of all ranks together
        ("steps_per_epoch = len(train_set) // args.global_batch", False),
        ("steps_per_epoch = len(train_set) // cfg.train.total_batch_size", False),
        # a "total" batch the file computes without the world size is one process's
        (
            "total_batch = args.batch_size * args.accum\nsteps_per_epoch = len(train_set) // total_batch",
            True,
        ),
    ],
    ids=["global-batch", "total-batch-size", "computed-total"],
)
def test_steps_counted_in_a_configured_global_batch_are_each_processs(steps, reported_):
    body = f"{steps}\ntorch.optim.lr_scheduler.OneCycleLR(opt, 0.1, epochs=3, steps_per_epoch=steps_per_epoch)"
    assert bool(reported(body)) is reported_


POLY = """
def poly_lr(step):
    if step < warmup_step:
        return (step + 1) / warmup_step
    return (1 - (step - warmup_step) / (total_step - warmup_step)) ** 2
"""


@pytest.mark.parametrize(
    "steps, reported_",
    [
        # blind set bm's 15: a face-recognition trainer's configured image count
        ("total_step = args.num_image // args.batch_size * args.epochs", True),
        ("total_step = len(train_set) // args.batch_size * args.epochs", True),
        # divided by the number of processes, or a sampler's own (per-process) count
        ("total_step = args.num_image // (args.batch_size * world_size) * args.epochs", False),
        ("total_step = sampler.num_samples // args.batch_size * args.epochs", False),
        ("total_step = len(train_loader) * args.epochs", False),
    ],
    ids=["configured-count", "dataset-length", "world-size", "sampler-share", "loader"],
)
def test_a_lambda_schedule_is_read_through_the_names_its_function_reads(steps, reported_):
    body = (
        f"{steps}\nwarmup_step = total_step // 20\n{POLY}\n"
        "scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, poly_lr)\n"
        "lam = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / total_step)\n"
    )
    assert bool(reported(body)) == reported_
    if reported_:
        assert len(reported(body)) == 2  # the function's, and the lambda's


def test_a_single_process_script_is_not_read():
    source = "import torch\nsteps = len(train_ds) // 32\ntorch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=steps)\n"
    assert lint_snippet("", source, ["effective-batch-size-changed"]) == []


MODULE = """
class Retrieval(LightningModule):
    def __init__(self, lr, steps_per_epoch, epochs=10):
        super().__init__()
        self.save_hyperparameters()

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, self.hparams.lr, epochs=self.hparams.epochs,
            steps_per_epoch=self.hparams.steps_per_epoch)
        return [opt], [sched]


def main(args, train_ds):
    {steps}
    model = Retrieval(args.lr, {passed})
    Trainer(devices=args.devices, strategy="ddp").fit(model)
"""
MODULE_HEADER = "import torch\nfrom lightning.pytorch import LightningModule, Trainer\n"


@pytest.mark.parametrize(
    ("steps", "passed", "found"),
    [
        # counted in main() from the whole dataset, read back through the hyperparameters
        ("steps = len(train_ds) // args.batch_size", "steps", True),
        ("pass", "steps_per_epoch=len(train_ds) // args.batch_size", True),
        # divided by the number of processes, or the loader's own length
        ("steps = len(train_ds) // (args.batch_size * args.devices)", "steps", False),
        ("loader = make_loader(train_ds)", "len(loader)", False),
    ],
)
def test_a_modules_schedule_is_read_back_to_what_its_construction_passes(steps, passed, found):
    body = MODULE.format(steps=steps, passed=passed)
    lines = [
        line for line, _ in lint_snippet(MODULE_HEADER, body, ["effective-batch-size-changed"])
    ]
    assert bool(lines) == found


LOADER = "train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)\n"


@pytest.mark.parametrize(
    "scaling",
    [
        "args.lr = args.lr * args.batch_size / 256",  # blind set ad's 07
        "peak_lr = args.base_lr * (args.batch_size / 512)",
        "optimizer = torch.optim.AdamW(params, lr=args.blr * args.batch_size / 256)",
        # blind set j's 13: the batch counted in a name first (with accumulation)
        "eff_batch = args.batch_size * args.accum_iter\nargs.lr = args.blr * eff_batch / 256",
    ],
)
def test_a_learning_rate_scaled_by_one_process_batch_is_reported(scaling: str):
    assert len(reported(LOADER + scaling)) == 1


@pytest.mark.parametrize(
    "scaling",
    [
        # the global batch: every process's batch counted
        "args.lr = args.lr * args.batch_size * dist.get_world_size() / 256",
        "lr = args.lr * args.batch_size * world_size / 512",
        "lr = args.lr * global_batch / 256",
        "eff_batch = args.batch_size * args.accum_iter * world_size\nargs.lr = args.blr * eff_batch / 256",
        # the process count under a name of the script's own, set in a tuple (set ai's 13)
        (
            "num_tasks, global_rank = dist.get_world_size(), dist.get_rank()\n"
            "total_batch = args.batch_size * args.update_freq * num_tasks\n"
            "args.lr = args.lr * total_batch / 4096"
        ),
        # a global batch split among the processes before the loader takes it
        "args.lr = args.lr * args.batch_size / 256\nargs.batch_size //= world_size",
        # not a learning rate
        "warmup = args.warmup_steps * args.batch_size / 256",
    ],
    ids=[
        "world-size-call",
        "world-size-name",
        "global-batch",
        "global-batch-in-a-name",
        "world-size-in-a-tuple-assigned-name",
        "batch-split-later",
        "not-an-lr",
    ],
)
def test_quiet_where_the_rule_counts_every_process(scaling: str):
    assert reported(LOADER + scaling) == []


ACCELERATE = """
from accelerate import Accelerator
accelerator = Accelerator(OPTIONS)
steps = len(train_dataset) // 32 * 3
scheduler = get_linear_schedule_with_warmup(opt, 100, num_training_steps=steps)
model, opt, loader, scheduler = accelerator.prepare(model, opt, loader, scheduler)
"""


def test_a_schedule_accelerate_steps_once_per_process_is_counted_in_one_gpus_steps():
    # blind set ax: Accelerate's prepared scheduler steps num_processes times a step
    assert reported(ACCELERATE.replace("OPTIONS", "")) == []
    # each batch split over the processes: one GPU's steps, stepped once each
    assert reported(ACCELERATE.replace("OPTIONS", "split_batches=True")) == []
    # a schedule left out of prepare() steps once per call on each process
    unprepared = ACCELERATE.replace(", scheduler = accelerator", " = accelerator").replace(
        ", loader, scheduler)", ", loader)"
    )
    assert reported(unprepared.replace("OPTIONS", "")) == [5]


@pytest.mark.parametrize(
    "accumulation, reported_",
    [
        # blind set bu's 09: fairseq's update_freq for a paper's tokens per update
        ("update_freq = max(1, args.tokens_per_update // args.max_tokens)", [2]),
        ("grad_accum_steps = args.total_batch_size // args.batch_size", [2]),
        # the world size counted (nanoGPT), or no target of the whole update
        (
            (
                "grad_accum_steps = args.total_batch_size // (args.batch_size * args.seq_len"
                " * dist.get_world_size())"
            ),
            [],
        ),
        (
            "world = dist.get_world_size(); grad_accum = args.global_batch // (args.micro * world)",
            [],
        ),
        ("accum_steps = args.accum_steps // 1", []),
        # blind set dl's 06: a tensor-parallel run's data-parallel size counted
        ("accum = args.global_batch // (args.micro_batch * MP.dp_size)", []),
    ],
)
def test_accumulation_that_reaches_an_update_target_counts_every_process(accumulation, reported_):
    body = f"""
        {accumulation}
        model = torch.nn.parallel.DistributedDataParallel(net)
        """
    assert reported(body) == reported_


@pytest.mark.parametrize(
    "loader, reported_",
    [
        # blind set by's 13: detectron2's IMS_PER_BATCH, images across all machines
        ("DataLoader(ds, batch_size=CFG['IMS_PER_BATCH'])", [4]),
        ("Grouped(ds, cfg.global_batch_size)", [4]),
        ("DataLoader(ds, batch_size=CFG['IMS_PER_BATCH'] // world_size)", []),
        ("DataLoader(ds, batch_size=CFG['MAX_ITER'])", []),  # a key not said to count all
        ("DataLoader(ds, batch_size=args.batch_size)", []),
        ("Sampler(ds, global_batch=args.global_batch)", []),  # not handed as a batch size
        # a key of that name the file does not say counts every process (u's 13)
        ("DataLoader(ds, batch_size=args.ims_per_batch)", []),
        # blind set ea's 04: a sampler of the file that divides it by the world itself
        ("IdentitySampler(ds, CFG['IMS_PER_BATCH'], world)", []),
    ],
)
def test_a_global_batch_given_as_each_processs_batch_is_reported(loader, reported_):
    body = f"""
        CFG = {{"IMS_PER_BATCH": 16,  # images per batch across all machines
               "MAX_ITER": 90000}}
        loader = {loader}
        model = torch.nn.parallel.DistributedDataParallel(net)
        class Grouped:
            def __init__(self, data, batch_size):
                self.batch_size = batch_size
        class Sampler:
            def __init__(self, data, global_batch):
                self.n = global_batch
        class IdentitySampler:
            def __init__(self, data, batch_size, world_size):
                self.mini_batch = batch_size // world_size
        """
    assert reported(body) == reported_


def test_a_batch_said_to_be_one_processs_is_not_read_as_global_by_what_the_comment_adds():
    """Blind set gx's 02 (correct): `batch_size=8,  # per GPU; the learning rates below
    are for 8 GPUs (global batch 64)` is each process's batch, though the comment goes
    on to name the global one."""
    body = """
        CFG = dict(
            batch_size=8,  # per GPU; the learning rates below are for 8 GPUs (global batch 64)
            ims_per_batch=64,  # global batch across all GPUs
        )
        loader = DataLoader(ds, batch_size=CFG["batch_size"])
        other = DataLoader(ds, batch_size=CFG["ims_per_batch"])
        model = torch.nn.parallel.DistributedDataParallel(net)
        """
    assert reported(body) == [7]
