"""Decoder-only LM pretraining on a document-indexed token corpus.

The corpus is `corpus.bin` (uint16 tokens, documents concatenated) plus
`corpus.idx` (int64 start offset of every document, plus the final end offset).
A held-out set of documents is used for validation.

    torchrun --nnodes=1 --nproc_per_node=8 06_books_doc_corpus.py --data /data/books --run books-base
"""
import os
import math
import time
import random
import argparse
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


@dataclass
class Config:
    data: str = "data/books"
    run: str = "books-base"
    seq_len: int = 1024
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    vocab: int = 50304
    micro_batch: int = 16
    accum: int = 4
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_iters: int = 1000
    max_iters: int = 50000
    val_frac: float = 0.005
    eval_interval: int = 500
    eval_batches: int = 32
    ckpt_interval: int = 2500
    seed: int = 1234


def parse() -> Config:
    p = argparse.ArgumentParser()
    for f in dataclasses.fields(Config):
        p.add_argument(f"--{f.name}", type=f.type, default=f.default)
    return Config(**vars(p.parse_args()))


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class DocCorpus:
    def __init__(self, root):
        self.tokens = np.memmap(os.path.join(root, "corpus.bin"), dtype=np.uint16, mode="r")
        self.offsets = np.fromfile(os.path.join(root, "corpus.idx"), dtype=np.int64)
        self.n_docs = len(self.offsets) - 1

    def split(self, val_frac):
        perm = np.random.permutation(self.n_docs)
        n_val = max(1, int(self.n_docs * val_frac))
        return np.sort(perm[n_val:]), np.sort(perm[:n_val])

    def sample(self, doc_ids, batch, seq_len, device):
        # windows start at a document boundary and run on into the following documents
        starts = self.offsets[np.random.choice(doc_ids, size=batch)]
        starts = np.minimum(starts, len(self.tokens) - seq_len - 1)
        buf = np.stack([self.tokens[s:s + seq_len + 1] for s in starts]).astype(np.int64)
        t = torch.from_numpy(buf).pin_memory().to(device, non_blocking=True)
        return t[:, :-1], t[:, 1:]


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c.d_model), nn.LayerNorm(c.d_model)
        self.attn = nn.Linear(c.d_model, 3 * c.d_model, bias=False)
        self.proj = nn.Linear(c.d_model, c.d_model, bias=False)
        self.ff = nn.Sequential(nn.Linear(c.d_model, 4 * c.d_model, bias=False), nn.GELU(approximate="tanh"),
                                nn.Linear(4 * c.d_model, c.d_model, bias=False))
        self.h = c.n_heads

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn(self.ln1(x)).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.ff(self.ln2(x))


class LM(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.emb = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln = nn.LayerNorm(c.d_model)
        self.out = nn.Linear(c.d_model, c.vocab, bias=False)
        self.out.weight = self.emb.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, tgt):
        x = self.emb(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.out(self.ln(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.reshape(-1))


def cosine_lr(it, c: Config):
    if it < c.warmup_iters:
        return c.lr * (it + 1) / c.warmup_iters
    r = min(1.0, (it - c.warmup_iters) / (c.max_iters - c.warmup_iters))
    return c.min_lr + 0.5 * (1.0 + math.cos(math.pi * r)) * (c.lr - c.min_lr)


def main():
    c = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    # different sampling stream on every rank
    seed_everything(c.seed + rank)

    corpus = DocCorpus(c.data)
    train_docs, val_docs = corpus.split(c.val_frac)
    ckpt_dir = os.path.join("checkpoints", c.run)
    writer = None
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join("tb", c.run))
        print(f"{corpus.n_docs} docs: {len(train_docs)} train / {len(val_docs)} val, world={world}")

    with torch.random.fork_rng(devices=[device]):
        torch.manual_seed(c.seed)
        model = LM(c).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=c.lr, betas=(0.9, 0.95), fused=True)
    model = DDP(torch.compile(model), device_ids=[local_rank])

    @torch.no_grad()
    def evaluate():
        model.eval()
        acc = torch.zeros((), device=device)
        for _ in range(c.eval_batches):
            x, y = corpus.sample(val_docs, c.micro_batch, c.seq_len, device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                acc += model(x, y)
        dist.all_reduce(acc)
        model.train()
        return acc.item() / (c.eval_batches * world)

    tok_per_iter = c.micro_batch * c.seq_len * c.accum * world
    t0 = time.time()
    for it in range(c.max_iters + 1):
        if it % c.eval_interval == 0:
            vloss = evaluate()
            if rank == 0:
                print(f"iter {it:6d} | val loss {vloss:.4f} | ppl {math.exp(vloss):.1f}")
                writer.add_scalar("val/loss", vloss, it)
        if it == c.max_iters:
            break

        lr = cosine_lr(it, c)
        for g in opt.param_groups:
            g["lr"] = lr
        for micro in range(c.accum):
            x, y = corpus.sample(train_docs, c.micro_batch, c.seq_len, device)
            model.require_backward_grad_sync = micro == c.accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y) / c.accum
            loss.backward()
        gn = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

        if rank == 0 and it % 20 == 0:
            torch.cuda.synchronize()
            dt = (time.time() - t0) / (20 if it else 1)
            t0 = time.time()
            writer.add_scalar("train/loss", loss.item() * c.accum, it)
            writer.add_scalar("train/lr", lr, it)
            writer.add_scalar("perf/tok_per_s", tok_per_iter / dt, it)
            print(f"iter {it:6d} | loss {loss.item() * c.accum:.4f} | gnorm {gn.item():.2f} | "
                  f"{dt*1000:.0f} ms | {tok_per_iter / dt:,.0f} tok/s")

        if rank == 0 and it > 0 and it % c.ckpt_interval == 0:
            torch.save({"model": model.module._orig_mod.state_dict(), "opt": opt.state_dict(),
                        "iter": it, "config": dataclasses.asdict(c)},
                       os.path.join(ckpt_dir, f"iter_{it:06d}.pt"))

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
