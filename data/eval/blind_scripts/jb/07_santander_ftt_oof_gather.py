"""
Santander customer transaction prediction - FT-Transformer with per-feature
"count" categorical tokens (frequency of each raw value, the well-known magic
feature) and 10-fold out-of-fold predictions gathered across all GPUs.

    torchrun --nnodes=1 --nproc_per_node=8 07_santander_ftt_oof_gather.py \
        --train /datasets/santander/train.csv --test /datasets/santander/test.csv
"""
import argparse
import logging
import os
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_VARS = 200
log = logging.getLogger("santander")


class Rows(Dataset):
    def __init__(self, num, cnt, y):
        self.num, self.cnt, self.y = num, cnt, y

    def __len__(self):
        return len(self.num)

    def __getitem__(self, i):
        return i, self.num[i], self.cnt[i], self.y[i]


class VarTokenizer(nn.Module):
    """One token per raw variable: value * w_j + b_j + emb_j(count bucket)."""

    def __init__(self, n_vars, n_buckets, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n_vars, d) / d ** 0.5)
        self.b = nn.Parameter(torch.zeros(n_vars, d))
        self.count_emb = nn.Embedding(n_vars * n_buckets, d)
        self.register_buffer("shift", torch.arange(n_vars) * n_buckets, persistent=False)

    def forward(self, num, cnt):
        return num.unsqueeze(-1) * self.w + self.b + self.count_emb(cnt + self.shift)


class FTT(nn.Module):
    def __init__(self, n_vars=N_VARS, n_buckets=8, d=64, blocks=2, heads=4, drop=0.1):
        super().__init__()
        self.tok = VarTokenizer(n_vars, n_buckets, d)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, drop, activation="gelu", batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, blocks, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.GELU(), nn.Linear(d, 1))

    def forward(self, num, cnt):
        x = self.tok(num, cnt)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], 1)
        return self.head(self.enc(x)[:, 0]).squeeze(-1)


def count_buckets(train, test, cols, n_buckets):
    """Bucketed value counts computed over train + real test rows (deterministic, no target)."""
    full = pd.concat([train[cols], test[cols]])
    out_tr = np.zeros((len(train), len(cols)), np.int64)
    out_te = np.zeros((len(test), len(cols)), np.int64)
    edges = np.array([1, 2, 3, 5, 10, 20, 50])[: n_buckets - 1]
    for j, c in enumerate(cols):
        vc = full[c].value_counts()
        out_tr[:, j] = np.searchsorted(edges, train[c].map(vc).values, side="right")
        out_te[:, j] = np.searchsorted(edges, test[c].map(vc).values, side="right")
    return out_tr, out_te


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    ids, probs = [], []
    for i, num, cnt, _ in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logit = model(num.to(device, non_blocking=True), cnt.to(device, non_blocking=True))
        probs.append(torch.sigmoid(logit.float()).cpu())
        ids.append(i)
    return torch.cat(ids), torch.cat(probs)


def all_gather_cat(t):
    bufs = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(bufs, t)
    return torch.cat(bufs)


def oof_from_shards(ids, probs, n):
    ids, probs = all_gather_cat(ids).numpy(), all_gather_cat(probs).numpy()
    out = np.zeros(n, np.float32)
    out[ids] = probs        # DistributedSampler padding repeats a few ids; same value either way
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--out", default="runs/santander_ftt")
    ap.add_argument("--folds", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=512, help="per GPU")
    ap.add_argument("--base-lr", type=float, default=1e-4, help="per 512 samples")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s | %(message)s")
    torch.manual_seed(args.seed)
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)

    train, test = pd.read_csv(args.train), pd.read_csv(args.test)
    cols = [f"var_{i}" for i in range(N_VARS)]
    cnt_tr, cnt_te = count_buckets(train, test, cols, 8)
    mu, sd = train[cols].mean(), train[cols].std()
    num_tr = ((train[cols] - mu) / sd).values.astype(np.float32)
    num_te = ((test[cols] - mu) / sd).values.astype(np.float32)
    y = train["target"].values.astype(np.float32)
    test_ds = Rows(num_te, cnt_te, np.zeros(len(test), np.float32))
    test_loader = DataLoader(test_ds, batch_size=4096, sampler=DistributedSampler(test_ds, shuffle=False), num_workers=2)

    oof = np.zeros(len(train), np.float32)
    sub = np.zeros(len(test), np.float32)
    skf = StratifiedKFold(args.folds, shuffle=True, random_state=args.seed)
    for fold, (tr_idx, va_idx) in enumerate(skf.split(num_tr, y)):
        tr_ds = Rows(num_tr[tr_idx], cnt_tr[tr_idx], y[tr_idx])
        va_ds = Rows(num_tr[va_idx], cnt_tr[va_idx], y[va_idx])
        sampler = DistributedSampler(tr_ds, shuffle=True, seed=args.seed + fold, drop_last=True)
        tr_loader = DataLoader(tr_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                               pin_memory=True, drop_last=True)
        va_loader = DataLoader(va_ds, batch_size=4096, sampler=DistributedSampler(va_ds, shuffle=False), num_workers=2)

        model = DDP(FTT().to(device), device_ids=[local_rank])
        lr = args.base_lr * args.batch_size * world / 512
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
        total = args.epochs * len(tr_loader)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=0.05)
        scaler = torch.cuda.amp.GradScaler()

        best = 0.0
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for _, num, cnt, yb in tr_loader:
                num, cnt, yb = num.to(device, non_blocking=True), cnt.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    logit = model(num, cnt)
                loss = F.binary_cross_entropy_with_logits(logit.float(), yb)
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                sched.step()

            ids, probs = predict(model.module, va_loader, device)
            val = oof_from_shards(ids, probs, len(va_ds))
            auc = roc_auc_score(y[va_idx], val)
            log.info("fold %d epoch %d auc %.5f lr %.2e", fold, epoch, auc, sched.get_last_lr()[0])
            if auc > best:
                best = auc
                oof[va_idx] = val
                if rank == 0:
                    torch.save({"state_dict": model.module.state_dict(), "auc": float(auc)}, out / f"fold{fold}.pt")

        dist.barrier()
        ckpt = torch.load(out / f"fold{fold}.pt", map_location=device)
        model.module.load_state_dict(ckpt["state_dict"])
        ids, probs = predict(model.module, test_loader, device)
        sub += oof_from_shards(ids, probs, len(test_ds)) / args.folds
        log.info("fold %d best auc %.5f", fold, best)

    if rank == 0:
        log.info("OOF AUC %.5f", roc_auc_score(y, oof))
        pd.DataFrame({"ID_code": train["ID_code"], "oof": oof}).to_csv(out / "oof.csv", index=False)
        pd.DataFrame({"ID_code": test["ID_code"], "target": sub}).to_csv(out / "submission.csv", index=False)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
