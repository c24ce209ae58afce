"""Codon-level masked language model on coding sequences (CDS) from Ensembl / RefSeq
for 30 vertebrate and 20 bacterial genomes.  Tokens are the 64 codons plus
specials; an organism token is prepended so codon usage can be conditioned on it.

Launch (one node, 4 GPUs):
    torchrun --nproc_per_node=4 13_codon_lm.py --cds-dir data/cds --out runs/codonlm
"""
import argparse
import glob
import gzip
import itertools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CODONS = ["".join(c) for c in itertools.product("TCAG", repeat=3)]
SPECIAL = ["<pad>", "<mask>", "<unk>", "<eos>"]
PAD, MASK, UNK, EOS = range(4)
CODON_ID = {c: i + len(SPECIAL) for i, c in enumerate(CODONS)}
N_CODON_TOKENS = len(SPECIAL) + len(CODONS)


def parse_args():
    p = argparse.ArgumentParser(description="codon MLM")
    p.add_argument("--cds-dir", required=True, help="one <organism>.cds.fa.gz per organism")
    p.add_argument("--out", required=True)
    p.add_argument("--max-codons", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--valid-every-n-genes", type=int, default=50, help="every n-th gene goes to validation")
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--seed", type=int, default=11)
    return p.parse_args()


def read_cds(path):
    seqs, cur = [], []
    with gzip.open(path, "rt") as fh:
        for line in fh:
            if line.startswith(">"):
                if cur:
                    seqs.append("".join(cur))
                cur = []
            else:
                cur.append(line.strip().upper())
    if cur:
        seqs.append("".join(cur))
    return [s for s in seqs if len(s) % 3 == 0 and len(s) >= 90]


class CDSDataset(Dataset):
    def __init__(self, records, n_orgs, max_codons):
        self.records = records            # list of (organism_idx, cds string)
        self.n_orgs = n_orgs
        self.max_codons = max_codons

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        org, cds = self.records[i]
        codons = [CODON_ID.get(cds[j:j + 3], UNK) for j in range(0, len(cds), 3)][: self.max_codons]
        ids = [N_CODON_TOKENS + org] + codons + [EOS]
        return torch.tensor(ids, dtype=torch.long)


def collate(batch):
    L = max(len(b) for b in batch)
    x = torch.full((len(batch), L), PAD, dtype=torch.long)
    for i, b in enumerate(batch):
        x[i, : len(b)] = b
    return x


class CodonBERT(nn.Module):
    def __init__(self, vocab, d=512, layers=10, heads=8, max_len=1030):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=PAD)
        self.pos = nn.Parameter(torch.zeros(1, max_len, d))
        nn.init.normal_(self.pos, std=0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, N_CODON_TOKENS)   # organism tokens are never predicted

    def forward(self, x):
        h = self.emb(x) + self.pos[:, : x.size(1)]
        h = self.enc(h, src_key_padding_mask=x.eq(PAD))
        return self.out(self.ln(h))


def mask_codons(x, p=0.15):
    maskable = (x >= len(SPECIAL)) & (x < N_CODON_TOKENS)
    sel = (torch.rand(x.shape, device=x.device) < p) & maskable
    y = x.masked_fill(~sel, -100)
    return x.masked_fill(sel, MASK), y


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(3, device=device, dtype=torch.float64)
    for x in loader:
        x = x.to(device)
        inp, y = mask_codons(x)
        logits = model(inp).float()
        m = y != -100
        tot[0] += F.cross_entropy(logits[m], y[m], reduction="sum")
        tot[1] += (logits[m].argmax(-1) == y[m]).sum()
        tot[2] += m.sum()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    files = sorted(glob.glob(os.path.join(args.cds_dir, "*.cds.fa.gz")))
    organisms = [os.path.basename(f).split(".")[0] for f in files]
    train_rec, valid_rec = [], []
    for org_idx, f in enumerate(files):
        for g, cds in enumerate(read_cds(f)):
            (valid_rec if g % args.valid_every_n_genes == 0 else train_rec).append((org_idx, cds))

    train_ds = CDSDataset(train_rec, len(organisms), args.max_codons)
    valid_ds = CDSDataset(valid_rec, len(organisms), args.max_codons)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(torch.utils.data.Subset(valid_ds, range(rank, len(valid_ds), world)),
                              batch_size=args.batch_size, collate_fn=collate, num_workers=2)

    model = CodonBERT(N_CODON_TOKENS + len(organisms)).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.04)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "organisms.txt"), "w") as fh:
            fh.write("\n".join(organisms) + "\n")
        print(f"{len(organisms)} organisms, {len(train_ds)} train / {len(valid_ds)} valid CDS", flush=True)

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for x in train_loader:
            x = x.to(device, non_blocking=True)
            inp, y = mask_codons(x)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step}/{total} loss {loss.item():.4f}", flush=True)

        vloss, vacc = evaluate(model.module, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: valid ppl {math.exp(vloss):.2f} codon acc {vacc:.3f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "organisms": organisms},
                       os.path.join(args.out, f"epoch_{epoch:02d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
