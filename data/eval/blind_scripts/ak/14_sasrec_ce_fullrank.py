#!/usr/bin/env python
"""SASRec with full softmax (cross-entropy over all items) and full-ranking eval.

Sequences come from a preprocessed .pt file {"train": [[item, ...], ...],
"num_items": N} (ids 1..N, 0 = padding). Validation ranks the held-out next
item against the full catalogue (no sampled negatives) and reports Recall@K and
NDCG@K for K in {10, 20, 50}.

    torchrun --nproc_per_node=4 14_sasrec_ce_fullrank.py --data data/yelp_seq.pt
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

KS = (10, 20, 50)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--max-len", type=int, default=100)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--out", default="out/sasrec_ce")
    return p.parse_args()


class NextItemTrain(Dataset):
    def __init__(self, seqs, max_len):
        # drop the last two items (validation, test targets)
        self.seqs = [s[:-2] for s in seqs if len(s) >= 4]
        self.max_len = max_len

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i][-(self.max_len + 1):]
        x, y = s[:-1], s[1:]
        pad = self.max_len - len(x)
        return torch.tensor([0] * pad + x), torch.tensor([0] * pad + y)


class NextItemEval(Dataset):
    def __init__(self, seqs, max_len, which="val"):
        self.rows = []
        for s in seqs:
            if len(s) < 4:
                continue
            hist, target = (s[:-2], s[-2]) if which == "val" else (s[:-1], s[-1])
            self.rows.append((hist[-max_len:], target, set(hist)))
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        hist, target, _ = self.rows[i]
        return torch.tensor([0] * (self.max_len - len(hist)) + hist), torch.tensor(target), i


class SASRecCE(nn.Module):
    def __init__(self, num_items, max_len, d, layers, heads, dropout):
        super().__init__()
        self.item = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        self.emb_drop = nn.Dropout(dropout)
        block = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(block, layers)
        self.final_ln = nn.LayerNorm(d)
        self.register_buffer("attn_mask", torch.triu(torch.full((max_len, max_len), float("-inf")), 1),
                             persistent=False)

    def hidden(self, x):
        p = torch.arange(x.size(1), device=x.device)
        h = self.emb_drop(self.item(x) + self.pos(p))
        h = self.blocks(h, mask=self.attn_mask)
        return self.final_ln(h)

    def forward(self, x):
        # logits over the whole catalogue, weight-tied with the input embedding
        return self.hidden(x) @ self.item.weight.t()


@torch.no_grad()
def evaluate(model, loader, ds, device):
    model.eval()
    sums = torch.zeros(2 * len(KS) + 1, device=device)
    for x, target, idx in loader:
        x, target = x.to(device), target.to(device)
        scores = model(x)[:, -1]
        scores[:, 0] = float("-inf")
        for row, i in enumerate(idx.tolist()):
            seen = list(ds.rows[i][2] - {ds.rows[i][1]})
            if seen:
                scores[row, seen] = float("-inf")
        tgt = scores.gather(1, target.unsqueeze(1))
        rank = (scores > tgt).sum(1)
        for j, k in enumerate(KS):
            hit = (rank < k).float()
            sums[2 * j] += hit.sum()
            sums[2 * j + 1] += (hit / torch.log2(rank.float() + 2)).sum()
        sums[-1] += x.size(0)
    dist.all_reduce(sums)
    model.train()
    n = sums[-1].item()
    out = {}
    for j, k in enumerate(KS):
        out[f"recall@{k}"] = sums[2 * j].item() / n
        out[f"ndcg@{k}"] = sums[2 * j + 1].item() / n
    return out


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    blob = torch.load(args.data)
    seqs, num_items = blob["train"], blob["num_items"]
    train_ds = NextItemTrain(seqs, args.max_len)
    val_ds = NextItemEval(seqs, args.max_len, "val")
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=512, num_workers=2)

    model = SASRecCE(num_items, args.max_len, args.d_model, args.n_layers, args.n_heads,
                     args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    best, bad = -1.0, 0
    if is_main:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        if is_main:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} {time.time() - t0:.0f}s",
                  flush=True)

        stop = torch.zeros(1, device=device)
        if epoch % args.eval_every == 0 and is_main:
            metrics = evaluate(model.module, val_loader, val_ds, device)
            print("  " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
            if metrics["ndcg@10"] > best:
                best, bad = metrics["ndcg@10"], 0
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
            else:
                bad += 1
                if bad >= args.patience:
                    stop.fill_(1)
        dist.broadcast(stop, src=0)
        if stop.item():
            if is_main:
                print(f"early stop at epoch {epoch}, best ndcg@10 {best:.4f}", flush=True)
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
