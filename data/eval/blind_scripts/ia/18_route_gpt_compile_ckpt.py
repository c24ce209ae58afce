"""OD-conditioned route generation: a GPT over road segments (Chengdu + Xi'an).

Given origin and destination segments and the departure time, the model
generates the route segment by segment. Segment ids are global over both
cities (segment_vocab.parquet from the map-matching job) so one vocabulary
serves every rank and city.

    torchrun --nproc_per_node=8 18_route_gpt_compile_ckpt.py --data /data/didi_routes
"""
import argparse
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

BOS, EOS, PAD, N_SPECIAL = 0, 1, 2, 3


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/didi_routes")
    ap.add_argument("--out", default="/data/exp/route_gpt")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--n_layer", type=int, default=12)
    ap.add_argument("--n_head", type=int, default=12)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--micro_bs", type=int, default=32)
    ap.add_argument("--global_bs", type=int, default=512)
    ap.add_argument("--lr", type=float, default=6e-4, help="peak lr at global_bs=512")
    ap.add_argument("--max_steps", type=int, default=60000)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--eval_every", type=int, default=2000)
    ap.add_argument("--grad_ckpt", action="store_true")
    ap.add_argument("--no_compile", action="store_true")
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


class RouteDataset(Dataset):
    def __init__(self, df, ctx):
        self.routes, self.slot, self.ctx = df.route.values, df.slot.values, ctx

    def __len__(self):
        return len(self.routes)

    def __getitem__(self, i):
        r = np.asarray(self.routes[i], dtype=np.int64) + N_SPECIAL
        seq = np.full(self.ctx + 1, PAD, dtype=np.int64)
        body = np.concatenate([[BOS], r[: self.ctx - 1], [EOS]])[: self.ctx + 1]
        seq[: len(body)] = body
        seq = torch.from_numpy(seq)
        od = torch.tensor([r[0], r[-1]])
        return seq[:-1], seq[1:], od, int(self.slot[i])


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.h = h

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class RouteGPT(nn.Module):
    def __init__(self, vocab, ctx, n_layer, n_head, d, grad_ckpt=False):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.slot = nn.Embedding(7 * 24, d)
        self.od = nn.Linear(2 * d, d)
        self.blocks = nn.ModuleList([Block(d, n_head) for _ in range(n_layer)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.grad_ckpt = grad_ckpt

    def forward(self, idx, od, slot):
        T = idx.size(1)
        cond = self.od(self.tok(od).flatten(1)) + self.slot(slot)
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device)) + cond[:, None]
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return self.head(self.ln(x))


def lr_at(step, peak, warmup, total):
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y, od, slot in loader:
        x, y, od, slot = x.to(device), y.to(device), od.to(device), slot.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(x, od, slot)
        s[0] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=PAD, reduction="sum")
        s[1] += (y != PAD).sum()
    dist.all_reduce(s)
    net.train()
    return (s[0] / s[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)
    torch.backends.cuda.matmul.allow_tf32 = True

    vocab = len(pd.read_parquet(os.path.join(args.data, "segment_vocab.parquet"))) + N_SPECIAL
    train_df = pd.read_parquet(os.path.join(args.data, "train.parquet"), columns=["route", "slot"])
    val_df = pd.read_parquet(os.path.join(args.data, "val.parquet"), columns=["route", "slot"])
    train_ds, val_ds = RouteDataset(train_df, args.ctx), RouteDataset(val_df, args.ctx)

    assert args.global_bs % (args.micro_bs * world) == 0
    accum = args.global_bs // (args.micro_bs * world)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=1234, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.micro_bs, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=64, num_workers=4)

    net = RouteGPT(vocab, args.ctx, args.n_layer, args.n_head, args.d, args.grad_ckpt).to(device)
    decay = [p for p in net.parameters() if p.dim() >= 2]
    no_decay = [p for p in net.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=True)

    step, epoch = 0, 0
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, epoch = ck["step"], ck["epoch"]

    model = net if args.no_compile else torch.compile(net)
    model = DDP(model, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="route-gpt", config=vars(args) | {"world": world, "accum": accum}, resume="allow")
        print(f"vocab={vocab} train={len(train_ds)} val={len(val_ds)} accum={accum}", flush=True)

    model.train()
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        micro = 0
        for x, y, od, slot in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            od, slot = od.to(device, non_blocking=True), slot.to(device, non_blocking=True)
            micro += 1
            last_micro = micro % accum == 0
            with (nullcontext() if last_micro else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(x, od, slot)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=PAD)
                (loss / accum).backward()
            if not last_micro:
                continue
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args.lr, args.warmup, args.max_steps)
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/gnorm": gnorm.item(),
                           "lr": opt.param_groups[0]["lr"], "tok_per_s": 50 * args.global_bs * args.ctx / (time.time() - t0)},
                          step=step)
                t0 = time.time()
            if step % args.eval_every == 0 or step == args.max_steps:
                val = evaluate(net, val_dl, device)
                if rank == 0:
                    wandb.log({"val/nll": val, "val/ppl": math.exp(val)}, step=step)
                    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "step": step, "epoch": epoch,
                                "vocab": vocab, "args": vars(args)}, ckpt_path)
                dist.barrier()
            if step >= args.max_steps:
                break
        opt.zero_grad(set_to_none=True)
        epoch += 1

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
