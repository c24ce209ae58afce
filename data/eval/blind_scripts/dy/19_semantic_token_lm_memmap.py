"""AudioLM-style semantic stage: decoder-only LM over HuBERT k-means units (25 Hz, 1024 units).

All training utterances are concatenated into one uint16 memmap with an end-of-utterance
token between them; samples are fixed-length windows at random offsets.

    torchrun --nproc_per_node=8 19_semantic_token_lm_memmap.py --tokens /data/semantic/train.u16 \
        --valid-tokens /data/semantic/valid.u16 --out /shared/exp/semantic_lm
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
from torch.utils.tensorboard import SummaryWriter

N_UNITS = 1024
EOU = N_UNITS  # end of utterance
VOCAB = N_UNITS + 1


class TokenWindows(Dataset):
    def __init__(self, path, window, stride):
        self.path, self.window, self.stride = path, window, stride
        n = os.path.getsize(path) // 2
        self.n_windows = (n - window - 1) // stride
        self.tokens = None

    def __len__(self):
        return self.n_windows

    def __getitem__(self, i):
        if self.tokens is None:
            self.tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        s = i * self.stride
        chunk = torch.from_numpy(self.tokens[s : s + self.window + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.w, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return self.w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotary(x, base=10000.0):
    b, h, t, d = x.shape
    inv = 1.0 / base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class Layer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = RMSNorm(dim), RMSNorm(dim)
        self.qkv, self.o = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.up, self.gate, self.down = (nn.Linear(dim, 4 * dim, bias=False), nn.Linear(dim, 4 * dim, bias=False),
                                         nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class SemanticLM(nn.Module):
    def __init__(self, dim=1024, heads=16, layers=24):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(Layer(dim, heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        self.lm_head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--valid-tokens", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--min-lr", type=float, default=3e-5)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=2000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds = TokenWindows(args.tokens, args.window, stride=args.window // 2)
    valid_ds = TokenWindows(args.valid_tokens, args.window, stride=args.window)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=4,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    valid_dl = DataLoader(valid_ds, batch_size=args.batch_size,
                          sampler=DistributedSampler(valid_ds, shuffle=False, drop_last=True), num_workers=2)

    model = DDP(SemanticLM().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    total_steps = args.epochs * len(train_dl)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        p = (step - args.warmup) / max(1, total_steps - args.warmup)
        return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * p))

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))
        print(f"{len(train_ds)} windows/epoch, {total_steps} steps, world {world}", flush=True)

    step, t0 = 0, time.time()
    for epoch in range(args.epochs):
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1

            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tok_s = 100 * args.batch_size * args.window * world / (time.time() - t0)
                    writer.add_scalar("train/loss", l.item(), step)
                    writer.add_scalar("train/tokens_per_s", tok_s, step)
                    print(f"ep {epoch} step {step}/{total_steps} loss {l.item():.4f} {tok_s / 1e3:.0f}k tok/s", flush=True)
                t0 = time.time()

            if step % args.eval_every == 0:
                model.eval()
                acc = torch.zeros(2, device=device)
                with torch.no_grad():
                    for vx, vy in valid_dl:
                        vx, vy = vx.to(device), vy.to(device)
                        with torch.autocast("cuda", dtype=torch.bfloat16):
                            vl = model.module(vx)
                        acc[0] += F.cross_entropy(vl.float().view(-1, VOCAB), vy.view(-1), reduction="sum")
                        acc[1] += vy.numel()
                dist.all_reduce(acc)
                model.train()
                if rank == 0:
                    val = (acc[0] / acc[1]).item()
                    writer.add_scalar("valid/loss", val, step)
                    print(f"[valid] step {step} loss {val:.4f} ppl {math.exp(val):.2f}", flush=True)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                               os.path.join(args.out, "last.pt"))
                dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
