"""
nanoGPT-style training on OpenWebText with Muon + AdamW.

Muon's orthogonalisation is done by one owner rank per matrix and broadcast
from there (round-robin ownership), so each NS iteration runs once per step
instead of world_size times.

$ torchrun --standalone --nproc_per_node=8 15_muon_nanogpt_owt.py --dataset owt --max_iters 20000
"""
import argparse
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


@torch.compile
def orthogonalize(G, steps: int = 5):
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.bfloat16()
    tall = G.size(0) > G.size(1)
    if tall:
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


class OwnerMuon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02, momentum=0.95, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    @torch.no_grad()
    def step(self):
        i = 0
        for group in self.param_groups:
            for p in group["params"]:
                owner = i % self.world
                i += 1
                st = self.state[p]
                if "buf" not in st:
                    st["buf"] = torch.zeros_like(p)
                    st["upd"] = torch.empty_like(p, dtype=torch.bfloat16)
                if self.rank == owner:
                    st["buf"].mul_(group["momentum"]).add_(p.grad)
                    g = p.grad.add(st["buf"], alpha=group["momentum"])
                    st["upd"].copy_(orthogonalize(g))
                dist.broadcast(st["upd"], src=owner)
                scale = max(1.0, p.size(0) / p.size(1)) ** 0.5
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(st["upd"].to(p.dtype), alpha=-group["lr"] * scale)


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=False)
        self.attn_qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.attn_out = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=False)
        self.mlp_in = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.mlp_out = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)
        self.n_head = cfg.n_head

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn_qkv(self.ln_1(x)).view(B, T, 3, self.n_head, C // self.n_head).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=False),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for blk in self.transformer.h:
            x = blk(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, muon_lr, adam_lr, weight_decay):
        matrices = [p for p in self.transformer.h.parameters() if p.ndim == 2]
        matrix_ids = {id(p) for p in matrices}
        others = [p for p in self.parameters() if id(p) not in matrix_ids]
        muon = OwnerMuon(matrices, lr=muon_lr, weight_decay=weight_decay)
        adam = torch.optim.AdamW(others, lr=adam_lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
        return [muon, adam]


def get_batch(split, args, device):
    data = np.memmap(os.path.join("data", args.dataset, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - args.block_size, (args.batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + args.block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + args.block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="owt")
    ap.add_argument("--out_dir", default="out-muon")
    ap.add_argument("--batch_size", type=int, default=12)
    ap.add_argument("--block_size", type=int, default=1024)
    ap.add_argument("--grad_accum", type=int, default=5)
    ap.add_argument("--max_iters", type=int, default=20000)
    ap.add_argument("--muon_lr", type=float, default=0.02)
    ap.add_argument("--adam_lr", type=float, default=6e-4)
    ap.add_argument("--weight_decay", type=float, default=0.0)
    ap.add_argument("--eval_interval", type=int, default=1000)
    ap.add_argument("--eval_iters", type=int, default=100)
    args = ap.parse_args()

    dist.init_process_group(backend="nccl")
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    device = f"cuda:{local_rank}"
    torch.cuda.set_device(device)
    master = rank == 0
    torch.manual_seed(1337 + rank)

    model = GPT(GPTConfig(block_size=args.block_size)).to(device)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    model = DDP(model, device_ids=[local_rank])
    optimizers = model.configure_optimizers(args.muon_lr, args.adam_lr, args.weight_decay)
    for o in optimizers:
        for g in o.param_groups:
            g["initial_lr"] = g["lr"]

    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"tokens per iter: {args.grad_accum * world * args.batch_size * args.block_size:,}")

    def lr_factor(it):
        warm, decay_from = 200, int(0.7 * args.max_iters)
        if it < warm:
            return (it + 1) / warm
        if it < decay_from:
            return 1.0
        return max(0.05, (args.max_iters - it) / (args.max_iters - decay_from))

    t0 = time.time()
    for it in range(args.max_iters + 1):
        if it % args.eval_interval == 0:
            model.eval()
            losses = torch.zeros(2, device=device)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                for s, split in enumerate(["train", "val"]):
                    for _ in range(args.eval_iters):
                        x, y = get_batch(split, args, device)
                        losses[s] += model(x, y)[1] / args.eval_iters
            dist.all_reduce(losses, op=dist.ReduceOp.AVG)
            model.train()
            if master:
                print(f"iter {it}: train {losses[0].item():.4f} val {losses[1].item():.4f}")
                torch.save({"model": model.module.state_dict(), "iter": it, "args": vars(args)},
                           os.path.join(args.out_dir, "ckpt.pt"))
        if it == args.max_iters:
            break

        for micro in range(args.grad_accum):
            model.require_backward_grad_sync = micro == args.grad_accum - 1
            x, y = get_batch("train", args, device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(x, y)
            (loss / args.grad_accum).backward()
        f = lr_factor(it)
        for o in optimizers:
            for g in o.param_groups:
                g["lr"] = g["initial_lr"] * f
            o.step()
        model.zero_grad(set_to_none=True)

        if master and it % 10 == 0:
            dt = time.time() - t0
            t0 = time.time()
            print(f"iter {it}: loss {loss.item():.4f}, {dt * 100:.1f}ms/iter")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
