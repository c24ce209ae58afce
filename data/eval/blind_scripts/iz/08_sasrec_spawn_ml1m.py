"""SASRec on ML-1M, one process per GPU started with torch.multiprocessing.spawn.

Usage (single node, all visible GPUs):
    python 08_sasrec_spawn_ml1m.py --data_dir data/ml-1m --gpus 4
"""
import argparse
import math
import os
import pickle
import random
import socket
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="data/ml-1m")
    p.add_argument("--save_dir", default="ckpt/sasrec_ml1m_spawn")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--maxlen", type=int, default=200)
    p.add_argument("--dim", type=int, default=50)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--global_batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--eval_every", type=int, default=20)
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def preprocess(data_dir):
    """Runs once in the parent process; workers receive the result through spawn."""
    cache = os.path.join(data_dir, "sasrec_seqs.pkl")
    if os.path.exists(cache):
        with open(cache, "rb") as f:
            return pickle.load(f)
    by_user = defaultdict(list)
    with open(os.path.join(data_dir, "ratings.dat")) as f:
        for line in f:
            u, i, _r, t = line.strip().split("::")
            by_user[int(u)].append((int(t), int(i)))
    item_ids = {it: k + 1 for k, it in enumerate(sorted({i for v in by_user.values() for _, i in v}))}
    seqs = [[item_ids[i] for _, i in sorted(by_user[u])] for u in sorted(by_user)]
    data = {"seqs": seqs, "num_items": len(item_ids)}
    tmp = cache + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(data, f)
    os.replace(tmp, cache)
    return data


class TrainData(Dataset):
    def __init__(self, seqs, num_items, maxlen):
        self.seqs = [s[:-2] for s in seqs]
        self.num_items = num_items
        self.maxlen = maxlen

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        seen = set(s)
        inp, pos = s[:-1][-self.maxlen:], s[1:][-self.maxlen:]
        neg = []
        for _ in pos:
            j = random.randint(1, self.num_items)
            while j in seen:
                j = random.randint(1, self.num_items)
            neg.append(j)
        pad = [0] * (self.maxlen - len(inp))
        return torch.tensor(pad + inp), torch.tensor(pad + pos), torch.tensor(pad + neg)


class SASRec(nn.Module):
    def __init__(self, num_items, maxlen, dim, blocks, heads, dropout):
        super().__init__()
        self.item_emb = nn.Embedding(num_items + 1, dim, padding_idx=0)
        self.pos_emb = nn.Embedding(maxlen, dim)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(dim, heads, dim, dropout, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, blocks, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(dim, eps=1e-8)

    def hidden(self, seq):
        L = seq.size(1)
        x = self.item_emb(seq) * math.sqrt(self.item_emb.embedding_dim)
        x = self.drop(x + self.pos_emb.weight[:L])
        x = x * (seq != 0).unsqueeze(-1)
        causal = torch.ones(L, L, device=seq.device, dtype=torch.bool).triu(1)
        return self.ln(self.enc(x, mask=causal))

    def forward(self, seq, pos, neg):
        h = self.hidden(seq)
        return (h * self.item_emb(pos)).sum(-1), (h * self.item_emb(neg)).sum(-1)


@torch.no_grad()
def evaluate(net, seqs, users, num_items, maxlen, split, device):
    net.eval()
    g = torch.Generator().manual_seed(1234)
    out = torch.zeros(3, device=device, dtype=torch.float64)
    for b in range(0, len(users), 256):
        us = users[b:b + 256]
        inp, cand = [], []
        for u in us:
            s = seqs[u]
            hist, tgt = (s[:-2], s[-2]) if split == "valid" else (s[:-1], s[-1])
            hist = hist[-maxlen:]
            inp.append([0] * (maxlen - len(hist)) + hist)
            seen = set(s)
            negs = []
            while len(negs) < 100:
                c = int(torch.randint(1, num_items + 1, (1,), generator=g))
                if c not in seen:
                    negs.append(c)
            cand.append([tgt] + negs)
        inp = torch.tensor(inp, device=device)
        cand = torch.tensor(cand, device=device)
        h = net.hidden(inp)[:, -1:, :]
        scores = (net.item_emb(cand) * h).sum(-1)
        r = (scores[:, 1:] > scores[:, :1]).sum(1)
        hit = (r < 10).double()
        out += torch.stack([hit.sum(), (hit / torch.log2(r.double() + 2)).sum(),
                            torch.tensor(float(len(us)), device=device, dtype=torch.float64)])
    dist.all_reduce(out)
    net.train()
    return (out[0] / out[2]).item(), (out[1] / out[2]).item()


def train_worker(rank, world_size, args, data):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    seqs, num_items = data["seqs"], data["num_items"]
    ds = TrainData(seqs, num_items, args.maxlen)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.global_batch // world_size, sampler=sampler,
                        num_workers=2, pin_memory=True, persistent_workers=True)

    model = DDP(SASRec(num_items, args.maxlen, args.dim, args.blocks, args.heads, args.dropout).to(device),
                device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))

    ckpt_path = os.path.join(args.save_dir, "best.pt")
    users = list(range(rank, len(seqs), world_size))
    best = -1.0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for seq, pos, neg in loader:
            seq, pos, neg = seq.to(device), pos.to(device), neg.to(device)
            pl, nl = model(seq, pos, neg)
            m = pos != 0
            loss = F.binary_cross_entropy_with_logits(pl[m], torch.ones_like(pl[m])) \
                + F.binary_cross_entropy_with_logits(nl[m], torch.zeros_like(nl[m]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_sum)
        if rank == 0:
            print(f"epoch {epoch}: loss {(loss_sum[0] / loss_sum[1]).item():.4f}, {time.time() - t0:.1f}s", flush=True)
        if epoch % args.eval_every == 0:
            hr, ndcg = evaluate(model.module, seqs, users, num_items, args.maxlen, "valid", device)
            if rank == 0:
                print(f"epoch {epoch}: valid HR@10 {hr:.4f} NDCG@10 {ndcg:.4f}", flush=True)
                if ndcg > best:
                    best = ndcg
                    torch.save(model.module.state_dict(), ckpt_path)
            dist.barrier()

    # every rank reloads the best weights (saved from cuda:0) onto its own GPU
    state = torch.load(ckpt_path, map_location={"cuda:0": f"cuda:{rank}"})
    model.module.load_state_dict(state)
    hr, ndcg = evaluate(model.module, seqs, users, num_items, args.maxlen, "test", device)
    if rank == 0:
        print(f"test HR@10 {hr:.4f} NDCG@10 {ndcg:.4f}", flush=True)
    dist.destroy_process_group()


def main():
    args = get_args()
    os.makedirs(args.save_dir, exist_ok=True)
    data = preprocess(args.data_dir)
    assert args.global_batch % args.gpus == 0, "global batch must divide evenly over GPUs"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    print(f"{len(data['seqs'])} users, {data['num_items']} items, spawning {args.gpus} workers")
    mp.spawn(train_worker, args=(args.gpus, args, data), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
