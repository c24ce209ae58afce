"""Small top-1 MoE language model, launched directly by srun (one task per GPU).

#!/bin/bash
#SBATCH --job-name=moe-lm
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=12:00:00
#SBATCH --requeue
#SBATCH --signal=USR1@180
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
srun --kill-on-bad-exit=1 python 12_moe_lm_srun_requeue.py --run-dir /lustre/$USER/moe_lm/run3
"""
import argparse
import math
import os
import signal
import subprocess
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

_requeue_requested = False


def _handle_usr1(signum, frame):
    global _requeue_requested
    _requeue_requested = True


class Expert(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class MoELayer(nn.Module):
    def __init__(self, d, n_experts):
        super().__init__()
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList([Expert(d) for _ in range(n_experts)])

    def forward(self, x):
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        probs = self.router(flat).softmax(-1)
        gate, idx = probs.max(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            sel = (idx == e).nonzero(as_tuple=True)[0]
            if sel.numel() == 0:
                continue  # expert receives no tokens in this micro-batch on this rank
            out[sel] = expert(flat[sel]) * gate[sel, None]
        # switch-transformer load balancing loss
        frac = torch.bincount(idx, minlength=len(self.experts)).float() / idx.numel()
        aux = len(self.experts) * (frac * probs.mean(0)).sum()
        return out.view(b, t, d), aux


class Block(nn.Module):
    def __init__(self, d, heads, n_experts):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.moe = MoELayer(d, n_experts)

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)[0]
        m, aux = self.moe(self.ln2(x))
        return x + m, aux


class MoELM(nn.Module):
    def __init__(self, vocab, d=768, layers=12, heads=12, n_experts=8, ctx=1024):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList([Block(d, heads, n_experts) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids):
        t = ids.size(1)
        mask = torch.triu(torch.full((t, t), float("-inf"), device=ids.device), 1)
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        aux_total = 0.0
        for blk in self.blocks:
            x, aux = blk(x, mask)
            aux_total = aux_total + aux
        return self.head(self.ln(x)), aux_total / len(self.blocks)


class Blocks(Dataset):
    def __init__(self, path, ctx):
        self.a = np.memmap(path, dtype=np.uint16, mode="r")
        self.ctx = ctx

    def __len__(self):
        return (len(self.a) - 1) // self.ctx

    def __getitem__(self, i):
        s = i * self.ctx
        x = torch.from_numpy(self.a[s:s + self.ctx + 1].astype(np.int64))
        return x[:-1], x[1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-bin", default="/lustre/shared/tok/openweb_train.bin")
    ap.add_argument("--val-bin", default="/lustre/shared/tok/openweb_val.bin")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--steps", type=int, default=60000)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--ckpt-every", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=2000)
    args = ap.parse_args()

    signal.signal(signal.SIGUSR1, _handle_usr1)
    # srun layout: one task per GPU, Slurm provides the rank information
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world)
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
    dist.barrier()

    train_ds, val_ds = Blocks(args.train_bin, args.ctx), Blocks(args.val_bin, args.ctx)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    val_sub = Subset(val_ds, range(rank, min(len(val_ds), 4096), world))
    val_dl = DataLoader(val_sub, batch_size=args.bs, num_workers=2)

    torch.manual_seed(0)
    model = MoELM(vocab=50304, ctx=args.ctx).to(device)
    # experts that receive no tokens on a rank have no grad for that step
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = 1000
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))

    ckpt = os.path.join(args.run_dir, "last.pt")
    step, epoch = 0, 0
    if os.path.exists(ckpt):
        st = torch.load(ckpt, map_location=device)
        model.module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        step, epoch = st["step"], st["epoch"]
        if rank == 0:
            print(f"restart #{os.environ.get('SLURM_RESTART_COUNT', 0)}: resume at step {step}", flush=True)

    def save():
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "step": step, "epoch": epoch}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()

    flag = torch.zeros(1, device=device)
    model.train()
    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
        for x, y in dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, aux = model(x)
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
            (loss + args.aux_coef * aux).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            flag.fill_(1.0 if _requeue_requested else 0.0)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                save()
                if rank == 0:
                    print(f"USR1: checkpointed step {step}, requeueing job", flush=True)
                    subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]])
                dist.destroy_process_group()
                return

            if step % 20 == 0 and rank == 0:
                print(f"step {step} loss {loss.item():.4f} aux {float(aux):.4f} "
                      f"{(time.time() - t0) / 20:.3f}s/step", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0:
                model.eval()
                tot = torch.zeros(2, device=device)
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    for vx, vy in val_dl:
                        vx, vy = vx.to(device), vy.to(device)
                        vl, _ = model.module(vx)
                        tot[0] += F.cross_entropy(vl.float().view(-1, vl.size(-1)), vy.view(-1),
                                                  reduction="sum")
                        tot[1] += vy.numel()
                dist.all_reduce(tot)
                model.train()
                if rank == 0:
                    print(f"[val] step {step} ppl {math.exp((tot[0] / tot[1]).item()):.2f}", flush=True)
            if step % args.ckpt_every == 0:
                save()
            if step >= args.steps:
                break
        else:
            epoch += 1

    save()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
