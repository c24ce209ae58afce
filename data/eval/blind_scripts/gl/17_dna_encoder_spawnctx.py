#!/usr/bin/env python3
"""Long-context DNA encoder for promoter / enhancer classification.

    python 17_dna_encoder_spawnctx.py --tsv /data/genomics/regions_8kb.tsv --out /shared/dna/enc8k --gpus 8

The launcher looks at GPU memory first (CUDA is initialised in the parent for
that), then starts the workers with the "spawn" start method so each child
gets a fresh CUDA context.
"""
import argparse
import datetime
import multiprocessing
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

LUT = np.zeros(256, dtype=np.int64)
for i, ch in enumerate("ACGTN"):
    LUT[ord(ch)] = i
    LUT[ord(ch.lower())] = i


def encode_tsv(tsv, cache):
    seqs, labels = [], []
    with open(tsv) as f:
        next(f)
        for line in f:
            seq, lab = line.rstrip("\n").split("\t")
            seqs.append(LUT[np.frombuffer(seq.encode(), dtype=np.uint8)])
            labels.append(int(lab))
    np.savez(cache + ".tmp.npz", x=np.stack(seqs).astype(np.int8), y=np.array(labels, dtype=np.int64))
    os.replace(cache + ".tmp.npz", cache)


class Regions(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.from_numpy(self.x[i].astype(np.int64)), self.y[i]


class Layer(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.h = h

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, L, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, D)
        x = x + self.o(a)
        return x + self.ff(self.n2(x))


class DNAEncoder(nn.Module):
    def __init__(self, n_cls, d=256, h=8, layers=8, stem_stride=8, max_len=8192, grad_ckpt=True):
        super().__init__()
        self.emb = nn.Embedding(5, d)
        self.stem = nn.Conv1d(d, d, kernel_size=stem_stride * 2, stride=stem_stride, padding=stem_stride // 2)
        self.pos = nn.Parameter(torch.zeros(1, max_len // stem_stride + 1, d))
        self.layers = nn.ModuleList(Layer(d, h) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, n_cls)
        self.grad_ckpt = grad_ckpt

    def forward(self, tokens):
        x = self.stem(self.emb(tokens).transpose(1, 2)).transpose(1, 2)
        x = x + self.pos[:, : x.size(1)]
        for layer in self.layers:
            if self.grad_ckpt and self.training:
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return self.head(self.norm(x).mean(1))


def worker(rank, world, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=60))
    device = torch.device("cuda", rank)

    cache = args.tsv + ".encoded.npz"
    if rank == 0 and not os.path.exists(cache):
        encode_tsv(args.tsv, cache)
    dist.barrier()
    blob = np.load(cache)
    x, y = blob["x"], blob["y"]
    # fixed split, identical on every rank
    perm = np.random.default_rng(2024).permutation(len(y))
    n_val = len(y) // 20
    train_ds = Regions(x[perm[n_val:]], y[perm[n_val:]])
    val_ds = Regions(x[perm[:n_val]], y[perm[:n_val]])

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    dl = DataLoader(train_ds, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=4,
                    pin_memory=True, drop_last=True)

    torch.manual_seed(args.seed)
    model = DNAEncoder(int(y.max()) + 1).to(device)
    model = DDP(model, device_ids=[rank], gradient_as_bucket_view=True, static_graph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(dl),
                                                pct_start=0.1)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (tok, lab) in enumerate(dl):
            tok, lab = tok.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(tok), lab)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} it {i}/{len(dl)} loss {loss.item():.4f}", flush=True)

        if rank == 0:
            # the validation split is small: evaluate it on rank 0 alone, with the bare module
            net = model.module.eval()
            correct = 0
            with torch.no_grad():
                for tok, lab in DataLoader(val_ds, batch_size=64, num_workers=2):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        pred = net(tok.to(device)).argmax(1).cpu()
                    correct += (pred == lab).sum().item()
            acc = correct / len(val_ds)
            print(f"epoch {epoch}: val acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if acc > best:
                best = acc
                torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


def gpus_ready(n, min_free_gib=30):
    ok = True
    for i in range(n):
        free, _ = torch.cuda.mem_get_info(i)
        if free / 2 ** 30 < min_free_gib:
            print(f"GPU {i} has only {free / 2 ** 30:.1f} GiB free", file=sys.stderr)
            ok = False
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tsv", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--port", type=int, default=29655)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-per-gpu", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    if not gpus_ready(args.gpus):
        sys.exit(2)

    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, args.gpus, args), name=f"dna-rank{r}") for r in range(args.gpus)]
    for p in procs:
        p.start()

    def shutdown(signum, _):
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        sys.exit(128 + signum)

    signal.signal(signal.SIGINT, shutdown)
    signal.signal(signal.SIGTERM, shutdown)

    while True:
        codes = [p.exitcode for p in procs]
        if all(c == 0 for c in codes):
            print("all workers finished")
            return
        if any(c not in (None, 0) for c in codes):
            print(f"worker exit codes {codes}; stopping", file=sys.stderr)
            shutdown(signal.SIGTERM, None)
        time.sleep(3)


if __name__ == "__main__":
    main()
