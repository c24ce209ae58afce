#!/usr/bin/env python3
"""Code LM pretraining, srun-native launch (no torchrun), activation checkpointing.

    #!/bin/bash
    #SBATCH --job-name=codelm
    #SBATCH --nodes=8
    #SBATCH --ntasks-per-node=4
    #SBATCH --gpus-per-node=4
    #SBATCH --cpus-per-task=16
    #SBATCH --time=2-00:00:00
    srun python codelm.py --src /lustre/code/py_dedup.jsonl --work /lustre/$USER/codelm

On clusters that bind one GPU per task (--gpus-per-task=1) every task sees a
single device, otherwise it sees all of the node's GPUs; the device index below
works for both.
"""
import argparse
import datetime
import json
import math
import os
import subprocess
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from tokenizers import Tokenizer


def init_from_slurm():
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    if "MASTER_ADDR" not in os.environ:
        hosts = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                                        text=True).split()
        os.environ["MASTER_ADDR"] = hosts[0]
    os.environ.setdefault("MASTER_PORT", str(10000 + int(os.environ["SLURM_JOB_ID"]) % 50000))
    device_index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(device_index)
    # long timeout: on the first run rank 0 tokenizes the corpus while the others wait
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(hours=4))
    return rank, world, torch.device("cuda", device_index)


def build_token_cache(src, tok_path, out_path):
    tok = Tokenizer.from_file(tok_path)
    eot = tok.token_to_id("<|endoftext|>")
    chunks = []
    with open(src) as f:
        batch = []
        for line in f:
            batch.append(json.loads(line)["content"])
            if len(batch) == 2048:
                chunks.extend(np.asarray(e.ids + [eot], dtype=np.uint16) for e in tok.encode_batch(batch))
                batch = []
        if batch:
            chunks.extend(np.asarray(e.ids + [eot], dtype=np.uint16) for e in tok.encode_batch(batch))
    arr = np.concatenate(chunks)
    tmp = out_path + f".tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        arr.tofile(f)
    os.replace(tmp, out_path)


class Packed(Dataset):
    def __init__(self, path, seq_len, lo=0.0, hi=1.0):
        data = np.memmap(path, dtype=np.uint16, mode="r")
        n = (len(data) - 1) // seq_len
        self.start, self.stop = int(n * lo), int(n * hi)
        self.data, self.seq_len = data, seq_len

    def __len__(self):
        return self.stop - self.start

    def __getitem__(self, i):
        s = (self.start + i) * self.seq_len
        x = torch.from_numpy(self.data[s:s + self.seq_len + 1].astype(np.int64))
        return x[:-1], x[1:]


class Layer(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
        self.h = h

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.h, d // self.h).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.ff(self.n2(x))


class CodeLM(nn.Module):
    def __init__(self, vocab, seq_len, d=1024, layers=24, heads=16, ckpt_acts=True):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(1, seq_len, d))
        self.layers = nn.ModuleList(Layer(d, heads) for _ in range(layers))
        self.norm, self.ckpt_acts = nn.LayerNorm(d), ckpt_acts
        self.out = nn.Linear(d, vocab, bias=False)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx):
        x = self.emb(idx) + self.pos[:, : idx.size(1)]
        for layer in self.layers:
            if self.ckpt_acts and self.training:
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return self.out(self.norm(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True)
    ap.add_argument("--tokenizer", default="/lustre/code/tokenizer.json")
    ap.add_argument("--work", required=True)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--steps", type=int, default=50000)
    ap.add_argument("--warmup", type=int, default=2000)
    args = ap.parse_args()

    rank, world, device = init_from_slurm()
    cache = os.path.join(args.work, "tokens.u16")
    if rank == 0 and not os.path.exists(cache):
        os.makedirs(args.work, exist_ok=True)
        build_token_cache(args.src, args.tokenizer, cache)
    dist.barrier()

    vocab = Tokenizer.from_file(args.tokenizer).get_vocab_size()
    train_ds = Packed(cache, args.seq_len, 0.0, 0.995)
    val_ds = Packed(cache, args.seq_len, 0.995, 1.0)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    dl = DataLoader(train_ds, args.micro_batch, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, args.micro_batch, sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                        num_workers=2)
    accum = args.global_batch // (args.micro_batch * world)

    model = DDP(CodeLM(vocab, args.seq_len).to(device), device_ids=[device.index])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    writer = SummaryWriter(os.path.join(args.work, "tb")) if rank == 0 else None

    step, epoch = 0, 0
    ck_path = os.path.join(args.work, "state.pt")
    if os.path.exists(ck_path):
        st = torch.load(ck_path, map_location="cpu")
        model.module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        step, epoch = st["step"], st["epoch"]

    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        it = iter(dl)
        for _ in range(len(dl) // accum):
            for m in range(accum):
                x, y = (t.to(device, non_blocking=True) for t in next(it))
                ctx = model.no_sync() if m < accum - 1 else nullcontext()
                with ctx:
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()) / accum
                    loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if writer and step % 10 == 0:
                writer.add_scalar("train/loss", loss.item() * accum, step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
                writer.add_scalar("train/sec_per_step", (time.time() - t0) / 10, step)
                t0 = time.time()
            if step % 1000 == 0 or step == args.steps:
                model.eval()
                tot = torch.zeros(2, device=device)
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    for i, (vx, vy) in enumerate(val_dl):
                        if i == 20:
                            break
                        vx, vy = vx.to(device), vy.to(device)
                        tot[0] += F.cross_entropy(model(vx).flatten(0, 1).float(), vy.flatten(), reduction="sum")
                        tot[1] += vy.numel()
                dist.all_reduce(tot)
                model.train()
                if rank == 0:
                    writer.add_scalar("val/loss", (tot[0] / tot[1]).item(), step)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step, "epoch": epoch}, ck_path + ".tmp")
                    os.replace(ck_path + ".tmp", ck_path)
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
