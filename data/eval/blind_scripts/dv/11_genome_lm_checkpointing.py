"""Multi-species genomic MLM (Nucleotide-Transformer-like, non-overlapping 6-mers).

12 kb windows -> 2k tokens; 24 layers with activation checkpointing to fit the
context on 40 GB A100s.  Every `--aux-every` steps a species-classification head on
the CLS token is trained as well.

Windows table: TSV with columns  species_id  fasta  chrom  start   (end = start + window)

    torchrun --nnodes=1 --nproc_per_node=8 11_genome_lm_checkpointing.py --windows windows_train.tsv \
        --valid-windows windows_valid.tsv --n-species 48
"""
import argparse
import itertools
import math
import os
import time

import numpy as np
import pandas as pd
import pyfaidx
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

K = 6
KMERS = ["".join(p) for p in itertools.product("ACGT", repeat=K)]
SPECIALS = ["<pad>", "<cls>", "<mask>", "<unk>"] + list("ACGTN")
VOCAB = {t: i for i, t in enumerate(SPECIALS + KMERS)}
PAD, CLS, MASK, UNK = 0, 1, 2, 3
FIRST_KMER = len(SPECIALS)


def tokenize(seq):
    ids = [CLS]
    n_full = len(seq) // K
    for i in range(n_full):
        ids.append(VOCAB.get(seq[i * K:(i + 1) * K], UNK))
    for c in seq[n_full * K:]:
        ids.append(VOCAB.get(c, UNK))
    return ids


class GenomeWindows(Dataset):
    def __init__(self, table, window):
        self.df = pd.read_csv(table, sep="\t")
        self.window = window
        self._fa = {}

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        fa = self._fa.get(r.fasta)
        if fa is None:
            fa = self._fa[r.fasta] = pyfaidx.Fasta(r.fasta, sequence_always_upper=True)
        seq = str(fa[r.chrom][int(r.start):int(r.start) + self.window])
        return torch.tensor(tokenize(seq)), int(r.species_id)


def collate(batch):
    toks, species = zip(*batch)
    L = max(len(t) for t in toks)
    out = torch.full((len(toks), L), PAD, dtype=torch.long)
    for i, t in enumerate(toks):
        out[i, : len(t)] = t
    return out, torch.tensor(species)


def mask_kmers(tokens, p=0.15):
    cand = tokens >= FIRST_KMER
    sel = (torch.rand(tokens.shape, device=tokens.device) < p) & cand
    labels = tokens.masked_fill(~sel, -100)
    u = torch.rand(tokens.shape, device=tokens.device)
    inp = tokens.masked_fill(sel & (u < 0.8), MASK)
    rnd = sel & (u >= 0.8) & (u < 0.9)
    inp[rnd] = torch.randint(FIRST_KMER, len(VOCAB), (int(rnd.sum()),), device=tokens.device)
    return inp, labels


class EncoderBlock(nn.Module):
    def __init__(self, d, h, dropout=0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, pad_mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, key_padding_mask=pad_mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GenomeLM(nn.Module):
    def __init__(self, n_species, d=768, layers=24, heads=12, max_tokens=2100, grad_ckpt=True):
        super().__init__()
        self.tok = nn.Embedding(len(VOCAB), d, padding_idx=PAD)
        self.pos = nn.Embedding(max_tokens, d)
        self.blocks = nn.ModuleList(EncoderBlock(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, len(VOCAB))
        self.species_head = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, n_species))
        self.grad_ckpt = grad_ckpt

    def forward(self, tokens, with_species=False):
        pad = tokens.eq(PAD)
        x = self.tok(tokens) + self.pos(torch.arange(tokens.size(1), device=tokens.device))[None]
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, pad, use_reentrant=True)
            else:
                x = blk(x, pad)
        x = self.ln(x)
        logits = self.lm_head(x)
        species_logits = self.species_head(x[:, 0]) if with_species else None
        return logits, species_logits


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(4, device=device, dtype=torch.float64)
    for tokens, species in loader:
        tokens, species = tokens.to(device), species.to(device)
        inp, labels = mask_kmers(tokens)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, sp = model(inp, with_species=True)
        acc[0] += F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        acc[1] += (labels != -100).sum()
        acc[2] += (sp.argmax(-1) == species).sum()
        acc[3] += species.numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item(), (acc[2] / acc[3]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", required=True)
    ap.add_argument("--valid-windows", required=True)
    ap.add_argument("--n-species", type=int, required=True)
    ap.add_argument("--window", type=int, default=12282)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=5000)
    ap.add_argument("--max-steps", type=int, default=300000)
    ap.add_argument("--aux-every", type=int, default=4)
    ap.add_argument("--aux-weight", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=5000)
    ap.add_argument("--out", default="runs/genome_lm")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds = GenomeWindows(args.windows, args.window)
    valid_full = GenomeWindows(args.valid_windows, args.window)
    valid_ds = Subset(valid_full, range(rank, len(valid_full), world))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)
    valid_loader = DataLoader(valid_ds, batch_size=args.batch_size, collate_fn=collate, num_workers=4)

    model = GenomeLM(args.n_species).to(device)
    # species head only gets gradients on the auxiliary steps
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, s / args.warmup) * max(0.05, 1.0 - s / args.max_steps))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step, epoch, t0 = 0, 0, time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for tokens, species in loader:
            tokens, species = tokens.to(device, non_blocking=True), species.to(device, non_blocking=True)
            aux = step % args.aux_every == 0
            inp, labels = mask_kmers(tokens)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, sp = model(inp, with_species=aux)
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
            if aux:
                loss = loss + args.aux_weight * F.cross_entropy(sp.float(), species)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 100:.3f}s/it", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0:
                vl, vacc = evaluate(model.module, valid_loader, device)
                if rank == 0:
                    print(f"step {step} valid mlm {vl:.4f} ppl {math.exp(vl):.2f} species acc {vacc:.3f}", flush=True)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step},
                               os.path.join(args.out, f"step{step}.pt"))
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
