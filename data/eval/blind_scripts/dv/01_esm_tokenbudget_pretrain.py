#!/usr/bin/env python
"""Pretrain a small ESM-style masked protein language model on UniRef50.

Batches are built by token budget (sequences of similar length grouped so that
padded batch size <= --max-tokens). One process per GPU, launched with torchrun.
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

AA = "LAGVSERTIDPKQNFYMHWCXBUZO"
SPECIAL = ["<cls>", "<pad>", "<eos>", "<unk>", "<mask>"]
VOCAB = {t: i for i, t in enumerate(SPECIAL + list(AA))}
CLS, PAD, EOS, UNK, MASK = (VOCAB[t] for t in SPECIAL)
N_AA_START = len(SPECIAL)


def read_fasta(path, max_len):
    seqs, cur = [], []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            if line.startswith(">"):
                if cur:
                    seqs.append("".join(cur)[:max_len])
                    cur = []
            else:
                cur.append(line.upper())
    if cur:
        seqs.append("".join(cur)[:max_len])
    return seqs


class ProteinDataset(Dataset):
    def __init__(self, seqs):
        self.seqs = seqs

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        toks = [CLS] + [VOCAB.get(a, UNK) for a in self.seqs[i]] + [EOS]
        return torch.tensor(toks, dtype=torch.long)


class TokenBudgetBatchSampler(Sampler):
    """Length-grouped batches with at most `max_tokens` padded tokens each."""

    def __init__(self, lengths, max_tokens, rank, world_size, seed=0, sort_chunk=10000):
        self.lengths = lengths
        self.max_tokens = max_tokens
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.sort_chunk = sort_chunk
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        rng = random.Random(self.seed + self.epoch)
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        order = order[self.rank::self.world_size]
        batches = []
        for s in range(0, len(order), self.sort_chunk):
            chunk = sorted(order[s:s + self.sort_chunk], key=lambda j: self.lengths[j])
            cur, cur_max = [], 0
            for j in chunk:
                L = self.lengths[j]
                if cur and max(cur_max, L) * (len(cur) + 1) > self.max_tokens:
                    batches.append(cur)
                    cur, cur_max = [], 0
                cur.append(j)
                cur_max = max(cur_max, L)
            if cur:
                batches.append(cur)
        rng.shuffle(batches)
        return batches

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


def collate(batch):
    L = max(x.numel() for x in batch)
    out = torch.full((len(batch), L), PAD, dtype=torch.long)
    for i, x in enumerate(batch):
        out[i, : x.numel()] = x
    return out


def mask_tokens(tokens, p=0.15):
    labels = tokens.clone()
    maskable = tokens >= N_AA_START
    sel = (torch.rand_like(tokens, dtype=torch.float) < p) & maskable
    labels[~sel] = -100
    inp = tokens.clone()
    r = torch.rand_like(tokens, dtype=torch.float)
    inp[sel & (r < 0.8)] = MASK
    rand_sel = sel & (r >= 0.8) & (r < 0.9)
    inp[rand_sel] = torch.randint(N_AA_START, N_AA_START + 20, (int(rand_sel.sum()),), device=tokens.device)
    return inp, labels


class ESMLike(nn.Module):
    def __init__(self, vocab_size, d_model=480, n_layers=12, n_heads=20, max_len=1026, dropout=0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, 4 * d_model, dropout=dropout, activation="gelu",
            batch_first=True, norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.final_ln = nn.LayerNorm(d_model)
        self.lm_dense = nn.Linear(d_model, d_model)
        self.lm_ln = nn.LayerNorm(d_model)
        self.lm_bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, tokens):
        pad_mask = tokens.eq(PAD)
        pos = torch.arange(tokens.size(1), device=tokens.device)
        x = self.embed(tokens) + self.pos(pos)[None]
        x = self.encoder(x, src_key_padding_mask=pad_mask)
        x = self.final_ln(x)
        x = self.lm_ln(F.gelu(self.lm_dense(x)))
        return F.linear(x, self.embed.weight) + self.lm_bias


def lr_lambda(step, warmup, total):
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for tokens in loader:
        tokens = tokens.to(device, non_blocking=True)
        inp, labels = mask_tokens(tokens)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(inp)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1),
                               ignore_index=-100, reduction="sum")
        tot[0] += loss
        tot[1] += (labels != -100).sum()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-fasta", required=True)
    ap.add_argument("--valid-fasta", required=True)
    ap.add_argument("--out", default="runs/esm_t12")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_seqs = read_fasta(args.train_fasta, args.max_len)
    valid_seqs = read_fasta(args.valid_fasta, args.max_len)
    train_ds = ProteinDataset(train_seqs)
    valid_ds = Subset(ProteinDataset(valid_seqs), range(rank, len(valid_seqs), world))
    lengths = [len(s) + 2 for s in train_seqs]

    sampler = TokenBudgetBatchSampler(lengths, args.max_tokens, rank, world, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_sampler=sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True)
    valid_loader = DataLoader(valid_ds, batch_size=32, collate_fn=collate, num_workers=2)

    model = ESMLike(len(VOCAB), max_len=args.max_len + 2).to(device)
    model = DDP(model, device_ids=[local_rank])
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    total_steps = args.epochs * len(sampler)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, args.warmup, total_steps))

    start_epoch, step = 0, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as fh:
            json.dump(vars(args), fh, indent=2)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"world={world} params={n_params/1e6:.1f}M train={len(train_ds)} valid={len(valid_seqs)}")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, run_loss, run_tok = time.time(), 0.0, 0
        for tokens in train_loader:
            tokens = tokens.to(device, non_blocking=True)
            inp, labels = mask_tokens(tokens)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1),
                                   ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            run_loss += loss.item()
            run_tok += tokens.ne(PAD).sum().item()
            if step % args.log_every == 0 and rank == 0:
                dt = time.time() - t0
                print(f"ep {epoch} step {step} loss {run_loss/args.log_every:.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e} tok/s/gpu {run_tok/dt:.0f}", flush=True)
                t0, run_loss, run_tok = time.time(), 0.0, 0

        val_loss = evaluate(model.module, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch} valid loss {val_loss:.4f} ppl {math.exp(val_loss):.3f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(args.out, "checkpoint_last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
