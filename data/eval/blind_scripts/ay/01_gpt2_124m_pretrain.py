"""
GPT-style pretraining on pre-tokenized shards (uint16 memmap), DDP + torch.compile.

    torchrun --standalone --nproc_per_node=8 01_gpt2_124m_pretrain.py --data_dir /data/fineweb10B
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


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # padded to a multiple of 128
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
        return logits, loss

    def num_params(self, non_embedding=True):
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wpe.weight.numel()
        return n

    def configure_optimizers(self, weight_decay, lr, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)

    def estimate_mfu(self, fwdbwd_per_iter, dt, peak_flops=989e12):
        # PaLM appendix B: 6N + 12 L H Q T flops per token
        N = self.num_params()
        L, H, Q, T = self.cfg.n_layer, self.cfg.n_head, self.cfg.n_embd // self.cfg.n_head, self.cfg.block_size
        flops_per_token = 6 * N + 12 * L * H * Q * T
        flops_per_iter = flops_per_token * T * fwdbwd_per_iter
        return (flops_per_iter / dt) / peak_flops


def get_batch(data, batch_size, block_size, device):
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix])
    x = x.pin_memory().to(device, non_blocking=True)
    y = y.pin_memory().to(device, non_blocking=True)
    return x, y


def get_lr(it, args):
    if it < args.warmup_iters:
        return args.lr * (it + 1) / args.warmup_iters
    if it > args.max_iters:
        return args.min_lr
    ratio = (it - args.warmup_iters) / (args.max_iters - args.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return args.min_lr + coeff * (args.lr - args.min_lr)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--out_dir", default="out/gpt2-124m")
    p.add_argument("--batch_size", type=int, default=16, help="micro batch per GPU")
    p.add_argument("--total_batch_tokens", type=int, default=524288)
    p.add_argument("--max_iters", type=int, default=19073)
    p.add_argument("--warmup_iters", type=int, default=715)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min_lr", type=float, default=6e-5)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--eval_interval", type=int, default=250)
    p.add_argument("--eval_iters", type=int, default=50)
    p.add_argument("--log_interval", type=int, default=10)
    p.add_argument("--compile", action="store_true", default=True)
    p.add_argument("--no_compile", dest="compile", action="store_false")
    return p.parse_args()


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    master = rank == 0

    torch.manual_seed(1337 + rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    cfg = GPTConfig()
    tokens_per_micro = args.batch_size * cfg.block_size * world_size
    assert args.total_batch_tokens % tokens_per_micro == 0
    grad_accum = args.total_batch_tokens // tokens_per_micro
    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"world={world_size} grad_accum={grad_accum} tokens/step={args.total_batch_tokens}")

    train_data = np.memmap(os.path.join(args.data_dir, "train.bin"), dtype=np.uint16, mode="r")
    val_data = np.memmap(os.path.join(args.data_dir, "val.bin"), dtype=np.uint16, mode="r")

    raw_model = GPT(cfg).to(device)
    optimizer = raw_model.configure_optimizers(args.weight_decay, args.lr, (0.9, 0.95))
    model = torch.compile(raw_model) if args.compile else raw_model
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True, bucket_cap_mb=50)
    autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16)

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        out = {}
        for split, data in (("train", train_data), ("val", val_data)):
            losses = torch.zeros(args.eval_iters, device=device)
            for k in range(args.eval_iters):
                x, y = get_batch(data, args.batch_size, cfg.block_size, device)
                with autocast:
                    _, loss = model(x, y)
                losses[k] = loss
            mean = losses.mean()
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            out[split] = mean.item()
        model.train()
        return out

    x, y = get_batch(train_data, args.batch_size, cfg.block_size, device)
    t0 = time.time()
    for it in range(args.max_iters + 1):
        lr = get_lr(it, args)
        for g in optimizer.param_groups:
            g["lr"] = lr

        if it % args.eval_interval == 0:
            losses = estimate_loss()
            if master:
                print(f"step {it}: train {losses['train']:.4f} val {losses['val']:.4f}")
                if it > 0:
                    ckpt = {
                        "model": raw_model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "iter": it,
                        "config": cfg.__dict__,
                        "val_loss": losses["val"],
                    }
                    torch.save(ckpt, os.path.join(args.out_dir, "ckpt.pt"))
            dist.barrier()

        for micro in range(grad_accum):
            # only all-reduce on the last micro step
            model.require_backward_grad_sync = micro == grad_accum - 1
            with autocast:
                _, loss = model(x, y)
                loss = loss / grad_accum
            x, y = get_batch(train_data, args.batch_size, cfg.block_size, device)
            loss.backward()

        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if it % args.log_interval == 0:
            torch.cuda.synchronize()
            t1 = time.time()
            dt = (t1 - t0) / args.log_interval if it > 0 else t1 - t0
            t0 = t1
            loss_t = loss.detach() * grad_accum
            dist.all_reduce(loss_t, op=dist.ReduceOp.AVG)
            if master:
                tok_per_sec = args.total_batch_tokens / dt
                mfu = model.estimate_mfu(args.batch_size * grad_accum, dt)
                print(
                    f"iter {it}: loss {loss_t.item():.4f} lr {lr:.2e} norm {norm:.3f} "
                    f"dt {dt * 1000:.1f}ms tok/s {tok_per_sec:,.0f} mfu {mfu * 100:.1f}%"
                )

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
