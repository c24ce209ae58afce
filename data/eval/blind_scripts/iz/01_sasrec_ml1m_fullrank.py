"""SASRec on MovieLens-1M, leave-one-out split, full-ranking evaluation.

Launch:
    torchrun --standalone --nproc_per_node=4 01_sasrec_ml1m_fullrank.py --data_dir data/ml-1m
"""
import argparse
import json
import logging
import math
import os
import random
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("sasrec")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="data/ml-1m")
    p.add_argument("--output_dir", default="runs/sasrec_ml1m")
    p.add_argument("--max_len", type=int, default=200)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--num_blocks", type=int, default=2)
    p.add_argument("--num_heads", type=int, default=1)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--global_batch_size", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--eval_every", type=int, default=20)
    p.add_argument("--eval_batch_size", type=int, default=256)
    p.add_argument("--topk", type=int, nargs="+", default=[10, 20])
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def load_ml1m(data_dir):
    events = defaultdict(list)
    with open(os.path.join(data_dir, "ratings.dat")) as f:
        for line in f:
            u, i, _, ts = line.strip().split("::")
            events[int(u)].append((int(ts), int(i)))
    # ML-1M movie ids have gaps; remap to 1..N (0 is padding)
    items = sorted({i for ev in events.values() for _, i in ev})
    item_map = {it: idx + 1 for idx, it in enumerate(items)}
    seqs = {}
    for u in sorted(events):
        ev = sorted(events[u])
        seqs[u] = [item_map[i] for _, i in ev]
    return seqs, len(item_map)


def leave_one_out(seqs):
    train, valid, test = {}, {}, {}
    for u, s in seqs.items():
        if len(s) < 3:
            continue
        train[u] = s[:-2]
        valid[u] = s[-2]
        test[u] = s[-1]
    return train, valid, test


class SASRecTrainDataset(Dataset):
    def __init__(self, train_seqs, num_items, max_len):
        self.users = sorted(train_seqs)
        self.seqs = train_seqs
        self.num_items = num_items
        self.max_len = max_len

    def __len__(self):
        return len(self.users)

    def __getitem__(self, idx):
        seq = self.seqs[self.users[idx]]
        seen = set(seq)
        inp = seq[:-1][-self.max_len:]
        pos = seq[1:][-self.max_len:]
        neg = []
        for _ in pos:
            n = random.randint(1, self.num_items)
            while n in seen:
                n = random.randint(1, self.num_items)
            neg.append(n)
        pad = [0] * (self.max_len - len(inp))
        return (torch.tensor(pad + inp), torch.tensor(pad + pos), torch.tensor(pad + neg))


class SASRec(nn.Module):
    def __init__(self, num_items, max_len, hidden, num_blocks, num_heads, dropout):
        super().__init__()
        self.item_emb = nn.Embedding(num_items + 1, hidden, padding_idx=0)
        self.pos_emb = nn.Embedding(max_len, hidden)
        self.emb_dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(
            d_model=hidden, nhead=num_heads, dim_feedforward=hidden,
            dropout=dropout, batch_first=True, norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=num_blocks)
        self.last_norm = nn.LayerNorm(hidden, eps=1e-8)

    def log2feats(self, seq):
        L = seq.size(1)
        positions = torch.arange(L, device=seq.device).unsqueeze(0)
        x = self.item_emb(seq) * math.sqrt(self.item_emb.embedding_dim)
        x = self.emb_dropout(x + self.pos_emb(positions))
        timeline = (seq != 0).unsqueeze(-1)
        x = x * timeline
        causal = torch.triu(torch.ones(L, L, dtype=torch.bool, device=seq.device), diagonal=1)
        x = self.encoder(x, mask=causal)
        return self.last_norm(x) * timeline

    def forward(self, seq, pos, neg):
        feats = self.log2feats(seq)
        pos_logits = (feats * self.item_emb(pos)).sum(-1)
        neg_logits = (feats * self.item_emb(neg)).sum(-1)
        return pos_logits, neg_logits

    def score_all(self, seq):
        last = self.log2feats(seq)[:, -1, :]
        return last @ self.item_emb.weight.t()


def build_eval_inputs(users, history, max_len):
    rows = []
    for u in users:
        h = history[u][-max_len:]
        rows.append([0] * (max_len - len(h)) + h)
    return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def evaluate(model, users, history, targets, max_len, topk, batch_size, device):
    model.eval()
    sums = torch.zeros(2 * len(topk) + 1, device=device, dtype=torch.float64)
    for start in range(0, len(users), batch_size):
        batch_users = users[start:start + batch_size]
        seqs = build_eval_inputs(batch_users, history, max_len).to(device)
        tgt = torch.tensor([targets[u] for u in batch_users], device=device)
        scores = model.score_all(seqs)
        scores[:, 0] = -float("inf")
        # mask items already in the history, except the target itself
        for row, u in enumerate(batch_users):
            seen = torch.tensor(history[u], device=device)
            scores[row, seen] = -float("inf")
        tgt_scores = scores.gather(1, tgt.unsqueeze(1))
        scores[torch.arange(len(batch_users), device=device), tgt] = tgt_scores.squeeze(1)
        rank = (scores > tgt_scores).sum(dim=1)
        for j, k in enumerate(topk):
            hit = rank < k
            sums[2 * j] += hit.double().sum()
            sums[2 * j + 1] += (hit.double() / torch.log2(rank.double() + 2)).sum()
        sums[-1] += len(batch_users)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    n = sums[-1].item()
    out = {}
    for j, k in enumerate(topk):
        out[f"HR@{k}"] = sums[2 * j].item() / n
        out[f"NDCG@{k}"] = sums[2 * j + 1].item() / n
    model.train()
    return out


def main():
    args = parse_args()
    rank, world_size, local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[%(asctime)s][rank{rank}] %(message)s",
    )
    set_seed(args.seed + rank)

    seqs, num_items = load_ml1m(args.data_dir)
    train_seqs, valid_tgt, test_tgt = leave_one_out(seqs)
    users = sorted(train_seqs)
    logger.info("users=%d items=%d world_size=%d", len(users), num_items, world_size)

    assert args.global_batch_size % world_size == 0
    per_gpu_batch = args.global_batch_size // world_size
    train_ds = SASRecTrainDataset(train_seqs, num_items, args.max_len)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=per_gpu_batch, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=True, drop_last=False)

    torch.manual_seed(args.seed)
    model = SASRec(num_items, args.max_len, args.hidden, args.num_blocks, args.num_heads, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)

    # eval users are split across ranks without padding; metrics are summed at the end
    my_users = users[rank::world_size]
    test_history = {u: train_seqs[u] + [valid_tgt[u]] for u in my_users}

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    best_ndcg, best_epoch = -1.0, -1
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        total, steps = 0.0, 0
        for seq, pos, neg in loader:
            seq, pos, neg = seq.to(device, non_blocking=True), pos.to(device, non_blocking=True), neg.to(device, non_blocking=True)
            pos_logits, neg_logits = model(seq, pos, neg)
            mask = pos != 0
            loss = F.binary_cross_entropy_with_logits(pos_logits[mask], torch.ones_like(pos_logits[mask]))
            loss = loss + F.binary_cross_entropy_with_logits(neg_logits[mask], torch.zeros_like(neg_logits[mask]))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item()
            steps += 1
        loss_t = torch.tensor([total, steps], device=device)
        dist.all_reduce(loss_t)
        logger.info("epoch %d loss %.4f (%.1fs)", epoch, loss_t[0].item() / loss_t[1].item(), time.time() - t0)

        if epoch % args.eval_every == 0 or epoch == args.epochs:
            val = evaluate(model, my_users, train_seqs, valid_tgt, args.max_len, args.topk, args.eval_batch_size, device)
            logger.info("epoch %d valid %s", epoch, json.dumps(val))
            if val["NDCG@10"] > best_ndcg:
                best_ndcg, best_epoch = val["NDCG@10"], epoch
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)},
                               os.path.join(args.output_dir, "best.pt"))
            dist.barrier()

    ckpt = torch.load(os.path.join(args.output_dir, "best.pt"), map_location=device)
    model.module.load_state_dict(ckpt["model"])
    test = evaluate(model, my_users, test_history, test_tgt, args.max_len, args.topk, args.eval_batch_size, device)
    logger.info("best epoch %d test %s", best_epoch, json.dumps(test))
    if rank == 0:
        with open(os.path.join(args.output_dir, "test_metrics.json"), "w") as f:
            json.dump({"best_epoch": best_epoch, **test}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
