"""
Pretraining with a map-style packed dataset (fixed 2048-token samples out of a
memory-mapped uint16 corpus) fed through a DataLoader with worker processes.

    torchrun --standalone --nproc_per_node=8 19_wiki_410m.py --train data/wiki_en/train.bin \
        --valid data/wiki_en/valid.bin --save ckpt/wiki-410m
"""
import os
import math
import time
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.nn.parallel import DistributedDataParallel as DDP


class PackedBin(Dataset):
    def __init__(self, path, seq_len):
        self.path = path
        self.seq_len = seq_len
        self.n = (os.path.getsize(path) // 2 - 1) // seq_len
        self.tokens = None

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        if self.tokens is None:
            self.tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        start = idx * self.seq_len
        chunk = torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class TransformerLM(nn.Module):
    def __init__(self, vocab, seq_len, d, n_layers, n_heads):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq_len, d)
        self.layers = nn.ModuleList()
        for _ in range(n_layers):
            self.layers.append(nn.ModuleDict({
                "ln1": nn.LayerNorm(d), "qkv": nn.Linear(d, 3 * d), "o": nn.Linear(d, d),
                "ln2": nn.LayerNorm(d), "up": nn.Linear(d, 4 * d), "down": nn.Linear(4 * d, d),
            }))
        self.n_heads = n_heads
        self.ln_f = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x):
        B, T = x.shape
        h = self.embed(x) + self.pos(torch.arange(T, device=x.device))
        for L in self.layers:
            q, k, v = L["qkv"](L["ln1"](h)).view(B, T, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + L["o"](a.transpose(1, 2).reshape(B, T, -1))
            h = h + L["down"](F.gelu(L["up"](L["ln2"](h))))
        return self.out(self.ln_f(h))


def lm_loss(logits, y):
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--save", default="ckpt/run")
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--d_model", type=int, default=1024)
    ap.add_argument("--n_layers", type=int, default=24)
    ap.add_argument("--n_heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--micro_batch", type=int, default=8)
    ap.add_argument("--global_batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=1500)
    ap.add_argument("--train_iters", type=int, default=30000)
    ap.add_argument("--eval_interval", type=int, default=500)
    ap.add_argument("--eval_iters", type=int, default=30)
    ap.add_argument("--save_interval", type=int, default=2500)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    assert args.global_batch % (args.micro_batch * world) == 0
    accum = args.global_batch // (args.micro_batch * world)

    train_ds = PackedBin(args.train, args.seq_len)
    valid_ds = PackedBin(args.valid, args.seq_len)
    train_loader = DataLoader(train_ds, batch_size=args.micro_batch, shuffle=True, drop_last=True,
                              num_workers=args.workers, pin_memory=True, persistent_workers=True)
    valid_loader = DataLoader(valid_ds, batch_size=args.micro_batch, shuffle=False, num_workers=2, pin_memory=True)

    model = TransformerLM(args.vocab, args.seq_len, args.d_model, args.n_layers, args.n_heads).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    model = DDP(torch.compile(model), device_ids=[local_rank])

    def lr_at(it):
        if it < args.warmup:
            return args.lr * (it + 1) / args.warmup
        p = min(1.0, (it - args.warmup) / (args.train_iters - args.warmup))
        return args.lr * 0.1 + args.lr * 0.45 * (1.0 + math.cos(math.pi * p))

    @torch.no_grad()
    def evaluate():
        model.eval()
        tot = torch.zeros(2, device=device)
        for i, (x, y) in enumerate(valid_loader):
            if i >= args.eval_iters:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                tot[0] += lm_loss(model(x), y) * y.numel()
            tot[1] += y.numel()
        dist.all_reduce(tot)
        model.train()
        return (tot[0] / tot[1]).item()

    def infinite(loader):
        epoch = 0
        while True:
            for b in loader:
                yield b
            epoch += 1

    batches = infinite(train_loader)
    tokens_per_iter = args.global_batch * args.seq_len
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
        print(f"{n_params/1e6:.0f}M params, {len(train_ds):,} samples, accum {accum}, {tokens_per_iter:,} tok/iter")

    t0 = time.time()
    for it in range(1, args.train_iters + 1):
        lr = lr_at(it)
        for g in opt.param_groups:
            g["lr"] = lr
        running = 0.0
        for m in range(accum):
            x, y = next(batches)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            model.require_backward_grad_sync = (m == accum - 1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = lm_loss(model(x), y) / accum
            loss.backward()
            running += loss.item()
        gnorm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

        if it % 10 == 0 and rank == 0:
            torch.cuda.synchronize()
            dt = (time.time() - t0) / 10
            t0 = time.time()
            tps = tokens_per_iter / dt
            print(f"iter {it:6d} | loss {running:.4f} | lr {lr:.2e} | gnorm {gnorm.item():.2f} | "
                  f"{tps:,.0f} tok/s | mfu {100 * 6 * n_params * tps / (world * 989e12):.1f}%")

        if it % args.eval_interval == 0:
            vl = evaluate()
            if rank == 0:
                print(f"iter {it:6d} | valid loss {vl:.4f} | ppl {math.exp(vl):.2f}")

        if it % args.save_interval == 0:
            if rank == 0:
                torch.save({"model": model.module._orig_mod.state_dict(), "optimizer": opt.state_dict(),
                            "iter": it, "args": vars(args)}, os.path.join(args.save, f"iter_{it:07d}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
