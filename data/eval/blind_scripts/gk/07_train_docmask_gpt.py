"""
nanoGPT fork: document-masked attention (FlexAttention), Muon + AdamW, bf16.

    torchrun --standalone --nproc_per_node=4 train.py --dataset fineweb_edu --out_dir out-docmask
"""
import argparse
import math
import os
import time
from dataclasses import dataclass, asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.nn.parallel import DistributedDataParallel as DDP

EOT = 50256


@dataclass
class ModelConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x, block_mask):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, -1).transpose(1, 2)
        k = k.view(B, T, self.n_head, -1).transpose(1, 2)
        v = v.view(B, T, self.n_head, -1).transpose(1, 2)
        y = flex_attention(q, k, v, block_mask=block_mask)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=False)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=False)
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x, block_mask):
        x = x + self.attn(self.ln_1(x), block_mask)
        x = x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))
        return x


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=False)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)

    def _init_weights(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        B, T = idx.shape
        docs = (idx == EOT).cumsum(dim=1)

        def doc_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])

        block_mask = create_block_mask(doc_causal, B, None, T, T, device=idx.device)
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x, block_mask)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def zeropower_via_newtonschulz5(G, steps=5, eps=1e-7):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    X /= X.norm() + eps
    if G.size(0) > G.size(1):
        X = X.T
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(0) > G.size(1):
        X = X.T
    return X


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02, momentum=0.95, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "buf" not in st:
                    st["buf"] = torch.zeros_like(p.grad)
                st["buf"].mul_(group["momentum"]).add_(p.grad)
                g = p.grad.add(st["buf"], alpha=group["momentum"])
                u = zeropower_via_newtonschulz5(g)
                if group["weight_decay"] > 0:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(u.type_as(p), alpha=-group["lr"] * max(1, p.size(0) / p.size(1)) ** 0.5)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="fineweb_edu")
    ap.add_argument("--out_dir", default="out-docmask")
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--grad_accum", type=int, default=8, help="total over all ranks")
    ap.add_argument("--max_iters", type=int, default=20000)
    ap.add_argument("--warmup_iters", type=int, default=500)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--muon_lr", type=float, default=0.02)
    ap.add_argument("--min_lr_frac", type=float, default=0.1)
    ap.add_argument("--eval_interval", type=int, default=500)
    ap.add_argument("--eval_iters", type=int, default=100)
    ap.add_argument("--log_interval", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--no_compile", action="store_true")
    return ap.parse_args()


def main():
    args = get_args()
    cfg = ModelConfig()

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    device = torch.device(f"cuda:{local_rank}")
    torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl")
    master = rank == 0

    assert args.grad_accum % world_size == 0
    grad_accum = args.grad_accum // world_size
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    data_dir = os.path.join("data", args.dataset)
    train_data = np.memmap(os.path.join(data_dir, "train.bin"), dtype=np.uint16, mode="r")
    val_data = np.memmap(os.path.join(data_dir, "val.bin"), dtype=np.uint16, mode="r")

    def get_batch(split):
        data = train_data if split == "train" else val_data
        ix = np.random.randint(0, len(data) - cfg.block_size - 1, size=args.batch_size)
        x = torch.from_numpy(np.stack([data[i:i + cfg.block_size] for i in ix]).astype(np.int64))
        y = torch.from_numpy(np.stack([data[i + 1:i + 1 + cfg.block_size] for i in ix]).astype(np.int64))
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)

    model = GPT(cfg).to(device)
    matrix_params = [p for n, p in model.blocks.named_parameters() if p.ndim == 2]
    other_params = [p for n, p in model.named_parameters() if not n.startswith("blocks.") or p.ndim < 2]
    adamw = torch.optim.AdamW(other_params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    muon = Muon(matrix_params, lr=args.muon_lr, momentum=0.95)
    optimizers = [adamw, muon]
    base_lrs = [[g["lr"] for g in opt.param_groups] for opt in optimizers]

    if not args.no_compile:
        model = torch.compile(model)
    model = DDP(model, device_ids=[local_rank])

    ctx = torch.autocast(device_type="cuda", dtype=torch.bfloat16)

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                X, Y = get_batch(split)
                with ctx:
                    loss = model(X, Y)
                losses[k] = loss.item()
            split_loss = losses.mean()
            dist.all_reduce(split_loss, op=dist.ReduceOp.AVG)
            out[split] = split_loss.item()
        model.train()
        return out

    def lr_mult(it):
        if it < args.warmup_iters:
            return (it + 1) / args.warmup_iters
        ratio = min(1.0, (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters))
        return args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1.0 + math.cos(math.pi * ratio))

    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"world size {world_size}, grad accum {grad_accum}, "
              f"tokens/iter {grad_accum * world_size * args.batch_size * cfg.block_size:,}")

    best_val = float("inf")
    X, Y = get_batch("train")
    t0 = time.time()
    for it in range(args.max_iters + 1):
        m = lr_mult(it)
        for opt, lrs in zip(optimizers, base_lrs):
            for g, lr in zip(opt.param_groups, lrs):
                g["lr"] = lr * m

        if it % args.eval_interval == 0:
            losses = estimate_loss()
            if master:
                print(f"iter {it}: train {losses['train']:.4f} val {losses['val']:.4f}")
                if losses["val"] < best_val and it > 0:
                    best_val = losses["val"]
                    torch.save({
                        "model": model.module.state_dict(),
                        "optimizers": [o.state_dict() for o in optimizers],
                        "iter": it,
                        "best_val": best_val,
                        "model_config": asdict(cfg),
                    }, os.path.join(args.out_dir, "ckpt.pt"))
        if it == args.max_iters:
            break

        for micro in range(grad_accum):
            with model.no_sync() if micro < grad_accum - 1 else torch.enable_grad():
                with ctx:
                    loss = model(X, Y) / grad_accum
                X, Y = get_batch("train")
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)

        if it % args.log_interval == 0:
            lossf = loss.detach() * grad_accum
            dist.all_reduce(lossf, op=dist.ReduceOp.AVG)
            t1 = time.time()
            if master:
                print(f"iter {it}: loss {lossf.item():.4f}, lr x{m:.3f}, "
                      f"{(t1 - t0) * 1000 / args.log_interval:.1f} ms/iter")
            t0 = t1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
