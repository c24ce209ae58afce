"""Masked LM on UniRef90 subsample, ESM-1b-like, 12 layers.

On first use the FASTA is tokenized into a flat int8 array next to it
(<fasta>.tok.npy + <fasta>.idx.npy), so later runs start in seconds.

    torchrun --standalone --nproc_per_node=4 05_uniref_mlm_cache.py \
        --train data/uniref90_sub.fasta --valid data/uniref90_valid.fasta
"""
import argparse
import logging
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

log = logging.getLogger("mlm")

ALPHABET = "<cls> <pad> <eos> <unk> L A G V S E R T I D P K Q N F Y M H W C X B U Z O . - <null_1> <mask>".split()
TOK = {t: i for i, t in enumerate(ALPHABET)}
PAD, CLS, EOS, UNK, MASK = TOK["<pad>"], TOK["<cls>"], TOK["<eos>"], TOK["<unk>"], TOK["<mask>"]


def tokenize_fasta(fasta, max_len):
    toks, idx, cur = [], [], []
    off = 0

    def flush():
        nonlocal off
        seq = "".join(cur)[: max_len - 2]
        ids = [CLS] + [TOK.get(c, UNK) for c in seq] + [EOS]
        toks.append(np.asarray(ids, dtype=np.int8))
        idx.append((off, len(ids)))
        off += len(ids)

    with open(fasta) as fh:
        for line in fh:
            if line.startswith(">"):
                if cur:
                    flush()
                    cur = []
            else:
                cur.append(line.strip())
    if cur:
        flush()
    return np.concatenate(toks), np.asarray(idx, dtype=np.int64)


def load_or_build(fasta, max_len):
    tok_path, idx_path = fasta + ".tok.npy", fasta + ".idx.npy"
    if not (os.path.exists(tok_path) and os.path.exists(idx_path)):
        log.info("tokenizing %s", fasta)
        toks, idx = tokenize_fasta(fasta, max_len)
        np.save(tok_path, toks)
        np.save(idx_path, idx)
    return np.load(tok_path, mmap_mode="r"), np.load(idx_path)


class FlatTokens(Dataset):
    def __init__(self, toks, idx):
        self.toks, self.idx = toks, idx

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        o, n = self.idx[i]
        return torch.from_numpy(np.asarray(self.toks[o:o + n], dtype=np.int64))


def collate(items):
    L = max(len(x) for x in items)
    b = torch.full((len(items), L), PAD, dtype=torch.long)
    for i, x in enumerate(items):
        b[i, : len(x)] = x
    return b


def apply_mask(tokens, rate=0.15):
    special = (tokens == PAD) | (tokens == CLS) | (tokens == EOS)
    sel = (torch.rand(tokens.shape, device=tokens.device) < rate) & ~special
    labels = torch.where(sel, tokens, torch.full_like(tokens, -100))
    u = torch.rand(tokens.shape, device=tokens.device)
    inp = tokens.clone()
    inp[sel & (u < 0.8)] = MASK
    swap = sel & (u >= 0.8) & (u < 0.9)
    inp[swap] = torch.randint(4, 24, (int(swap.sum().item()),), device=tokens.device)
    return inp, labels


class LearnedPosTransformer(nn.Module):
    def __init__(self, n_tok, dim=768, layers=12, heads=12, max_len=1024):
        super().__init__()
        self.tok = nn.Embedding(n_tok, dim, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, dim)
        self.ln_in = nn.LayerNorm(dim)
        enc = nn.TransformerEncoderLayer(dim, heads, dim * 4, dropout=0.1, activation="gelu",
                                         batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(enc, layers, enable_nested_tensor=False)
        self.ln_out = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, n_tok)

    def forward(self, x):
        pos = torch.arange(x.size(1), device=x.device)[None]
        h = self.ln_in(self.tok(x) + self.pos(pos))
        h = self.enc(h, src_key_padding_mask=x.eq(PAD))
        return self.out(self.ln_out(h))


def run_eval(model, loader, device):
    model.eval()
    agg = torch.zeros(2, device=device)
    gen_state = torch.cuda.get_rng_state(device)
    torch.cuda.manual_seed(0)
    with torch.no_grad():
        for tokens in loader:
            tokens = tokens.to(device)
            inp, labels = apply_mask(tokens)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp).float()
            agg[0] += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
            agg[1] += (labels != -100).sum()
    torch.cuda.set_rng_state(gen_state, device)
    dist.all_reduce(agg)
    model.train()
    return (agg[0] / agg[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--save-dir", default="ckpt/uniref_mlm")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--num-workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s r{rank}] %(message)s")

    train_toks, train_idx = load_or_build(args.train, args.max_len)
    valid_toks, valid_idx = load_or_build(args.valid, args.max_len)
    train_ds = FlatTokens(train_toks, train_idx)
    valid_ds = FlatTokens(valid_toks, valid_idx)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    valid_idx_rank = list(range(rank, len(valid_ds), world))
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=args.num_workers, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(torch.utils.data.Subset(valid_ds, valid_idx_rank), batch_size=args.batch_size,
                              collate_fn=collate, num_workers=2)

    model = LearnedPosTransformer(len(ALPHABET), max_len=args.max_len).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.0, 1 - s / total))

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best = math.inf
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for tokens in train_loader:
            tokens = tokens.to(device, non_blocking=True)
            inp, labels = apply_mask(tokens)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp).float()
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 100 == 0:
                log.info("epoch %d step %d loss %.4f lr %.2e (%.1f it/s)", epoch, step, loss.item(),
                         sched.get_last_lr()[0], 100 / (time.time() - t0))
                t0 = time.time()

        vloss = run_eval(model.module, valid_loader, device)
        log.info("epoch %d valid loss %.4f ppl %.2f", epoch, vloss, math.exp(vloss))
        if rank == 0:
            ckpt = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "epoch": epoch, "step": step}
            torch.save(ckpt, os.path.join(args.save_dir, "last.pt"))
            if vloss < best:
                best = vloss
                torch.save(ckpt, os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
