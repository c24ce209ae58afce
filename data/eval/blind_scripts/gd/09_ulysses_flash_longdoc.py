"""Long-document LM fine-tuning (128k tokens) with Ulysses sequence parallelism + FlashAttention-2.

    torchrun --nproc_per_node=8 09_ulysses_flash_longdoc.py --config configs/longdoc_128k.json
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from flash_attn import flash_attn_func
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from datasets import load_from_disk


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=str, required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--resume", type=str, default="")
    args = parser.parse_args()
    with open(args.config) as f:
        for k, v in json.load(f).items():
            setattr(args, k, v)
    return args


class DistAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        n = dist.get_world_size(group)
        inp = [c.contiguous() for c in torch.chunk(x, n, dim=scatter_dim)]
        out = [torch.empty_like(inp[0]) for _ in range(n)]
        dist.all_to_all(out, inp, group=group)
        return torch.cat(out, dim=gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return DistAllToAll.apply(grad, ctx.group, gather_dim, scatter_dim), None, None, None


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim, base):
        super().__init__()
        self.head_dim, self.base = head_dim, base

    def forward(self, positions):
        # computed in fp32 every call: the model itself is cast to bf16
        inv_freq = 1.0 / self.base ** (torch.arange(0, self.head_dim, 2, device=positions.device).float() / self.head_dim)
        f = torch.outer(positions.float(), inv_freq)
        return torch.cat([f, f], -1).cos()[None, :, None], torch.cat([f, f], -1).sin()[None, :, None]


def rot_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, sp_group):
        super().__init__()
        d, self.nh = cfg["hidden"], cfg["heads"]
        self.hd = d // self.nh
        self.sp_group = sp_group
        self.in_norm = nn.RMSNorm(d, eps=1e-5)
        self.post_norm = nn.RMSNorm(d, eps=1e-5)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, cfg["ffn"], bias=False)
        self.up = nn.Linear(d, cfg["ffn"], bias=False)
        self.down = nn.Linear(cfg["ffn"], d, bias=False)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        h = self.in_norm(x)
        q = self.q_proj(h).view(b, s, self.nh, self.hd)
        k = self.k_proj(h).view(b, s, self.nh, self.hd)
        v = self.v_proj(h).view(b, s, self.nh, self.hd)
        q = q * cos + rot_half(q) * sin
        k = k * cos + rot_half(k) * sin
        # flash-attn wants [b, seq, heads, dim], which is exactly the layout the all-to-all produces
        q, k, v = (DistAllToAll.apply(t.to(torch.bfloat16), self.sp_group, 2, 1) for t in (q, k, v))
        o = flash_attn_func(q, k, v, causal=True)
        o = DistAllToAll.apply(o, self.sp_group, 1, 2).reshape(b, s, d)
        x = x + self.o_proj(o)
        h = self.post_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LongDocLM(nn.Module):
    def __init__(self, cfg, sp_group):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab"], cfg["hidden"])
        self.layers = nn.ModuleList(DecoderLayer(cfg, sp_group) for _ in range(cfg["layers"]))
        self.norm = nn.RMSNorm(cfg["hidden"], eps=1e-5)
        self.lm_head = nn.Linear(cfg["hidden"], cfg["vocab"], bias=False)
        self.rotary = RotaryEmbedding(cfg["hidden"] // cfg["heads"], cfg["rope_theta"])

    def forward(self, ids, positions):
        cos, sin = self.rotary(positions)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def collate(batch):
    ids = torch.tensor([b["input_ids"] for b in batch], dtype=torch.long)
    mask = torch.tensor([b["loss_mask"] for b in batch], dtype=torch.bool)
    return ids, mask


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    torch.cuda.set_device(args.local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    sp = args.sp_size

    sp_group = None
    for i in range(world // sp):
        members = list(range(i * sp, (i + 1) * sp))
        g = dist.new_group(members)
        if rank in members:
            sp_group = g
    sp_rank = rank % sp
    dp_rank, dp_size = rank // sp, world // sp

    model_cfg = args.model
    model = LongDocLM(model_cfg, sp_group)
    if args.init_from:
        model.load_state_dict(torch.load(args.init_from, map_location="cpu"))
    model = model.to(torch.bfloat16).cuda()
    model = DDP(model, device_ids=[args.local_rank], gradient_as_bucket_view=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-6)

    ds = load_from_disk(args.dataset)["train"]
    sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=1, sampler=sampler, collate_fn=collate, num_workers=4, pin_memory=True)
    steps_total = args.epochs * len(loader)

    seq_len = args.seq_len
    chunk = seq_len // sp
    positions = torch.arange(sp_rank * chunk, (sp_rank + 1) * chunk, device="cuda")

    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        start_epoch = ck["epoch"] + 1

    step = start_epoch * len(loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for ids, mask in loader:
            ids, mask = ids.cuda(non_blocking=True), mask.cuda(non_blocking=True)
            inp = ids[:, :-1][:, sp_rank * chunk:(sp_rank + 1) * chunk]
            tgt = ids[:, 1:][:, sp_rank * chunk:(sp_rank + 1) * chunk]
            m = mask[:, 1:][:, sp_rank * chunk:(sp_rank + 1) * chunk]

            logits = model(inp, positions)
            tok_loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), reduction="none")
            n_tok = m.sum().float()
            n_all = n_tok.clone()
            dist.all_reduce(n_all)
            # sum over the whole global batch / number of target tokens in it; DDP divides by world
            loss = (tok_loss * m.flatten()).sum() / n_all.clamp(min=1) * world

            lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps_total)))
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            step += 1

            if step % args.log_interval == 0:
                rep = loss.detach() / world
                dist.all_reduce(rep)
                if rank == 0:
                    print(json.dumps({"step": step, "loss": round(rep.item(), 4), "lr": lr,
                                      "gnorm": round(gnorm.item(), 3),
                                      "s_per_step": round((time.time() - t0) / args.log_interval, 3)}), flush=True)
                t0 = time.time()

        if rank == 0:
            os.makedirs(args.output_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optim": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.output_dir, f"epoch_{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
