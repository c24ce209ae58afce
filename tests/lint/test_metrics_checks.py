"""metrics-not-reduced: an evaluation over each rank's share whose totals are shown
or compared without combining the ranks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from snippets import lint_snippet

from assistant.lint import lint_source

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
BROKEN = SCRIPTS / "validation_accuracy_of_one_share.py"
FIXED = SCRIPTS / "correct_validation_counts_all_reduced.py"

HEADER = """
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from accelerate import Accelerator
"""


def reported_lines(body: str) -> list[int]:
    return [line for line, _ in lint_snippet(HEADER, body, ["metrics-not-reduced"])]


@pytest.mark.slow
def test_each_rank_prints_its_own_share_and_the_twin_prints_the_whole(torchrun):
    wait_broken, wait_fixed = torchrun.start(BROKEN), torchrun.start(FIXED)
    broken = wait_broken()
    assert broken.returncode == 0, broken.stderr[-2000:]
    # the two ranks write to one pipe: their lines may come in either order, or torn
    assert sorted(re.findall(r"val acc \d\.\d{3}", broken.stdout)) == [
        "val acc 0.000",
        "val acc 0.750",
    ]
    fixed = wait_fixed()
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert fixed.stdout.count("val acc 0.375") == 2


def test_an_inline_loop_and_a_metric_fed_batch_by_batch_are_reported():
    lines = reported_lines(
        """
        dist.init_process_group("nccl")
        val = DataLoader(data, sampler=DistributedSampler(data))
        correct = 0
        for x, y in val:
            correct += (model(x).argmax(-1) == y).sum().item()
        if dist.get_rank() == 0:
            print("acc", correct / len(data))
        accelerator = Accelerator()
        model, loader = accelerator.prepare(model, loader)
        for batch in loader:
            metric.add_batch(predictions=model(**batch).logits.argmax(-1), references=batch["y"])
        scores = metric.compute()
        if scores["f1"] > best:
            best = scores["f1"]
        """
    )
    assert lines == [5, 11]


STEP_COUNTER = """
dist.init_process_group("nccl")
train = DataLoader(data, sampler=DistributedSampler(data))
step = 0
for x, y in train:
    loss = model(x, y)
    COUNT
if dist.get_rank() == 0:
    print("lr", schedule(step))
"""


@pytest.mark.parametrize(
    "count, reported",
    [
        # blind set gj's 07 (correct): a step counter, the same on every rank, shown
        # as the learning rate at that step
        ("step += 1", []),
        # a count of what the batch holds, or of the batches that pass a test, is
        # this rank's share
        ("step += len(y)", [5]),
        ("if loss > 1:\n        step += 1", [5]),
    ],
)
def test_a_counter_of_the_loops_batches_is_not_a_total_of_the_data(count, reported):
    assert reported_lines(STEP_COUNTER.replace("COUNT", count)) == reported


NESTED_EVALUATION = """
def main():
    accelerator = Accelerator()
    model, eval_dl = accelerator.prepare(model, eval_dl)

    def evaluate():
        n_correct, n_total = 0, 0
        for batch in eval_dl:
            n_correct += int(model(batch["x"]).argmax(-1) == batch["y"])
            n_total += 1
        return n_correct / max(1, n_total)

    for epoch in range(3):
        em = COMBINED
        accelerator.log({"exact_match": em}, step=epoch)
"""


@pytest.mark.parametrize(
    "combined, reported",
    [("evaluate()", [8]), ("accelerator.reduce(torch.tensor(evaluate()), 'mean').item()", [])],
)
def test_an_evaluation_nested_in_main_over_its_prepared_loader(combined, reported):
    # blind set bb's 19: `def evaluate():` inside main reads main's prepared loader and
    # returns the exact match of this process's share, which main logs as it is
    body = NESTED_EVALUATION.replace("COMBINED", combined)
    assert reported_lines(body) == reported


SEGMENTATION_METRICS = """
import numpy as np


class RunningConfusion:
    def __init__(self, n):
        self.confusion = np.zeros((n, n))

    def update(self, truth, pred):
        self.confusion += np.bincount(truth * 19 + pred, minlength=361).reshape(19, 19)

    def miou(self):
        SYNC
        return np.nanmean(np.diag(self.confusion) / self.confusion.sum(1))


def build_loaders(data):
    val_loader = DataLoader(data, batch_size=1, sampler=DistributedSampler(data))
    return None, val_loader


def validate(model, loader):
    metrics = RunningConfusion(19)
    for x, y in loader:
        metrics.update(y, model(x).argmax(1))
    return metrics.miou()


def main():
    dist.init_process_group("nccl")
    _, val_loader = build_loaders(data)
    score = validate(model, val_loader)
    if dist.get_rank() == 0:
        print("mIoU", score)
"""


@pytest.mark.parametrize(
    "sync, reported",
    [
        ("pass", [24]),
        # the read all-reduces the matrix first: the class combines the ranks itself
        ("dist.all_reduce(torch.as_tensor(self.confusion))", []),
    ],
)
def test_a_running_confusion_of_the_files_own_over_a_helpers_loader(sync, reported):
    # blind set be's 06: a loader returned by the file's builder, a metric object of the
    # file's own class that adds to a field and never communicates
    body = SEGMENTATION_METRICS.replace("SYNC", sync)
    assert reported_lines(body) == reported


AVERAGE_METERS = """
class AverageMeter:
    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n

    @property
    def avg(self):
        return self.sum / max(1, self.count)


def validate(loader, model):
    top1, losses = AverageMeter(), AverageMeter()
    for images, target in loader:
        output = model(images)
        top1.update((output.argmax(1) == target).float().mean().item(), images.size(0))
    return top1.avg


dist.init_process_group("nccl")
val_loader = DataLoader(val_set, batch_size=256, sampler=DistributedSampler(val_set))
acc1 = validate(val_loader, model)
if dist.get_rank() == 0:
    print(f"Acc@1 {acc1:.3f}")
"""


def test_meters_of_the_files_own_bound_in_one_tuple_assignment_are_running_metrics():
    # blind set bh's 16: the ImageNet example's meters, made two to a line
    assert reported_lines(AVERAGE_METERS) == [17]


def test_a_total_carried_by_assignment_is_a_total():
    # blind set as 01: a confusion matrix updated through a helper that returns it
    body = """
        def update(conf, pred, target):
            return conf + torch.bincount(target * 2 + pred, minlength=4).reshape(2, 2)
        dist.init_process_group("nccl")
        val = DataLoader(data, sampler=DistributedSampler(data))
        conf = torch.zeros(2, 2)
        total = 0.0
        for x, y in val:
            x = x.cuda()
            conf = update(conf, model(x).argmax(-1), y)
            total = total + x.shape[0]
        print("iou", conf.diag() / conf.sum(0), total)
        """
    assert reported_lines(body) == [8]
    # reduced before it is shown: quiet; a batch moved to the GPU is no total
    assert (
        reported_lines(
            body.replace(
                'print("iou"',
                'dist.all_reduce(conf)\n        dist.all_reduce(total)\n        print("iou"',
            )
        )
        == []
    )
    assert (
        reported_lines(
            body.replace("conf = update(conf, model(x).argmax(-1), y)", "pass").replace(
                "total = total + x.shape[0]", "pass"
            )
        )
        == []
    )


def test_totals_reduced_gathered_or_training_loops_are_not():
    lines = reported_lines(
        """
        dist.init_process_group("nccl")
        sampler = DistributedSampler(data)
        val = DataLoader(data, sampler=sampler)
        loss_sum, n = 0.0, 0
        for x, y in val:
            loss_sum += model(x, y).item()
            n += 1
        t = torch.tensor([loss_sum, n])
        dist.all_reduce(t)
        print("loss", t[0] / t[1])
        preds = []
        for x, y in val:
            preds.append(model(x))
        gathered = utils.all_gather_list(preds)
        print(len(gathered))
        for x, y in val:
            loss = model(x, y)
            loss.backward()
            running += loss.item()
        print(running)
        for x, y in val:
            torchmetric.update(model(x), y)
        print(torchmetric.compute())
        """
    )
    assert lines == []


@pytest.mark.parametrize(
    "combine, reported",
    [
        ("g = lambda t: torch.cat(all_gather_list(t))", []),  # bs's 10
        ("g = lambda t: torch.cat([t, t])", [6]),  # a lambda that gathers nothing
        ("def g(t):\n            return torch.cat([t, t])", [7]),
    ],
)
def test_values_gathered_through_a_lambda_are_combined(combine, reported):
    body = f"""
        dist.init_process_group("nccl")
        val = DataLoader(data, sampler=DistributedSampler(data))
        feats = []
        {combine}
        for x, y in val:
            feats.append(model(x))
        feats = torch.cat(feats)
        feats = g(feats)
        print("recall", (feats > 0).float().mean())
        """
    assert reported_lines(body) == reported


@pytest.mark.parametrize(
    "count, reported",
    [
        ("n_episodes // world", [4]),  # br's 05: each rank draws its share of the episodes
        ("n_episodes", []),  # every rank draws them all: the same figure everywhere
    ],
)
def test_an_evaluation_over_a_batch_sampler_given_a_share_of_the_count(count, reported):
    body = f"""
        def evaluate(model, loader):
            accs = []
            for x, y in loader:
                accs.append((model(x).argmax(1) == y).float().mean().item())
            return sum(accs) / len(accs)
        def main():
            dist.init_process_group("nccl")
            world = dist.get_world_size()
            model = DDP(net)
            def episode_loader(ds, n_episodes):
                sampler = EpisodeSampler(ds.labels, {count}, 5, 15)
                return DataLoader(ds, batch_sampler=sampler)
            val_loader = episode_loader(valset, 600)
            acc = evaluate(model.module, val_loader)
            if dist.get_rank() == 0:
                print("val acc", acc)
        """
    assert reported_lines(body) == reported


@pytest.mark.parametrize(
    "combine, reported",
    [
        ("", [5]),  # bs's 03: captions of the rank's share, scored on rank 0
        ("preds = gather_dicts(preds)", []),
    ],
)
def test_predictions_kept_by_key_are_a_total(combine, reported):
    body = f"""
        dist.init_process_group("nccl")
        val = DataLoader(data, sampler=DistributedSampler(data))
        preds = {{}}
        for images, ids in val:
            for i, caption in zip(ids.tolist(), model.generate(images)):
                preds[i] = caption
        {combine}
        if dist.get_rank() == 0:
            print("CIDEr", cider(preds, refs))
        """
    assert reported_lines(body) == reported


@pytest.mark.parametrize(
    "reduce, reported",
    [
        ("dist.all_reduce(stats)", [6]),  # bu's 04: the loss reduced, the hypotheses not
        ("dist.all_reduce(stats)\n        hyps = all_gather_object_list(hyps)", []),
    ],
)
def test_each_total_is_combined_on_its_own(reduce, reported):
    body = f"""
        dist.init_process_group("nccl")
        val = DataLoader(data, sampler=DistributedSampler(data))
        stats = torch.zeros(2)
        hyps = []
        for src, tgt in val:
            stats += torch.stack([model(src, tgt), tgt.numel()])
            hyps.extend(model.translate(src))
        {reduce}
        bleu = corpus_bleu(hyps, refs)
        if dist.get_rank() == 0:
            print("loss", stats[0] / stats[1], "BLEU", bleu)
        """
    assert reported_lines(body) == reported


METRIC_LOGGER = """
class MetricLogger:
    def __init__(self):
        self.meters = {{}}

    def update(self, **values):
        for key, value in values.items():
            self.meters.setdefault(key, []).append(value)

    def synchronize_between_processes(self):
        for values in self.meters.values():
            dist.all_reduce(torch.tensor(values))

def evaluate(loader, model):
    metric_logger = MetricLogger()
    for images, target in loader:
        metric_logger.update(acc1=(model(images).argmax(-1) == target).float().mean().item())
    {sync}
    return {{k: sum(v) / len(v) for k, v in metric_logger.meters.items()}}

dist.init_process_group("nccl")
val_loader = DataLoader(data, sampler=DistributedSampler(data, shuffle=False))
stats = evaluate(val_loader, model)
print("acc@1", stats["acc1"])
"""


@pytest.mark.parametrize(
    "sync, reported",
    [
        # blind set ai's 13: DeiT / ConvNeXt's evaluate() without the logger's sync
        ("pass", [16]),
        ("metric_logger.synchronize_between_processes()", []),
    ],
)
def test_a_metric_logger_of_the_files_own_read_without_its_sync_is_reported(sync, reported):
    assert reported_lines(METRIC_LOGGER.format(sync=sync)) == reported


SUBSET_EVALUATION = """
from torch.utils.data import Subset

def accuracy(model, loader):
    correct = total = 0
    for x, y in loader:
        correct += (model(x).argmax(1) == y).sum().item()
        total += len(y)
    return correct / total

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
shard = Subset(val_set, range(rank, len(val_set), world))
loader = DataLoader(shard, batch_size=64)
acc = accuracy(model, loader)
if rank == 0:
    print(f"val acc {acc:.3f}")
"""


@pytest.mark.parametrize(
    ("change", "reported"),
    [
        # a loader over a dataset cut by rank is a share as a DistributedSampler's is
        ({}, [6]),
        ({"range(rank, len(val_set), world)": "list(range(len(val_set)))[rank::world]"}, [6]),
        # the same helper over the whole set, on rank 0: the whole
        ({"Subset(val_set, range(rank, len(val_set), world))": "val_set"}, []),
    ],
)
def test_an_evaluation_over_a_subset_cut_by_rank(change, reported):
    body = SUBSET_EVALUATION
    for old, new in change.items():
        body = body.replace(old, new)
    assert reported_lines(body) == reported


# blind set bg's correct 20: the error is all-reduced, the predictions returned beside
# it stay the rank's own, and the caller shows only the error
TUPLE_EVALUATION = """
def evaluate(model, loader):
    s = torch.zeros(2)
    preds = []
    for x, y in loader:
        p = model(x)
        s[0] += ((p - y) ** 2).sum()
        s[1] += len(y)
        preds.append(p)
    dist.all_reduce(s)
    return (s[0] / s[1]).sqrt().item(), torch.cat(preds)

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=64)
{unpack} = evaluate(model, loader)
if rank == 0:
    print(f"val rmse {shown}")
"""


@pytest.mark.parametrize(
    ("unpack", "shown", "reported"),
    [
        ("rmse, _", "rmse:.3f", []),
        ("rmse, preds", "rmse:.3f", []),
        ("rmse, preds", "preds.mean():.3f", [6]),
        ("result", "result[1].mean():.3f", [6]),
    ],
    ids=["reduced-element", "reduced-element-shown", "local-element-shown", "whole-tuple"],
)
def test_only_the_returned_element_a_caller_shows_counts(unpack, shown, reported):
    body = "from torch.utils.data import Subset\n" + TUPLE_EVALUATION.format(
        unpack=unpack, shown="{" + shown + "}"
    )
    assert reported_lines(body) == reported


def test_a_helper_run_over_a_share_and_reduced_then_over_everything_on_rank_zero_is_quiet():
    """Blind set a's 14 and s's 11: the shard's counts are all-reduced; the final
    test on rank 0 runs the same helper over the whole test set and shows it."""
    body = (
        SUBSET_EVALUATION.replace("    return correct / total", "    return correct, total")
        .replace(
            "acc = accuracy(model, loader)\n",
            "c, t = accuracy(model, loader)\nboth = torch.tensor([c, t])\ndist.all_reduce(both)\n",
        )
        .replace(
            '    print(f"val acc {acc:.3f}")',
            "    c, t = accuracy(model, DataLoader(val_set, batch_size=64))\n"
            '    print(f"val acc {both[0] / both[1]:.3f} test acc {c / t:.3f}")',
        )
    )
    assert reported_lines(body) == []


def test_a_loop_that_trains_through_a_method_of_the_files_class_is_no_evaluation():
    """Blind set q's 08: `loss = brain.fit_batch(batch)` runs backward in the file's
    Brain class; the loop over the rank's shards trains, it evaluates nothing."""
    body = """
    from torch.utils.data import Subset

    class Brain:
        def fit_batch(self, batch):
            loss = self.model(batch).mean()
            loss.backward()
            self.optimizer.step()
            return loss

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = DataLoader(Subset(train_set, range(rank, len(train_set), world)), batch_size=8)
    brain = Brain()
    run_loss, n = 0.0, 0
    for batch in loader:
        run_loss += brain.fit_batch(batch).item()
        n += 1
    if rank == 0:
        print(run_loss / n)
    """
    assert reported_lines(body) == []
    evaluating = body.replace("            loss.backward()\n", "")
    assert reported_lines(evaluating) == [15]


def test_a_loader_of_the_same_name_in_another_function_is_not_the_sharded_one():
    lines = reported_lines(
        """
        def evaluate(loader):
            hits = 0
            for x, y in loader:
                hits += (model(x) == y).sum().item()
            return hits

        def main():
            dist.init_process_group("nccl")
            loader = DataLoader(data, sampler=DistributedSampler(data))
            full = DataLoader(data)
            if dist.get_rank() == 0:
                print(evaluate(full))
        """
    )
    assert lines == []


# ---------------------------------------------------------------- Lightning's epoch-end metrics

EPISODE_EVALUATION = """
from torch.nn.parallel import DistributedDataParallel as DDP


def run_eval(agent, episodes, seed):
    returns = []
    for i in range(episodes):
        returns.append(play(agent, seed + i))
    return returns


def cosine_lr(optimizer, base, steps):
    return lambda step: base * (1 + math.cos(math.pi * step / steps)) / 2


dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
agent = DDP(Policy())
per_rank = cfg.eval_episodes // world
set_lr = cosine_lr(optimizer, cfg.lr, cfg.total_steps // world)
print(set_lr(0))
rets = run_eval(agent.module, per_rank, seed=1000 * rank)
eval_mean = sum(rets) / len(rets)
{combine}
if rank == 0:
    print(f"eval return {{eval_mean:.1f}}")
"""


@pytest.mark.slow
def test_rank_zero_prints_the_mean_of_its_own_episodes_and_the_twin_of_all(torchrun):
    wait_broken = torchrun.start(SCRIPTS / "episodes_evaluated_per_rank_shown_on_rank_zero.py")
    wait_fixed = torchrun.start(SCRIPTS / "correct_episodes_evaluated_per_rank_all_reduced.py")
    broken, fixed = wait_broken(), wait_fixed()
    assert broken.returncode == 0, broken.stderr[-2000:]
    assert broken.stdout.count("eval return 1.50") == 1  # rank 0's episodes 0..3
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert fixed.stdout.count("eval return 3.50") == 1  # every episode, 0..7


@pytest.mark.parametrize(
    "combine, reported",
    [
        # blind set bl's 17: the evaluation episodes dealt out by rank, rank 0's mean shown
        ("", [22]),
        # the ranks' returns combined first
        ("t = torch.tensor([eval_mean]); dist.all_reduce(t)\neval_mean = t.item() / world", []),
        ("gathered = [None] * world; dist.all_gather_object(gathered, rets)", []),
    ],
    ids=["rank-zero-share", "all-reduced", "gathered"],
)
def test_an_evaluation_of_a_share_of_the_episodes(combine, reported):
    # the schedule sized by a share is handed no model: it evaluates nothing
    assert reported_lines(EPISODE_EVALUATION.format(combine=combine)) == reported


LIGHTNING_MODULE = """
import lightning as L
import torch


class Model(L.LightningModule):
    def validation_step(self, batch, batch_idx):
        self.outputs.append(self(batch[0]))

    def on_validation_epoch_end(self):
        outputs = torch.cat(self.outputs)
        score = outputs.mean().item()
        self.log("val_score", score)
"""


def lightning_findings(source: str) -> list[int]:
    return [f.line for f in lint_source(source) if f.cause_id == "metrics-not-reduced"]


@pytest.mark.parametrize(
    "logged",
    [
        'self.log("val_score", score)',
        'self.log(name="val_score", value=score)',
        'self.log_dict({"val_score": score})',
        'self.log_dict(dictionary={"val_score": score})',
    ],
)
def test_a_lightning_epoch_metric_from_collected_outputs_is_reported(logged):
    source = LIGHTNING_MODULE.replace('self.log("val_score", score)', logged)
    assert lightning_findings(source) == [len(source.splitlines())]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # gathered from every rank first
        ("torch.cat(self.outputs)", "self.all_gather(torch.cat(self.outputs))"),
        # Lightning averages it over the ranks
        ('self.log("val_score", score)', 'self.log("val_score", score, sync_dist=True)'),
        # one process: every Trainer of the file runs on one device
        ("class Model", "trainer = L.Trainer(devices=1)\n\n\nclass Model"),
        # a torchmetrics object syncs at compute(): nothing collected in a list
        ("self.outputs.append(self(batch[0]))", "self.metric.update(self(batch[0]))"),
    ],
)
def test_a_gathered_synced_one_device_or_torchmetrics_epoch_metric_is_quiet(old, new):
    assert old in LIGHTNING_MODULE
    assert lightning_findings(LIGHTNING_MODULE.replace(old, new)) == []


@pytest.mark.parametrize(
    "summed",
    [
        "self.outputs += torch.bincount(self(batch[0]).argmax(1), minlength=4)",
        "self.outputs[batch[1]] += 1",
    ],
)
def test_a_lightning_epoch_metric_from_a_field_summed_in_place_is_reported(summed):
    # a confusion matrix or per-class counts summed in validation_step: one rank's share
    source = LIGHTNING_MODULE.replace("self.outputs.append(self(batch[0]))", summed)
    source = source.replace("torch.cat(self.outputs)", "self.outputs.float()")
    assert lightning_findings(source) == [len(source.splitlines())]
    synced = source.replace("self.outputs.float()", "self.all_gather(self.outputs).sum(0)")
    assert lightning_findings(synced) == []


# Blind set cl's 05: the loaders are a trainer's fields, built in __init__ and walked
# in another method.
TRAINER_FIELDS = """
class Trainer:
    def __init__(self, data):
        self.val_sampler = DistributedSampler(data, shuffle=False)
        self.val_loader = DataLoader(data, batch_size=8, sampler=self.val_sampler)

    def validate(self, model):
        total = 0.0
        for x, y in self.val_loader:
            total += (model(x) - y).abs().sum().item()
        COMBINE
        print(f"val {total:.3f}")
"""

# Blind set cp's 04: one loader per split, kept in a dict.
LOADER_DICT = """
def main(sets, model):
    samplers = {f: DistributedSampler(ds, shuffle=(f == "train")) for f, ds in sets.items()}
    loaders = {f: DataLoader(ds, batch_size=8, sampler=samplers[f]) for f, ds in sets.items()}
    errors = []
    for x, y in loaders["test"]:
        errors.append((model(x) - y).abs().mean().item())
    COMBINE
    print(sum(errors) / len(errors))
"""


@pytest.mark.parametrize(
    "body, combine, reported",
    [
        (TRAINER_FIELDS, "pass", True),
        (TRAINER_FIELDS, "dist.barrier()", True),
        (
            TRAINER_FIELDS,
            "t = torch.tensor([total])\n        dist.all_reduce(t)\n        total = t.item()",
            False,
        ),
        (LOADER_DICT, "pass", True),
        (
            LOADER_DICT,
            (
                "parts = [None] * dist.get_world_size()\n    dist.all_gather_object(parts, errors)\n"
                "    errors = sum(parts, [])"
            ),
            False,
        ),
    ],
    ids=["fields", "fields-barrier", "fields-reduced", "dict", "dict-gathered"],
)
def test_a_sharded_loader_kept_as_a_field_or_in_a_dict_is_sharded(body, combine, reported):
    found = reported_lines("dist.init_process_group('nccl')\n" + body.replace("COMBINE", combine))
    assert bool(found) == reported, found


def test_a_methods_unreduced_result_shown_by_another_method_of_its_class():
    # blind set cl's 05: Trainer.evaluate returns its shard's averages, fit() logs them
    body = TRAINER_FIELDS.replace("COMBINE", "pass").replace(
        '        print(f"val {total:.3f}")', "        return {'mae': total}"
    ) + (
        "\n    def fit(self, model):\n"
        "        metrics = self.validate(model)\n"
        "        print(metrics['mae'])\n"
    )
    assert reported_lines("dist.init_process_group('nccl')\n" + body)


def test_totals_handed_to_a_file_function_that_gathers_them_are_combined():
    # blind set cu's 17: `collect()` all_gathers the scores predict_shard returns
    body = (
        "dist.init_process_group('nccl')\n"
        "def collect(scores, world):\n"
        "    parts = [torch.zeros_like(scores) for _ in range(world)]\n"
        "    dist.all_gather(parts, scores)\n"
        "    return torch.cat(parts)\n"
        "def predict(net, data):\n"
        "    loader = DataLoader(data, sampler=DistributedSampler(data, shuffle=False))\n"
        "    scores = []\n"
        "    for x, _ in loader:\n"
        "        scores.append(net(x))\n"
        "    scores = torch.cat(scores)\n"
        "    COMBINE\n"
        "    print(scores.mean())\n"
    )
    assert reported_lines(body.replace("COMBINE", "scores = collect(scores, 4)")) == []
    assert reported_lines(body.replace("COMBINE", "scores = scores.float()"))


# mmcv's collect_results_cpu: each rank dumps its part into a shared folder, a barrier,
# then one rank reads every rank's file back (blind set hm's 17, correct).
COLLECT_THROUGH_FILES = """
def collect(part, tmpdir, rank, world):
    with open(os.path.join(tmpdir, f"part_{rank}.json"), "w") as f:
        json.dump(part, f)
    dist.barrier()
    if rank != 0:
        return None
    merged = []
    for r in range(READ_RANKS):
        with open(os.path.join(tmpdir, f"part_{READ}.json")) as f:
            merged.extend(json.load(f))
    return merged


def evaluate(net, data, tmpdir, rank, world):
    loader = DataLoader(data, sampler=DistributedSampler(data, shuffle=False))
    part = []
    for x, idx in loader:
        part.append(net(x).argmax(-1).tolist())
    results = collect(part, tmpdir, rank, world)
    if rank == 0:
        print("accuracy", score(results))
"""


@pytest.mark.parametrize(
    ("read_ranks", "read", "reported"),
    [
        ("world", "r", []),
        ("world_size", "r", []),
        ("world", "rank", [19]),  # rank 0 reads its own file, once per rank
        ("4", "r", [19]),  # a loop over four files is no loop over the ranks
    ],
    ids=["every rank's file", "world_size", "its own file", "a fixed count"],
)
def test_a_part_per_rank_read_back_by_one_rank_is_combined(read_ranks, read, reported):
    body = "dist.init_process_group('nccl')\n" + COLLECT_THROUGH_FILES.replace(
        "READ_RANKS", read_ranks
    ).replace("READ", read)
    assert reported_lines(body) == reported


# One loader per task kept in a container entry by entry, each given a
# DistributedSampler, and a loop over one entry picked by a variable (blind set
# bz's 04): the entries are shares like any sharded loader.
LOADERS_PER_TASK = """
def evaluate(model, loaders):
    acc = {}
    for task in TASKS:
        correct, total = 0, 0
        for x, y in loaders[task]:
            correct += (model(x).argmax(1) == y).sum().item()
            total += y.numel()
        acc[task] = correct / max(total, 1)
    return acc


def main():
    dist.init_process_group("nccl")
    val_loaders = {}
    for task in TASKS:
        data = TaskSet(task)
        val_loaders[task] = DataLoader(data, sampler=DistributedSampler(data, shuffle=False))
    acc = evaluate(model, val_loaders)
    {shown}
"""


def test_a_container_of_sharded_loaders_filled_entry_by_entry_is_a_share():
    shown = 'if dist.get_rank() == 0:\n        print("val", acc)'
    assert reported_lines(LOADERS_PER_TASK.replace("{shown}", shown)) == [6]
    reduced = (
        "for task in acc:\n"
        "        value = torch.tensor(acc[task])\n"
        "        dist.all_reduce(value)\n"
        "        acc[task] = value.item() / dist.get_world_size()\n"
        '    if dist.get_rank() == 0:\n        print("val", acc)'
    )
    assert reported_lines(LOADERS_PER_TASK.replace("{shown}", reduced)) == []


# An evaluation helper that stops at a cap it is given (`if i >= max_batches:
# break`), called once over the shard with its totals all-reduced and once with
# a cap for a quick look at a converted model on rank 0 (blind set dq's 02).
CAPPED_EVALUATION = """
def evaluate(model, loader, max_batches=None):
    correct, seen = 0, 0
    for i, (x, y) in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        correct += (model(x).argmax(1) == y).sum().item()
        seen += y.numel()
    return correct, seen


def main():
    dist.init_process_group("nccl")
    loader = DataLoader(data, sampler=DistributedSampler(data, shuffle=False))
    counts = torch.tensor(evaluate(model, loader))
    dist.all_reduce(counts)
    if dist.get_rank() == 0:
        print("top1", (counts[0] / counts[1]).item())
        c8, n8 = evaluate(int8_model, loader, {cap})
        print("int8 top1 on the first batches", c8 / n8)
"""


def test_a_capped_look_at_the_first_batches_is_a_sample_by_design():
    assert reported_lines(CAPPED_EVALUATION.replace("{cap}", "args.int8_batches")) == []
    assert reported_lines(CAPPED_EVALUATION.replace("{cap}", "None")) == [4]


# Sums all-reduced, and a few (reference, hypothesis) pairs kept while the list
# is short, to show (blind set dr's 18): the examples are no total.
EXAMPLES_TO_SHOW = """
def evaluate(model, loader):
    sums = torch.zeros(2)
    examples = []
    for x, refs in loader:
        hyps = model(x)
        sums[0] += errors(refs, hyps)
        sums[1] += len(refs)
        for ref, hyp in zip(refs, hyps):
            KEPT
    dist.all_reduce(sums)
    return sums[0] / sums[1], examples


def main():
    dist.init_process_group("nccl")
    loader = DataLoader(data, sampler=DistributedSampler(data, shuffle=False))
    wer, examples = evaluate(model, loader)
    if dist.get_rank() == 0:
        print(wer, examples)
"""


@pytest.mark.parametrize(
    "kept, reported",
    [
        ("if len(examples) < 5:\n                examples.append((ref, hyp))", []),
        ("examples.append((ref, hyp))", [5]),  # every pair of the share: its own part
    ],
)
def test_a_few_examples_kept_to_show_are_no_total(kept, reported):
    assert reported_lines(EXAMPLES_TO_SHOW.replace("KEPT", kept)) == reported


# Each rank writes its share's predictions to a file of its own, merged after a
# barrier (VideoMAE's multi-view test: blind set ek's 08).
PER_RANK_FILES = """
def final_test(model, loader, path):
    lines = []
    for x, ids in loader:
        lines.append(f"{ids} {model(x).argmax(1)}")
    with open(path, "w") as f:
        f.write("\\\\n".join(lines))


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    loader = DataLoader(data, sampler=DistributedSampler(data, shuffle=False))
    final_test(model, loader, PATH)
"""


@pytest.mark.parametrize(
    "path, reported",
    [
        ('os.path.join(out_dir, f"{rank}.txt")', []),  # a part per rank, merged later
        ('os.path.join(out_dir, "test.txt")', [4]),  # one file: the last rank's share wins
    ],
)
def test_a_share_written_to_a_file_of_its_rank_is_a_part_to_merge(path, reported):
    assert reported_lines(PER_RANK_FILES.replace("PATH", path)) == reported


TOKEN_BUCKETS = """
class TokenBuckets:
    def __init__(self, lengths, max_tokens, PARAMETERS):
        self.lengths = lengths


dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
dev = DataLoader(data, batch_sampler=TokenBuckets(lengths, 4096, ARGUMENTS))
correct = 0
for x, y in dev:
    correct += (model(x).argmax(-1) == y).sum().item()
print("dev acc", correct / len(data))
"""


@pytest.mark.parametrize(
    ("parameters", "arguments", "reported"),
    [
        # blind set ft's 09: the file's own bucketing sampler deals each rank its batches
        ("num_replicas, rank", "world, rank", [11]),
        # a sampler of the file that takes no rank: every rank reads the whole set
        ("shuffle=False", "shuffle=False", []),
    ],
    ids=["rank-dealing", "whole"],
)
def test_an_evaluation_over_the_files_own_rank_dealing_sampler(parameters, arguments, reported):
    body = TOKEN_BUCKETS.replace("PARAMETERS", parameters).replace("ARGUMENTS", arguments)
    assert reported_lines(body) == reported


# Blind set hm's 01: each rank's results go to a file and a COCO-style evaluator
# reads them back from its path, then the AP of the rank's own share is returned.
SHARE_OF_THE_ITEMS = """
def evaluate(model, api, rank, world):
    loader = DataLoader(api.images, sampler=DistributedSampler(api.images, shuffle=False))
    results = []
    for x in loader:
        results.extend(predict(model, x))
    if not results:
        return 0.0
    WRITE
    COMBINE
    return score(detections)


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    ap = evaluate(model, api, rank, world)
    if rank == 0:
        print("AP", ap)
"""


@pytest.mark.parametrize(
    ("write", "combine", "reported"),
    [
        ("detections = api.loadRes(results)", "pass", [5]),
        (
            "with open(res_file, 'w') as f:\n        json.dump(results, f)",
            "detections = api.loadRes(res_file)",
            [5],
        ),
        ("torch.save(results, res_file)", "detections = torch.load(res_file)", [5]),
        # numpy writes to the path it is given first
        ("numpy.save(res_file, results)", "detections = numpy.load(res_file)", [5]),
        (
            "merged = [None] * world\n    dist.all_gather_object(merged, results)",
            "detections = api.loadRes(sum(merged, []))",
            [],
        ),
    ],
    ids=[
        "read in place",
        "through a json file",
        "through torch.save",
        "through numpy.save",
        "gathered first",
    ],
)
def test_results_read_back_from_the_file_they_were_written_to(write, combine, reported):
    body = SHARE_OF_THE_ITEMS.replace("WRITE", write).replace("COMBINE", combine)
    assert reported_lines(body) == reported


def test_the_finding_names_where_the_figure_is_shown_not_the_guard_for_nothing():
    body = SHARE_OF_THE_ITEMS.replace("WRITE", "detections = results").replace("COMBINE", "")
    [(_, finding)] = lint_snippet(HEADER, body, ["metrics-not-reduced"])
    source = (HEADER + body).splitlines()
    shown = next(n for n, line in enumerate(source, 1) if 'print("AP", ap)' in line)
    assert f"line {shown} shows" in finding.message, finding.message  # not `if not results:`


# Blind set hq's 06: each document's matches counted in a scratch value reset on every
# pass, then added to counts that are all-reduced after the loop.
SCRATCH_COUNT = """
dist.init_process_group("nccl")
def evaluate(model, data):
    loader = DataLoader(data, sampler=DistributedSampler(data, shuffle=False))
    counts = torch.zeros(2)
    for x, fields in loader:
        tp = 0
        for f in model(x):
            if f in fields:
                tp += 1
        counts += torch.tensor([tp, len(fields)])
    REDUCE
    tp, n = counts.tolist()
    print("F1", tp / n)
"""


@pytest.mark.parametrize(
    ("reduce", "reported"), [("dist.all_reduce(counts)", []), ("pass", [6])], ids=["reduced", "not"]
)
def test_a_scratch_count_reset_on_every_pass_is_no_total(reduce, reported):
    assert reported_lines(SCRATCH_COUNT.replace("REDUCE", reduce)) == reported


TRIAL = """
@torch.no_grad()
def validate(model, loader):
    correct, seen = 0, 0
    for x, y in loader:
        correct += (model(x).argmax(-1) == y).sum().item()
        seen += y.numel()
    return correct / seen


def objective(trial, model, val_set):
    dist.init_process_group("gloo")
    va = DataLoader(val_set, 256, sampler=DistributedSampler(val_set, shuffle=False))
    for epoch in range(10):
        acc = COMBINED
        if dist.get_rank() == 0:
            trial.report(acc, epoch)
"""


@pytest.mark.parametrize(
    "combined, reported",
    [
        # blind set hv's 04: a sweep's trial ranked and pruned on rank 0's own share
        ("validate(model, va)", [5]),
        ("reduce_mean(validate(model, va))", []),
    ],
    ids=["own share", "combined"],
)
def test_a_hyperparameter_trial_reported_this_ranks_share(combined, reported):
    body = TRIAL.replace("COMBINED", combined)
    assert reported_lines(body) == reported


# Blind sets ih's 05, ii's 03 and if's 13: an evaluation over a list cut into this
# rank's strided share by hand (trials, games, scenario files), never combined.
STRIDED_SHARE = """
@torch.no_grad()
def validate(model, trials, rank, world):
    model.eval()
    mine = trials[rank::world]
    EVALUATE
    COMBINE
    return float(np.mean(scores))


def main(model, trials):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    eer = validate(model, trials, rank, world)
    if rank == 0:
        print("EER", eer)
"""
LOOP = """scores = []
    for enroll, test in mine:
        scores.append(float(model(enroll) @ model(test)))"""
COMPREHENSION = "scores = np.stack([simulate(model, item) for item in mine])"
GATHER = """parts = [None] * world
    dist.all_gather_object(parts, scores)
    scores = [s for part in parts for s in part]"""


@pytest.mark.parametrize(
    ("evaluate", "combine", "reported"),
    [
        (LOOP, "", [7]),
        (COMPREHENSION, "", [6]),
        (LOOP, GATHER, []),
        (COMPREHENSION, GATHER, []),
    ],
    ids=["loop", "comprehension", "loop gathered", "comprehension gathered"],
)
def test_an_evaluation_over_a_strided_share_of_a_list(evaluate, combine, reported):
    body = STRIDED_SHARE.replace("EVALUATE", evaluate).replace("COMBINE", combine)
    assert reported_lines(body) == reported


@pytest.mark.parametrize(
    ("walked", "reported"),
    [("trials[rank::world]", [6]), ("trials", [])],
    ids=["this rank's share in place", "every trial"],
)
def test_an_evaluation_walking_a_strided_share_in_place(walked, reported):
    # blind set jm's 08: `for prob in self.problems[self.rank :: self.world]:` in an
    # evaluation, its pass@k averaged and shown by the caller
    loop = LOOP.replace("for enroll, test in mine:", f"for enroll, test in {walked}:")
    body = STRIDED_SHARE.replace("    mine = trials[rank::world]\n", "")
    body = body.replace("EVALUATE", loop).replace("COMBINE", "")
    assert f"in {walked}:" in body and "mine" not in body
    assert reported_lines(body) == reported


def test_a_strided_share_handed_to_an_evaluation_function_is_its_share():
    body = """
@torch.no_grad()
def evaluate(model, games):
    model.eval()
    maps = []
    for game in games:
        maps.append(score_game(model, game))
    return sum(maps) / len(maps)


def main(model, splits):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    val_games = sorted(splits["val"])[rank::world]
    best = 0.0
    for epoch in range(10):
        m = evaluate(model, val_games)
        if rank == 0 and m > best:
            best = m
"""
    assert reported_lines(body) == [6]


def test_a_strided_share_of_work_outside_an_evaluation_is_no_metric():
    # Batches formed from this rank's share of the indices (a sampler's own
    # bookkeeping, no model in eval mode) and a count logged: not an evaluation.
    body = """
def batches_of(indices, budget, rank, world):
    shard = indices[rank::world]
    batches, cur = [], []
    for i in shard:
        cur.append(i)
        if len(cur) >= budget:
            batches.append(cur)
            cur = []
    print("batches", len(batches))
    return batches


def main(data):
    dist.init_process_group("nccl")
    return batches_of(list(range(len(data))), 64, dist.get_rank(), dist.get_world_size())
"""
    assert reported_lines(body) == []


def test_a_countdown_set_anew_for_each_item_is_no_total():
    # blind set fd's 19: samples drawn per task until `remaining` reaches 0, the
    # completions gathered from every rank before pass@k is computed.
    body = """
def main(model, problems, n_samples):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    task_ids = list(range(len(problems)))[rank::world]
    local = []
    for pi in task_ids:
        remaining = n_samples
        while remaining > 0:
            n = min(8, remaining)
            local.extend(model.generate(problems[pi], n))
            remaining -= n
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    if rank == 0:
        n = len(gathered)
        print("pass@1", score(gathered, n))
"""
    assert reported_lines(body) == []


@pytest.mark.parametrize(
    ("name", "reported"),
    [("evaluate_fid", [5]), ("generate_images", [])],
    ids=["an evaluation by its name", "no evaluation"],
)
def test_a_share_read_batch_by_batch_through_its_positions(name, reported):
    # blind set ir's 05 (also hg's 19): images generated for this rank's prompts,
    # a batch at a time, and the FID of its features logged on rank 0
    body = f"""
def {name}(pipe, inception, prompts, rank, world):
    mine = prompts[rank::world]
    feats = []
    for i in range(0, len(mine), 8):
        feats.append(inception(pipe(mine[i : i + 8]).images))
    return frechet_distance(torch.cat(feats))


def main(pipe, inception, prompts):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    fid = {name}(pipe, inception, prompts, rank, world)
    if rank == 0:
        print("FID", fid)
"""
    assert reported_lines(body) == reported


@pytest.mark.parametrize(
    ("helper", "reported"),
    [
        ("dist.all_gather(bufs, t)", []),
        ("bufs = [t]", [6]),  # the helper combines nothing: each rank shows its own share
    ],
    ids=["gathers", "gathers nothing"],
)
def test_predictions_combined_by_a_helper_that_calls_the_gathering_one(helper, reported):
    # blind set jb's 07: out-of-fold predictions joined by a helper of the file that calls
    # another helper of the file, which runs the all_gather
    body = f"""
@torch.no_grad()
def predict(model, loader):
    model.eval()
    ids, probs = [], []
    for i, x in loader:
        probs.append(torch.sigmoid(model(x)))
        ids.append(i)
    return torch.cat(ids), torch.cat(probs)


def all_gather_cat(t):
    bufs = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    {helper}
    return torch.cat(bufs)


def oof_from_shards(ids, probs, n):
    out = np.zeros(n)
    out[all_gather_cat(ids).numpy()] = all_gather_cat(probs).numpy()
    return out


def main(model, va_ds, y):
    dist.init_process_group("nccl")
    loader = DataLoader(va_ds, sampler=DistributedSampler(va_ds, shuffle=False))
    ids, probs = predict(model, loader)
    val = oof_from_shards(ids, probs, len(va_ds))
    print("auc", roc_auc_score(y, val))
"""
    assert reported_lines(body) == reported


@pytest.mark.parametrize(
    ("sampler", "reported"),
    [("sampler=DistributedSampler(ds, shuffle=False)", [5]), ("shuffle=False", [])],
    ids=["a share per rank", "the whole task on every rank"],
)
def test_an_evaluation_over_a_loader_kept_in_a_list_of_loaders(sampler, reported):
    # blind set jf's 19 (also ed's 16): one test loader per task appended to a list, each
    # evaluated by a helper whose counts fill an accuracy matrix shown on rank 0
    body = f"""
@torch.no_grad()
def eval_task(net, loader):
    correct = total = 0
    for x, y in loader:
        correct += (net(x).argmax(1) == y).sum().item()
        total += y.numel()
    return 100.0 * correct / total


def main(net, tasks, acc):
    dist.init_process_group("nccl")
    test_loaders = []
    for ds in tasks:
        test_loaders.append(DataLoader(ds, batch_size=128, {sampler}))
    for t in range(len(tasks)):
        for j in range(t + 1):
            acc[t, j] = eval_task(net, test_loaders[j])
        if dist.get_rank() == 0:
            print("average accuracy", acc[t, : t + 1].mean())
"""
    assert reported_lines(body) == reported
