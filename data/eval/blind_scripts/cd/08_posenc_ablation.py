"""
GPT with a choice of positional encoding (learned absolute or rotary), used for the
positional-encoding ablation runs. Trains on random windows of fineweb-edu token bins.

  torchrun --standalone --nproc_per_node=8 08_posenc_ablation.py --pos rope --run rope-124m
  torchrun --standalone --nproc_per_node=8 08_posenc_ablation.py --pos learned --run abs-124m
"""
import os
import math
import time
import json
import argparse
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Rotary(nn.Module):
    def __init__(self, dim, max_len, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        t = torch.arange(max_len).float()
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos()[None, None], persistent=False)
        self.register_buffer("sin", freqs.sin()[None, None], persistent=False)

    def forward(self, x):
        T = x.size(2)
        x1, x2 = x.chunk(2, dim=-1)
        cos, sin = self.cos[:, :, :T], self.sin[:, :, :T]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.nh = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.rotary = Rotary(cfg.n_embd // cfg.n_head, cfg.block_size) if cfg.pos == "rope" else None

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.nh, C // self.nh).permute(2, 0, 3, 1, 4)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    def _init_weights(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        x = self.wte(idx)
        if self.cfg.pos == "learned":
            x = x + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--run", default="rope-124m")
    p.add_argument("--data_dir", default="/data/fineweb-edu-10B")
    p.add_argument("--pos", choices=["learned", "rope"], default="rope")
    p.add_argument("--vocab_size", type=int, default=50304)
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--n_layer", type=int, default=12)
    p.add_argument("--n_head", type=int, default=12)
    p.add_argument("--n_embd", type=int, default=768)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--total_batch", type=int, default=524288, help="tokens per optimizer step")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=715)
    p.add_argument("--max_steps", type=int, default=19073)
    p.add_argument("--eval_every", type=int, default=250)
    p.add_argument("--eval_steps", type=int, default=20)
    p.add_argument("--save_every", type=int, default=5000)
    return p.parse_args()


def main():
    cfg = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = f"cuda:{local_rank}"
    torch.cuda.set_device(device)
    master = rank == 0

    B, T = cfg.batch_size, cfg.block_size
    assert cfg.total_batch % (B * T * world) == 0
    accum = cfg.total_batch // (B * T * world)
    out_dir = os.path.join("runs", cfg.run)
    if master:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "args.json"), "w") as f:
            json.dump(vars(cfg), f, indent=2)
        print(f"world={world} accum={accum} pos={cfg.pos}")

    train = np.memmap(os.path.join(cfg.data_dir, "train.bin"), dtype=np.uint16, mode="r")
    val = np.memmap(os.path.join(cfg.data_dir, "val.bin"), dtype=np.uint16, mode="r")
    g = torch.Generator().manual_seed(1000 + rank)

    def get_batch(data, gen):
        ix = torch.randint(len(data) - T - 1, (B,), generator=gen)
        xy = torch.stack([torch.from_numpy(data[i:i + T + 1].astype(np.int64)) for i in ix.tolist()])
        xy = xy.pin_memory().to(device, non_blocking=True)
        return xy[:, :-1], xy[:, 1:]

    torch.manual_seed(1337)
    model = GPT(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    nodecay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": nodecay, "weight_decay": 0.0}],
                                  lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    model = torch.compile(model)
    model = DDP(model, device_ids=[local_rank])

    def lr_at(step):
        min_lr = cfg.lr * 0.1
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        r = (step - cfg.warmup) / (cfg.max_steps - cfg.warmup)
        return min_lr + 0.5 * (1 + math.cos(math.pi * r)) * (cfg.lr - min_lr)

    def evaluate():
        model.eval()
        vg = torch.Generator().manual_seed(7 + rank)
        loss = torch.zeros((), device=device)
        with torch.no_grad():
            for _ in range(cfg.eval_steps):
                x, y = get_batch(val, vg)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss += model(x, y)
        loss /= cfg.eval_steps
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        model.train()
        return loss.item()

    log_path = os.path.join(out_dir, "log.txt")
    for step in range(cfg.max_steps):
        t0 = time.time()
        last = step == cfg.max_steps - 1
        if step % cfg.eval_every == 0 or last:
            vl = evaluate()
            if master:
                print(f"step {step} val {vl:.4f}")
                with open(log_path, "a") as f:
                    f.write(f"{step} val {vl:.4f}\n")

        loss_accum = torch.zeros((), device=device)
        for micro in range(accum):
            x, y = get_batch(train, g)
            sync = micro == accum - 1
            with (nullcontext() if sync else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x, y) / accum
                loss_accum += loss.detach()
                loss.backward()
        dist.all_reduce(loss_accum, op=dist.ReduceOp.AVG)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr = lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = time.time() - t0
        if master:
            tok_s = cfg.total_batch / dt
            mfu = 6 * n_params * tok_s / (world * 989e12)
            print(f"step {step:5d} | loss {loss_accum.item():.4f} | lr {lr:.4e} | norm {norm:.3f} | "
                  f"dt {dt*1000:.1f}ms | tok/s {tok_s:,.0f} | mfu {mfu*100:.1f}%")
            with open(log_path, "a") as f:
                f.write(f"{step} train {loss_accum.item():.6f}\n")

        if master and step > 0 and (step % cfg.save_every == 0 or last):
            torch.save({"model": model.module._orig_mod.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step, "config": vars(cfg)}, os.path.join(out_dir, f"model_{step:05d}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
