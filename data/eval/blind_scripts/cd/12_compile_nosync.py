"""
GPT-2 medium pretraining. torch.compile + DDP, gradient accumulation under no_sync,
bf16 autocast, checkpoint every N iters with resume.

    torchrun --standalone --nproc_per_node=8 12_compile_nosync.py --out_dir out/gpt2-medium
    torchrun --standalone --nproc_per_node=8 12_compile_nosync.py --out_dir out/gpt2-medium --resume
"""
import os
import math
import time
import argparse
import contextlib

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class CausalSelfAttention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, h)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(d, 4 * d), c_proj=nn.Linear(4 * d, d)))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        std_proj = 0.02 / math.sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=std_proj)
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            else:
                nn.init.zeros_(p) if name.endswith("bias") else None

    def forward(self, idx, targets):
        t = idx.size(1)
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(t, device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


def clean_state_dict(sd):
    """Strip wrapper prefixes (DDP 'module.', torch.compile '_orig_mod.') from checkpoint keys."""
    out = {}
    for k, v in sd.items():
        for prefix in ("module.", "_orig_mod."):
            if k.startswith(prefix):
                k = k[len(prefix):]
        out[k] = v
    return out


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", default="data/openwebtext")
    ap.add_argument("--out_dir", default="out/gpt2-medium")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--block_size", type=int, default=1024)
    ap.add_argument("--tokens_per_step", type=int, default=491520)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--min_lr", type=float, default=3e-5)
    ap.add_argument("--warmup_iters", type=int, default=2000)
    ap.add_argument("--max_iters", type=int, default=400000)
    ap.add_argument("--eval_interval", type=int, default=1000)
    ap.add_argument("--eval_iters", type=int, default=100)
    ap.add_argument("--ckpt_interval", type=int, default=2000)
    return ap.parse_args()


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    master = rank == 0

    per_rank_micro = args.batch_size * args.block_size
    assert args.tokens_per_step % (per_rank_micro * world) == 0, "tokens_per_step must divide evenly"
    grad_accum = args.tokens_per_step // (per_rank_micro * world)

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    model = GPT(block_size=args.block_size).to(device)
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=True)
    model = torch.compile(model)
    model = DDP(model, device_ids=[local_rank])

    iter_num = 0
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    if args.resume:
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module._orig_mod.load_state_dict(clean_state_dict(ckpt["model"]))
        optimizer.load_state_dict(ckpt["optimizer"])
        iter_num = ckpt["iter_num"]
        del ckpt
    elif master:
        os.makedirs(args.out_dir, exist_ok=True)

    torch.manual_seed(1337 + rank + 100003 * iter_num)
    train_data = np.memmap(os.path.join(args.data_dir, "train.bin"), dtype=np.uint16, mode="r")
    val_data = np.memmap(os.path.join(args.data_dir, "val.bin"), dtype=np.uint16, mode="r")

    def get_batch(data):
        T = args.block_size
        ix = torch.randint(len(data) - T - 1, (args.batch_size,))
        x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)

    def get_lr(it):
        if it < args.warmup_iters:
            return args.lr * (it + 1) / (args.warmup_iters + 1)
        if it > args.max_iters:
            return args.min_lr
        r = (it - args.warmup_iters) / (args.max_iters - args.warmup_iters)
        return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * r)) * (args.lr - args.min_lr)

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        res = torch.zeros(2, device=device)
        for i, data in enumerate((train_data, val_data)):
            for _ in range(args.eval_iters):
                x, y = get_batch(data)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    res[i] += model(x, y)
        res /= args.eval_iters
        dist.all_reduce(res, op=dist.ReduceOp.AVG)
        model.train()
        return res.tolist()

    n_params = sum(p.numel() for p in model.parameters())
    x, y = get_batch(train_data)
    t0 = time.time()
    while iter_num <= args.max_iters:
        lr = get_lr(iter_num)
        for g in optimizer.param_groups:
            g["lr"] = lr

        if iter_num % args.eval_interval == 0:
            tr, va = estimate_loss()
            if master:
                print(f"step {iter_num}: train {tr:.4f} val {va:.4f}")

        if iter_num > 0 and iter_num % args.ckpt_interval == 0:
            if master:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "iter_num": iter_num, "args": vars(args)}, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            dist.barrier()

        for micro_step in range(grad_accum):
            sync_ctx = model.no_sync() if micro_step < grad_accum - 1 else contextlib.nullcontext()
            with sync_ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x, y) / grad_accum
                loss.backward()
            x, y = get_batch(train_data)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if iter_num % 10 == 0 and master:
            torch.cuda.synchronize()
            dt = (time.time() - t0) / (10 if iter_num else 1)
            t0 = time.time()
            tok_s = args.tokens_per_step / dt
            mfu = 6 * n_params * tok_s / (world * 989e12)
            print(f"iter {iter_num}: loss {loss.item() * grad_accum:.4f} lr {lr:.2e} "
                  f"{dt*1000:.0f}ms {tok_s:,.0f} tok/s mfu {mfu*100:.1f}%")
        iter_num += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
