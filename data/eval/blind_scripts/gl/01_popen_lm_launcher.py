#!/usr/bin/env python3
"""Single-node job wrapper for the byte-level LM pretraining runs.

    python 01_popen_lm_launcher.py --nproc 8 --data /datasets/owt --out /checkpoints/lm-small

The parent starts one worker per GPU by re-invoking this file with --worker,
sends every worker's output to its own log file and restarts the whole group
(up to --max-restarts times) when one of the workers dies.
"""
import argparse
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import closing

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("lm")


def get_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nproc", type=int, default=torch.cuda.device_count())
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--max-steps", type=int, default=50000)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--ckpt-every", type=int, default=2000)
    return p.parse_args(argv)


# --------------------------------------------------------------------------- #
# launcher
# --------------------------------------------------------------------------- #
def find_free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", 0))
        return s.getsockname()[1]


def worker_env(local_rank, nproc, master_addr):
    env = os.environ.copy()
    env.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(find_free_port()),
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "4"),
        PYTHONUNBUFFERED="1",
    )
    return env


def start_group(args, attempt):
    log_dir = os.path.join(args.out, "logs", f"attempt{attempt}")
    os.makedirs(log_dir, exist_ok=True)
    procs = []
    for local_rank in range(args.nproc):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker"] + sys.argv[1:]
        fh = open(os.path.join(log_dir, f"rank{local_rank}.log"), "w")
        p = subprocess.Popen(cmd, env=worker_env(local_rank, args.nproc, args.master_addr),
                             stdout=fh, stderr=subprocess.STDOUT)
        procs.append((p, fh))
    return procs


def stop_group(procs, sig=signal.SIGTERM, grace=30):
    for p, _ in procs:
        if p.poll() is None:
            p.send_signal(sig)
    deadline = time.time() + grace
    for p, fh in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        fh.close()


def launch(args):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(message)s")
    os.makedirs(args.out, exist_ok=True)
    procs = []

    def _forward(signum, _frame):
        log.info("got signal %d, stopping workers", signum)
        stop_group(procs)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, _forward)
    signal.signal(signal.SIGINT, _forward)

    for attempt in range(args.max_restarts + 1):
        procs[:] = start_group(args, attempt)
        log.info("attempt %d: started %d workers", attempt, len(procs))
        failed = None
        while True:
            codes = [p.poll() for p, _ in procs]
            failed = next((c for c in codes if c not in (None, 0)), None)
            if failed is not None or all(c == 0 for c in codes):
                break
            time.sleep(5)
        if failed is None:
            stop_group(procs)
            log.info("all workers finished")
            return 0
        log.warning("a worker exited with %d, restarting group", failed)
        stop_group(procs)
    log.error("giving up after %d restarts", args.max_restarts)
    return 1


# --------------------------------------------------------------------------- #
# worker
# --------------------------------------------------------------------------- #
class TokenBlocks(Dataset):
    def __init__(self, path, block_size):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.block = block_size

    def __len__(self):
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i):
        s = i * self.block
        chunk = torch.from_numpy(self.data[s:s + self.block + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ByteLM(nn.Module):
    def __init__(self, vocab, block, d, h, n):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.ModuleList([Block(d, h) for _ in range(n)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        T = idx.size(1)
        mask = torch.triu(torch.ones(T, T, device=idx.device, dtype=torch.bool), 1)
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln_f(x))


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return 0.1 * args.lr + 0.9 * args.lr * 0.5 * (1 + math.cos(math.pi * t))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(loader):
        if i == 50:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        tot[0] += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1), reduction="sum")
        tot[1] += y.numel()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def worker(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(1234)

    assert args.global_batch % world == 0
    per_rank = args.global_batch // world
    train_ds = TokenBlocks(os.path.join(args.data, "train.bin"), args.block_size)
    val_ds = TokenBlocks(os.path.join(args.data, "val.bin"), args.block_size)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1234, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=per_rank, sampler=train_sampler,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=per_rank,
                        sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                        num_workers=2, pin_memory=True)

    model = ByteLM(256, args.block_size, args.d_model, args.n_head, args.n_layer).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    ckpt_path = os.path.join(args.out, "last.pt")
    step = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step = ck["step"]
        log.info("resumed from step %d", step)

    epoch = step // len(train_dl)
    model.train()
    t0 = time.time()
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for x, y in train_dl:
            if step >= args.max_steps:
                break
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, 256), y.view(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1

            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                log.info("step %d loss %.4f lr %.2e %.1fs", step, l.item(), lr_at(step, args), time.time() - t0)
                t0 = time.time()
            if step % args.eval_every == 0:
                vl = evaluate(model, val_dl, device)
                log.info("step %d val_loss %.4f bpb %.4f", step, vl, vl / math.log(2))
            if step % args.ckpt_every == 0:
                if rank == 0:
                    tmp = ckpt_path + ".tmp"
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "step": step, "args": vars(args)}, tmp)
                    os.replace(tmp, ckpt_path)
                dist.barrier()
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    a = get_args()
    if a.worker:
        worker(a)
    else:
        sys.exit(launch(a))
