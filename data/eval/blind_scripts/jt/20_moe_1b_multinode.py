"""
Long-running MoE LM pretraining job, written to be preempted and resumed (Slurm requeue).
Saves a full checkpoint (model, optimizer, scheduler, sampler position) every N steps.

    srun --ntasks-per-node=1 torchrun --nnodes=$SLURM_NNODES --nproc_per_node=8 \
        --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \
        20_moe_1b_multinode.py --data /shared/tok/dclm --ckpt_dir /shared/ckpt/moe_1b --auto_resume
"""
import argparse
import contextlib
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt_dir", required=True)
    p.add_argument("--auto_resume", action="store_true")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dim", type=int, default=1536)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top_k", type=int, default=2)
    p.add_argument("--capacity", type=float, default=1.25)
    p.add_argument("--aux_coef", type=float, default=0.01)
    p.add_argument("--micro_bs", type=int, default=2)
    p.add_argument("--global_bs", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--ckpt_every", type=int, default=500)
    p.add_argument("--keep_last", type=int, default=3)
    return p.parse_args()


class Seq(Dataset):
    def __init__(self, path, n):
        self.path, self.len_ = path, n
        self.count = (os.path.getsize(path) // 2 - 1) // n
        self.m = None

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        if self.m is None:
            self.m = np.memmap(self.path, dtype=np.uint16, mode="r")
        t = torch.from_numpy(self.m[i * self.len_:(i + 1) * self.len_ + 1].astype(np.int64))
        return t[:-1], t[1:]


class MoE(nn.Module):
    def __init__(self, d, E, k, cap):
        super().__init__()
        self.E, self.k, self.cap = E, k, cap
        self.router = nn.Linear(d, E, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d, bias=False))
            for _ in range(E))

    def forward(self, x):
        shp = x.shape
        x = x.view(-1, shp[-1])
        probs = self.router(x).float().softmax(-1)
        w, sel = probs.topk(self.k, -1)
        w = w / w.sum(-1, keepdim=True)
        aux = self.E * (F.one_hot(sel, self.E).float().mean((0, 1)) * probs.mean(0)).sum()
        C = math.ceil(self.cap * x.size(0) * self.k / self.E)
        y = torch.zeros_like(x)
        for e in range(self.E):
            r, c = (sel == e).nonzero(as_tuple=True)
            if r.numel() == 0:
                continue
            r, c = r[:C], c[:C]
            y.index_add_(0, r, (self.experts[e](x[r]) * w[r, c, None]).to(y.dtype))
        return y.view(shp), aux


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.h = a.heads
        self.ln1, self.ln2 = nn.LayerNorm(a.dim), nn.LayerNorm(a.dim)
        self.qkv = nn.Linear(a.dim, 3 * a.dim, bias=False)
        self.proj = nn.Linear(a.dim, a.dim, bias=False)
        self.moe = MoE(a.dim, a.experts, a.top_k, a.capacity)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))
        y, aux = self.moe(self.ln2(x))
        return x + y, aux


class LM(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok = nn.Embedding(a.vocab, a.dim)
        self.pos = nn.Embedding(a.seq, a.dim)
        self.blocks = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.ln = nn.LayerNorm(a.dim)
        self.head = nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, idx, tgt):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        aux = 0.0
        for b in self.blocks:
            x, a = b(x)
            aux = aux + a
        logits = self.head(self.ln(x)).float()
        return F.cross_entropy(logits.flatten(0, 1), tgt.flatten()), aux / len(self.blocks)


def latest_checkpoint(d):
    files = sorted(glob.glob(os.path.join(d, "step_*.pt")))
    return files[-1] if files else None


def main():
    a = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    accum = a.global_bs // (a.micro_bs * world)
    assert accum * a.micro_bs * world == a.global_bs, "global batch must divide micro_bs * world"

    model = LM(a).to(device)
    ddp = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / a.warmup) * max(0.1, 0.5 * (1 + math.cos(math.pi * s / a.steps))))

    ds = Seq(os.path.join(a.data, "train.bin"), a.seq)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=a.micro_bs, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    micro_per_epoch = len(loader)

    step = 0
    ckpt_path = latest_checkpoint(a.ckpt_dir) if a.auto_resume else None
    if ckpt_path is not None:
        ckpt = torch.load(ckpt_path)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        step = ckpt["step"]
        del ckpt
        if rank == 0:
            print(f"resumed from {ckpt_path} at step {step}", flush=True)
    if rank == 0:
        os.makedirs(a.ckpt_dir, exist_ok=True)

    micro_done = step * accum
    epoch = micro_done // micro_per_epoch
    sampler.set_epoch(epoch)
    it = iter(loader)
    for _ in range(micro_done % micro_per_epoch):
        next(it)

    t0 = time.time()
    while step < a.steps:
        stats = torch.zeros(2, device=device)
        for i in range(accum):
            try:
                x, y = next(it)
            except StopIteration:
                epoch += 1
                sampler.set_epoch(epoch)
                it = iter(loader)
                x, y = next(it)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with ddp.no_sync() if i < accum - 1 else contextlib.nullcontext():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    ce, aux = ddp(x, y)
                ((ce + a.aux_coef * aux) / accum).backward()
            stats += torch.stack([ce.detach(), aux.detach()]) / accum
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if step % 10 == 0:
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} ce {stats[0]:.4f} aux {stats[1]:.4f} gnorm {gn:.2f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 10:.2f}s/step", flush=True)
            t0 = time.time()

        if step % a.ckpt_every == 0 or step == a.steps:
            if rank == 0:
                path = os.path.join(a.ckpt_dir, f"step_{step:08d}.pt")
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "step": step, "args": vars(a)}, path + ".tmp")
                os.replace(path + ".tmp", path)
                for old in sorted(glob.glob(os.path.join(a.ckpt_dir, "step_*.pt")))[:-a.keep_last]:
                    os.remove(old)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
