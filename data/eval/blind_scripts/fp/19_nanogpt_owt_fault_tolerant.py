"""GPT-2 medium on OpenWebText, nanoGPT-style, with preemption handling.

    torchrun --nnodes=2 --nproc-per-node=8 --max-restarts=3 --rdzv-id=owt \
        --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29400 19_nanogpt_owt_fault_tolerant.py
"""
import argparse
import inspect
import math
import os
import signal
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 24
    n_head: int = 16
    n_embd: int = 1024
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.n_head, self.dropout = cfg.n_head, cfg.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = [t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v)]
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._init)

    def _init(self, m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.h:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, lr, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="/fsx/data/openwebtext")
    p.add_argument("--out-dir", default="/fsx/out/owt-medium")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=4, help="per rank; 16 ranks x 8 x 4 = 512 seqs/step")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min-lr", type=float, default=3e-5)
    p.add_argument("--warmup-iters", type=int, default=2000)
    p.add_argument("--max-iters", type=int, default=200000)
    p.add_argument("--eval-interval", type=int, default=1000)
    p.add_argument("--eval-iters", type=int, default=100)
    p.add_argument("--ckpt-interval", type=int, default=500)
    return p.parse_args()


def get_lr(it, a):
    if it < a.warmup_iters:
        return a.lr * (it + 1) / a.warmup_iters
    r = (it - a.warmup_iters) / (a.max_iters - a.warmup_iters)
    return a.min_lr + 0.5 * (1.0 + math.cos(math.pi * min(r, 1.0))) * (a.lr - a.min_lr)


preempt = False


def _on_sigterm(signum, frame):
    global preempt
    preempt = True


def main():
    a = get_args()
    signal.signal(signal.SIGTERM, _on_sigterm)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{local_rank}"
    master = rank == 0

    train_data = np.memmap(os.path.join(a.data_dir, "train.bin"), dtype=np.uint16, mode="r")
    val_data = np.memmap(os.path.join(a.data_dir, "val.bin"), dtype=np.uint16, mode="r")

    cfg = GPTConfig()
    model = GPT(cfg).to(device)
    optimizer = model.configure_optimizers(0.1, a.lr, (0.9, 0.95))

    iter_num, best_val = 0, 1e9
    ckpt_path = os.path.join(a.out_dir, "ckpt.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        iter_num, best_val = ck["iter_num"], ck["best_val_loss"]
        del ck
    # random windows: per-rank generator so ranks draw different batches; reseeded on restart
    gen = torch.Generator().manual_seed(1337 + rank + 7919 * iter_num)

    def get_batch(split):
        data = train_data if split == "train" else val_data
        ix = torch.randint(len(data) - cfg.block_size, (a.batch_size,), generator=gen)
        x = torch.stack([torch.from_numpy(data[i:i + cfg.block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + cfg.block_size].astype(np.int64)) for i in ix])
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)

    model = DDP(model, device_ids=[local_rank])

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        out = {}
        for split in ("train", "val"):
            losses = torch.zeros(a.eval_iters, device=device)
            for k in range(a.eval_iters):
                x, y = get_batch(split)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    _, loss = model(x, y)
                losses[k] = loss
            m = losses.mean()
            dist.all_reduce(m, op=dist.ReduceOp.AVG)
            out[split] = m.item()
        model.train()
        return out

    def save_checkpoint():
        if master:
            os.makedirs(a.out_dir, exist_ok=True)
            ck = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                  "model_args": asdict(model.config), "iter_num": iter_num, "best_val_loss": best_val}
            torch.save(ck, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            print(f"saved checkpoint at iter {iter_num}", flush=True)
        dist.barrier()

    x, y = get_batch("train")
    t0 = time.time()
    stop = torch.zeros(1, device=device)
    while iter_num < a.max_iters:
        lr = get_lr(iter_num, a)
        for g in optimizer.param_groups:
            g["lr"] = lr

        if iter_num > 0 and iter_num % a.eval_interval == 0:
            losses = estimate_loss()
            if master:
                print(f"iter {iter_num}: train {losses['train']:.4f} val {losses['val']:.4f}", flush=True)
            best_val = min(best_val, losses["val"])

        for micro in range(a.grad_accum):
            model.require_backward_grad_sync = micro == a.grad_accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(x, y)
                loss = loss / a.grad_accum
            x, y = get_batch("train")
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1

        if master and iter_num % 10 == 0:
            dt = time.time() - t0
            t0 = time.time()
            print(f"iter {iter_num}: loss {loss.item() * a.grad_accum:.4f}, {dt * 100:.0f} ms/iter, lr {lr:.2e}",
                  flush=True)

        stop[0] = 1.0 if preempt else 0.0
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item() or iter_num % a.ckpt_interval == 0:
            save_checkpoint()
        if stop.item():
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
