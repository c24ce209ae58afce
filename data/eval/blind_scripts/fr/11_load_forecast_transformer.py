"""
Day-ahead load forecasting with a patch transformer (PatchTST-style).

PyTorchJob "load-forecast" (namespace ml-energy), Master + 1 Worker, 4 x V100 per pod.
Pods restart on failure (restartPolicy: OnFailure), so the script resumes from the
last checkpoint on the shared NFS volume.

    torchrun --nnodes 2 --nproc_per_node 4 --node_rank $RANK \
        --master_addr $MASTER_ADDR --master_port $MASTER_PORT \
        forecast.py --series /data/meters/series.npy --run-dir /nfs/runs/patchtst-v3
"""
import argparse
import logging
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("forecast")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--series", required=True, help="float32 array [n_meters, n_hours]")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--context", type=int, default=336)
    p.add_argument("--horizon", type=int, default=24)
    p.add_argument("--patch", type=int, default=16)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--val-hours", type=int, default=24 * 28)
    return p.parse_args()


class WindowDataset(Dataset):
    def __init__(self, series, context, horizon, start, end, stride=1):
        self.series = series
        self.context = context
        self.horizon = horizon
        self.index = [(m, t) for m in range(series.shape[0])
                      for t in range(start, end - context - horizon + 1, stride)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        m, t = self.index[i]
        x = self.series[m, t:t + self.context]
        y = self.series[m, t + self.context:t + self.context + self.horizon]
        return torch.from_numpy(np.array(x)), torch.from_numpy(np.array(y))


class PatchTransformer(nn.Module):
    def __init__(self, context, horizon, patch, d_model, layers):
        super().__init__()
        self.patch = patch
        n_patches = context // patch
        self.embed = nn.Linear(patch, d_model)
        self.pos = nn.Parameter(torch.randn(1, n_patches, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, nhead=8, dim_feedforward=4 * d_model,
                                           dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(n_patches * d_model, horizon)

    def forward(self, x):
        mu = x.mean(dim=1, keepdim=True)
        sigma = x.std(dim=1, keepdim=True) + 1e-5
        z = (x - mu) / sigma
        z = z.unfold(1, self.patch, self.patch)
        h = self.encoder(self.embed(z) + self.pos)
        out = self.head(h.flatten(1))
        return out * sigma + mu


def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            pred = model(x)
            acc[0] += (pred - y).abs().sum()
            acc[1] += y.abs().sum()
            acc[2] += ((pred - y) ** 2).sum()
    dist.all_reduce(acc)
    model.train()
    n = len(loader.dataset.dataset) * 1.0
    return (acc[0] / acc[1]).item(), math.sqrt(acc[2].item() / (n * y.size(1)))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    series = np.load(args.series, mmap_mode="r")
    n_hours = series.shape[1]
    split = n_hours - args.val_hours
    train_ds = WindowDataset(series, args.context, args.horizon, 0, split, stride=6)
    val_full = WindowDataset(series, args.context, args.horizon, split - args.context, n_hours,
                             stride=args.horizon)
    val_ds = Subset(val_full, range(rank, len(val_full), world))
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                          num_workers=6, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=512, num_workers=2)

    net = PatchTransformer(args.context, args.horizon, args.patch, args.d_model, args.layers).to(device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr,
                                                    total_steps=args.epochs * len(train_dl))

    ckpt_path = os.path.join(args.run_dir, "checkpoint.pt")
    start_epoch, best_wape = 0, float("inf")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_wape = ckpt["epoch"] + 1, ckpt["best_wape"]
        log.info("resumed from epoch %d", ckpt["epoch"])

    model = DDP(net, device_ids=[local_rank])
    loss_fn = nn.HuberLoss(delta=1.0)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        for x, y in train_dl:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            pred = model(x)
            loss = loss_fn(pred / (y.abs().mean(1, keepdim=True) + 1), y / (y.abs().mean(1, keepdim=True) + 1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)

        wape, rmse = evaluate(model, val_dl, device)
        log.info("epoch %d train_loss %.4f val WAPE %.4f RMSE %.2f",
                 epoch, (running[0] / running[1]).item(), wape, rmse)

        if rank == 0:
            best_wape = min(best_wape, wape)
            os.makedirs(args.run_dir, exist_ok=True)
            torch.save({
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "best_wape": best_wape,
            }, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if wape <= best_wape:
                torch.save(net.state_dict(), os.path.join(args.run_dir, "best_model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
