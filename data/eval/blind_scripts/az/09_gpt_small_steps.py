"""Small GPT language model, step-based training (the JAX/pmap version ran
`for step, batch in zip(range(num_steps), ds.repeat().as_numpy_iterator())`).

Tokens are pre-encoded uint16 in train.bin / val.bin.

    torchrun --nproc_per_node=8 09_gpt_small_steps.py --data-dir data/owt --max-steps 50000
"""
import argparse
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


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="data/owt")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--per-device-batch", type=int, default=24)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-steps", type=int, default=2000)
    p.add_argument("--max-steps", type=int, default=50000)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--eval-batches", type=int, default=50)
    p.add_argument("--out", default="out/gpt_small")
    return p.parse_args()


class TokenChunks(Dataset):
    def __init__(self, path, block_size):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.block = block_size

    def __len__(self):
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i):
        chunk = torch.from_numpy(self.data[i * self.block: (i + 1) * self.block + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, block, n_layer, n_head, d):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.ModuleList([Block(d, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.tok.weight
        self.register_buffer("mask", torch.triu(torch.ones(block, block, dtype=torch.bool), 1), persistent=False)

    def forward(self, idx):
        t = idx.size(1)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.lm_head(self.ln_f(x))


def lr_at(step, args):
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    prog = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
    return 0.1 * args.lr + 0.9 * args.lr * 0.5 * (1 + math.cos(math.pi * prog))


def repeat(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


@torch.no_grad()
def estimate_val_loss(model, val_iter, n_batches, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for _ in range(n_batches):
        x, y = next(val_iter)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        tot[0] += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        tot[1] += 1
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = True

    train_ds = TokenChunks(os.path.join(args.data_dir, "train.bin"), args.block_size)
    val_ds = TokenChunks(os.path.join(args.data_dir, "val.bin"), args.block_size)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1337, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=True, seed=0, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.per_device_batch, sampler=train_sampler,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.per_device_batch, sampler=val_sampler,
                        num_workers=2, pin_memory=True, drop_last=True)
    train_iter, val_iter = repeat(train_dl, train_sampler), repeat(val_dl, val_sampler)

    model = GPT(args.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd).to(device)
    model = DDP(model, device_ids=[local_rank])
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        n = sum(p.numel() for p in model.module.parameters())
        print(f"params {n / 1e6:.1f}M | tokens/step {args.per_device_batch * args.block_size * world:,}")

    best_val, skipped = float("inf"), 0
    t0 = time.time()
    for step in range(args.max_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        x, y = next(train_iter)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        if not torch.isfinite(loss):
            skipped += 1
            if skipped > 100:
                raise RuntimeError("too many non-finite losses")
            continue
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

        if rank == 0 and step % 100 == 0:
            dt = (time.time() - t0) / (step + 1)
            print(f"step {step} loss {loss.item():.4f} lr {lr_at(step, args):.2e} {dt * 1000:.0f}ms/step "
                  f"skipped {skipped}", flush=True)

        if (step + 1) % args.eval_every == 0:
            val_loss = estimate_val_loss(model, val_iter, args.eval_batches, device)
            if rank == 0:
                print(f"step {step + 1}: val_loss {val_loss:.4f} ppl {math.exp(val_loss):.1f}", flush=True)
                if val_loss < best_val:
                    best_val = val_loss
                    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                                "step": step + 1, "val_loss": val_loss, "args": vars(args)},
                               os.path.join(args.out, "ckpt.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
