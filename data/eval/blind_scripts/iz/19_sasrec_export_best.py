"""Train SASRec on Amazon Clothing/Shoes/Jewelry and export the best model for serving:
a TorchScript user-tower plus the item-embedding table for the ANN index.

    torchrun --nproc_per_node=8 19_sasrec_export_best.py --data data/clothing.txt --export_dir export/sasrec_clothing
"""
import argparse
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

logger = logging.getLogger(__name__)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="'user item' per line, time-ordered, ids from 1")
    p.add_argument("--ckpt_dir", default="ckpt/sasrec_clothing")
    p.add_argument("--export_dir", default="export/sasrec_clothing")
    p.add_argument("--maxlen", type=int, default=50)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--global_batch", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--eval_every", type=int, default=5)
    p.add_argument("--seed", type=int, default=123)
    return p.parse_args()


def read_data(path):
    seq = defaultdict(list)
    n_items = 0
    with open(path) as f:
        for line in f:
            u, i = line.split()
            seq[int(u)].append(int(i))
            n_items = max(n_items, int(i))
    users = sorted(u for u in seq if len(seq[u]) >= 3)
    return [seq[u] for u in users], n_items


class Train(Dataset):
    def __init__(self, seqs, n_items, maxlen):
        self.seqs, self.n_items, self.maxlen = [s[:-2] for s in seqs], n_items, maxlen

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        seen = set(s)
        x, p = s[:-1][-self.maxlen:], s[1:][-self.maxlen:]
        n = []
        for _ in p:
            c = random.randint(1, self.n_items)
            while c in seen:
                c = random.randint(1, self.n_items)
            n.append(c)
        z = [0] * (self.maxlen - len(x))
        return torch.tensor(z + x), torch.tensor(z + p), torch.tensor(z + n)


class SASRec(nn.Module):
    def __init__(self, n_items, maxlen, hidden, blocks, heads, dropout):
        super().__init__()
        self.item_emb = nn.Embedding(n_items + 1, hidden, padding_idx=0)
        self.pos_emb = nn.Embedding(maxlen, hidden)
        self.emb_drop = nn.Dropout(dropout)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(hidden, heads, hidden, dropout, batch_first=True, norm_first=True),
            blocks, enable_nested_tensor=False)
        self.last_ln = nn.LayerNorm(hidden, eps=1e-8)
        self.maxlen = maxlen

    def user_vector(self, seq):
        L = seq.size(1)
        h = self.item_emb(seq) * math.sqrt(self.item_emb.embedding_dim) + self.pos_emb.weight[:L]
        h = self.emb_drop(h) * (seq > 0).unsqueeze(-1).to(h.dtype)
        mask = torch.triu(torch.ones(L, L, dtype=torch.bool, device=seq.device), 1)
        return self.last_ln(self.encoder(h, mask=mask))

    def forward(self, seq, pos, neg):
        h = self.user_vector(seq)
        return (h * self.item_emb(pos)).sum(-1), (h * self.item_emb(neg)).sum(-1)


class UserTower(nn.Module):
    """Serving wrapper: history (B, maxlen) -> last-position user embedding (B, hidden)."""

    def __init__(self, sasrec):
        super().__init__()
        self.sasrec = sasrec

    def forward(self, seq):
        return self.sasrec.user_vector(seq)[:, -1]


@torch.no_grad()
def evaluate(net, seqs, users, n_items, maxlen, split, device, seed):
    net.eval()
    rng = np.random.default_rng(seed)
    agg = torch.zeros(3, device=device, dtype=torch.float64)
    for b in range(0, len(users), 1024):
        us = users[b:b + 1024]
        X = np.zeros((len(us), maxlen), dtype=np.int64)
        C = np.zeros((len(us), 101), dtype=np.int64)
        for r, u in enumerate(us):
            s = seqs[u]
            h, t = (s[:-2], s[-2]) if split == "valid" else (s[:-1], s[-1])
            h = h[-maxlen:]
            X[r, maxlen - len(h):] = h
            seen, negs = set(s), []
            while len(negs) < 100:
                c = int(rng.integers(1, n_items + 1))
                if c not in seen:
                    negs.append(c)
            C[r] = [t] + negs
        uv = net.user_vector(torch.from_numpy(X).to(device))[:, -1]
        sc = torch.einsum("bd,bkd->bk", uv, net.item_emb(torch.from_numpy(C).to(device)))
        rk = (sc[:, 1:] > sc[:, :1]).sum(1).double()
        hit = (rk < 10).double()
        agg += torch.stack([hit.sum(), (hit / torch.log2(rk + 2)).sum(),
                            torch.tensor(float(len(us)), device=device, dtype=torch.float64)])
    dist.all_reduce(agg)
    net.train()
    return (agg[0] / agg[2]).item(), (agg[1] / agg[2]).item()


def export_best(args, n_items):
    net = SASRec(n_items, args.maxlen, args.hidden, args.blocks, args.heads, args.dropout)
    state = torch.load(os.path.join(args.ckpt_dir, "best.pt"), map_location="cpu")
    net.load_state_dict(state["model"])
    net.eval()
    os.makedirs(args.export_dir, exist_ok=True)
    example = torch.zeros(1, args.maxlen, dtype=torch.long)
    example[0, -3:] = torch.tensor([1, 2, 3])
    traced = torch.jit.trace(UserTower(net), example)
    traced.save(os.path.join(args.export_dir, "user_tower.pt"))
    np.save(os.path.join(args.export_dir, "item_embeddings.npy"), net.item_emb.weight.detach().numpy())
    logger.info("exported epoch-%d model to %s", state["epoch"], args.export_dir)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    seqs, n_items = read_data(args.data)
    logger.info("users %d items %d", len(seqs), n_items)
    ds = Train(seqs, n_items, args.maxlen)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    dl = DataLoader(ds, batch_size=args.global_batch // world, sampler=sampler, num_workers=4, pin_memory=True)

    model = DDP(SASRec(n_items, args.maxlen, args.hidden, args.blocks, args.heads, args.dropout).to(device),
                device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))

    users = list(range(rank, len(seqs), world))
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    best = -1.0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        t0 = time.time()
        m = torch.zeros(2, device=device)
        for x, p, n in dl:
            x, p, n = x.to(device), p.to(device), n.to(device)
            pl, nl = model(x, p, n)
            v = p > 0
            loss = F.binary_cross_entropy_with_logits(pl[v], torch.ones_like(pl[v])) + \
                F.binary_cross_entropy_with_logits(nl[v], torch.zeros_like(nl[v]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            m += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(m)
        logger.info("epoch %d loss %.4f %.0fs", epoch, (m[0] / m[1]).item(), time.time() - t0)

        if epoch % args.eval_every == 0:
            hr, ndcg = evaluate(model.module, seqs, users, n_items, args.maxlen, "valid", device, seed=epoch + 97 * rank)
            logger.info("epoch %d valid HR@10 %.4f NDCG@10 %.4f", epoch, hr, ndcg)
            if rank == 0 and ndcg > best:
                torch.save({"model": model.state_dict(), "epoch": epoch, "ndcg": ndcg},
                           os.path.join(args.ckpt_dir, "best.pt"))
            best = max(best, ndcg)
            dist.barrier()

    hr, ndcg = evaluate(model.module, seqs, users, n_items, args.maxlen, "test", device, seed=5 + rank)
    logger.info("last-epoch test HR@10 %.4f NDCG@10 %.4f", hr, ndcg)
    if rank == 0:
        export_best(args, n_items)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
