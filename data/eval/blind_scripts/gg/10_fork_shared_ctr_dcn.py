#!/usr/bin/env python3
"""DCN-v2 click-through-rate model on pre-hashed Criteo-style features.

    python 10_fork_shared_ctr_dcn.py --data data/criteo_hashed.npz --out runs/dcn

The feature arrays are loaded once in the launcher and the per-GPU workers are
forked from it, so all workers share the same pages of memory. Worker logs go
to <out>/worker<rank>.log; a failed group is retried from the last checkpoint.
"""
import argparse
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/criteo_hashed.npz")
    p.add_argument("--out", default="runs/dcn")
    p.add_argument("--hash-size", type=int, default=2 ** 20)
    p.add_argument("--emb-dim", type=int, default=16)
    p.add_argument("--cross-layers", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=16384)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--retries", type=int, default=2)
    return p.parse_args()


class CrossNet(nn.Module):
    def __init__(self, dim, layers):
        super().__init__()
        self.w = nn.ModuleList([nn.Linear(dim, dim) for _ in range(layers)])

    def forward(self, x0):
        x = x0
        for lin in self.w:
            x = x0 * lin(x) + x
        return x


class DCN(nn.Module):
    def __init__(self, n_dense, n_sparse, hash_size, emb_dim, cross_layers):
        super().__init__()
        self.emb = nn.Embedding(hash_size, emb_dim)
        d = n_dense + n_sparse * emb_dim
        self.dense_bn = nn.LayerNorm(n_dense)
        self.cross = CrossNet(d, cross_layers)
        self.deep = nn.Sequential(nn.Linear(d, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU())
        self.out = nn.Linear(d + 512, 1)

    def forward(self, dense, sparse):
        e = self.emb(sparse).flatten(1)
        x = torch.cat([self.dense_bn(dense), e], dim=1)
        return self.out(torch.cat([self.cross(x), self.deep(x)], dim=1)).squeeze(1)


def shard_indices(n, rank, world, epoch, seed=0):
    """Same permutation on every rank (same seed), each rank takes its own stride."""
    g = np.random.default_rng(seed + epoch)
    perm = g.permutation(n)
    usable = (n // world) * world
    return perm[:usable][rank::world]


def iterate(indices, batch, dense, sparse, labels, device):
    for s in range(0, len(indices) - batch + 1, batch):
        idx = np.sort(indices[s:s + batch])
        yield (torch.from_numpy(dense[idx]).to(device, non_blocking=True),
               torch.from_numpy(sparse[idx]).to(device, non_blocking=True),
               torch.from_numpy(labels[idx]).to(device, non_blocking=True))


def worker(rank, world, port, data, args, log_path):
    sys.stdout = sys.stderr = open(log_path, "a", buffering=1)
    try:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world)
        device = torch.device("cuda", rank)
        train_idx, val_idx = data["train_idx"], data["val_idx"]
        dense, sparse, labels = data["dense"], data["sparse"], data["labels"]

        torch.manual_seed(1234)
        model = DCN(dense.shape[1], sparse.shape[1], args.hash_size, args.emb_dim, args.cross_layers).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        ckpt_path = os.path.join(args.out, "ckpt.pt")
        start_epoch = 0
        if os.path.exists(ckpt_path):
            ck = torch.load(ckpt_path, map_location=device)
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            start_epoch = ck["epoch"] + 1
        ddp = DDP(model, device_ids=[rank])
        per_rank = args.global_batch // world

        for epoch in range(start_epoch, args.epochs):
            my_idx = train_idx[shard_indices(len(train_idx), rank, world, epoch)]
            t0 = time.time()
            for step, (xd, xs, y) in enumerate(iterate(my_idx, per_rank, dense, sparse, labels, device)):
                loss = F.binary_cross_entropy_with_logits(ddp(xd, xs), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if step % 500 == 0:
                    print(f"epoch {epoch} step {step} logloss {loss.item():.5f}")

            # validation: gather scores from every rank so AUC is computed over the whole split
            model.eval()
            my_val = val_idx[rank::world]
            scores = []
            with torch.no_grad():
                for s in range(0, len(my_val), 65536):
                    idx = my_val[s:s + 65536]
                    scores.append(torch.sigmoid(model(torch.from_numpy(dense[idx]).to(device),
                                                      torch.from_numpy(sparse[idx]).to(device))).cpu())
            model.train()
            local = np.concatenate([t.numpy() for t in scores]) if scores else np.zeros(0, np.float32)
            gathered = [None] * world
            dist.all_gather_object(gathered, local)
            if rank == 0:
                all_scores = np.empty(len(val_idx), dtype=np.float32)
                for r, part in enumerate(gathered):
                    all_scores[r::world] = part
                auc = roc_auc_score(labels[val_idx], all_scores)
                print(f"epoch {epoch} val AUC {auc:.5f} ({time.time() - t0:.0f}s)")
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                           ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            dist.barrier()
        dist.destroy_process_group()
    except Exception:
        traceback.print_exc()
        sys.exit(1)


def load_data(path, val_frac=0.05, seed=0):
    z = np.load(path)
    dense = np.log1p(np.maximum(z["dense"], 0)).astype(np.float32)
    data = {"dense": dense, "sparse": z["sparse"].astype(np.int64), "labels": z["labels"].astype(np.float32)}
    n = len(data["labels"])
    perm = np.random.default_rng(seed).permutation(n)
    n_val = int(n * val_frac)
    data["val_idx"], data["train_idx"] = np.sort(perm[:n_val]), perm[n_val:]
    return data


def describe_gpus():
    n = torch.cuda.device_count()
    for i in range(n):
        props = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i} {props.name} {props.total_memory / 2 ** 30:.0f} GiB, {props.multi_processor_count} SMs")
    return n


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    args = get_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    data = load_data(args.data)
    print(f"loaded {len(data['labels']):,} rows in {time.time() - t0:.0f}s", flush=True)
    world = describe_gpus()

    ctx = mp.get_context("fork")  # workers inherit `data` without copying
    for attempt in range(args.retries + 1):
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, world, port, data, args,
                                                  os.path.join(args.out, f"worker{r}.log")))
                 for r in range(world)]
        for p in procs:
            p.start()
        while True:
            codes = [p.exitcode for p in procs]
            if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
                break
            time.sleep(3)
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
        if all(p.exitcode == 0 for p in procs):
            print("training finished", flush=True)
            return 0
        print(f"attempt {attempt} failed: exit codes {[p.exitcode for p in procs]}", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
