"""
SASRec (self-attentive sequential recommendation) on MovieLens-1M / Amazon style data.
Input file: one line per user "user_id item_1 item_2 ... item_n" (chronological, 1-based item ids).
Leave-one-out split: last item = test, second to last = valid.

    torchrun --nproc_per_node=4 14_sasrec_seqrec.py --data data/ml-1m.txt --epochs 200
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def read_sequences(path):
    seqs, n_items = {}, 0
    with open(path) as f:
        for line in f:
            parts = list(map(int, line.split()))
            seqs[parts[0]] = parts[1:]
            n_items = max(n_items, max(parts[1:]))
    return seqs, n_items


class TrainSeqs(Dataset):
    def __init__(self, seqs, n_items, max_len):
        self.users = [u for u, s in seqs.items() if len(s) >= 3]
        self.seqs, self.n_items, self.max_len = seqs, n_items, max_len

    def __len__(self):
        return len(self.users)

    def __getitem__(self, i):
        s = self.seqs[self.users[i]][:-2]                  # hold out valid + test
        inp = np.zeros(self.max_len, dtype=np.int64)
        pos = np.zeros(self.max_len, dtype=np.int64)
        neg = np.zeros(self.max_len, dtype=np.int64)
        seen = set(s)
        tail = s[-(self.max_len + 1):]
        for k, (a, b) in enumerate(zip(tail[:-1][::-1], tail[1:][::-1])):
            idx = self.max_len - 1 - k
            inp[idx], pos[idx] = a, b
            n = random.randint(1, self.n_items)
            while n in seen:
                n = random.randint(1, self.n_items)
            neg[idx] = n
        return torch.from_numpy(inp), torch.from_numpy(pos), torch.from_numpy(neg)


class EvalSeqs(Dataset):
    """Rank the held-out item against 100 sampled negatives."""

    def __init__(self, seqs, n_items, max_len, split="valid", n_neg=100, seed=0):
        rng = random.Random(seed)
        self.rows = []
        for u, s in seqs.items():
            if len(s) < 3:
                continue
            hist, target = (s[:-2], s[-2]) if split == "valid" else (s[:-1], s[-1])
            seen = set(s)
            negs = []
            while len(negs) < n_neg:
                n = rng.randint(1, n_items)
                if n not in seen:
                    negs.append(n)
            inp = np.zeros(max_len, dtype=np.int64)
            h = hist[-max_len:]
            inp[max_len - len(h):] = h
            self.rows.append((inp, np.array([target] + negs, dtype=np.int64)))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        inp, cands = self.rows[i]
        return torch.from_numpy(inp), torch.from_numpy(cands)


class SASRec(nn.Module):
    def __init__(self, n_items, max_len=200, d=64, layers=2, heads=1, dropout=0.2):
        super().__init__()
        self.item_emb = nn.Embedding(n_items + 1, d, padding_idx=0)
        self.pos_emb = nn.Embedding(max_len, d)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(d)
        self.register_buffer("causal", torch.triu(torch.ones(max_len, max_len, dtype=torch.bool), 1),
                             persistent=False)

    def encode(self, seq):
        pos = torch.arange(seq.size(1), device=seq.device)
        x = self.item_emb(seq) * self.item_emb.embedding_dim ** 0.5 + self.pos_emb(pos)
        x = self.drop(x) * (seq > 0).unsqueeze(-1)
        x = self.encoder(x, mask=self.causal[: seq.size(1), : seq.size(1)])
        return self.norm(x)

    def forward(self, seq, pos, neg):
        h = self.encode(seq)
        pos_logits = (h * self.item_emb(pos)).sum(-1)
        neg_logits = (h * self.item_emb(neg)).sum(-1)
        return pos_logits, neg_logits

    def score(self, seq, cands):
        h = self.encode(seq)[:, -1]
        return torch.einsum("bd,bkd->bk", h, self.item_emb(cands))


@torch.no_grad()
def evaluate(model, loader, device, k=10):
    model.eval()
    m = torch.zeros(3, device=device)  # ndcg, hit, n
    for seq, cands in loader:
        scores = model.score(seq.to(device), cands.to(device))
        rank = (scores > scores[:, :1]).sum(1)            # target is column 0
        hit = rank < k
        m[0] += (hit.float() / torch.log2(rank.float() + 2)).sum()
        m[1] += hit.sum()
        m[2] += seq.size(0)
    dist.all_reduce(m)
    model.train()
    return (m[0] / m[2]).item(), (m[1] / m[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--max-len", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--ckpt", default="ckpt/sasrec.pt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(0)

    seqs, n_items = read_sequences(args.data)
    train_ds = TrainSeqs(seqs, n_items, args.max_len)
    valid_ds = EvalSeqs(seqs, n_items, args.max_len, "valid")
    test_ds = EvalSeqs(seqs, n_items, args.max_len, "test")
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, drop_last=True)
    shard = lambda ds: Subset(ds, list(range(rank, len(ds), world)))
    valid_loader = DataLoader(shard(valid_ds), batch_size=512)
    test_loader = DataLoader(shard(test_ds), batch_size=512)

    model = SASRec(n_items, args.max_len).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * args.batch_size * world / 128,
                                 betas=(0.9, 0.98))
    start_epoch, best_ndcg = 0, 0.0
    if os.path.exists(args.ckpt):
        ckpt = torch.load(args.ckpt, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_ndcg = ckpt["epoch"] + 1, ckpt["best_ndcg"]
    model = DDP(model, device_ids=[local_rank])

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        total = torch.zeros(1, device=device)
        for seq, pos, neg in loader:
            seq, pos, neg = seq.to(device), pos.to(device), neg.to(device)
            pos_logits, neg_logits = model(seq, pos, neg)
            mask = pos > 0
            loss = (F.binary_cross_entropy_with_logits(pos_logits[mask], torch.ones_like(pos_logits[mask]))
                    + F.binary_cross_entropy_with_logits(neg_logits[mask], torch.zeros_like(neg_logits[mask])))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"epoch {epoch} loss {total.item() / len(loader):.4f} ({time.time() - t0:.1f}s)", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            ndcg, hr = evaluate(model.module, valid_loader, device)
            if rank == 0:
                print(f"  valid NDCG@10 {ndcg:.4f} HR@10 {hr:.4f}", flush=True)
                if ndcg > best_ndcg:
                    best_ndcg = ndcg
                    os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "epoch": epoch, "best_ndcg": best_ndcg}, args.ckpt)
            dist.barrier()

    # test with the best checkpoint
    best = SASRec(n_items, args.max_len).to(device)
    best.load_state_dict(torch.load(args.ckpt, map_location=device)["model"])
    ndcg, hr = evaluate(best, test_loader, device)
    if rank == 0:
        print(f"test NDCG@10 {ndcg:.4f} HR@10 {hr:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
