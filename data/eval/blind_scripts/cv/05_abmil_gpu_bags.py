#!/usr/bin/env python
# ABMIL baseline for HER2 status prediction from H&E (slide-level labels), DDP.
#
# Bags are the per-slide feature tensors from our UNI extraction run:
#   /mnt/features/uni_v1/<slide_id>.pt   ->  float16 [n_patches, 1024]
# Patient-level 5-fold CV; folds are assigned in the master sheet (column "fold").
#
#   torchrun --standalone --nproc_per_node=4 05_abmil_gpu_bags.py --config configs/her2_abmil.yaml

import argparse
import logging
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)

DEFAULTS = dict(
    sheet="/mnt/meta/her2_slides.csv",
    feature_dir="/mnt/features/uni_v1",
    out_dir="/mnt/experiments/her2_abmil",
    in_dim=1024,
    embed_dim=512,
    attn_dim=384,
    dropout=0.25,
    epochs=30,
    lr=1e-4,
    weight_decay=1e-2,
    warmup_epochs=2,
    num_workers=6,
    folds=[0, 1, 2, 3, 4],
    seed=7,
)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=str, default=None)
    ap.add_argument("--fold", type=int, default=None, help="run a single fold")
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    if a.fold is not None:
        cfg["folds"] = [a.fold]
    return argparse.Namespace(**cfg)


class SlideFeatures(Dataset):
    def __init__(self, frame, feature_dir, device):
        self.ids = frame.slide_id.tolist()
        self.targets = frame.her2.astype(int).tolist()
        self.feature_dir = Path(feature_dir)
        self.device = device

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        x = torch.load(self.feature_dir / f"{self.ids[i]}.pt", map_location=self.device)
        return x.float(), self.targets[i], i


class AttentionMIL(nn.Module):
    def __init__(self, in_dim, embed_dim, attn_dim, dropout):
        super().__init__()
        self.embed = nn.Sequential(nn.LayerNorm(in_dim), nn.Linear(in_dim, embed_dim), nn.GELU(), nn.Dropout(dropout))
        self.V = nn.Linear(embed_dim, attn_dim)
        self.U = nn.Linear(embed_dim, attn_dim)
        self.w = nn.Linear(attn_dim, 1)
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(embed_dim, 1))

    def forward(self, x):
        h = self.embed(x)
        scores = self.w(torch.tanh(self.V(h)) * torch.sigmoid(self.U(h))).squeeze(-1)
        attn = torch.softmax(scores, dim=0)
        z = torch.einsum("n,nd->d", attn, h)
        return self.head(z).squeeze(-1), attn


def cosine_with_warmup(optimizer, warmup, total):
    def fn(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


@torch.no_grad()
def predict(net, loader, world):
    net.eval()
    out = []
    for x, y, i in loader:
        logit, _ = net(x[0])
        out.append((int(i), torch.sigmoid(logit).item(), int(y)))
    parts = [None] * world
    dist.all_gather_object(parts, out)
    by_slide = {}
    for part in parts:
        for i, p, y in part:
            by_slide[i] = (p, y)
    p = np.array([v[0] for v in by_slide.values()])
    y = np.array([v[1] for v in by_slide.values()])
    return p, y


def run_fold(cfg, sheet, fold, rank, world, device):
    train_df = sheet[sheet.fold != fold].reset_index(drop=True)
    test_df = sheet[sheet.fold == fold].reset_index(drop=True)

    train_ds = SlideFeatures(train_df, cfg.feature_dir, device)
    test_ds = SlideFeatures(test_df, cfg.feature_dir, device)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=1, sampler=train_sampler, num_workers=cfg.num_workers)
    test_dl = DataLoader(test_ds, batch_size=1, sampler=test_sampler, num_workers=cfg.num_workers)

    net = AttentionMIL(cfg.in_dim, cfg.embed_dim, cfg.attn_dim, cfg.dropout).to(device)
    model = DDP(net, device_ids=[device.index])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = len(train_dl)
    sched = cosine_with_warmup(opt, cfg.warmup_epochs * steps_per_epoch, cfg.epochs * steps_per_epoch)
    pos_weight = torch.tensor((train_df.her2 == 0).sum() / max(1, (train_df.her2 == 1).sum()), device=device)

    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_acc = torch.zeros(2, device=device)
        for x, y, _ in train_dl:
            logit, _ = model(x[0])
            loss = F.binary_cross_entropy_with_logits(logit, y[0].float().to(device), pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            loss_acc[0] += loss.detach()
            loss_acc[1] += 1
        dist.all_reduce(loss_acc)
        if rank == 0:
            log.info("fold %d epoch %d  loss %.4f  lr %.2e", fold, epoch, (loss_acc[0] / loss_acc[1]).item(),
                     sched.get_last_lr()[0])

    p, y = predict(net, test_dl, world)
    auc = roc_auc_score(y, p)
    if rank == 0:
        fold_dir = Path(cfg.out_dir) / f"fold_{fold}"
        fold_dir.mkdir(parents=True, exist_ok=True)
        torch.save(net.state_dict(), fold_dir / "final.pt")
        pd.DataFrame({"prob": p, "label": y}).to_csv(fold_dir / "test_predictions.csv", index=False)
        log.info("fold %d: test AUC %.4f over %d slides", fold, auc, len(y))
    return auc


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(cfg.seed)

    sheet = pd.read_csv(cfg.sheet)
    sheet = sheet[sheet.her2.isin([0, 1])]
    aucs = [run_fold(cfg, sheet, fold, rank, world, device) for fold in cfg.folds]
    if rank == 0:
        log.info("AUC per fold: %s", ", ".join(f"{a:.4f}" for a in aucs))
        log.info("mean AUC %.4f +- %.4f", np.mean(aucs), np.std(aucs))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
