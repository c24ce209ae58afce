"""Continued pretraining of a ~1.3B-total / 350M-active MoE decoder.

Memory is tight at seq 2048, so decoder layers are activation-checkpointed.
Top-2 routing with capacity; experts that receive no tokens in a micro-batch
are skipped, hence find_unused_parameters.

    torchrun --nproc_per_node=8 13_moe_1b_continued_pretrain.py \
        --dataset /data/grouped/cc_news_2048 --init ckpt/moe1b3/pretrain_final.pt --out ckpt/moe1b3_ccnews
"""
import argparse
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


@dataclass
class MoEConfig:
    vocab_size: int = 50432
    hidden: int = 1024
    layers: int = 24
    heads: int = 16
    ffn: int = 4096
    experts: int = 16
    moe_freq: int = 2
    capacity_factor: float = 1.25
    max_len: int = 2048
    gradient_checkpointing: bool = True


class Router(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.proj = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.E = cfg.experts

    def forward(self, h):
        logits = self.proj(h).float()
        probs = logits.softmax(-1)
        w, idx = probs.topk(2, -1)
        w = w / w.sum(-1, keepdim=True)
        lb = self.E * (F.one_hot(idx, self.E).float().sum(1).mean(0) / 2 * probs.mean(0)).sum()
        z = torch.logsumexp(logits, -1).pow(2).mean()
        return w, idx, lb, z


class MoEMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(cfg.hidden, cfg.ffn), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn, cfg.hidden))
            for _ in range(cfg.experts))

    def forward(self, x):
        B, T, D = x.shape
        h = x.view(-1, D)
        w, idx, lb, z = self.router(h)
        cap = int(math.ceil(self.cfg.capacity_factor * 2 * h.size(0) / self.cfg.experts))
        out = torch.zeros_like(h)
        for e in range(self.cfg.experts):
            rows, which = (idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            rows, which = rows[:cap], which[:cap]
            out.index_add_(0, rows, self.experts[e](h[rows]) * w[rows, which].unsqueeze(-1).to(h.dtype))
        return out.view(B, T, D), lb, z


class DecoderLayer(nn.Module):
    def __init__(self, cfg, moe):
        super().__init__()
        self.cfg = cfg
        self.input_norm = nn.LayerNorm(cfg.hidden)
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        self.kv = nn.Linear(cfg.hidden, 2 * cfg.hidden)
        self.o = nn.Linear(cfg.hidden, cfg.hidden)
        self.post_norm = nn.LayerNorm(cfg.hidden)
        self.is_moe = moe
        self.mlp = MoEMLP(cfg) if moe else nn.Sequential(
            nn.Linear(cfg.hidden, cfg.ffn), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn, cfg.hidden))

    def forward(self, x):
        B, T, D = x.shape
        H = self.cfg.heads
        n = self.input_norm(x)
        q = self.q(n).view(B, T, H, -1).transpose(1, 2)
        k, v = self.kv(n).view(B, T, 2, H, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
        if self.is_moe:
            y, lb, z = self.mlp(self.post_norm(x))
        else:
            y = self.mlp(self.post_norm(x))
            lb = z = x.new_zeros((), dtype=torch.float32)
        return x + y, lb, z


class MoEForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.embed_pos = nn.Embedding(cfg.max_len, cfg.hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg, (i + 1) % cfg.moe_freq == 0) for i in range(cfg.layers))
        self.final_norm = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, input_ids, labels=None):
        T = input_ids.size(1)
        x = self.embed_tokens(input_ids) + self.embed_pos(torch.arange(T, device=input_ids.device))
        lb_total = z_total = 0.0
        for layer in self.layers:
            if self.cfg.gradient_checkpointing and self.training:
                x, lb, z = checkpoint(layer, x, use_reentrant=True)
            else:
                x, lb, z = layer(x)
            lb_total, z_total = lb_total + lb, z_total + z
        logits = self.lm_head(self.final_norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        n_moe = sum(l.is_moe for l in self.layers)
        return loss, lb_total / n_moe, z_total / n_moe


def collate(rows):
    ids = torch.tensor([r["input_ids"] for r in rows], dtype=torch.long)
    return ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--init", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--accum", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lb-coef", type=float, default=0.01)
    ap.add_argument("--z-coef", type=float, default=1e-3)
    ap.add_argument("--save-every", type=int, default=500)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    cfg = MoEConfig()
    model = MoEForCausalLM(cfg)
    if args.init:
        state = torch.load(args.init, map_location="cpu")
        model.load_state_dict(state["model"] if "model" in state else state)
    model.to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    ds = load_from_disk(args.dataset)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=args.micro_batch, sampler=sampler, collate_fn=collate,
                        num_workers=4, pin_memory=True, drop_last=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total = args.epochs * len(loader) // args.accum
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.1, 1 - s / max(total, 1)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{n_params / 1e9:.2f}B params, {len(loader)} micro-batches/epoch/rank, {total} optimizer steps",
              flush=True)

    step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, ids in enumerate(loader):
            ids = ids.to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            if not last_micro:
                with model.no_sync():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss, lb, z = model(ids, labels=ids)
                        total_loss = loss + args.lb_coef * lb + args.z_coef * z
                    (total_loss / args.accum).backward()
                continue
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, lb, z = model(ids, labels=ids)
                total_loss = loss + args.lb_coef * lb + args.z_coef * z
            (total_loss / args.accum).backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                rep = torch.stack([loss.detach().float(), lb.detach().float(), gn.float()])
                dist.all_reduce(rep)
                rep /= world
                if rank == 0:
                    tok_s = 10 * args.accum * args.micro_batch * cfg.max_len * world / (time.time() - t0)
                    print(f"step {step}/{total} loss {rep[0]:.4f} lb {rep[1]:.3f} gnorm {rep[2]:.2f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {tok_s / 1e3:.1f}k tok/s", flush=True)
                t0 = time.time()

            if step % args.save_every == 0 and rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step,
                            "config": cfg.__dict__}, os.path.join(args.out, f"step_{step}.pt"))

    if rank == 0:
        torch.save({"model": model.module.state_dict(), "config": cfg.__dict__}, os.path.join(args.out, "final.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
