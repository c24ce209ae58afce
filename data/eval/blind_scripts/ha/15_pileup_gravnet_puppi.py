#!/usr/bin/env python
# Per-particle pileup identification (LV vs PU) with GravNet, as a learned PUPPI.
# Events: PyG Data with x = [pt, eta, phi, charge, is_chg_hadron, is_neu_hadron,
# is_photon, is_lepton, puppi_weight, dz(charged, 0 otherwise)], y = 1 for LV particles.
# Charged particles with a vertex assignment are trivially labelled; the metric we care
# about is the ROC on neutral particles.
#
#   torchrun --nproc_per_node=4 15_pileup_gravnet_puppi.py --data /data/pu200/graphs --epochs 25
import argparse
import glob
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score, roc_curve
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.loader import DataLoader
from torch_geometric.nn import GravNetConv

N_FEAT = 10


class PUGraphs(torch.utils.data.Dataset):
    def __init__(self, files):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = torch.load(self.files[i], weights_only=False)
        x = d.x.clone()
        x[:, 0] = torch.log(x[:, 0].clamp(min=0.1))
        d.x = x
        d.y = d.y.float()
        return d


class GravNetPU(nn.Module):
    def __init__(self, hidden=64, n_blocks=4, k=16):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(N_FEAT, hidden), nn.ELU(), nn.Linear(hidden, hidden), nn.ELU())
        self.blocks = nn.ModuleList()
        self.post = nn.ModuleList()
        for _ in range(n_blocks):
            self.blocks.append(GravNetConv(hidden, hidden, space_dimensions=4,
                                           propagate_dimensions=32, k=k))
            self.post.append(nn.Sequential(nn.Linear(hidden, hidden), nn.ELU(), nn.LayerNorm(hidden)))
        self.out = nn.Sequential(nn.Linear(hidden * n_blocks + N_FEAT, 64), nn.ELU(), nn.Linear(64, 1))

    def forward(self, x, batch):
        h = self.embed(x)
        feats = []
        for conv, post in zip(self.blocks, self.post):
            h = post(conv(h, batch)) + h
            feats.append(h)
        return self.out(torch.cat(feats + [x], dim=1)).squeeze(-1)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/gravnet_pu")
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--batch-size", type=int, default=4, help="events per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--n-val", type=int, default=500)
    return ap.parse_args()


@torch.no_grad()
def evaluate(model, loader, device, world):
    model.eval()
    scores, labels, neutral = [], [], []
    for d in loader:
        d = d.to(device)
        scores.append(torch.sigmoid(model(d.x, d.batch)))
        labels.append(d.y)
        neutral.append(d.x[:, 3] == 0)
    scores, labels, neutral = torch.cat(scores), torch.cat(labels), torch.cat(neutral)

    # collect all particles on every rank for the ROC
    all_s = [torch.zeros_like(scores) for _ in range(world)]
    all_y = [torch.zeros_like(labels) for _ in range(world)]
    all_n = [torch.zeros_like(neutral) for _ in range(world)]
    dist.all_gather(all_s, scores)
    dist.all_gather(all_y, labels)
    dist.all_gather(all_n, neutral)
    s = torch.cat(all_s).cpu().numpy()
    y = torch.cat(all_y).cpu().numpy()
    n = torch.cat(all_n).cpu().numpy()

    auc_all = roc_auc_score(y, s)
    auc_neu = roc_auc_score(y[n], s[n])
    fpr, tpr, _ = roc_curve(y[n], s[n])
    pu_rej = 1.0 - fpr[np.searchsorted(tpr, 0.9)]
    bce = F.binary_cross_entropy(torch.from_numpy(s).clamp(1e-6, 1 - 1e-6), torch.from_numpy(y)).item()
    return {"auc": auc_all, "auc_neutral": auc_neu, "pu_rej@90": pu_rej, "bce": bce}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    files = sorted(glob.glob(os.path.join(args.data, "*.pt")))
    train_files, val_files = files[args.n_val:], files[:args.n_val]
    train_ds = PUGraphs(train_files)
    val_ds = PUGraphs(val_files[rank::world])

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, num_workers=2)

    model = DDP(GravNetPU().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=len(train_dl) * 5)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for d in train_dl:
            d = d.to(device, non_blocking=True)
            logit = model(d.x, d.batch)
            # up-weight neutrals, where PUPPI struggles
            w = torch.where(d.x[:, 3] == 0, 3.0, 1.0)
            loss = F.binary_cross_entropy_with_logits(logit, d.y, weight=w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(tot)

        m = evaluate(model.module, val_dl, device, world)
        if rank == 0:
            print(f"epoch {epoch:02d} train_loss {(tot[0] / tot[1]).item():.4f} "
                  + " ".join(f"{k} {v:.4f}" for k, v in m.items()), flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": m},
                       os.path.join(args.out, "last.pt"))
            if m["auc_neutral"] > best:
                best = m["auc_neutral"]
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
