"""Behaviour-deviation network: how far does this transaction sit from the card's recent profile?

Inputs per sample:
    profile : the card's previous 50 transactions (amount, mcc, hour, country, channel, dt)
    current : the transaction being scored
The model attends from the current transaction over the profile and classifies.

    torchrun --nproc_per_node=4 14_behavior_deviation_net.py --train /data/bdn/train.h5 --val /data/bdn/val.h5
"""
import argparse
import os
import time
from dataclasses import dataclass

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Config:
    train: str
    val: str
    out: str = "runs/bdn"
    d: int = 96
    heads: int = 4
    batch_size: int = 512
    epochs: int = 12
    lr: float = 4e-4
    weight_decay: float = 1e-4
    pos_weight: float = 20.0
    num_workers: int = 6


class H5Pairs(Dataset):
    """Lazily opened so each DataLoader worker gets its own file handle.

    prof_mask marks real history slots; the export writes one neutral slot for cards without history.
    """

    def __init__(self, path):
        self.path = path
        with h5py.File(path, "r") as f:
            self.n = f["label"].shape[0]
            self.n_num = f["prof_num"].shape[-1]
        self.f = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        f = self.f
        return (
            torch.from_numpy(f["prof_num"][i]).float(),
            torch.from_numpy(f["prof_cat"][i]).long(),
            torch.from_numpy(f["prof_mask"][i]).bool(),
            torch.from_numpy(f["cur_num"][i]).float(),
            torch.from_numpy(f["cur_cat"][i]).long(),
            torch.tensor(f["label"][i], dtype=torch.float32),
        )


class TxnEmbed(nn.Module):
    def __init__(self, n_num, d, cards=(1000, 256, 24, 8)):
        super().__init__()
        self.num = nn.Linear(n_num, d)
        self.cat = nn.ModuleList(nn.Embedding(c, d) for c in cards)

    def forward(self, num, cat):
        h = self.num(num)
        for j, e in enumerate(self.cat):
            h = h + e(cat[..., j])
        return h


class BehaviorDeviationNet(nn.Module):
    def __init__(self, n_num, d, heads):
        super().__init__()
        self.embed = TxnEmbed(n_num, d)
        self.prof_enc = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, heads, 2 * d, 0.1, batch_first=True), num_layers=2)
        self.cross = nn.MultiheadAttention(d, heads, batch_first=True)
        self.cls = nn.Sequential(nn.Linear(4 * d, 2 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * d, 1))

    def forward(self, pnum, pcat, pmask, cnum, ccat):
        p = self.prof_enc(self.embed(pnum, pcat), src_key_padding_mask=~pmask)
        c = self.embed(cnum, ccat).unsqueeze(1)
        ctx, _ = self.cross(c, p, p, key_padding_mask=~pmask)
        c, ctx = c.squeeze(1), ctx.squeeze(1)
        return self.cls(torch.cat([c, ctx, c - ctx, c * ctx], dim=-1)).squeeze(-1)


def train_one_epoch(model, loader, opt, sched, pos_weight, device):
    model.train()
    loss_sum, n = torch.zeros((), device=device), 0
    for pnum, pcat, pmask, cnum, ccat, y in loader:
        pnum, pcat, pmask = pnum.to(device, non_blocking=True), pcat.to(device), pmask.to(device)
        cnum, ccat, y = cnum.to(device), ccat.to(device), y.to(device)
        logit = model(pnum, pcat, pmask, cnum, ccat)
        loss = F.binary_cross_entropy_with_logits(logit, y, pos_weight=pos_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_sum += loss.detach()
        n += 1
    return loss_sum / max(n, 1)


@torch.no_grad()
def evaluate(model, loader, device, world):
    model.eval()
    s, t = [], []
    for pnum, pcat, pmask, cnum, ccat, y in loader:
        logit = model.module(pnum.to(device), pcat.to(device), pmask.to(device), cnum.to(device), ccat.to(device))
        s.append(torch.sigmoid(logit).cpu())
        t.append(y)
    parts = [None] * world
    dist.all_gather_object(parts, (torch.cat(s).numpy(), torch.cat(t).numpy()))
    scores = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    return average_precision_score(labels, scores)


def main():
    ap = argparse.ArgumentParser()
    for field, default in Config.__dataclass_fields__.items():
        if default.default is default.default_factory:  # required (no default)
            ap.add_argument(f"--{field}", required=True)
        else:
            ap.add_argument(f"--{field.replace('_', '-')}", type=type(default.default), default=default.default)
    cfg = Config(**vars(ap.parse_args()))

    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds, val_ds = H5Pairs(cfg.train), H5Pairs(cfg.val)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler,
                          num_workers=cfg.num_workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_idx = list(range(rank, len(val_ds), world))
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=2048, num_workers=cfg.num_workers)

    model = DDP(BehaviorDeviationNet(train_ds.n_num, cfg.d, cfg.heads).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.epochs * len(train_dl))
    pos_weight = torch.tensor(cfg.pos_weight, device=device)

    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        print(f"train={len(train_ds)} val={len(val_ds)} steps/epoch={len(train_dl)} world={world}", flush=True)

    best = 0.0
    for epoch in range(cfg.epochs):
        t0 = time.time()
        loss = train_one_epoch(model, train_dl, opt, sched, pos_weight, device)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        val_ap = evaluate(model, val_dl, device, world)
        if rank == 0:
            print(f"epoch {epoch:02d} loss {loss.item():.4f} val_pr_auc {val_ap:.4f} ({time.time() - t0:.0f}s)",
                  flush=True)
            if val_ap > best:
                best = val_ap
                torch.save({"model": model.module.state_dict(), "cfg": cfg.__dict__, "epoch": epoch},
                           os.path.join(cfg.out, "best.pt"))
        dist.barrier()

    if rank == 0:
        print(f"best val PR-AUC {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
