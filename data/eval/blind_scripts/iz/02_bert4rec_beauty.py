#!/usr/bin/env python
# BERT4Rec on Amazon Beauty (5-core), leave-one-out, 100 sampled negatives per user.
#
#   torchrun --nproc_per_node=4 02_bert4rec_beauty.py --ratings data/ratings_Beauty.csv --accum_steps 2
#
import argparse
import csv
import math
import os
import random
import time
from collections import Counter, defaultdict
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ratings", default="data/ratings_Beauty.csv")
    ap.add_argument("--out", default="checkpoints/bert4rec_beauty")
    ap.add_argument("--init_from", default="")
    ap.add_argument("--min_count", type=int, default=5)
    ap.add_argument("--max_len", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--mask_prob", type=float, default=0.2)
    ap.add_argument("--batch_size", type=int, default=64, help="per-GPU micro batch")
    ap.add_argument("--accum_steps", type=int, default=1)
    ap.add_argument("--base_lr", type=float, default=1e-3, help="lr for a global batch of 256")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--num_neg", type=int, default=100)
    ap.add_argument("--eval_every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def read_beauty(path, min_count):
    rows = []
    with open(path) as f:
        for user, item, _rating, ts in csv.reader(f):
            rows.append((user, item, int(ts)))
    # 5-core filtering, repeated until stable
    while True:
        uc = Counter(r[0] for r in rows)
        ic = Counter(r[1] for r in rows)
        kept = [r for r in rows if uc[r[0]] >= min_count and ic[r[1]] >= min_count]
        if len(kept) == len(rows):
            break
        rows = kept
    item_ids = {it: i + 1 for i, it in enumerate(sorted({r[1] for r in rows}))}
    by_user = defaultdict(list)
    for u, it, ts in rows:
        by_user[u].append((ts, item_ids[it]))
    seqs = [[it for _, it in sorted(v)] for _, v in sorted(by_user.items())]
    return seqs, len(item_ids)


class ClozeDataset(Dataset):
    def __init__(self, seqs, num_items, max_len, mask_prob):
        self.seqs = seqs
        self.num_items = num_items
        self.mask_token = num_items + 1
        self.max_len = max_len
        self.mask_prob = mask_prob

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, idx):
        seq = self.seqs[idx][-self.max_len:]
        tokens, labels = [], []
        for it in seq:
            p = random.random()
            if p < self.mask_prob:
                p /= self.mask_prob
                if p < 0.8:
                    tokens.append(self.mask_token)
                elif p < 0.9:
                    tokens.append(random.randint(1, self.num_items))
                else:
                    tokens.append(it)
                labels.append(it)
            else:
                tokens.append(it)
                labels.append(0)
        if all(l == 0 for l in labels):
            # always predict at least the last position
            tokens[-1], labels[-1] = self.mask_token, seq[-1]
        pad = self.max_len - len(tokens)
        return torch.tensor([0] * pad + tokens), torch.tensor([0] * pad + labels)


class BERT4Rec(nn.Module):
    def __init__(self, num_items, max_len, hidden, layers, heads, dropout):
        super().__init__()
        # 0 = padding, 1..num_items = items, num_items + 1 = [MASK]
        self.tok_emb = nn.Embedding(num_items + 2, hidden, padding_idx=0)
        self.pos_emb = nn.Embedding(max_len, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.drop = nn.Dropout(dropout)
        enc_layer = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout,
                                               activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, layers)
        self.head = nn.Linear(hidden, num_items + 1)

    def forward(self, tokens):
        pos = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0)
        x = self.drop(self.norm(self.tok_emb(tokens) + self.pos_emb(pos)))
        x = self.encoder(x, src_key_padding_mask=tokens == 0)
        return self.head(x)


def sample_negatives(user_idx, seen, num_items, n, seed):
    rng = random.Random(seed * 1_000_003 + user_idx)
    negs = []
    while len(negs) < n:
        c = rng.randint(1, num_items)
        if c not in seen:
            negs.append(c)
    return negs


@torch.no_grad()
def evaluate(net, seqs, user_ids, num_items, args, split, device):
    net.eval()
    mask_token = num_items + 1
    results = []
    for start in range(0, len(user_ids), 256):
        chunk = user_ids[start:start + 256]
        toks, cands = [], []
        for u in chunk:
            s = seqs[u]
            hist = s[:-2] if split == "valid" else s[:-1]
            target = s[-2] if split == "valid" else s[-1]
            inp = (hist + [mask_token])[-args.max_len:]
            toks.append([0] * (args.max_len - len(inp)) + inp)
            cands.append([target] + sample_negatives(u, set(s), num_items, args.num_neg, args.seed))
        toks = torch.tensor(toks, device=device)
        cands = torch.tensor(cands, device=device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(toks)[:, -1, :]
        scores = logits.float().gather(1, cands)
        ranks = (scores[:, 1:] > scores[:, :1]).sum(1).tolist()
        results.extend(zip(chunk, ranks))
    net.train()
    return results


def summarize(results, ks=(5, 10)):
    out = {}
    n = len(results)
    for k in ks:
        out[f"HR@{k}"] = sum(r < k for _, r in results) / n
        out[f"NDCG@{k}"] = sum(1.0 / math.log2(r + 2) for _, r in results if r < k) / n
    return out


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    is_main = rank == 0

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    seqs, num_items = read_beauty(args.ratings, args.min_count)
    train_seqs = [s[:-2] for s in seqs]
    if is_main:
        print(f"{len(seqs)} users, {num_items} items, world={world}", flush=True)

    ds = ClozeDataset(train_seqs, num_items, args.max_len, args.mask_prob)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = BERT4Rec(num_items, args.max_len, args.hidden, args.layers, args.heads, args.dropout)
    if args.init_from:
        state = torch.load(args.init_from, map_location="cpu")
        model.load_state_dict(state["model"])
    model = model.to(device)
    ddp = DDP(model, device_ids=[local_rank])

    global_batch = args.batch_size * args.accum_steps * world
    lr = args.base_lr * global_batch / 256
    opt = torch.optim.AdamW(ddp.parameters(), lr=lr, weight_decay=0.01)
    updates_per_epoch = math.ceil(len(loader) / args.accum_steps)
    total_updates = updates_per_epoch * args.epochs
    warmup = max(1, min(1000, total_updates // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, (total_updates - s) / max(1, total_updates - warmup)))
    if is_main:
        print(f"global batch {global_batch}, lr {lr:.2e}, {total_updates} updates", flush=True)
        os.makedirs(args.out, exist_ok=True)

    my_users = list(range(rank, len(seqs), world))
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0, run_loss = time.time(), torch.zeros(2, device=device)
        for i, (tokens, labels) in enumerate(loader):
            tokens = tokens.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            sync_now = (i + 1) % args.accum_steps == 0 or (i + 1) == len(loader)
            with (nullcontext() if sync_now else ddp.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = ddp(tokens)
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1), ignore_index=0)
                (loss / args.accum_steps).backward()
            run_loss += torch.stack([loss.detach(), torch.ones((), device=device)])
            if sync_now:
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 5.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
        dist.all_reduce(run_loss)
        if is_main:
            print(f"epoch {epoch} loss {(run_loss[0] / run_loss[1]).item():.4f} {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            local = evaluate(model, seqs, my_users, num_items, args, "valid", device)
            gathered = [None] * world
            dist.all_gather_object(gathered, local)
            if is_main:
                merged = [r for part in gathered for r in part]
                metrics = summarize(merged)
                print(f"epoch {epoch} valid " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
                if metrics["NDCG@10"] > best:
                    best = metrics["NDCG@10"]
                    torch.save({"model": model.state_dict(), "epoch": epoch, "num_items": num_items},
                               os.path.join(args.out, "best.pt"))
            dist.barrier()

    state = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
    model.load_state_dict(state["model"])
    local = evaluate(model, seqs, my_users, num_items, args, "test", device)
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    if is_main:
        merged = sorted(r for part in gathered for r in part)
        print("test", summarize(merged), flush=True)
        with open(os.path.join(args.out, "test_ranks.tsv"), "w") as f:
            for u, r in merged:
                f.write(f"{u}\t{r}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
