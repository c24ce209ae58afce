"""Paired antibody language model (VH <sep> VL) trained on OAS paired sequences.

Inputs are the OAS paired CSVs after our ANARCI numbering step: columns
sequence_alignment_aa_heavy, sequence_alignment_aa_light, cdr3_aa_heavy.
Batches are length-bucketed with a token budget because VH+VL length varies 200-260.

    torchrun --nproc_per_node=4 12_antibody_mlm.py --train oas_paired_train.csv.gz --valid oas_paired_valid.csv.gz
"""
import argparse
import math
import os
import random
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

AA20 = "ACDEFGHIKLMNPQRSTVWY"
SPECIAL = ["<pad>", "<cls>", "<sep>", "<eos>", "<mask>", "<unk>"]
STOI = {t: i for i, t in enumerate(SPECIAL + list(AA20))}
PAD, CLS, SEP, EOS, MASK, UNK = range(6)


class PairedAbs(Dataset):
    def __init__(self, csv):
        df = pd.read_csv(csv, usecols=["sequence_alignment_aa_heavy", "sequence_alignment_aa_light", "cdr3_aa_heavy"])
        df = df.dropna()
        self.heavy = df.sequence_alignment_aa_heavy.tolist()
        self.light = df.sequence_alignment_aa_light.tolist()
        self.cdr3 = df.cdr3_aa_heavy.tolist()

    def __len__(self):
        return len(self.heavy)

    def length(self, i):
        return len(self.heavy[i]) + len(self.light[i]) + 3

    def __getitem__(self, i):
        h, l = self.heavy[i], self.light[i]
        ids = [CLS] + [STOI.get(a, UNK) for a in h] + [SEP] + [STOI.get(a, UNK) for a in l] + [EOS]
        # position of CDR-H3 in the token sequence (1-based because of CLS)
        c3 = h.rfind(self.cdr3[i])
        cdr3 = torch.zeros(len(ids), dtype=torch.bool)
        if c3 >= 0:
            cdr3[1 + c3: 1 + c3 + len(self.cdr3[i])] = True
        chain = torch.zeros(len(ids), dtype=torch.long)
        chain[len(h) + 2:] = 1
        return torch.tensor(ids), chain, cdr3


class BucketBatchSampler(Sampler):
    def __init__(self, lengths, max_tokens, bucket_width=8, seed=0):
        self.lengths = lengths
        self.max_tokens = max_tokens
        self.bucket_width = bucket_width
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, e):
        self.epoch = e

    def _make(self):
        rng = random.Random(self.seed + self.epoch)
        buckets = {}
        for i, L in enumerate(self.lengths):
            buckets.setdefault(L // self.bucket_width, []).append(i)
        batches = []
        for key, idx in buckets.items():
            rng.shuffle(idx)
            per_batch = max(1, self.max_tokens // ((key + 1) * self.bucket_width))
            batches += [idx[j:j + per_batch] for j in range(0, len(idx), per_batch)]
        rng.shuffle(batches)
        return batches

    def __iter__(self):
        return iter(self._make())

    def __len__(self):
        return len(self._make())


def collate(items):
    ids, chain, cdr3 = zip(*items)
    L = max(len(x) for x in ids)
    B = len(ids)
    tok = torch.full((B, L), PAD, dtype=torch.long)
    ch = torch.zeros((B, L), dtype=torch.long)
    c3 = torch.zeros((B, L), dtype=torch.bool)
    for i in range(B):
        n = len(ids[i])
        tok[i, :n], ch[i, :n], c3[i, :n] = ids[i], chain[i], cdr3[i]
    return tok, ch, c3


def mask_tokens(tok, p=0.15):
    sel = (torch.rand(tok.shape, device=tok.device) < p) & (tok > UNK)
    labels = tok.masked_fill(~sel, -100)
    return tok.masked_fill(sel, MASK), labels


class AbLM(nn.Module):
    def __init__(self, d=512, layers=8, heads=8, max_len=320):
        super().__init__()
        self.tok = nn.Embedding(len(STOI), d, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, d)
        self.chain = nn.Embedding(2, d)
        enc = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, activation="gelu",
                                         batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, len(STOI))

    def forward(self, tok, chain):
        pos = torch.arange(tok.size(1), device=tok.device)
        x = self.tok(tok) + self.pos(pos)[None] + self.chain(chain)
        x = self.encoder(x, src_key_padding_mask=tok.eq(PAD))
        return self.head(self.norm(x))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(4, device=device, dtype=torch.float64)
    for tok, chain, cdr3 in loader:
        tok, chain, cdr3 = tok.to(device), chain.to(device), cdr3.to(device)
        inp, labels = mask_tokens(tok)
        logits = model(inp, chain).float()
        m = labels != -100
        s[0] += F.cross_entropy(logits[m], labels[m], reduction="sum")
        s[1] += m.sum()
        h3 = m & cdr3
        s[2] += (logits.argmax(-1)[h3] == labels[h3]).sum()
        s[3] += h3.sum()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item(), (s[2] / s[3].clamp_min(1)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--out", default="runs/ablm_paired")
    ap.add_argument("--max-tokens", type=int, default=12288)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_ds = PairedAbs(args.train)
    valid_ds = PairedAbs(args.valid)
    lengths = [train_ds.length(i) for i in range(len(train_ds))]
    batch_sampler = BucketBatchSampler(lengths, args.max_tokens, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_sampler=batch_sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True)
    valid_loader = DataLoader(Subset(valid_ds, range(rank, len(valid_ds), world)), batch_size=64,
                              collate_fn=collate, num_workers=2)

    model = AbLM().to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    total = args.epochs * len(batch_sampler)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, 0.5 * (1 + math.cos(math.pi * min(s, total) / total))))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_ds)} pairs, {len(batch_sampler)} batches/epoch on {world} GPUs", flush=True)

    best = float("inf")
    step = 0
    for epoch in range(args.epochs):
        batch_sampler.set_epoch(epoch)
        t0 = time.time()
        for tok, chain, _ in train_loader:
            tok, chain = tok.to(device, non_blocking=True), chain.to(device, non_blocking=True)
            inp, labels = mask_tokens(tok)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp, chain)
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)

        vloss, h3_acc = evaluate(model.module, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch} valid ppl {math.exp(vloss):.3f} CDR-H3 recovery {h3_acc:.3f} "
                  f"({(time.time() - t0) / 60:.1f} min)", flush=True)
            state = {"model": model.module.state_dict(), "epoch": epoch, "step": step, "args": vars(args)}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if vloss < best:
                best = vloss
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
