"""uneven-inputs: a step one rank skips on its own data, before the gradient
all-reduce the other ranks wait in (the fixture holds a NaN loss and an empty
batch; these hold a batch with no targets), and a loop one rank leaves on a
flag its own signal handler set (a preemption notice)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from snippets import RANKS_STOPPED_MATCHING, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"

HEADER = """
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
model = DDP(net)
"""


def skipped_lines(body: str) -> list[int]:
    return [line for line, _f in lint_snippet(HEADER, body, ["uneven-inputs"])]


def test_a_batch_whose_mask_or_labels_hold_no_target_is_a_skip_on_local_data():
    body = """
    for x, y, mask in loader:
        if not mask.any():
            continue
        model(x).sum().backward()
    for step, (x, labels) in enumerate(loader):
        if (labels != -100).sum() == 0:
            continue
        model(x).sum().backward()
    """
    assert skipped_lines(body) == [3, 7]


def test_a_value_the_step_computes_from_its_batch_is_the_ranks_own_data():
    """Blind set cw's 11: hard negatives mined for this rank's batch; a batch with
    none usable is skipped on this rank alone."""
    body = """
    for step, (x, ids, idx) in enumerate(loader):
        idx = idx.to(device)
        hard_idx, ok = mine_hard(bank, idx, args.k)
        if not ok.any():
            continue
        model(x).sum().backward()
    for step, (x, ids, idx) in enumerate(loader):
        ok = bank.ready
        if not ok.any():
            continue
        model(x).sum().backward()
    """
    assert skipped_lines(body) == [5]


def test_a_batch_with_no_boxes_by_its_shape_or_size_is_a_skip_on_local_data():
    # A detector's batch of background images: the targets tensor has no rows.
    body = """
    for i, (imgs, targets, paths, _) in enumerate(loader):
        if targets.shape[0] == 0:
            continue
        model(imgs).sum().backward()
    for imgs, targets in loader:
        if not targets.size(0):
            continue
        model(imgs).sum().backward()
    for imgs, boxes in loader:
        if boxes.shape[0] < 1:
            continue
        model(imgs).sum().backward()
    for batch in loader:
        batch = batch.to(device)
        if batch.x.shape[0] == 1 or batch.batch[-1] == 0:
            continue
        model(batch).sum().backward()
    """
    assert skipped_lines(body) == [3, 7, 11, 16]


def test_a_batch_with_fewer_rows_than_a_minimum_of_its_own_is_a_skip_on_local_data():
    # blind set bn's 08: a random crop of a scene that holds too few voxels
    body = """
    for coords, feats, labels in loader:
        if feats.shape[0] < args.min_points:
            continue
        model(feats).sum().backward()
    for points, labels in loader:
        if points.size(0) <= min_voxels:
            continue
        model(points).sum().backward()
    """
    assert skipped_lines(body) == [3, 7]


def test_a_parameter_without_a_gradient_skipped_in_averaging_by_hand_is_quiet():
    # blind set bk's 05: every rank skips the same parameters (same model, same graph)
    body = """
    for x, y in loader:
        model(x).sum().backward()
        for param in model.parameters():
            if param.grad is None:
                continue
            dist.all_reduce(param.grad.data)
    """
    assert skipped_lines(body) == []


def test_a_batch_compared_with_the_batch_size_is_quiet():
    # DistributedSampler pads every rank to the same number of samples: a short
    # last batch is as short on every rank, and each of them skips it.
    body = """
    for imgs, labels in loader:
        if imgs.shape[0] != args.batch_size:
            continue
        model(imgs).sum().backward()
    for imgs, labels in loader:
        if imgs.size(0) < cfg.per_gpu_batch:
            continue
        model(imgs).sum().backward()
    for imgs, labels in loader:
        if imgs.shape[0] < bs:
            continue
        model(imgs).sum().backward()
    """
    assert skipped_lines(body) == []


def test_a_skip_on_the_step_count_or_on_a_value_every_rank_agreed_on_is_quiet():
    body = """
    for step, (x, mask) in enumerate(loader):
        if step % 10 == 9:
            continue
        has_targets = mask.any().float()
        dist.all_reduce(has_targets, op=dist.ReduceOp.MIN)
        if not has_targets.item():
            continue
        model(x).sum().backward()
    """
    assert skipped_lines(body) == []


def test_a_rollout_value_compared_after_a_reduction_is_a_skip_on_local_data():
    # RL loops draw their batch inside the loop (`next(it)`, a rollout): the skip
    # reads a value the rank computed, not a loader's item.
    body = """
    for step in range(1000):
        rewards = rollout(next(it))
        adv = rewards - rewards.mean()
        if adv.abs().sum() == 0:
            continue
        model(adv).sum().backward()
    """
    assert skipped_lines(body) == [5]


def test_a_compared_reduction_every_rank_agreed_on_is_quiet():
    body = """
    for step in range(1000):
        adv = rollout(next(it))
        flat = adv.abs().sum()
        dist.all_reduce(flat, op=dist.ReduceOp.MIN)
        if flat.sum() == 0:
            continue
        model(adv).sum().backward()
    """
    assert skipped_lines(body) == []


SIGNAL_HANDLER = """
import signal, sys
STOP = False
def on_term(signum, frame):
    global STOP
    STOP = True
signal.signal(signal.SIGTERM, on_term)
"""


@pytest.mark.parametrize(
    ("leave", "reported"),
    [
        ("break", True),
        ("sys.exit()", True),
        ("sys.exit(0)", True),
        ("raise SystemExit", True),
        ("return", True),
        # an exit with an error code: torchrun stops the other ranks, nothing waits
        ("sys.exit(1)", False),
        ("raise SystemExit(2)", False),
    ],
)
def test_a_loop_left_on_a_flag_this_process_signal_handler_set(leave, reported):
    body = f"""
    def train():
        for x in loader:
            model(x).sum().backward()
            if STOP:
                save()
                {leave}
    """
    lines = [line for line, _ in lint_snippet(HEADER + SIGNAL_HANDLER, body, ["uneven-inputs"])]
    assert lines == ([5] if reported else [])


EARLY_STOPPING = """
rank = dist.get_rank()
for epoch in range(100):
    for x, y in loader:
        model(x).sum().backward()
    if rank == 0:
        stopper(validate(model.module))
    LEAVE
"""


@pytest.mark.parametrize(
    "leave, reported",
    [
        # blind set bd's 16: only rank 0 knows it should stop, and only rank 0 leaves
        ("if rank == 0 and stopper.early_stop:\n        break", [8]),
        ("if rank == 0:\n        if stopper.early_stop:\n            break", [9]),
        ("if rank != 0 and epoch > 50:\n        break", [8]),
        # every rank reads a flag rank 0 broadcast first, or the epoch count
        (
            (
                "flag = torch.tensor([stopper.early_stop])\n    dist.broadcast(flag, 0)\n"
                "    if flag.item():\n        break"
            ),
            [],
        ),
        ("if epoch >= 50:\n        break", []),
    ],
)
def test_a_loop_left_on_some_ranks_only_leaves_the_others_waiting(leave, reported):
    assert skipped_lines(EARLY_STOPPING.replace("LEAVE", leave)) == reported


def test_a_signal_flag_agreed_by_an_all_reduce_or_never_registered_is_quiet():
    agreed = """
    for x in loader:
        model(x).sum().backward()
        stop = torch.tensor(float(STOP))
        dist.all_reduce(stop)
        if stop.item():
            break
    """
    assert lint_snippet(HEADER + SIGNAL_HANDLER, agreed, ["uneven-inputs"]) == []
    unregistered = SIGNAL_HANDLER.replace("signal.signal(signal.SIGTERM, on_term)", "")
    left = """
    for x in loader:
        model(x).sum().backward()
        if STOP:
            break
    """
    assert lint_snippet(HEADER + unregistered, left, ["uneven-inputs"]) == []


def test_the_finding_says_the_flag_comes_from_a_signal():
    [(_, finding)] = lint_snippet(
        HEADER + SIGNAL_HANDLER,
        """
    for x in loader:
        model(x).sum().backward()
        if STOP:
            break
    """,
        ["uneven-inputs"],
    )
    assert "signal handler" in finding.message
    assert "leaves the loop" in finding.message


@pytest.mark.slow
def test_the_preemption_fixture_fails_under_torchrun_and_its_twin_stops_together(torchrun):
    wait_failed = torchrun.start(SCRIPTS / "preemption_flag_not_agreed_across_ranks.py")
    wait_ran = torchrun.start(SCRIPTS / "correct_preemption_flag_agreed_across_ranks.py")
    failed = wait_failed()
    assert failed.returncode != 0
    assert failed.stdout.count("saved at step 3") == 1  # rank 0 alone left
    ran = wait_ran()
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.count("saved at step 3") == 2


ACCELERATE = """
import torch
from accelerate import Accelerator

accelerator = Accelerator()
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
"""


@pytest.mark.parametrize(
    ("agreed", "reported"),
    [
        ("", True),
        # the skip decided together: every rank sees the same flag
        ("bad = accelerator.reduce(bad, reduction='sum')\n        ", False),
    ],
)
def test_a_nan_step_skipped_under_accelerate_before_its_backward(agreed, reported):
    # Accelerate wraps the model in DDP out of sight: its backward all-reduces the same way
    body = f"""
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        bad = (~torch.isfinite(loss)).float()
        {agreed}if bad.item() > 0:
            optimizer.zero_grad()
            continue
        accelerator.backward(loss)
        optimizer.step()
    """
    found = [line for line, _f in lint_snippet(ACCELERATE, body, ["uneven-inputs"])]
    assert bool(found) == reported


@pytest.mark.slow
def test_early_stopping_on_rank_zero_alone_fails_under_torchrun_and_the_shared_twin_stops_together(
    torchrun,
):
    wait_failed = torchrun.start(SCRIPTS / "early_stopping_decided_on_rank_zero_only.py")
    wait_ran = torchrun.start(SCRIPTS / "correct_early_stopping_decided_on_rank_zero_and_shared.py")
    failed = wait_failed()
    assert failed.returncode != 0
    assert failed.stdout.count("stopped early at epoch 2") == 1  # rank 0 alone left
    assert any(text in failed.stderr for text in RANKS_STOPPED_MATCHING), failed.stderr[-3000:]
    ran = wait_ran()
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.count("stopped early at epoch 2") == 2


@pytest.mark.parametrize(
    "measured, reported",
    [
        # blind set eb's 01: the share of valid pixels in this rank's batch
        ("valid = (y != IGNORE).float().mean().item()", [4]),
        ("valid = (y != IGNORE).sum()", [4]),
        ("valid = y.size(0)", []),  # a row count below a bound: the short last batch
        ("valid = args.min_valid_frac * 2", []),  # no data of the step
        # blind set bt's 02 (correct): a flag every rank agreed on, read after its all_reduce
        (
            (
                "flag = torch.tensor([float(PREEMPTED)])\n        dist.all_reduce(flag)\n"
                "        valid = flag.item()"
            ),
            [],
        ),
    ],
)
def test_a_name_the_step_reads_from_its_batch_is_its_own_data(measured, reported):
    body = f"""
    for step, (x, y) in enumerate(loader):
        {measured}
        if valid < args.min_valid_frac:
            continue
        model(x).sum().backward()
    """
    assert skipped_lines(body) == reported


@pytest.mark.parametrize(
    ("handler", "reported"),
    [
        # blind set ft's 17: a long batch out of memory on one rank, skipped there alone
        ("except torch.cuda.OutOfMemoryError:\n    torch.cuda.empty_cache()\n    continue", [6]),
        (
            (
                "except RuntimeError as e:\n    if 'out of memory' in str(e):\n"
                "        optimizer.zero_grad()\n        continue\n    raise"
            ),
            [6],
        ),
        # the ranks agree to skip; a handler that stops the run; another error skipped
        (
            (
                "except torch.cuda.OutOfMemoryError:\n    oom = torch.ones(1)\n"
                "    dist.all_reduce(oom)\n    continue"
            ),
            [],
        ),
        ("except torch.cuda.OutOfMemoryError:\n    print('OOM')\n    raise", []),
        ("except ValueError:\n    print('out of memory')\n    continue", []),
    ],
    ids=["oom-error", "runtime-error-message", "agreed", "re-raised", "other-error"],
)
def test_a_step_skipped_when_this_ranks_batch_runs_out_of_memory(handler, reported):
    body = (
        "for x, y in loader:\n    try:\n        loss = model(x).sum()\n        loss.backward()\n"
        + textwrap.indent(handler, "    ")
        + "\n    optimizer.step()\n"
    )
    assert skipped_lines("\n" + body) == reported


@pytest.mark.parametrize(
    ("tested", "reported"),
    [
        # blind set fx's 12: the gradient norm after the backward's all-reduce is every
        # rank's alike, so the skip on it is taken together
        ("gn", []),
        # the loss before the backward is this rank's own
        ("loss", [6]),
    ],
)
def test_a_skip_on_the_gradient_norm_is_taken_together(tested, reported):
    body = f"""
    for x, y in loader:
        loss = model(x).sum()
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not torch.isfinite({tested}):
            optimizer.zero_grad()
            continue
        optimizer.step()
        dist.all_reduce(loss.detach())
    """
    assert skipped_lines(body) == reported


def test_a_loss_a_module_of_the_file_all_reduces_before_returning_it_is_agreed():
    """Blind set gs's 11 (correct): a partial-FC head whose cross-entropy Function
    all-reduces the loss before returning it: a non-finite loss is non-finite on
    every rank, so all of them skip the step together. A module that gathers
    features and returns a loss of its own rank's rows is not agreed."""
    body = """
    class DistCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, label):
            loss = F.cross_entropy(logits, label, reduction="none")
            dist.all_reduce(loss)
            return loss.mean()

    class PartialFC(torch.nn.Module):
        def forward(self, emb, label):
            return DistCrossEntropy.apply(self.fc(emb), label)

    class GatheredLoss(torch.nn.Module):
        def forward(self, emb, label):
            every = [torch.zeros_like(emb) for _ in range(dist.get_world_size())]
            dist.all_gather(every, emb)
            return F.cross_entropy(emb @ torch.cat(every).T, label)

    pfc = PartialFC().to(device)
    gathered = GatheredLoss().to(device)
    for x, y in loader:
        loss = pfc(model(x), y)
        if not torch.isfinite(loss):
            continue
        loss.backward()
    for x, y in loader:
        loss = gathered(model(x), y)
        if not torch.isfinite(loss):
            continue
        loss.backward()
    """
    assert skipped_lines(body) == [28]


def test_an_epoch_loop_left_on_this_ranks_own_accuracy_is_reported():
    """Blind set hl's 05: training stops once this rank's own shard reaches a
    target accuracy, counted over the epoch's batches; the ranks reach it at
    different epochs, and those still training wait in the gradient all-reduce.
    Counted after an all_reduce of the counts, every rank stops together."""
    body = """
    for epoch in range(100):
        n_correct, n_seen = 0, 0
        for x, y in loader:
            out = model(x)
            F.cross_entropy(out, y).backward()
            n_correct += (out.argmax(1) == y).sum().item()
            n_seen += y.size(0)
        acc = n_correct / max(n_seen, 1)
        if acc >= 0.99:
            break
    for epoch in range(100):
        counts = torch.zeros(2)
        for x, y in loader:
            out = model(x)
            F.cross_entropy(out, y).backward()
            counts += torch.tensor([(out.argmax(1) == y).sum().item(), y.size(0)])
        dist.all_reduce(counts)
        acc = counts[0] / counts[1]
        if acc >= 0.99:
            break
    best, bad = float("inf"), 0
    for epoch in range(100):
        val = torch.zeros(2)
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            val += torch.tensor([F.mse_loss(model(x), y).item(), 1.0])
        dist.all_reduce(val)
        val_loss = (val[0] / val[1]).item()
        improved = val_loss < best
        best = min(best, val_loss)
        bad = 0 if improved else bad + 1
        if bad >= 5:
            break
    """
    assert skipped_lines(body) == [10]
