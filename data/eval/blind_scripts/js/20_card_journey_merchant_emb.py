"""Card-journey model: the sequence of merchants a card visited (plus amounts / gaps) -> fraud on the last txn.

Merchants (acquirer MID strings, e.g. "MID-004417-0093") are learned as embeddings: ids seen
at least --min-count times in the training window get their own row, the rest share the OOV row.

    torchrun --nproc_per_node=8 20_card_journey_merchant_emb.py --data /data/journeys/journeys.parquet
"""
import argparse
import json
import os
import time
from collections import Counter

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PAD, OOV = 0, 1
MAX_LEN = 30


class JourneyDataset(Dataset):
    def __init__(self, df, vocab):
        self.merch = [np.array([vocab.get(m, OOV) for m in seq[-MAX_LEN:]], dtype=np.int64) for seq in df["merchants"]]
        self.amts = [np.log1p(np.asarray(a[-MAX_LEN:], dtype=np.float32)) for a in df["amounts"]]
        self.gaps = [np.log1p(np.asarray(g[-MAX_LEN:], dtype=np.float32) / 60.0) for g in df["gaps_sec"]]
        self.y = df["is_fraud"].to_numpy(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        n = len(self.merch[i])
        m = np.full(MAX_LEN, PAD, dtype=np.int64)
        x = np.zeros((MAX_LEN, 2), dtype=np.float32)
        m[-n:] = self.merch[i]
        x[-n:, 0], x[-n:, 1] = self.amts[i], self.gaps[i]
        return torch.from_numpy(m), torch.from_numpy(x), torch.tensor(self.y[i])


class JourneyNet(nn.Module):
    def __init__(self, n_merchants, emb=64, hidden=128):
        super().__init__()
        self.merchant = nn.Embedding(n_merchants, emb, padding_idx=PAD)
        self.num = nn.Linear(2, emb)
        self.conv = nn.Sequential(
            nn.Conv1d(emb, hidden, 3, padding=1), nn.GELU(),
            nn.Conv1d(hidden, hidden, 3, padding=2, dilation=2), nn.GELU(),
        )
        self.attn = nn.Linear(hidden, 1)
        self.head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.GELU(), nn.Dropout(0.2), nn.Linear(hidden, 1))

    def forward(self, merch, num):
        h = self.merchant(merch) + self.num(num)
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        mask = merch == PAD
        w = self.attn(h).squeeze(-1).masked_fill(mask, float("-inf")).softmax(-1)
        pooled = (w.unsqueeze(-1) * h).sum(1)
        return self.head(torch.cat([pooled, h[:, -1]], dim=-1)).squeeze(-1)


def build_vocab(seqs, min_count):
    counts = Counter(m for seq in seqs for m in seq)
    kept = {m for m, c in counts.items() if c >= min_count}
    return {m: i + 2 for i, m in enumerate(kept)}


@torch.no_grad()
def evaluate(model, ds, device, rank, world):
    model.eval()
    dl = DataLoader(torch.utils.data.Subset(ds, range(rank, len(ds), world)), batch_size=4096, num_workers=2)
    s, t = [], []
    for merch, num, y in dl:
        s.append(torch.sigmoid(model.module(merch.to(device), num.to(device))).cpu())
        t.append(y)
    parts = [None] * world
    dist.all_gather_object(parts, (torch.cat(s).numpy(), torch.cat(t).numpy()))
    return average_precision_score(np.concatenate([p[1] for p in parts]), np.concatenate([p[0] for p in parts]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/journeys/journeys.parquet")
    ap.add_argument("--out", default="/shared/models/journey")
    ap.add_argument("--train-end", default="2024-04-01")
    ap.add_argument("--val-end", default="2024-05-01")
    ap.add_argument("--min-count", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--pos-weight", type=float, default=10.0)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    df = pd.read_parquet(args.data)
    df["txn_ts"] = pd.to_datetime(df["txn_ts"])
    train_df = df[df["txn_ts"] < args.train_end].reset_index(drop=True)
    val_df = df[(df["txn_ts"] >= args.train_end) & (df["txn_ts"] < args.val_end)].reset_index(drop=True)

    vocab = build_vocab(train_df["merchants"], args.min_count)
    train_ds, val_ds = JourneyDataset(train_df, vocab), JourneyDataset(val_df, vocab)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6, pin_memory=True,
                        drop_last=True)

    model = DDP(JourneyNet(len(vocab) + 2).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)
    pos_weight = torch.tensor(args.pos_weight, device=device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "merchant_vocab.json"), "w") as f:
            json.dump(vocab, f)
        print(f"merchants in vocab: {len(vocab)}  train {len(train_ds)}  val {len(val_ds)}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for merch, num, y in loader:
            merch, num, y = merch.to(device, non_blocking=True), num.to(device, non_blocking=True), y.to(device)
            loss = F.binary_cross_entropy_with_logits(model(merch, num), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(acc)
        ap_score = evaluate(model, val_ds, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} loss {(acc[0] / acc[1]).item():.4f} val PR-AUC {ap_score:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if ap_score > best:
                best = ap_score
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_pr_auc": ap_score},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
