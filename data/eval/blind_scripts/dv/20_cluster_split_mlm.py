"""ESM-style MLM with UniRef50-style sampling: each epoch visits every MMseqs2 cluster
once and draws a random member from it.  Validation = held-out clusters (no member
of a validation cluster is ever trained on).

Inputs:  clusters.tsv (representative \t member, from `mmseqs createtsv`) and an
indexed FASTA with all members (pyfaidx).

    torchrun --nproc_per_node=8 20_cluster_split_mlm.py --clusters clu_30.tsv --fasta members.fasta
"""
import argparse
import collections
import math
import os
import random
import time

import numpy as np
import pyfaidx
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

ALPHABET = ["<cls>", "<pad>", "<eos>", "<unk>"] + list("LAGVSERTIDPKQNFYMHWCXBUZO") + ["<mask>"]
TOK = {a: i for i, a in enumerate(ALPHABET)}
CLS, PAD, EOS, UNK, MASK = 0, 1, 2, 3, len(ALPHABET) - 1


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def read_clusters(tsv):
    clusters = collections.OrderedDict()
    with open(tsv) as fh:
        for line in fh:
            rep, mem = line.rstrip("\n").split("\t")
            clusters.setdefault(rep, []).append(mem)
    return clusters


class ClusterSampledSeqs(Dataset):
    """Item i = a random member of cluster i, cropped to max_len."""

    def __init__(self, fasta, members, max_len):
        self.fasta_path, self.members, self.max_len = fasta, members, max_len
        self._fa = None

    def __len__(self):
        return len(self.members)

    def __getitem__(self, i):
        if self._fa is None:
            self._fa = pyfaidx.Fasta(self.fasta_path, read_ahead=0)
        name = random.choice(self.members[i])
        seq = str(self._fa[name])
        if len(seq) > self.max_len:
            s = random.randint(0, len(seq) - self.max_len)
            seq = seq[s:s + self.max_len]
        return torch.tensor([CLS] + [TOK.get(c, UNK) for c in seq] + [EOS])


def pad_collate(xs):
    out = torch.full((len(xs), max(len(x) for x in xs)), PAD, dtype=torch.long)
    for i, x in enumerate(xs):
        out[i, : len(x)] = x
    return out


def bert_mask(tokens, p=0.15):
    can = (tokens > UNK) & (tokens != MASK)
    sel = (torch.rand(tokens.shape, device=tokens.device) < p) & can
    labels = tokens.masked_fill(~sel, -100)
    r = torch.rand(tokens.shape, device=tokens.device)
    inp = tokens.masked_fill(sel & (r < 0.8), MASK)
    swap = sel & (r >= 0.8) & (r < 0.9)
    inp[swap] = torch.randint(4, 24, (int(swap.sum()),), device=tokens.device)
    return inp, labels


class MLM(nn.Module):
    def __init__(self, d=768, layers=12, heads=12, max_len=1024):
        super().__init__()
        self.emb = nn.Embedding(len(ALPHABET), d, padding_idx=PAD)
        self.pos = nn.Embedding(max_len + 2, d)
        block = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, len(ALPHABET))

    def forward(self, t):
        x = self.emb(t) + self.pos(torch.arange(t.size(1), device=t.device))[None]
        return self.head(self.norm(self.blocks(x, src_key_padding_mask=t.eq(PAD))))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for t in loader:
        t = t.to(device)
        inp, labels = bert_mask(t)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(inp).float()
        acc[0] += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        acc[1] += (labels != -100).sum()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clusters", required=True)
    ap.add_argument("--fasta", required=True)
    ap.add_argument("--out", default="runs/clu_mlm")
    ap.add_argument("--max-len", type=int, default=1022)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--valid-clusters", type=int, default=20000)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different masking / member sampling on each GPU
    seed_everything(args.seed + rank)

    clusters = read_clusters(args.clusters)
    reps = list(clusters)
    random.shuffle(reps)
    valid_reps, train_reps = reps[: args.valid_clusters], reps[args.valid_clusters:]
    train_ds = ClusterSampledSeqs(args.fasta, [clusters[r] for r in train_reps], args.max_len)
    # validation uses the representative only, so the number is stable between epochs
    valid_ds = ClusterSampledSeqs(args.fasta, [[r] for r in valid_reps[rank::world]], args.max_len)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=pad_collate,
                        num_workers=6, pin_memory=True, drop_last=True, persistent_workers=True)
    valid_loader = DataLoader(valid_ds, batch_size=32, collate_fn=pad_collate, num_workers=2)

    model = MLM(max_len=args.max_len).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.1, 1 - s / total))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(clusters)} clusters: {len(train_reps)} train / {len(valid_reps)} valid", flush=True)

    step, best = 0, math.inf
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for t in loader:
            t = t.to(device, non_blocking=True)
            inp, labels = bert_mask(t)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp)
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{100 * args.batch_size * world / (time.time() - t0):.0f} seq/s", flush=True)
                t0 = time.time()

        vloss = evaluate(model.module, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch} held-out cluster ppl {math.exp(vloss):.3f}", flush=True)
            ck = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                  "epoch": epoch, "step": step}
            torch.save(ck, os.path.join(args.out, "last.pt"))
            if vloss < best:
                best = vloss
                torch.save(ck, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
