"""
Expert-parallel MoE GPT. Experts are sharded across all ranks (EP = world size),
attention / embeddings are data parallel through DDP.

Usage:
    torchrun --nproc_per_node=8 06_expert_parallel_gpt.py --config configs/ep_moe_350m.json
"""
import argparse
import json
import logging
import math
import os
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)

DEFAULTS = dict(
    data_dir="data/openwebtext", out_dir="out/ep_moe_350m",
    vocab_size=50304, block_size=1024, n_embd=1024, n_head=16, n_layer=24, moe_freq=2,
    num_experts=32, top_k=2, capacity_factor=1.25, eval_capacity_factor=2.0,
    lb_coef=0.01, micro_batch=4, grad_accum=8, lr=3e-4, min_lr=3e-5, warmup=2000,
    max_iters=80000, eval_interval=1000, eval_iters=100, log_interval=10, seed=1234,
)


class Windows(Dataset):
    def __init__(self, path, block):
        self.path, self.block = path, block
        self.n = (os.path.getsize(path) // 2 - 1) // block
        self._mm = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint16, mode="r")
        a = torch.from_numpy(self._mm[i * self.block:(i + 1) * self.block + 1].astype(np.int64))
        return a[:-1], a[1:]


class SwiGLU(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ShardedMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ep = dist.get_world_size()
        self.E, self.k = cfg.num_experts, cfg.top_k
        self.local_E = self.E // self.ep
        self.cf, self.eval_cf = cfg.capacity_factor, cfg.eval_capacity_factor
        self.gate = nn.Linear(cfg.n_embd, self.E, bias=False)
        hidden = int(8 * cfg.n_embd / 3)
        self.experts = nn.ModuleList(SwiGLU(cfg.n_embd, hidden) for _ in range(self.local_E))
        self.lb_loss = None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n, d = x.shape
        logits = self.gate(x).float()
        scores = logits.softmax(-1)
        topv, topi = scores.topk(self.k, -1)
        topv = topv / topv.sum(-1, keepdim=True)
        frac = F.one_hot(topi, self.E).sum(1).float().mean(0) / self.k
        self.lb_loss = self.E * (frac * scores.mean(0)).sum()

        cap = math.ceil((self.cf if self.training else self.eval_cf) * n * self.k / self.E)
        e = topi.t().reshape(-1)
        gw = topv.t().reshape(-1)
        src = torch.arange(n, device=x.device).repeat(self.k)
        rank_in_e = torch.zeros_like(e)
        order = torch.argsort(e, stable=True)
        counts = torch.bincount(e, minlength=self.E)
        starts = torch.cumsum(counts, 0) - counts
        rank_in_e[order] = torch.arange(e.numel(), device=x.device) - starts[e[order]]
        ok = rank_in_e < cap
        slot = e[ok] * cap + rank_in_e[ok]

        send = x.new_zeros(self.E * cap, d)
        send[slot] = x[src[ok]]
        recv = dist_fn.all_to_all_single(torch.empty_like(send), send)
        recv = recv.view(self.ep, self.local_E, cap, d)
        outs = [self.experts[j](recv[:, j].reshape(-1, d)).view(self.ep, 1, cap, d) for j in range(self.local_E)]
        out = torch.cat(outs, dim=1).reshape(self.E * cap, d)
        back = dist_fn.all_to_all_single(torch.empty_like(out), out)

        y = torch.zeros(n, d, device=x.device, dtype=back.dtype)
        y.index_add_(0, src[ok], back[slot] * gw[ok, None].to(back.dtype))
        return y.to(x.dtype).view(shape)


class Block(nn.Module):
    def __init__(self, cfg, moe):
        super().__init__()
        self.nh = cfg.n_head
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.mlp = ShardedMoE(cfg) if moe else SwiGLU(cfg.n_embd, 4 * cfg.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = [t.view(B, T, self.nh, C // self.nh).transpose(1, 2) for t in (q, k, v)]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg, moe=(i % cfg.moe_freq == cfg.moe_freq - 1)) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for blk in self.h:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        lb = torch.stack([b.mlp.lb_loss for b in self.h if isinstance(b.mlp, ShardedMoE)]).mean()
        return loss, lb


@torch.no_grad()
def clip_global(dense, experts, max_norm):
    # dense grads are identical on every rank after DDP; expert grads are not
    dense_sq = torch.stack([p.grad.float().pow(2).sum() for p in dense]).sum()
    expert_sq = torch.stack([p.grad.float().pow(2).sum() for p in experts]).sum()
    dist.all_reduce(expert_sq)
    norm = (dense_sq + expert_sq).sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in dense + experts:
        p.grad.mul_(coef)
    return norm


@torch.no_grad()
def evaluate(model, loader, iters, device):
    model.eval()
    losses = []
    for i, (x, y) in enumerate(loader):
        if i >= iters:
            break
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = model(x.to(device), y.to(device))
        losses.append(loss.item())
    model.train()
    return sum(losses) / len(losses)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(json.load(f))
    cfg = SimpleNamespace(**cfg)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")
    torch.manual_seed(cfg.seed + rank)

    raw = GPT(cfg).to(device)
    expert_keys = [n for n, _ in raw.named_parameters() if ".experts." in n]
    DDP._set_params_and_buffers_to_ignore_for_model(raw, expert_keys)
    model = DDP(raw, device_ids=[local_rank])
    experts = [p for n, p in raw.named_parameters() if ".experts." in n]
    dense = [p for n, p in raw.named_parameters() if ".experts." not in n]
    opt = torch.optim.AdamW(raw.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)

    train_ds = Windows(os.path.join(cfg.data_dir, "train.bin"), cfg.block_size)
    val_ds = Windows(os.path.join(cfg.data_dir, "val.bin"), cfg.block_size)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg.micro_batch, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=cfg.micro_batch, shuffle=False, num_workers=2, drop_last=True)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        log.info("params: %.1fM local (%d experts/rank)",
                 sum(p.numel() for p in raw.parameters()) / 1e6, cfg.num_experts // world)

    def get_lr(it):
        if it < cfg.warmup:
            return cfg.lr * it / cfg.warmup
        ratio = min(1.0, (it - cfg.warmup) / (cfg.max_iters - cfg.warmup))
        return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - cfg.min_lr)

    epoch = 0
    sampler.set_epoch(epoch)
    data_iter = iter(train_dl)

    def next_batch():
        nonlocal data_iter, epoch
        try:
            return next(data_iter)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            data_iter = iter(train_dl)
            return next(data_iter)

    t0 = time.time()
    for it in range(cfg.max_iters + 1):
        lr = get_lr(it)
        for g in opt.param_groups:
            g["lr"] = lr

        if it > 0 and it % cfg.eval_interval == 0:
            if rank == 0:
                val_loss = evaluate(raw, val_dl, cfg.eval_iters, device)
                log.info("iter %d: val loss %.4f", it, val_loss)
                torch.save({"model": {k: v for k, v in raw.state_dict().items() if ".experts." not in k},
                            "iter": it, "config": vars(cfg)}, os.path.join(cfg.out_dir, "dense.pt"))
            dist.barrier()
            torch.save({k: v for k, v in raw.state_dict().items() if ".experts." in k},
                       os.path.join(cfg.out_dir, f"experts_{rank}.pt"))
        if it == cfg.max_iters:
            break

        for micro in range(cfg.grad_accum):
            x, y = next_batch()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            model.require_backward_grad_sync = micro == cfg.grad_accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, lb = model(x, y)
                total = (loss + cfg.lb_coef * lb) / cfg.grad_accum
            total.backward()
        for p in experts:
            p.grad.div_(world)
        clip_global(dense, experts, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

        if it % cfg.log_interval == 0:
            stats = torch.stack([loss.detach(), lb.detach()])
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            dt = time.time() - t0
            t0 = time.time()
            log.info("iter %d loss %.4f lb %.4f lr %.2e %.0fms", it, stats[0], stats[1], lr, 1000 * dt)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
