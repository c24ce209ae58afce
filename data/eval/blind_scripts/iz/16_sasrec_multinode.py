"""Two-node SASRec training on MovieLens-20M.

Run the same command on both nodes (data and outputs live on the shared /mnt/shared NFS mount):

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=node01:29500 \
        --rdzv_id=sasrec-ml20m 16_sasrec_multinode.py \
        --data_root /mnt/shared/datasets/ml-20m --output_dir /mnt/shared/exp/sasrec_ml20m
"""
import argparse
import datetime
import logging
import math
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("sasrec")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", required=True, help="shared by all nodes")
    p.add_argument("--output_dir", required=True, help="shared by all nodes")
    p.add_argument("--max_len", type=int, default=200)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--batch_per_gpu", type=int, default=64)
    p.add_argument("--base_lr", type=float, default=1e-3, help="lr at a global batch of 128")
    p.add_argument("--max_lr", type=float, default=4e-3)
    p.add_argument("--warmup_epochs", type=int, default=2)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--eval_every", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def build_cache(data_root, cache_path):
    df = pd.read_csv(os.path.join(data_root, "ratings.csv"), usecols=["userId", "movieId", "timestamp"])
    df["item"] = pd.factorize(df["movieId"], sort=True)[0] + 1
    df = df.sort_values(["userId", "timestamp", "item"], kind="mergesort")
    seqs = df.groupby("userId", sort=True)["item"].agg(list)
    lengths = seqs.str.len().to_numpy()
    flat = np.concatenate(seqs.to_numpy()).astype(np.int32)
    tmp = cache_path + ".partial.npz"
    np.savez(tmp, flat=flat, lengths=lengths, num_items=int(df["item"].max()))
    os.replace(tmp, cache_path)


def load_cache(cache_path):
    z = np.load(cache_path)
    offsets = np.concatenate([[0], np.cumsum(z["lengths"])])
    flat = z["flat"]
    seqs = [flat[offsets[i]:offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]
    return seqs, int(z["num_items"])


class TrainSequences(Dataset):
    def __init__(self, seqs, num_items, max_len):
        self.seqs, self.num_items, self.max_len = seqs, num_items, max_len

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i][:-2]
        inp, pos = s[:-1][-self.max_len:], s[1:][-self.max_len:]
        seen = set(s)
        neg = [random.randint(1, self.num_items) for _ in pos]
        neg = [n if n not in seen else random.randint(1, self.num_items) for n in neg]
        pad = [0] * (self.max_len - len(inp))
        return torch.tensor(pad + inp), torch.tensor(pad + pos), torch.tensor(pad + neg)


class SASRec(nn.Module):
    def __init__(self, num_items, max_len, hidden, blocks, heads, dropout):
        super().__init__()
        self.item_emb = nn.Embedding(num_items + 1, hidden, padding_idx=0)
        self.pos_emb = nn.Embedding(max_len, hidden)
        self.dropout = nn.Dropout(dropout)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout, batch_first=True, norm_first=True),
            blocks, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden)

    def encode(self, seq):
        L = seq.size(1)
        x = self.item_emb(seq) * math.sqrt(self.item_emb.embedding_dim) + self.pos_emb.weight[:L]
        x = self.dropout(x) * (seq > 0).unsqueeze(-1)
        mask = torch.triu(torch.ones(L, L, dtype=torch.bool, device=seq.device), 1)
        return self.norm(self.encoder(x, mask=mask))

    def forward(self, seq, pos, neg):
        h = self.encode(seq)
        return (h * self.item_emb(pos)).sum(-1), (h * self.item_emb(neg)).sum(-1)


@torch.no_grad()
def evaluate(net, seqs, users, num_items, max_len, split, device, seed):
    net.eval()
    rng = np.random.default_rng(seed)
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for b in range(0, len(users), 512):
        chunk = users[b:b + 512]
        x = np.zeros((len(chunk), max_len), dtype=np.int64)
        cand = np.zeros((len(chunk), 101), dtype=np.int64)
        for r, u in enumerate(chunk):
            s = seqs[u]
            hist, tgt = (s[:-2], s[-2]) if split == "valid" else (s[:-1], s[-1])
            hist = hist[-max_len:]
            x[r, max_len - len(hist):] = hist
            seen = set(s)
            negs = []
            while len(negs) < 100:
                negs += [int(c) for c in rng.integers(1, num_items + 1, size=400) if int(c) not in seen]
            negs = negs[:100]
            cand[r] = [tgt] + negs
        h = net.encode(torch.from_numpy(x).to(device))[:, -1]
        c = torch.from_numpy(cand).to(device)
        sc = torch.einsum("bd,bkd->bk", h, net.item_emb(c))
        rank = (sc[:, 1:] > sc[:, :1]).sum(1).double()
        hit = (rank < 10).double()
        acc += torch.stack([hit.sum(), (hit / torch.log2(rank + 2)).sum(),
                            torch.tensor(float(len(chunk)), device=device, dtype=torch.float64)])
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # generous timeout: rank 0 may spend a while building the cache on first use
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [{rank}/{world}] %(message)s")
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    cache = os.path.join(args.data_root, "sasrec_cache.npz")
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        if not os.path.exists(cache):
            log.info("building %s", cache)
            build_cache(args.data_root, cache)
    dist.barrier()
    seqs, num_items = load_cache(cache)
    log.info("%d users, %d items", len(seqs), num_items)

    ds = TrainSequences(seqs, num_items, args.max_len)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    net = SASRec(num_items, args.max_len, args.hidden, args.blocks, args.heads, args.dropout).to(device)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    global_batch = args.batch_per_gpu * world
    peak_lr = min(args.max_lr, args.base_lr * global_batch / 128)
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.0)
    total_steps = args.epochs * len(loader)
    warmup_steps = args.warmup_epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup_steps if s < warmup_steps
        else 0.5 * (1 + math.cos(math.pi * (s - warmup_steps) / max(1, total_steps - warmup_steps))))
    log.info("global batch %d, peak lr %.2e, %d steps", global_batch, peak_lr, total_steps)

    ckpt_path = os.path.join(args.output_dir, "last.pt")
    start_epoch, best = 0, 0.0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        assert ckpt["world_size"] == world, "lr schedule and sampler were built for a different world size"
        log.info("resumed at epoch %d", start_epoch)

    users = list(range(rank, len(seqs), world))
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        meter = torch.zeros(2, device=device)
        for seq, pos, neg in loader:
            seq, pos, neg = (t.to(device, non_blocking=True) for t in (seq, pos, neg))
            pl, nl = model(seq, pos, neg)
            m = pos > 0
            loss = F.binary_cross_entropy_with_logits(pl[m], torch.ones_like(pl[m])) + \
                F.binary_cross_entropy_with_logits(nl[m], torch.zeros_like(nl[m]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            meter += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(meter)
        log.info("epoch %d loss %.4f (%.0fs)", epoch, (meter[0] / meter[1]).item(), time.time() - t0)

        if (epoch + 1) % args.eval_every == 0:
            hr, ndcg = evaluate(net, seqs, users, num_items, args.max_len, "valid", device, seed=rank)
            log.info("epoch %d valid HR@10 %.4f NDCG@10 %.4f", epoch, hr, ndcg)
            if rank == 0 and ndcg > best:
                torch.save(net.state_dict(), os.path.join(args.output_dir, "best_model.pt"))
            best = max(best, ndcg)
        if rank == 0:
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best": best, "world_size": world}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    hr, ndcg = evaluate(net, seqs, users, num_items, args.max_len, "test", device, seed=10_000 + rank)
    log.info("final test HR@10 %.4f NDCG@10 %.4f", hr, ndcg)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
