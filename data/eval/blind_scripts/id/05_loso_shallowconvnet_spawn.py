"""Leave-one-subject-out evaluation of ShallowFBCSPNet on High-Gamma Dataset.

Every fold (one held-out subject) is an independent training run, so the 14
folds are distributed over the local GPUs with torch.multiprocessing: process
k trains folds k, k + n_gpus, ...  A gloo process group is only used at the end
to collect the per-fold results on rank 0.

    python 05_loso_shallowconvnet_spawn.py --data /data/hgd/preprocessed --gpus 4
"""
import argparse
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


@dataclass
class Config:
    data: str = "/data/hgd/preprocessed"
    out: str = "results/loso_shallow"
    subjects: list = field(default_factory=lambda: list(range(1, 15)))
    gpus: int = 4
    epochs: int = 80
    batch_size: int = 64
    lr: float = 6.25e-4
    weight_decay: float = 0.0
    n_filters: int = 40
    port: int = 29533
    seed: int = 20190101


class ShallowFBCSPNet(nn.Module):
    def __init__(self, n_chans, n_classes, n_times, n_filters=40, drop=0.5):
        super().__init__()
        self.temporal = nn.Conv2d(1, n_filters, (1, 25))
        self.spatial = nn.Conv2d(n_filters, n_filters, (n_chans, 1), bias=False)
        self.bn = nn.BatchNorm2d(n_filters, momentum=0.1)
        self.pool = nn.AvgPool2d((1, 75), stride=(1, 15))
        self.drop = nn.Dropout(drop)
        with torch.no_grad():
            n_out = self._features(torch.zeros(1, 1, n_chans, n_times)).shape[1]
        self.classifier = nn.Linear(n_out, n_classes)

    def _features(self, x):
        x = self.bn(self.spatial(self.temporal(x)))
        x = torch.log(torch.clamp(self.pool(x * x), min=1e-6))
        return self.drop(x).flatten(1)

    def forward(self, x):
        return self.classifier(self._features(x.unsqueeze(1)))


def load_subject(root, sub):
    d = np.load(Path(root) / f"subject_{sub:02d}.npz")
    return d["X"].astype(np.float32), d["y"].astype(np.int64)


def exponential_standardize(X, factor=1e-3, eps=1e-4):
    """Exponential moving standardisation along time (Schirrmeister et al. 2017)."""
    out = np.empty_like(X)
    for i, trial in enumerate(X):
        mean = trial[:, 0].copy()
        var = np.ones_like(mean)
        for t in range(trial.shape[1]):
            mean = factor * trial[:, t] + (1 - factor) * mean
            var = factor * (trial[:, t] - mean) ** 2 + (1 - factor) * var
            out[i, :, t] = (trial[:, t] - mean) / np.maximum(np.sqrt(var), eps)
    return out


def train_fold(cfg, test_sub, device, log):
    torch.manual_seed(cfg.seed + test_sub)
    np.random.seed(cfg.seed + test_sub)
    train_subs = [s for s in cfg.subjects if s != test_sub]
    Xtr, ytr = zip(*[load_subject(cfg.data, s) for s in train_subs])
    Xtr, ytr = exponential_standardize(np.concatenate(Xtr)), np.concatenate(ytr)
    Xte, yte = load_subject(cfg.data, test_sub)
    Xte = exponential_standardize(Xte)

    train_dl = DataLoader(TensorDataset(torch.from_numpy(Xtr), torch.from_numpy(ytr)),
                          batch_size=cfg.batch_size, shuffle=True, drop_last=True, num_workers=2)
    test_dl = DataLoader(TensorDataset(torch.from_numpy(Xte), torch.from_numpy(yte)),
                         batch_size=256, shuffle=False)

    n_classes = int(ytr.max()) + 1
    model = ShallowFBCSPNet(Xtr.shape[1], n_classes, Xtr.shape[2], cfg.n_filters).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs * len(train_dl))

    for epoch in range(cfg.epochs):
        model.train()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        if epoch % 20 == 0:
            log(f"sub {test_sub:02d} epoch {epoch} loss {loss.item():.4f}")

    model.eval()
    correct, n = 0, 0
    with torch.no_grad():
        for x, y in test_dl:
            pred = model(x.to(device)).argmax(1).cpu()
            correct += (pred == y).sum().item()
            n += len(y)
    ckpt_dir = Path(cfg.out) / "models"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), ckpt_dir / f"loso_sub{test_sub:02d}.pt")
    return correct / n


def run_worker(rank, world_size, cfg):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(cfg.port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)

    def log(msg):
        print(f"[gpu{rank}] {time.strftime('%H:%M:%S')} {msg}", flush=True)

    my_folds = cfg.subjects[rank::world_size]
    log(f"folds {my_folds}")
    results = {}
    for sub in my_folds:
        t0 = time.time()
        results[sub] = train_fold(cfg, sub, device, log)
        log(f"sub {sub:02d} test acc {results[sub]:.4f} ({(time.time() - t0) / 60:.1f} min)")

    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        merged = {k: v for part in gathered for k, v in part.items()}
        accs = [merged[s] for s in sorted(merged)]
        summary = {"per_subject": {str(s): merged[s] for s in sorted(merged)},
                   "mean": float(np.mean(accs)), "std": float(np.std(accs))}
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        with open(Path(cfg.out) / "loso_summary.json", "w") as f:
            json.dump(summary, f, indent=2)
        log(f"LOSO mean acc {summary['mean']:.4f} +- {summary['std']:.4f}")
    dist.destroy_process_group()


def parse_config():
    cfg = Config()
    p = argparse.ArgumentParser()
    for f in dataclasses.fields(Config):
        if f.name == "subjects":
            p.add_argument("--subjects", type=int, nargs="+", default=cfg.subjects)
        else:
            p.add_argument(f"--{f.name}", type=type(getattr(cfg, f.name)), default=getattr(cfg, f.name))
    return Config(**vars(p.parse_args()))


if __name__ == "__main__":
    cfg = parse_config()
    world_size = min(cfg.gpus, torch.cuda.device_count(), len(cfg.subjects))
    mp.spawn(run_worker, args=(cfg, world_size), nprocs=world_size, join=True)
