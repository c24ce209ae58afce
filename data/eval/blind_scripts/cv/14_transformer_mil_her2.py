"""Transformer-MIL (pre-norm encoder + CLS token) for HER2-low vs HER2-zero, DDP.

Features: Virchow/UNI-style 1280-d tile embeddings, one <slide>.pt per slide, saved as
{"features": [N, 1280] half, "coords": [N, 2] int}.
Patient-level CV: the fold column in the slide table was assigned per patient.
"""
import argparse
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def options():
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", default="tables/her2_low_slides.csv")
    ap.add_argument("--bag_dir", default="/nvme/bags/virchow")
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--n_folds", type=int, default=5)
    ap.add_argument("--max_tiles", type=int, default=8192, help="random crop of the bag while training")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--patience", type=int, default=8)
    ap.add_argument("--save", default="ckpts/her2_tmil")
    ap.add_argument("--seed", type=int, default=11)
    return ap.parse_args()


class Bags(Dataset):
    def __init__(self, df, bag_dir, max_tiles=None):
        self.df, self.bag_dir, self.max_tiles = df.reset_index(drop=True), bag_dir, max_tiles

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        d = torch.load(os.path.join(self.bag_dir, f"{row.slide_id}.pt"), map_location="cpu")
        x = d["features"].float()
        if self.max_tiles and x.shape[0] > self.max_tiles:
            start = torch.randint(0, x.shape[0] - self.max_tiles + 1, (1,)).item()
            x = x[start:start + self.max_tiles]
        return x, int(row.her2_low), i


class TransformerMIL(nn.Module):
    def __init__(self, in_dim=1280, dim=384, depth=2, heads=8, n_classes=2):
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(in_dim, dim), nn.GELU())
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, dim * 4, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_classes)
        nn.init.trunc_normal_(self.cls, std=0.02)

    def forward(self, x):
        h = self.inp(x).unsqueeze(0)
        h = torch.cat([self.cls, h], dim=1)
        h = self.encoder(h)
        return self.head(self.norm(h[:, 0]))


def warmup_cosine(step, warmup_steps, total_steps):
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    t = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * t))


@torch.no_grad()
def eval_auc(net, loader, device):
    net.eval()
    rows = []
    for x, y, i in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logit = net(x[0].to(device, non_blocking=True))
        rows.append((int(i), logit.float().softmax(-1)[0, 1].item(), int(y)))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, rows)
    uniq = {i: (p, y) for part in parts for i, p, y in part}
    p = np.array([v[0] for v in uniq.values()])
    y = np.array([v[1] for v in uniq.values()])
    return roc_auc_score(y, p)


def main():
    args = options()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True

    table = pd.read_csv(args.table)
    val_fold = (args.fold + 1) % args.n_folds
    tr_df = table[~table.fold.isin([args.fold, val_fold])]
    va_df = table[table.fold == val_fold]
    te_df = table[table.fold == args.fold]

    tr_ds = Bags(tr_df, args.bag_dir, args.max_tiles)
    va_ds, te_ds = Bags(va_df, args.bag_dir), Bags(te_df, args.bag_dir)
    tr_sampler = DistributedSampler(tr_ds, shuffle=True, seed=args.seed)
    tr_dl = DataLoader(tr_ds, batch_size=1, sampler=tr_sampler, num_workers=8, pin_memory=True,
                       persistent_workers=True, prefetch_factor=4)
    va_dl = DataLoader(va_ds, batch_size=1, sampler=DistributedSampler(va_ds, shuffle=False), num_workers=4)
    te_dl = DataLoader(te_ds, batch_size=1, sampler=DistributedSampler(te_ds, shuffle=False), num_workers=4)

    net = TransformerMIL(dim=args.dim, depth=args.depth, heads=args.heads).to(device)
    model = DDP(net, device_ids=[local_rank])
    decay = [p for n, p in net.named_parameters() if p.ndim > 1 and "cls" not in n]
    no_decay = [p for n, p in net.named_parameters() if p.ndim <= 1 or "cls" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98))
    total = args.epochs * len(tr_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, args.warmup * len(tr_dl), total))

    ckpt = os.path.join(args.save, f"fold{args.fold}.pt")
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
    best_auc, bad_epochs = 0.0, 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for x, y, _ in tr_dl:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x[0].to(device, non_blocking=True))
            loss = F.cross_entropy(logits.float(), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(agg)

        val_auc = eval_auc(net, va_dl, device)
        improved = val_auc > best_auc
        if improved:
            best_auc, bad_epochs = val_auc, 0
        else:
            bad_epochs += 1
        if rank == 0:
            print(f"epoch {epoch:02d}  loss {(agg[0] / agg[1]).item():.4f}  val AUC {val_auc:.4f}"
                  f"{' *' if improved else ''}  {time.time() - t0:.0f}s", flush=True)
            if improved:
                torch.save({"model": net.state_dict(), "epoch": epoch, "args": vars(args)}, ckpt)
        if bad_epochs >= args.patience:
            break

    dist.barrier()
    net.load_state_dict(torch.load(ckpt, map_location=device)["model"])
    test_auc = eval_auc(net, te_dl, device)
    if rank == 0:
        print(f"fold {args.fold}: val AUC {best_auc:.4f}  test AUC {test_auc:.4f}")
        pd.DataFrame([{"fold": args.fold, "val_auc": best_auc, "test_auc": test_auc}]).to_csv(
            os.path.join(args.save, f"fold{args.fold}_result.csv"), index=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
