"""Blast-furnace anomaly detection: masked-patch reconstruction on all windows plus
an auxiliary event-type classifier trained on the (few) windows that operators
labelled (hanging, slip, channelling). Score = reconstruction error; the alarm
threshold is chosen on the validation campaign to hit a target false-alarm rate.

  torchrun --standalone --nproc_per_node=8 17_blast_furnace_weak_labels.py \
      --raw /shared/bf2/raw --cache /shared/bf2/cache --out /shared/bf2/runs/exp14
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_EVENT_TYPES = 4  # 0 = hanging, 1 = slip, 2 = channelling, 3 = other


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--raw", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--win", type=int, default=240)
    p.add_argument("--patch", type=int, default=10)
    p.add_argument("--mask", type=float, default=0.3)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--cls-weight", type=float, default=0.2)
    p.add_argument("--far", type=float, default=0.002, help="target false-alarm rate on val")
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--wandb", action="store_true")
    return p.parse_args()


def build_cache(raw_dir, cache_file):
    df = pd.read_parquet(os.path.join(raw_dir, "bf2_1min.parquet")).sort_index()
    events = pd.read_csv(os.path.join(raw_dir, "operator_events.csv"), parse_dates=["start", "end"])
    ev = np.full(len(df), -1, dtype=np.int64)
    for r in events.itertuples():
        ev[(df.index >= r.start) & (df.index <= r.end)] = r.event_type
    x = df.ffill().bfill().to_numpy(np.float32)
    n = len(x)
    tr, va = int(0.7 * n), int(0.85 * n)
    normal = ev[:tr] < 0
    mean, std = x[:tr][normal].mean(0), x[:tr][normal].std(0) + 1e-6
    np.savez(cache_file + ".tmp.npz", x=(x - mean) / std, ev=ev, tr=tr, va=va, mean=mean, std=std)
    os.replace(cache_file + ".tmp.npz", cache_file)


class Windows(Dataset):
    def __init__(self, x, ev, lo, hi, win, hop):
        self.x, self.ev, self.win = x, ev, win
        self.starts = np.arange(lo, hi - win + 1, hop)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        e = self.ev[s:s + self.win]
        label = int(e.max()) if (e >= 0).any() else -1
        return torch.from_numpy(self.x[s:s + self.win].astype(np.float32)), label


class FurnaceNet(nn.Module):
    def __init__(self, n_ch, a):
        super().__init__()
        self.patch, self.grad_ckpt = a.patch, a.grad_ckpt
        n_tok = a.win // a.patch
        self.embed = nn.Linear(n_ch * a.patch, a.dim)
        self.mask_tok = nn.Parameter(torch.zeros(1, 1, a.dim))
        self.pos = nn.Parameter(torch.zeros(1, n_tok, a.dim))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(a.dim, 8, 4 * a.dim, 0.1, batch_first=True, norm_first=True)
            for _ in range(a.depth))
        self.norm = nn.LayerNorm(a.dim)
        self.recon = nn.Linear(a.dim, n_ch * a.patch)
        self.cls = nn.Sequential(nn.Linear(a.dim, a.dim // 2), nn.GELU(),
                                 nn.Linear(a.dim // 2, N_EVENT_TYPES))

    def encode(self, tok):
        h = tok + self.pos
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                h = checkpoint(blk, h, use_reentrant=False)
            else:
                h = blk(h)
        return self.norm(h)

    def forward(self, x, mask_ratio=0.0, labelled=None):
        B, W, C = x.shape
        tgt = x.reshape(B, W // self.patch, self.patch * C)
        tok = self.embed(tgt)
        m = torch.rand(B, tok.shape[1], device=x.device) < mask_ratio
        tok = torch.where(m.unsqueeze(-1), self.mask_tok.to(tok.dtype), tok)
        h = self.encode(tok)
        logits = None
        if labelled is not None and labelled.any():
            logits = self.cls(h[labelled].mean(1))
        return self.recon(h), tgt, m, logits


def train_step(model, x, y, a):
    labelled = y >= 0
    rec, tgt, m, logits = model(x, a.mask, labelled)
    err = (rec - tgt).pow(2).mean(-1)
    loss = (err * m).sum() / m.sum().clamp_min(1)
    if logits is not None:
        loss = loss + a.cls_weight * F.cross_entropy(logits.float(), y[labelled])
    return loss


@torch.no_grad()
def scores(net, loader, device):
    net.eval()
    out = []
    for x, y in loader:
        x = x.to(device)
        rec, tgt, _, _ = net(x)
        out.append(torch.stack([(rec - tgt).pow(2).mean((1, 2)).float().cpu(), y.float()], 1))
    net.train()
    return torch.cat(out).numpy() if out else np.zeros((0, 2), np.float32)


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    cache_file = os.path.join(a.cache, f"bf2_w{a.win}.npz")
    if rank == 0 and not os.path.exists(cache_file):
        os.makedirs(a.cache, exist_ok=True)
        build_cache(a.raw, cache_file)
    dist.barrier()
    d = np.load(cache_file)
    x, ev, tr, va = d["x"], d["ev"], int(d["tr"]), int(d["va"])

    train_ds = Windows(x, ev, 0, tr, a.win, hop=5)
    val_ds = Windows(x, ev, tr, va, a.win, hop=a.win // 4)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=a.batch, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    # each rank scores a disjoint strided slice of val; results are gathered below
    val_part = torch.utils.data.Subset(val_ds, list(range(rank, len(val_ds), world)))
    val_dl = DataLoader(val_part, batch_size=256, num_workers=4)

    net = FurnaceNet(x.shape[1], a).to(device)
    # the event head only sees batches that contain labelled windows
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr * world * a.batch / 512, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.epochs * len(train_dl))

    run = None
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        if a.wandb:
            import wandb
            run = wandb.init(project="bf2-anomaly", config=vars(a), dir=a.out)

    thr = None
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for xb, yb in train_dl:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = train_step(model, xb, yb, a)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            acc[0] += loss.detach().float()
            acc[1] += 1
        dist.all_reduce(acc)

        local = scores(net, val_dl, device)
        parts = [None] * world
        dist.all_gather_object(parts, local)
        allv = np.concatenate(parts)
        normal = allv[:, 1] < 0
        thr = float(np.quantile(allv[normal, 0], 1 - a.far))
        recall = float((allv[~normal, 0] > thr).mean()) if (~normal).any() else float("nan")

        if rank == 0:
            msg = dict(epoch=epoch, loss=(acc[0] / acc[1]).item(), thr=thr, event_recall=recall,
                       n_val=len(allv), secs=time.time() - t0)
            print(msg, flush=True)
            if run is not None:
                run.log(msg)
            torch.save({"model": net.state_dict(), "threshold": thr, "epoch": epoch,
                        "mean": torch.from_numpy(d["mean"]), "std": torch.from_numpy(d["std"])},
                       os.path.join(a.out, "last.pt"))
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
