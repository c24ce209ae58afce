#!/usr/bin/env python
"""StarSpace-like product -> tag embedding model trained with sampled softmax.

Negatives are drawn from the tag unigram distribution raised to 0.75 (word2vec
style) and the logits are corrected by log Q(tag); sampled tags that are true
tags of the row ("accidental hits") are masked.

    torchrun --nproc_per_node=8 19_freq_sampled_softmax.py --data /mnt/shared/tagging/catalog_v7 \
        --out /mnt/shared/tagging/runs/starspace
"""
import argparse
import logging
import math
import os
import time

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("starspace")


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dim", type=int, default=300)
    p.add_argument("--num-sampled", type=int, default=20000)
    p.add_argument("--power", type=float, default=0.75)
    p.add_argument("--max-pos", type=int, default=16)
    p.add_argument("--global-batch-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--resume", default="")
    return p.parse_args()


class UnigramSampler:
    """Draws negatives with probability ~ count^power, kept on the GPU for speed."""

    def __init__(self, counts, power=0.75, device="cuda:0"):
        p = np.asarray(counts, dtype=np.float64) ** power
        p /= p.sum()
        self.probs = torch.tensor(p, dtype=torch.float32, device=device)
        self.log_q = torch.log(self.probs.clamp(min=1e-20))

    def sample(self, n):
        ids = torch.multinomial(self.probs, n, replacement=True)
        return ids, self.log_q[ids]


class Rows(Dataset):
    def __init__(self, tokens, Y, max_pos, rows=None):
        self.tokens, self.Y, self.max_pos = tokens, Y, max_pos
        self.rows = np.flatnonzero(np.diff(Y.indptr) > 0) if rows is None else rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        labs = self.Y.indices[self.Y.indptr[r]:self.Y.indptr[r + 1]]
        pos = np.full(self.max_pos, -1, dtype=np.int64)
        pos[: min(len(labs), self.max_pos)] = labs[: self.max_pos]
        one = int(np.random.choice(labs)) if len(labs) else -1
        return torch.from_numpy(self.tokens[r].astype(np.int64)), torch.from_numpy(pos), one


class StarSpace(nn.Module):
    def __init__(self, vocab, num_tags, dim):
        super().__init__()
        self.words = nn.EmbeddingBag(vocab, dim, mode="mean", padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.tags = nn.Embedding(num_tags, dim)
        nn.init.uniform_(self.tags.weight, -0.5 / dim, 0.5 / dim)

    def doc(self, tokens):
        return self.mlp(self.words(tokens))

    def forward(self, tokens, cand):
        return self.doc(tokens) @ self.tags(cand).t()


@torch.no_grad()
def evaluate(net, loader, device, ks=(1, 3, 5)):
    net.eval()
    W = net.tags.weight
    disc = 1.0 / torch.log2(torch.arange(2, max(ks) + 2, device=device).double())
    acc = torch.zeros(2 * len(ks) + 1, dtype=torch.float64, device=device)
    for tokens, pos, _ in loader:
        tokens, pos = tokens.to(device), pos.to(device)
        top = (net.doc(tokens) @ W.t()).topk(max(ks), dim=1).indices
        hit = (top.unsqueeze(-1) == pos.unsqueeze(1)).any(-1).double()
        n = (pos >= 0).sum(1)
        for j, k in enumerate(ks):
            acc[j] += hit[:, :k].sum() / k
            ideal = disc.cumsum(0)[(n.clamp(max=k) - 1).clamp(min=0)]
            acc[len(ks) + j] += torch.where(n > 0, (hit[:, :k] * disc[:k]).sum(1) / ideal,
                                            torch.zeros_like(ideal)).sum()
        acc[-1] += tokens.size(0)
    dist.all_reduce(acc)
    net.train()
    acc = (acc[:-1] / acc[-1]).tolist()
    return {**{f"P@{k}": acc[j] for j, k in enumerate(ks)},
            **{f"nDCG@{k}": acc[len(ks) + j] for j, k in enumerate(ks)}}


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    torch.manual_seed(0)

    tok_tr = np.load(os.path.join(args.data, "train_tokens.npy"), mmap_mode="r")
    tok_te = np.load(os.path.join(args.data, "test_tokens.npy"), mmap_mode="r")
    Y_tr = sp.load_npz(os.path.join(args.data, "train_labels.npz")).tocsr()
    Y_te = sp.load_npz(os.path.join(args.data, "test_labels.npz")).tocsr()
    vocab = int(tok_tr.max()) + 1
    num_tags = Y_tr.shape[1]
    tag_counts = np.asarray(Y_tr.sum(axis=0)).ravel() + 1.0
    neg_sampler = UnigramSampler(tag_counts, power=args.power)

    train_ds = Rows(tok_tr, Y_tr, args.max_pos)
    test_ds = Rows(tok_te, Y_te, args.max_pos, rows=np.arange(rank, tok_te.shape[0], world))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.global_batch_size // world, sampler=sampler,
                              num_workers=6, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=1024, num_workers=2)

    net = StarSpace(vocab, num_tags, args.dim).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    start = 0
    if args.resume:
        state = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["epoch"] + 1
    model = DDP(net, device_ids=[local_rank])

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (tokens, pos, one) in enumerate(train_loader):
            tokens, pos, one = tokens.to(device), pos.to(device), one.to(device)
            sampled, sampled_logq = neg_sampler.sample(args.num_sampled)
            cand = torch.cat([one, sampled])
            logits = model(tokens, cand)
            logits[:, one.numel():] -= sampled_logq
            acc_hit = (cand.view(1, -1, 1) == pos.unsqueeze(1)).any(-1)
            target = torch.arange(one.numel(), device=device)
            acc_hit[target, target] = False
            loss = F.cross_entropy(logits.masked_fill(acc_hit, -1e9), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 250 == 0:
                log.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_loader), loss.item())
        log.info("epoch %d took %.0fs", epoch, time.time() - t0)

        res = evaluate(net, test_loader, device)
        log.info("epoch %d %s", epoch, " ".join(f"{k}={v:.4f}" for k, v in res.items()))
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
