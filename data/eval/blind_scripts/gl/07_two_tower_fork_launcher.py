#!/usr/bin/env python3
"""Two-tower retrieval model with cross-GPU in-batch negatives.

    python 07_two_tower_fork_launcher.py --data /data/recsys/clicks_v3 --out /mnt/exp/two_tower --ngpu 8

The launcher checks that the GPUs are free, starts one worker process per GPU,
and kills the whole group if one worker dies.
"""
import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn as dist_nn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class ClickPairs(Dataset):
    def __init__(self, root, split):
        self.hist = np.load(os.path.join(root, f"{split}_history.npy"), mmap_mode="r")  # [N, L] item ids, 0 = pad
        self.target = np.load(os.path.join(root, f"{split}_target.npy"), mmap_mode="r")  # [N]

    def __len__(self):
        return len(self.target)

    def __getitem__(self, i):
        return torch.from_numpy(np.asarray(self.hist[i], dtype=np.int64)), int(self.target[i])


class Tower(nn.Module):
    def __init__(self, emb, dim):
        super().__init__()
        self.emb = emb
        self.proj = nn.Sequential(nn.Linear(emb.embedding_dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, ids):
        if ids.dim() == 2:
            mask = (ids > 0).float().unsqueeze(-1)
            x = (self.emb(ids) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        else:
            x = self.emb(ids)
        return F.normalize(self.proj(x), dim=-1)


class TwoTower(nn.Module):
    def __init__(self, n_items, emb_dim=128, out_dim=64):
        super().__init__()
        self.item_emb = nn.Embedding(n_items, emb_dim, padding_idx=0)
        self.user = Tower(self.item_emb, out_dim)
        self.item = Tower(self.item_emb, out_dim)
        self.log_temp = nn.Parameter(torch.tensor(np.log(1 / 0.05), dtype=torch.float32))

    def forward(self, hist, target):
        return self.user(hist), self.item(target), self.log_temp.exp()


def contrastive_loss(u, v, temp, rank):
    # negatives from every GPU; the autograd-aware all_gather sends gradients back
    all_v = torch.cat(dist_nn.all_gather(v), dim=0)
    logits = temp * u @ all_v.t()
    labels = torch.arange(u.size(0), device=u.device) + rank * u.size(0)
    return F.cross_entropy(logits, labels)


@torch.no_grad()
def recall_at_k(model, loader, device, k=50, n_eval_items=200_000):
    model.eval()
    net = model.module
    items = torch.arange(1, n_eval_items, device=device)
    item_vecs = torch.cat([net.item(chunk) for chunk in items.split(65536)])
    hits = torch.zeros(2, device=device)
    for hist, tgt in loader:
        hist, tgt = hist.to(device), tgt.to(device)
        scores = net.user(hist) @ item_vecs.t()
        topk = scores.topk(k, dim=1).indices + 1
        hits[0] += (topk == tgt[:, None]).any(1).sum()
        hits[1] += tgt.numel()
    dist.all_reduce(hits)
    model.train()
    return (hits[0] / hits[1]).item()


def worker(rank, world, port, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    train = ClickPairs(args.data, "train")
    val = ClickPairs(args.data, "val")
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    dl = DataLoader(train, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=4,
                    pin_memory=True, drop_last=True)
    vdl = DataLoader(torch.utils.data.Subset(val, range(rank, min(len(val), 100_000), world)),
                     batch_size=1024, num_workers=2)

    model = DDP(TwoTower(args.n_items).to(device), device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    hist_file = os.path.join(args.out, "metrics.jsonl")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (hist, tgt) in enumerate(dl):
            hist, tgt = hist.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            u, v, temp = model(hist, tgt)
            loss = contrastive_loss(u, v, temp, rank)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():
                model.module.log_temp.clamp_(0, np.log(100))
            if rank == 0 and step % 200 == 0:
                print(f"[ep {epoch} step {step}/{len(dl)}] loss {loss.item():.4f} temp {temp.item():.2f}",
                      flush=True)
        r50 = recall_at_k(model, vdl, device)
        if rank == 0:
            print(f"epoch {epoch}: recall@50 {r50:.4f} ({time.time() - t0:.0f}s)", flush=True)
            with open(hist_file, "a") as f:
                f.write(json.dumps({"epoch": epoch, "recall@50": r50}) + "\n")
            torch.save(model.module.state_dict(), os.path.join(args.out, f"two_tower_ep{epoch}.pt"))
        dist.barrier()
    dist.destroy_process_group()


def preflight(ngpu, min_free_frac=0.9):
    """Refuse to start on GPUs that still hold memory from an earlier run."""
    if torch.cuda.device_count() < ngpu:
        raise SystemExit(f"asked for {ngpu} GPUs, {torch.cuda.device_count()} visible")
    for i in range(ngpu):
        free, total = torch.cuda.mem_get_info(i)
        if free < min_free_frac * total:
            raise SystemExit(f"GPU {i}: only {free / 2**30:.1f} of {total / 2**30:.1f} GiB free - "
                             f"is another job still running?")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ngpu", type=int, default=8)
    ap.add_argument("--n-items", type=int, default=2_000_000)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-per-gpu", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=29621)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    preflight(args.ngpu)
    procs = []
    for r in range(args.ngpu):
        p = mp.Process(target=worker, args=(r, args.ngpu, args.port, args), daemon=False)
        p.start()
        procs.append(p)

    def kill_all(*_):
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            p.join(timeout=30)
        sys.exit(1)

    signal.signal(signal.SIGTERM, kill_all)
    signal.signal(signal.SIGINT, kill_all)

    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            print("a worker failed:", [p.exitcode for p in procs], file=sys.stderr)
            kill_all()
        time.sleep(5)
    sys.exit(max(p.exitcode for p in procs))


if __name__ == "__main__":
    main()
