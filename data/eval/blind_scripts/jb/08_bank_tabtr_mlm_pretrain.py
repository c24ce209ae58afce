#!/usr/bin/env python
# TabTransformer with masked-category pretraining (TabTransformer paper, Sec. 2.2, "MLM")
# on all labelled + unlabelled rows of the bank-marketing data, then supervised fine-tuning
# on one CV fold.  One process per GPU:
#
#   torchrun --nproc_per_node=4 08_bank_tabtr_mlm_pretrain.py --labelled data/bank/train.csv \
#       --unlabelled data/bank/unlabelled.csv --fold 0
import argparse
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CAT = ["job", "marital", "education", "default", "housing", "loan", "contact", "month", "day_of_week", "poutcome"]
NUM = ["age", "duration", "campaign", "pdays", "previous", "emp.var.rate", "cons.price.idx",
       "cons.conf.idx", "euribor3m", "nr.employed"]
MASK_ID = 1  # per-column id 0 = unknown, 1 = [MASK]


class TabTransformer(nn.Module):
    def __init__(self, cards, n_num, dim=32, depth=6, heads=8, dropout=0.1):
        super().__init__()
        self.cards = cards
        self.register_buffer("offsets", torch.tensor([0] + list(np.cumsum(cards)[:-1])))
        self.embed = nn.Embedding(sum(cards), dim)
        self.col = nn.Parameter(torch.randn(1, len(cards), dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        # pretraining: one classifier per column over that column's vocabulary
        self.mlm_heads = nn.ModuleList(nn.Linear(dim, c) for c in cards)
        # fine-tuning: contextual embeddings + continuous -> MLP
        d = dim * len(cards) + n_num
        self.num_norm = nn.LayerNorm(n_num)
        self.cls_head = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Dropout(dropout), nn.Linear(2 * d, 1))

    def contextual(self, x_cat):
        return self.encoder(self.embed(x_cat + self.offsets) + self.col)

    def forward(self, x_cat, x_num=None, pretrain=False):
        h = self.contextual(x_cat)
        if pretrain:
            return [head(h[:, j]) for j, head in enumerate(self.mlm_heads)]
        return self.cls_head(torch.cat([h.flatten(1), self.num_norm(x_num)], 1)).squeeze(-1)


def encode(df_lab, df_unl):
    full = pd.concat([df_lab, df_unl], ignore_index=True)
    cards = []
    for c in CAT:
        levels = sorted(full[c].dropna().astype(str).unique())
        lut = {v: i + 2 for i, v in enumerate(levels)}
        for df in (df_lab, df_unl):
            df[c] = df[c].astype(str).map(lut).fillna(0).astype(np.int64)
        cards.append(len(levels) + 2)
    for df in (df_lab, df_unl):
        df["pdays"] = df["pdays"].replace(999, -1)
        df["duration"] = np.log1p(df["duration"])
    return cards


def mask_tokens(x, p=0.3):
    m = torch.rand(x.shape, device=x.device) < p
    return x.masked_fill(m, MASK_ID), m


def cosine_lr(opt, base, step, total, warmup):
    lr = base * step / warmup if step < warmup else base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
    for g in opt.param_groups:
        g["lr"] = lr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--labelled", required=True)
    ap.add_argument("--unlabelled", required=True)
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--n-folds", type=int, default=5)
    ap.add_argument("--pretrain-epochs", type=int, default=30)
    ap.add_argument("--finetune-epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=1024, help="global batch size")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--out", default="runs/bank_tabtr")
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    main_proc = rank == 0

    lab = pd.read_csv(args.labelled, sep=";")
    unl = pd.read_csv(args.unlabelled, sep=";")
    lab["y"] = (lab["y"] == "yes").astype(np.float32)
    cards = encode(lab, unl)

    tr_idx, va_idx = list(StratifiedKFold(args.n_folds, shuffle=True, random_state=args.seed)
                          .split(lab, lab["y"]))[args.fold]
    tr, va = lab.iloc[tr_idx], lab.iloc[va_idx]
    mu, sd = tr[NUM].mean(), tr[NUM].std() + 1e-6
    t = lambda df, cols, dt: torch.tensor(df[cols].values, dtype=dt)

    net = TabTransformer(cards, len(NUM)).to(dev)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)

    # ---- stage 1: masked category modelling on labelled-train + unlabelled rows (no validation rows)
    pre_ds = TensorDataset(torch.cat([t(tr, CAT, torch.long), t(unl, CAT, torch.long)]))
    pre_sampler = DistributedSampler(pre_ds, shuffle=True, seed=args.seed, drop_last=True)
    pre_loader = DataLoader(pre_ds, batch_size=args.batch_size // world, sampler=pre_sampler, num_workers=2, drop_last=True)
    step, total = 0, args.pretrain_epochs * len(pre_loader)
    for epoch in range(args.pretrain_epochs):
        pre_sampler.set_epoch(epoch)
        model.train()
        for (xc,) in pre_loader:
            xc = xc.to(dev, non_blocking=True)
            xm, m = mask_tokens(xc)
            logits = model(xm, pretrain=True)
            loss = sum(F.cross_entropy(logits[j][m[:, j]], xc[m[:, j], j]) if m[:, j].any()
                       else logits[j].sum() * 0.0 for j in range(len(CAT))) / len(CAT)
            cosine_lr(opt, args.lr, step, total, warmup=len(pre_loader))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
        if main_proc:
            print(f"[pretrain] epoch {epoch} mlm loss {loss.item():.4f}", flush=True)
    if main_proc:
        os.makedirs(args.out, exist_ok=True)
        torch.save(net.state_dict(), os.path.join(args.out, "pretrained.pt"))

    # ---- stage 2: supervised fine-tuning
    ft_ds = TensorDataset(t(tr, CAT, torch.long), torch.tensor(((tr[NUM] - mu) / sd).values, dtype=torch.float32),
                          t(tr, ["y"], torch.float32).squeeze(1))
    ft_sampler = DistributedSampler(ft_ds, shuffle=True, seed=args.seed, drop_last=True)
    ft_loader = DataLoader(ft_ds, batch_size=args.batch_size // world, sampler=ft_sampler, num_workers=2, drop_last=True)
    va_cat = t(va, CAT, torch.long).to(dev)
    va_num = torch.tensor(((va[NUM] - mu) / sd).values, dtype=torch.float32).to(dev)
    pos = tr["y"].mean()
    crit = nn.BCEWithLogitsLoss(pos_weight=torch.tensor((1 - pos) / pos, device=dev))
    step, total, best = 0, args.finetune_epochs * len(ft_loader), 0.0
    for epoch in range(args.finetune_epochs):
        ft_sampler.set_epoch(epoch)
        model.train()
        for xc, xn, yb in ft_loader:
            xc, xn, yb = xc.to(dev), xn.to(dev), yb.to(dev)
            loss = crit(model(xc, xn), yb)
            cosine_lr(opt, args.lr / 3, step, total, warmup=len(ft_loader))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
        # every rank scores the full (small) validation fold, so the AUC is the same everywhere
        net.eval()
        with torch.no_grad():
            p = torch.sigmoid(net(va_cat, va_num)).cpu().numpy()
        auc = roc_auc_score(va["y"].values, p)
        if main_proc:
            print(f"[finetune] epoch {epoch} loss {loss.item():.4f} val auc {auc:.5f}", flush=True)
            if auc > best:
                best = auc
                torch.save(net.state_dict(), os.path.join(args.out, f"fold{args.fold}.pt"))
                np.save(os.path.join(args.out, f"oof_fold{args.fold}.npy"), np.stack([va_idx, p]))
    if main_proc:
        print(f"fold {args.fold} best val auc {best:.5f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
