"""Temporal-conv (TCN) fraud scorer over per-account event windows, single node, mp.spawn.

    python 07_tcn_syncbn_spawn.py --data /data/acct_windows --gpus 4
    python 07_tcn_syncbn_spawn.py --data /data/acct_windows --gpus 4 --resume runs/tcn/last.pt
"""
import argparse
import os
import socket
import time
from contextlib import closing

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def prepare_cache(root):
    """Convert the raw npz dump into contiguous arrays once, in the parent process."""
    out = os.path.join(root, "cache")
    if os.path.exists(os.path.join(out, "train_x.npy")):
        return out
    os.makedirs(out, exist_ok=True)
    for split in ("train", "val"):
        raw = np.load(os.path.join(root, f"{split}.npz"))
        x = raw["x"].astype(np.float32)                                # [N, C, T]
        x = np.sign(x) * np.log1p(np.abs(x))
        np.save(os.path.join(out, f"{split}_x.npy"), x)
        np.save(os.path.join(out, f"{split}_y.npy"), raw["y"].astype(np.float32))
    return out


class WindowDataset(Dataset):
    def __init__(self, cache, split):
        self.x = np.load(os.path.join(cache, f"{split}_x.npy"), mmap_mode="r")
        self.y = np.load(os.path.join(cache, f"{split}_y.npy"))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return i, torch.from_numpy(np.array(self.x[i])), torch.tensor(self.y[i])


class TemporalBlock(nn.Module):
    def __init__(self, c_in, c_out, dilation, dropout):
        super().__init__()
        self.conv1 = nn.Conv1d(c_in, c_out, 3, padding=dilation, dilation=dilation)
        self.bn1 = nn.BatchNorm1d(c_out)
        self.conv2 = nn.Conv1d(c_out, c_out, 3, padding=dilation, dilation=dilation)
        self.bn2 = nn.BatchNorm1d(c_out)
        self.drop = nn.Dropout(dropout)
        self.skip = nn.Conv1d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x):
        h = self.drop(F.relu(self.bn1(self.conv1(x))))
        h = self.bn2(self.conv2(h))
        return F.relu(h + self.skip(x))


class TCN(nn.Module):
    def __init__(self, c_in, channels=(64, 64, 128, 128), dropout=0.1):
        super().__init__()
        layers, c = [], c_in
        for i, ch in enumerate(channels):
            layers.append(TemporalBlock(c, ch, 2 ** i, dropout))
            c = ch
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(2 * c, 1)

    def forward(self, x):
        h = self.body(x)
        h = torch.cat([h.mean(-1), h[..., -1]], dim=1)
        return self.head(h).squeeze(1)


def evaluate(model, loader, device, world):
    model.eval()
    idx, prob, lab = [], [], []
    with torch.no_grad():
        for i, x, y in loader:
            p = torch.sigmoid(model(x.to(device, non_blocking=True)))
            idx.append(i.to(device))
            prob.append(p)
            lab.append(y.to(device))
    local = torch.stack([torch.cat(idx).double(), torch.cat(prob).double(), torch.cat(lab).double()])
    # DistributedSampler gives every rank the same count (padded), so all_gather shapes match
    out = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(out, local)
    allv = torch.cat(out, dim=1).cpu().numpy()
    _, first = np.unique(allv[0].astype(np.int64), return_index=True)   # drop padded duplicates
    p, y = allv[1, first], allv[2, first]
    return float(average_precision_score(y, p)), float(roc_auc_score(y, p))


def worker(rank, world_size, args, cache):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    train_ds, val_ds = WindowDataset(cache, "train"), WindowDataset(cache, "val")
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 1024, sampler=val_sampler, num_workers=args.workers, pin_memory=True)

    # positives over the whole training set, counted on the shard each rank sees
    n_pos = torch.tensor(float(train_ds.y[list(train_sampler)].sum()), device=device)
    n_all = torch.tensor(float(len(train_sampler)), device=device)
    dist.all_reduce(n_pos)
    dist.all_reduce(n_all)
    pos_weight = ((n_all - n_pos) / n_pos.clamp(min=1.0)).sqrt()

    model = TCN(c_in=train_ds.x.shape[1])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    criterion = nn.BCEWithLogitsLoss(pos_weight=pos_weight)

    start_epoch, best = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location={"cuda:0": f"cuda:{rank}"})
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"pos_weight={pos_weight.item():.2f} train={len(train_ds)} val={len(val_ds)}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, loss_acc = time.time(), torch.zeros((), device=device)
        for _, x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_acc += loss.detach()
        sched.step()
        dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)

        ap, auc = evaluate(model, val_dl, device, world_size)
        if rank == 0:
            print(f"epoch {epoch}: loss {loss_acc.item() / len(train_dl):.4f} AP {ap:.4f} AUC {auc:.4f} "
                  f"[{time.time() - t0:.0f}s]", flush=True)
            best = max(best, ap)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best": best}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if ap >= best:
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/tcn")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    cache = prepare_cache(args.data)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(args.gpus, args, cache), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
