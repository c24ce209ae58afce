"""
Small Mixtral-style sparse MoE (RMSNorm, RoPE, SwiGLU experts, top-2 routing) pretrained
with DDP. Experts are replicated; tokens beyond an expert's capacity are dropped.

    torchrun --nproc_per_node=8 08_mixtral_style_pretrain.py --data /fsx/tokens/redpajama \
        --wandb-project moe-small --resume /fsx/ckpt/mixtral_small/latest.pt
"""
import argparse
import contextlib
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt-dir", default="/fsx/ckpt/mixtral_small")
    p.add_argument("--resume", default="")
    p.add_argument("--wandb-project", default=None)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--n-layers", type=int, default=16)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--n-experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.5)
    p.add_argument("--router-aux-coef", type=float, default=0.02)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--tokens-per-step", type=int, default=2 ** 20)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--steps", type=int, default=50000)
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--save-every", type=int, default=1000)
    return p.parse_args()


class Tokens(Dataset):
    def __init__(self, path, seq_len):
        self.path, self.seq_len = path, seq_len
        self.n = (os.path.getsize(path) // 2 - 1) // seq_len
        self.mm = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.uint16, mode="r")
        c = torch.from_numpy(self.mm[i * self.seq_len:(i + 1) * self.seq_len + 1].astype(np.int64))
        return c[:-1], c[1:]


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype) * self.weight


def rope_cache(seq_len, head_dim, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    f = torch.outer(torch.arange(seq_len).float(), inv)
    return torch.cos(f), torch.sin(f)


def apply_rope(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Expert(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.n_experts, self.top_k, self.cf = a.n_experts, a.top_k, a.capacity_factor
        self.router = nn.Linear(a.dim, a.n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(a.dim, int(3.5 * a.dim)) for _ in range(a.n_experts))

    def forward(self, x):
        B, T, D = x.shape
        h = x.view(-1, D)
        logits = self.router(h).float()
        probs = logits.softmax(-1)
        w, sel = probs.topk(self.top_k, -1)
        w = (w / w.sum(-1, keepdim=True)).to(h.dtype)
        aux = self.n_experts * (F.one_hot(sel, self.n_experts).float().mean((0, 1)) * probs.mean(0)).sum()
        cap = math.ceil(self.cf * h.size(0) * self.top_k / self.n_experts)
        out = torch.zeros_like(h)
        routed = 0
        for e in range(self.n_experts):
            rows, slot = torch.where(sel == e)
            if rows.numel() == 0:
                continue  # no tokens this step: expert gets no gradient, DDP is told to expect that
            rows, slot = rows[:cap], slot[:cap]
            routed += rows.numel()
            out.index_add_(0, rows, (self.experts[e](h[rows]) * w[rows, slot, None]).to(out.dtype))
        dropped = 1.0 - routed / sel.numel()
        return out.view(B, T, D), aux, torch.tensor(dropped, device=x.device)


class DecoderLayer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.n_heads = a.n_heads
        self.attn_norm = RMSNorm(a.dim)
        self.ffn_norm = RMSNorm(a.dim)
        self.wqkv = nn.Linear(a.dim, 3 * a.dim, bias=False)
        self.wo = nn.Linear(a.dim, a.dim, bias=False)
        self.moe = SparseMoeBlock(a)

    def forward(self, x, cos, sin):
        B, T, D = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).view(B, T, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(B, T, D))
        y, aux, dropped = self.moe(self.ffn_norm(x))
        return x + y, aux, dropped


class MoETransformer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim)
        self.lm_head = nn.Linear(a.dim, a.vocab, bias=False)
        cos, sin = rope_cache(a.seq_len, a.dim // a.n_heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.grad_ckpt = a.grad_ckpt

    def forward(self, idx):
        T = idx.size(1)
        x = self.embed(idx)
        cos, sin = self.cos[:T], self.sin[:T]
        auxes, drops = [], []
        for layer in self.layers:
            if self.grad_ckpt and self.training:
                x, aux, dropped = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x, aux, dropped = layer(x, cos, sin)
            auxes.append(aux)
            drops.append(dropped)
        return self.lm_head(self.norm(x)), torch.stack(auxes).mean(), torch.stack(drops).mean()


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    master = rank == 0
    torch.manual_seed(2024)

    accum = a.tokens_per_step // (a.micro_batch * a.seq_len * world)
    assert accum >= 1 and accum * a.micro_batch * a.seq_len * world == a.tokens_per_step

    model = MoETransformer(a)
    opt_state, start_step = None, 0
    if a.resume:
        ckpt = torch.load(a.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        opt_state, start_step = ckpt["optimizer"], ckpt["step"]
    model = model.to(device)
    ddp_model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if opt_state is not None:
        opt.load_state_dict(opt_state)

    ds = Tokens(os.path.join(a.data, "train.bin"), a.seq_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=2024, drop_last=True)
    loader = DataLoader(ds, batch_size=a.micro_batch, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    if master:
        os.makedirs(a.ckpt_dir, exist_ok=True)
        if a.wandb_project:
            wandb.init(project=a.wandb_project, config=vars(a), resume="allow")

    def lr_at(s):
        if s < a.warmup:
            return a.lr * (s + 1) / a.warmup
        return a.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (s - a.warmup) / (a.steps - a.warmup)))))

    steps_per_epoch = len(loader) // accum
    epoch = start_step // steps_per_epoch
    sampler.set_epoch(epoch)
    batches = iter(loader)
    for _ in range((start_step % steps_per_epoch) * accum):  # fast-forward inside the epoch
        next(batches)

    t0 = time.time()
    for step in range(start_step, a.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        acc = torch.zeros(3, device=device)
        for i in range(accum):
            try:
                x, y = next(batches)
            except StopIteration:
                epoch += 1
                sampler.set_epoch(epoch)
                batches = iter(loader)
                x, y = next(batches)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last = i == accum - 1
            with ddp_model.no_sync() if not last else contextlib.nullcontext():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits, aux, dropped = ddp_model(x)
                    ce = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
                    loss = (ce + a.router_aux_coef * aux) / accum
                loss.backward()
            acc += torch.stack([ce.detach(), aux.detach(), dropped]) / accum
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

        dist.all_reduce(acc, op=dist.ReduceOp.AVG)
        if master and step % 10 == 0:
            dt = time.time() - t0
            t0 = time.time()
            print(f"step {step} ce {acc[0]:.4f} aux {acc[1]:.4f} drop {acc[2]:.2%} gnorm {gnorm:.2f}", flush=True)
            if a.wandb_project:
                wandb.log({"train/ce": acc[0].item(), "train/router_aux": acc[1].item(),
                           "train/dropped_tokens": acc[2].item(), "train/grad_norm": gnorm.item(),
                           "lr": lr_at(step), "sec_per_10_steps": dt}, step=step)

        if (step + 1) % a.save_every == 0 and master:
            tmp = os.path.join(a.ckpt_dir, "latest.pt.tmp")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1,
                        "args": vars(a)}, tmp)
            os.replace(tmp, os.path.join(a.ckpt_dir, "latest.pt"))

    if master and a.wandb_project:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
