"""Optuna + DDP: rank 0 drives the study, every trial is trained data-parallel
on all GPUs.  Rank 0 asks for a trial and broadcasts its parameters; the other
ranks only train.  Median pruning is decided on rank 0 and broadcast, so all
ranks leave a pruned trial at the same epoch.

    torchrun --nproc_per_node=4 optuna_ddp.py --n-trials 60 --out runs/cifar10_optuna
"""
import argparse
import json
import logging
import os

import optuna
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("optuna-ddp")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--out", default="runs/cifar10_optuna")
    ap.add_argument("--n-trials", type=int, default=60)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--per-gpu-batch", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


class Net(nn.Module):
    """VGG-ish net with an optional auxiliary classifier on the mid features."""

    def __init__(self, width, dropout, aux):
        super().__init__()
        w = width

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

        self.stage1 = nn.Sequential(block(3, w), block(w, w), nn.MaxPool2d(2))
        self.stage2 = nn.Sequential(block(w, 2 * w), block(2 * w, 2 * w), nn.MaxPool2d(2))
        self.stage3 = nn.Sequential(block(2 * w, 4 * w), block(4 * w, 4 * w),
                                    nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(4 * w, 10))
        self.aux_head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                      nn.Linear(2 * w, 10)) if aux else None

    def forward(self, x):
        h2 = self.stage2(self.stage1(x))
        logits = self.head(self.stage3(h2))
        if self.aux_head is not None and self.training:
            return logits, self.aux_head(h2)
        return logits, None


def data(args, rank, world):
    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261))
    train_tf = T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    test_tf = T.Compose([T.ToTensor(), norm])
    train_full = torchvision.datasets.CIFAR10(args.data, train=True, transform=train_tf)
    val_full = torchvision.datasets.CIFAR10(args.data, train=True, transform=test_tf)
    idx = torch.randperm(50000, generator=torch.Generator().manual_seed(args.seed)).tolist()
    train_ds, val_ds = Subset(train_full, idx[5000:]), Subset(val_full, idx[:5000])
    # strided, unpadded shard of the validation set; counts are summed below
    val_shard = Subset(val_ds, list(range(rank, len(val_ds), world)))
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.per_gpu_batch, sampler=sampler,
                              num_workers=6, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_shard, batch_size=500, num_workers=4, pin_memory=True)
    return train_loader, val_loader, sampler


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits, _ = net(x)
        counts[0] += (logits.argmax(1) == y).sum()
        counts[1] += y.numel()
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def train_trial(params, args, rank, device, loaders, study, trial):
    train_loader, val_loader, sampler = loaders
    torch.manual_seed(args.seed)
    net = Net(params["width"], params["dropout"], params["aux_weight"] > 0)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[device.index])
    opt = torch.optim.SGD(model.parameters(), lr=params["lr"], momentum=0.9, nesterov=True,
                          weight_decay=params["weight_decay"])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader))

    acc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits, aux = model(x)
            loss = F.cross_entropy(logits, y)
            if aux is not None:
                loss = loss + params["aux_weight"] * F.cross_entropy(aux, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()

        # evaluate the bare module: shards are unequal and eval needs no DDP sync
        acc = validate(model.module, val_loader, device)

        stop = torch.zeros(1, device=device)
        if rank == 0:
            trial.report(acc, epoch)
            logger.info("trial %d epoch %d acc %.4f", trial.number, epoch, acc)
            if trial.should_prune():
                stop.fill_(1.0)
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            return acc, True, model
    return acc, False, model


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(asctime)s %(message)s")

    if rank == 0:
        torchvision.datasets.CIFAR10(args.data, train=True, download=True)
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    loaders = data(args, rank, world)

    study = None
    if rank == 0:
        study = optuna.create_study(
            direction="maximize",
            sampler=optuna.samplers.TPESampler(seed=args.seed),
            pruner=optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=3))

    best_acc = -1.0
    for i in range(args.n_trials):
        payload = [None]
        trial = None
        if rank == 0:
            trial = study.ask()
            payload[0] = {
                "lr": trial.suggest_float("lr", 5e-3, 0.4, log=True),
                "weight_decay": trial.suggest_float("weight_decay", 1e-5, 1e-3, log=True),
                "width": trial.suggest_categorical("width", [32, 64, 96]),
                "dropout": trial.suggest_float("dropout", 0.0, 0.5),
                "aux_weight": trial.suggest_categorical("aux_weight", [0.0, 0.2, 0.4]),
            }
        dist.broadcast_object_list(payload, src=0)
        params = payload[0]

        acc, pruned, model = train_trial(params, args, rank, device, loaders, study, trial)

        if rank == 0:
            if pruned:
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            else:
                study.tell(trial, acc)
                if acc > best_acc:
                    best_acc = acc
                    torch.save({"model": model.module.state_dict(), "params": params,
                                "acc": acc}, os.path.join(args.out, "best_model.pt"))
            logger.info("trial %d done: acc %.4f pruned=%s params=%s", i, acc, pruned, params)
        del model
        torch.cuda.empty_cache()

    if rank == 0:
        trials = [{"number": t.number, "value": t.value, "state": t.state.name,
                   "params": t.params} for t in study.trials]
        with open(os.path.join(args.out, "trials.json"), "w") as f:
            json.dump(trials, f, indent=2)
        logger.info("best: %s (%.4f)", study.best_params, study.best_value)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
