"""
Forest CoverType (7 classes) with an FT-Transformer (Gorishniy et al., 2021), DDP.

After training we report the attention-based feature importance from the paper
(average CLS-token attention over heads, layers and validation rows).

    torchrun --nproc_per_node=4 15_covertype_ftt_attn_importance.py --csv data/covtype.csv
"""
import argparse
import json
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

NUM = ["Elevation", "Aspect", "Slope", "Horizontal_Distance_To_Hydrology", "Vertical_Distance_To_Hydrology",
       "Horizontal_Distance_To_Roadways", "Hillshade_9am", "Hillshade_Noon", "Hillshade_3pm",
       "Horizontal_Distance_To_Fire_Points"]


class Block(nn.Module):
    def __init__(self, d, heads, ffn_mult=4 / 3, attn_drop=0.2, ffn_drop=0.1, res_drop=0.0, first=False):
        super().__init__()
        self.norm1 = nn.Identity() if first else nn.LayerNorm(d)  # FT-T: no pre-norm in the first block
        self.attn = nn.MultiheadAttention(d, heads, dropout=attn_drop, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        h = int(d * ffn_mult)
        self.ffn = nn.Sequential(nn.Linear(d, 2 * h), nn.GLU(), nn.Dropout(ffn_drop), nn.Linear(h, d))
        self.drop = nn.Dropout(res_drop)

    def forward(self, x, return_attn=False):
        q = self.norm1(x)
        a, w = self.attn(q, q, q, need_weights=return_attn, average_attn_weights=True)
        x = x + self.drop(a)
        x = x + self.drop(self.ffn(self.norm2(x)))
        return (x, w) if return_attn else x


class FTTransformer(nn.Module):
    def __init__(self, n_num, cards, n_out, d=192, n_blocks=3, heads=8):
        super().__init__()
        self.n_features = n_num + len(cards)
        self.num_w = nn.Parameter(torch.empty(n_num, d).uniform_(-d ** -0.5, d ** -0.5))
        self.num_b = nn.Parameter(torch.empty(n_num, d).uniform_(-d ** -0.5, d ** -0.5))
        self.cat_emb = nn.ModuleList(nn.Embedding(c, d) for c in cards)
        self.cls = nn.Parameter(torch.empty(1, 1, d).uniform_(-d ** -0.5, d ** -0.5))
        self.blocks = nn.ModuleList(Block(d, heads, first=(i == 0)) for i in range(n_blocks))
        self.head = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, n_out))

    def tokens(self, x_num, x_cat):
        t = [x_num.unsqueeze(-1) * self.num_w + self.num_b,
             torch.stack([e(x_cat[:, i]) for i, e in enumerate(self.cat_emb)], 1)]
        return torch.cat([self.cls.expand(x_num.size(0), -1, -1)] + t, 1)

    def forward(self, x_num, x_cat):
        x = self.tokens(x_num, x_cat)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x[:, 0])

    @torch.no_grad()
    def cls_attention(self, x_num, x_cat):
        """Mean attention from CLS to every feature token, averaged over heads and layers: (B, n_features)."""
        x, acc = self.tokens(x_num, x_cat), 0.0
        for blk in self.blocks:
            x, w = blk(x, return_attn=True)
            acc = acc + w[:, 0, 1:]
        return acc / len(self.blocks)


def load(csv):
    df = pd.read_csv(csv)
    wild = [c for c in df.columns if c.startswith("Wilderness_Area")]
    soil = [c for c in df.columns if c.startswith("Soil_Type")]
    df["wilderness"] = df[wild].values.argmax(1)
    df["soil"] = df[soil].values.argmax(1)
    y = df["Cover_Type"].values.astype(np.int64) - 1
    return df, ["wilderness", "soil"], [len(wild), len(soil)], y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--out", default="runs/covtype_ftt")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=1024, help="global")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--wd", type=float, default=1e-5)
    ap.add_argument("--patience", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    df, cat_cols, cards, y = load(args.csv)
    idx_tr, idx_te = train_test_split(np.arange(len(df)), test_size=0.2, random_state=args.seed, stratify=y)
    idx_tr, idx_va = train_test_split(idx_tr, test_size=0.2, random_state=args.seed, stratify=y[idx_tr])
    mu, sd = df.iloc[idx_tr][NUM].mean(), df.iloc[idx_tr][NUM].std()
    x_num = torch.tensor(((df[NUM] - mu) / sd).values, dtype=torch.float32)
    x_cat = torch.tensor(df[cat_cols].values, dtype=torch.long)
    y_t = torch.from_numpy(y)

    train_ds = TensorDataset(x_num[idx_tr], x_cat[idx_tr], y_t[idx_tr])
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    model = FTTransformer(len(NUM), cards, 7).to(dev)
    model = DDP(model, device_ids=[local_rank])
    no_wd = {n for n, p in model.named_parameters() if p.ndim == 1 or "num_" in n or "cat_emb" in n or "cls" in n}
    opt = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if n not in no_wd], "weight_decay": args.wd},
        {"params": [p for n, p in model.named_parameters() if n in no_wd], "weight_decay": 0.0}], lr=args.lr)

    def accuracy(idx):
        rows = idx[rank::world]
        correct = torch.zeros(2, device=dev)
        model.module.eval()
        with torch.no_grad():
            for s in range(0, len(rows), 8192):
                r = rows[s:s + 8192]
                pred = model.module(x_num[r].to(dev), x_cat[r].to(dev)).argmax(1)
                correct += torch.tensor([(pred.cpu() == y_t[r]).sum().item(), len(r)], device=dev, dtype=torch.float32)
        dist.all_reduce(correct)
        return (correct[0] / correct[1]).item()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_acc, bad, ckpt = 0.0, 0, os.path.join(args.out, "best.pt")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for xn, xc, yb in loader:
            xn, xc, yb = xn.to(dev, non_blocking=True), xc.to(dev, non_blocking=True), yb.to(dev, non_blocking=True)
            loss = F.cross_entropy(model(xn, xc), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        acc = accuracy(idx_va)
        if rank == 0:
            print(f"epoch {epoch:03d} loss {loss.item():.4f} val_acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
        if acc > best_acc:
            best_acc, bad = acc, 0
            if rank == 0:
                torch.save(model.module.state_dict(), ckpt)
        else:
            bad += 1
            if bad > args.patience:
                break

    dist.barrier()
    model.module.load_state_dict(torch.load(ckpt, map_location=dev))
    test_acc = accuracy(idx_te)

    # attention-based feature importance on this rank's share of the validation rows
    rows = idx_va[rank::world]
    imp = torch.zeros(len(NUM) + len(cat_cols), device=dev)
    for s in range(0, len(rows), 4096):
        r = rows[s:s + 4096]
        imp += model.cls_attention(x_num[r].to(dev), x_cat[r].to(dev)).sum(0)
    dist.all_reduce(imp)
    imp = (imp / len(idx_va)).cpu().numpy()

    if rank == 0:
        ranking = sorted(zip(NUM + cat_cols, imp.tolist()), key=lambda t: -t[1])
        print(f"best val acc {best_acc:.4f}  test acc {test_acc:.4f}")
        for name, v in ranking:
            print(f"  {name:40s} {v:.4f}")
        with open(os.path.join(args.out, "importance.json"), "w") as f:
            json.dump({"test_acc": test_acc, "importance": dict(ranking)}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
