"""Optuna search for a CNN on Fashion-MNIST; every trial is trained with DDP on
all GPUs of the node.  The study lives in an SQLite file so that it can be
inspected (optuna-dashboard) and resumed after the job is preempted.

    torchrun --nproc_per_node=4 optuna_ddp.py --storage sqlite:///runs/fmnist.db --n-trials 40
"""
import argparse
import logging
import os

import optuna
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

log = logging.getLogger(__name__)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="./data")
    ap.add_argument("--storage", default="sqlite:///runs/fmnist_optuna.db")
    ap.add_argument("--study-name", default="fmnist-cnn")
    ap.add_argument("--n-trials", type=int, default=40)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/fmnist")
    return ap.parse_args()


class ConvNet(nn.Module):
    def __init__(self, n_blocks, base_width, fc_width, dropout):
        super().__init__()
        blocks, c_in = [], 1
        for i in range(n_blocks):
            c_out = base_width * (2 ** i)
            blocks += [
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True),
                nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2) if i < 2 else nn.Identity(),
            ]
            c_in = c_out
        self.features = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout), nn.Linear(c_in, fc_width),
            nn.ReLU(inplace=True), nn.Linear(fc_width, 10))

    def forward(self, x):
        return self.classifier(self.pool(self.features(x)))


def suggest(trial):
    return {
        "lr": trial.suggest_float("lr", 1e-4, 3e-2, log=True),
        "weight_decay": trial.suggest_float("weight_decay", 1e-6, 1e-2, log=True),
        "n_blocks": trial.suggest_int("n_blocks", 2, 4),
        "base_width": trial.suggest_categorical("base_width", [16, 32, 64]),
        "fc_width": trial.suggest_categorical("fc_width", [128, 256, 512]),
        "dropout": trial.suggest_float("dropout", 0.0, 0.5),
        "label_smoothing": trial.suggest_float("label_smoothing", 0.0, 0.2),
    }


def make_loaders(args, rank, world):
    tf_train = transforms.Compose([
        transforms.RandomCrop(28, padding=2),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize((0.2860,), (0.3530,)),
    ])
    tf_eval = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.2860,), (0.3530,))])
    train = datasets.FashionMNIST(args.data_root, train=True, transform=tf_train)
    val = datasets.FashionMNIST(args.data_root, train=False, transform=tf_eval)
    per_gpu = args.global_batch // world
    train_sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True,
                                       seed=args.seed)
    val_sampler = DistributedSampler(val, num_replicas=world, rank=rank, shuffle=False)
    train_loader = DataLoader(train, batch_size=per_gpu, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val, batch_size=1024, sampler=val_sampler, num_workers=4,
                            pin_memory=True)
    return train_loader, val_loader, train_sampler


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        stats[0] += (model(x).argmax(1) == y).sum()
        stats[1] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def run_trial(trial, args, rank, world, device, loaders):
    train_loader, val_loader, train_sampler = loaders
    params = suggest(trial)

    torch.manual_seed(args.seed + trial.number)
    model = ConvNet(params["n_blocks"], params["base_width"], params["fc_width"],
                    params["dropout"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[device.index])

    opt = torch.optim.AdamW(model.parameters(), lr=params["lr"],
                            weight_decay=params["weight_decay"])
    total_steps = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=params["lr"], total_steps=total_steps,
                                                pct_start=0.15)

    acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=params["label_smoothing"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        acc = evaluate(model, val_loader, device)
        if rank == 0:
            log.info("trial %d epoch %d acc %.4f", trial.number, epoch, acc)
    return acc, model


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        datasets.FashionMNIST(args.data_root, train=True, download=True)
        datasets.FashionMNIST(args.data_root, train=False, download=True)
        optuna.create_study(study_name=args.study_name, storage=args.storage,
                            direction="maximize", load_if_exists=True,
                            sampler=optuna.samplers.TPESampler(seed=args.seed))
    dist.barrier()
    study = optuna.load_study(study_name=args.study_name, storage=args.storage,
                              sampler=optuna.samplers.TPESampler(seed=args.seed))

    loaders = make_loaders(args, rank, world)
    best_acc = -1.0
    for _ in range(args.n_trials):
        trial = study.ask()
        acc, model = run_trial(trial, args, rank, world, device, loaders)
        if rank == 0:
            study.tell(trial, acc)
            if acc > best_acc:
                best_acc = acc
                torch.save({"model": model.module.state_dict(), "params": trial.params,
                            "acc": acc}, os.path.join(args.out, "best.pt"))
        dist.barrier()
        del model
        torch.cuda.empty_cache()

    if rank == 0:
        best = study.best_trial
        log.info("best trial #%d acc=%.4f params=%s", best.number, best.value, best.params)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
