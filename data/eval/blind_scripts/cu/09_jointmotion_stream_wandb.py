"""Joint-motion stream of a 4-stream ensemble (J, B, JM, BM) on NTU-60 X-Sub.

Run once per stream (--stream j|b|jm|bm); ensemble_scores.py fuses the saved
test scores afterwards with weights 0.6 / 0.6 / 0.4 / 0.4.
"""
import argparse
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import List

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

BONES = [(1, 2), (2, 21), (3, 21), (4, 3), (5, 21), (6, 5), (7, 6), (8, 7), (9, 21), (10, 9), (11, 10),
         (12, 11), (13, 1), (14, 13), (15, 14), (16, 15), (17, 1), (18, 17), (19, 18), (20, 19),
         (21, 21), (22, 23), (23, 8), (24, 25), (25, 12)]


@dataclass
class Config:
    data_root: str = "data/ntu60/xsub"
    stream: str = "jm"
    out_dir: str = "work_dir/ntu60_xsub"
    num_class: int = 60
    window: int = 64
    batch_size: int = 64          # global
    lr: float = 0.1
    weight_decay: float = 4e-4
    epochs: int = 65
    milestones: List[int] = field(default_factory=lambda: [35, 55])
    warmup: int = 5
    workers: int = 8
    project: str = "skeleton-ensemble"


def to_stream(x, stream):
    """x: C, T, V, M joint coordinates -> requested modality."""
    if stream in ("b", "bm"):
        b = np.zeros_like(x)
        for v1, v2 in BONES:
            b[:, :, v1 - 1] = x[:, :, v1 - 1] - x[:, :, v2 - 1]
        x = b
    if stream in ("jm", "bm"):
        m = np.zeros_like(x)
        m[:, :-1] = x[:, 1:] - x[:, :-1]
        x = m
    return x


class StreamFeeder(Dataset):
    def __init__(self, root, split, stream, window, train):
        self.data = np.load(os.path.join(root, f"{split}_data_joint.npy"), mmap_mode="r")
        with open(os.path.join(root, f"{split}_label.pkl"), "rb") as f:
            self.names, self.labels = pickle.load(f)
        self.stream, self.window, self.train = stream, window, train

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = np.array(self.data[i], dtype=np.float32)
        t = max(int((x.any(axis=(0, 2, 3))).sum()), 1)
        x = x[:, :t]
        if self.train and t > 8:
            s = np.random.randint(0, max(t // 10, 1))
            e = t - np.random.randint(0, max(t // 10, 1))
            x = x[:, s:e]
        idx = np.linspace(0, x.shape[1] - 1, self.window).round().astype(np.int64)
        x = to_stream(x[:, idx], self.stream)
        return torch.from_numpy(x), int(self.labels[i]), i


def adjacency():
    A = np.zeros((3, 25, 25), dtype=np.float32)
    A[0] = np.eye(25)
    for a, b in BONES:
        if a != b:
            A[1, b - 1, a - 1] = 1
            A[2, a - 1, b - 1] = 1
    for k in (1, 2):
        d = A[k].sum(0)
        d[d == 0] = 1
        A[k] = A[k] / d
    return A


class GCBlock(nn.Module):
    def __init__(self, cin, cout, A, stride=1):
        super().__init__()
        self.register_buffer("A", torch.from_numpy(A))
        self.PA = nn.Parameter(torch.zeros_like(self.A))
        self.conv = nn.Conv2d(cin, cout * A.shape[0], 1)
        self.bn = nn.BatchNorm2d(cout)
        self.tcn = nn.Sequential(nn.Conv2d(cout, cout, (9, 1), (stride, 1), (4, 0)), nn.BatchNorm2d(cout))
        self.res = (nn.Identity() if cin == cout and stride == 1
                    else nn.Sequential(nn.Conv2d(cin, cout, 1, (stride, 1)), nn.BatchNorm2d(cout)))

    def forward(self, x):
        n, _, t, v = x.shape
        k = self.A.shape[0]
        y = self.conv(x).view(n, k, -1, t, v)
        y = torch.einsum("nkctv,kvw->nctw", y, self.A + self.PA)
        y = F.relu(self.bn(y))
        return F.relu(self.tcn(y) + self.res(x))


class Net(nn.Module):
    def __init__(self, num_class):
        super().__init__()
        A = adjacency()
        self.data_bn = nn.BatchNorm1d(2 * 3 * 25)
        plan = [(3, 64, 1), (64, 64, 1), (64, 64, 1), (64, 64, 1), (64, 128, 2), (128, 128, 1),
                (128, 128, 1), (128, 256, 2), (256, 256, 1), (256, 256, 1)]
        self.blocks = nn.Sequential(*[GCBlock(a, b, A, s) for a, b, s in plan])
        self.fc = nn.Linear(256, num_class)

    def forward(self, x):
        n, c, t, v, m = x.shape
        x = self.data_bn(x.permute(0, 4, 3, 1, 2).reshape(n, -1, t))
        x = x.view(n, m, v, c, t).permute(0, 1, 3, 4, 2).reshape(n * m, c, t, v)
        x = self.blocks(x)
        return self.fc(x.view(n, m, 256, -1).mean(-1).mean(1))


def parse() -> Config:
    cfg = Config()
    ap = argparse.ArgumentParser()
    for k, v in vars(cfg).items():
        if isinstance(v, list):
            ap.add_argument(f"--{k}", type=int, nargs="+", default=v)
        else:
            ap.add_argument(f"--{k}", type=type(v), default=v)
    return Config(**vars(ap.parse_args()))


def main():
    cfg = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    out_dir = os.path.join(cfg.out_dir, cfg.stream)

    train_ds = StreamFeeder(cfg.data_root, "train", cfg.stream, cfg.window, True)
    test_ds = StreamFeeder(cfg.data_root, "val", cfg.stream, cfg.window, False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_dl = DataLoader(train_ds, cfg.batch_size // world, sampler=train_sampler,
                          num_workers=cfg.workers, pin_memory=True, drop_last=True)
    test_dl = DataLoader(test_ds, 128, sampler=test_sampler, num_workers=cfg.workers, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(Net(cfg.num_class)).to(dev)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, nesterov=True,
                          weight_decay=cfg.weight_decay)

    def lr_lambda(ep):
        if ep < cfg.warmup:
            return (ep + 1) / cfg.warmup
        return 0.1 ** sum(ep >= m for m in cfg.milestones)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)

    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        wandb.init(project=cfg.project, name=f"ntu60-xsub-{cfg.stream}", config=vars(cfg))

    best_top1 = 0.0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for x, y, _ in train_dl:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        model.eval()
        scores, hit1, hit5, n = {}, 0, 0, 0
        with torch.no_grad():
            for x, y, idx in test_dl:
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                out = model(x)
                top5 = out.topk(5, 1).indices
                hit1 += (top5[:, 0] == y).sum().item()
                hit5 += (top5 == y[:, None]).any(1).sum().item()
                n += y.size(0)
                for i, s in zip(idx.tolist(), out.cpu().numpy()):
                    scores[test_ds.names[i]] = s
        top1, top5 = hit1 / n, hit5 / n

        if rank == 0:
            print(f"[{cfg.stream}] epoch {epoch + 1} loss {loss.item():.4f} top1 {top1:.4f} top5 {top5:.4f} "
                  f"{time.time() - tic:.0f}s", flush=True)
            wandb.log({"loss": loss.item(), "top1": top1, "top5": top5, "lr": sched.get_last_lr()[0]}, step=epoch)
            torch.save(model.module.state_dict(), os.path.join(out_dir, "last.pt"))
            if top1 > best_top1:
                best_top1 = top1
                torch.save(model.module.state_dict(), os.path.join(out_dir, "best.pt"))
                with open(os.path.join(out_dir, "best_score.pkl"), "wb") as f:
                    pickle.dump(scores, f)

    if rank == 0:
        wandb.summary["best_top1"] = best_top1
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
