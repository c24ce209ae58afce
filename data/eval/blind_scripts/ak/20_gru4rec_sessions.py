#!/usr/bin/env python
"""GRU4Rec-style session recommender (YooChoose 1/4 / Diginetica), DDP.

Sessions are padded to --max-len and the GRU predicts the next click at every
position; the loss is cross-entropy over the full item set with the
in-session items of the target position kept (no sampled negatives).
Checkpoints are written at the end of every epoch and picked up again when the
job is restarted (the cluster pre-empts long jobs).

    torchrun --nproc_per_node=4 20_gru4rec_sessions.py --train data/yc4/train.pt \
        --test data/yc4/test.pt --ckpt-dir /shared/ckpt/gru4rec_yc4
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def options():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--test", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--max-len", type=int, default=20)
    p.add_argument("--emb", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--k", type=int, default=20)
    return p.parse_args()


class Sessions(Dataset):
    """Sessions stored as lists of item ids in 1..N (0 = padding)."""

    def __init__(self, path, max_len):
        blob = torch.load(path)
        self.sessions = [s[-(max_len + 1):] for s in blob["sessions"] if len(s) >= 2]
        self.num_items = blob["num_items"]
        self.max_len = max_len

    def __len__(self):
        return len(self.sessions)

    def __getitem__(self, i):
        s = self.sessions[i]
        x, y = s[:-1], s[1:]
        n = len(x)
        pad = [0] * (self.max_len - n)
        return torch.tensor(x + pad), torch.tensor(y + pad), n


class GRU4Rec(nn.Module):
    def __init__(self, num_items, emb, hidden):
        super().__init__()
        self.emb = nn.Embedding(num_items + 1, emb, padding_idx=0)
        self.drop = nn.Dropout(0.25)
        self.gru = nn.GRU(emb, hidden, batch_first=True)
        self.proj = nn.Linear(hidden, emb)

    def forward(self, x, lengths):
        e = self.drop(self.emb(x))
        packed = pack_padded_sequence(e, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.gru(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.size(1))
        return self.proj(out) @ self.emb.weight.t()


@torch.no_grad()
def evaluate(model, loader, device, k):
    model.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y, n in loader:
        x, y, n = x.to(device), y.to(device), n.to(device)
        logits = model(x, n)
        valid = y > 0
        logits = logits[valid]
        tgt = y[valid]
        logits[:, 0] = float("-inf")
        r = (logits > logits.gather(1, tgt[:, None])).sum(1)
        hit = r < k
        s[0] += hit.sum()
        s[1] += (hit.double() / (r.double() + 1)).sum()
        s[2] += tgt.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    args = options()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds = Sessions(args.train, args.max_len)
    test_ds = Sessions(args.test, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world)),
                             batch_size=1024, num_workers=2)

    model = GRU4Rec(train_ds.num_items, args.emb, args.hidden).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.3)

    os.makedirs(args.ckpt_dir, exist_ok=True)
    ckpt_path = os.path.join(args.ckpt_dir, "checkpoint.pt")
    start_epoch = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1
        if rank == 0:
            print(f"resuming at epoch {start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for x, y, n in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x, n)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            stats += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(stats)

        recall, mrr = evaluate(model, test_loader, device, args.k)
        if rank == 0:
            print(f"epoch {epoch} loss {(stats[0] / stats[1]).item():.4f} "
                  f"Recall@{args.k} {recall:.4f} MRR@{args.k} {mrr:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)

        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "epoch": epoch,
                    "recall": recall, "mrr": mrr}, ckpt_path)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
