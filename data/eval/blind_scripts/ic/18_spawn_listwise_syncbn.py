"""Listwise product ranker over precomputed embeddings + features, single node, mp.spawn.

For every query we have the frozen query embedding from the production two-tower
model and, for each of its candidates, the product embedding plus a handful of
dense features.  A small network with BatchNorm'd feature inputs scores each
candidate; ListMLE loss.  Lists are short (top-50), so per-GPU batches are small
and BatchNorm statistics are synchronised across GPUs.

    python 18_spawn_listwise_syncbn.py --data /data/rank/emb_lists_v3 --gpus 4
"""
import argparse
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/listmle_syncbn")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--list_size", type=int, default=50)
    ap.add_argument("--queries_per_gpu", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=20)
    return ap.parse_args()


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def prepare(data_dir, list_size):
    """Runs once in the parent: packs the per-query lists into fixed-size arrays."""
    packed = os.path.join(data_dir, f"packed_L{list_size}.npz")
    if os.path.exists(packed):
        return packed
    z = np.load(os.path.join(data_dir, "lists.npz"))  # q_emb [Q,D], p_emb [N,D], feats [N,F], grade [N], qptr [Q+1]
    Q, D = z["q_emb"].shape
    F_ = z["feats"].shape[1]
    p = np.zeros((Q, list_size, D), np.float16)
    f = np.zeros((Q, list_size, F_), np.float32)
    g = np.full((Q, list_size), -1, np.int8)
    for q in range(Q):
        s, e = z["qptr"][q], min(z["qptr"][q + 1], z["qptr"][q] + list_size)
        p[q, : e - s], f[q, : e - s], g[q, : e - s] = z["p_emb"][s:e], z["feats"][s:e], z["grade"][s:e]
    np.savez(packed + ".tmp.npz", q=z["q_emb"].astype(np.float16), p=p, f=f, g=g, split=z["split"])
    os.replace(packed + ".tmp.npz", packed)
    return packed


class Lists(Dataset):
    def __init__(self, arrays, split):
        keep = np.flatnonzero(arrays["split"] == split)
        self.q, self.p, self.f, self.g = (arrays[k][keep] for k in ("q", "p", "f", "g"))

    def __len__(self):
        return len(self.q)

    def __getitem__(self, i):
        return (torch.from_numpy(self.q[i].astype(np.float32)), torch.from_numpy(self.p[i].astype(np.float32)),
                torch.from_numpy(self.f[i]), torch.from_numpy(self.g[i].astype(np.float32)))


class Scorer(nn.Module):
    def __init__(self, d, n_feat):
        super().__init__()
        self.feat_bn = nn.BatchNorm1d(n_feat)
        self.net = nn.Sequential(
            nn.Linear(3 * d + n_feat, 512), nn.BatchNorm1d(512), nn.ReLU(),
            nn.Linear(512, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 1))

    def forward(self, q, p, f):
        B, L, D = p.shape
        q = q.unsqueeze(1).expand(B, L, D)
        f = self.feat_bn(f.reshape(B * L, -1))
        x = torch.cat([q.reshape(B * L, D), p.reshape(B * L, D), (q * p).reshape(B * L, D), f], dim=1)
        return self.net(x).view(B, L)


def list_mle(scores, grades):
    valid = grades >= 0
    # sort by label (random tie-break), then Plackett-Luce likelihood of that order
    noise = torch.rand_like(grades) * 1e-3
    order = (grades + noise).masked_fill(~valid, -1e9).argsort(dim=1, descending=True)
    s = scores.gather(1, order).masked_fill(~valid.gather(1, order), -1e4)
    cums = torch.logcumsumexp(s.flip(1), dim=1).flip(1)
    nll = (cums - s) * valid.gather(1, order)
    return nll.sum(1).mean()


@torch.no_grad()
def ndcg10(scores, grades):
    valid = grades >= 0
    gains = (2 ** grades.clamp(min=0) - 1) * valid
    top = scores.masked_fill(~valid, -1e9).topk(10, dim=1).indices
    disc = 1.0 / torch.log2(torch.arange(2, 12, device=scores.device).float())
    dcg = (gains.gather(1, top) * disc).sum(1)
    idcg = (gains.sort(1, descending=True).values[:, :10] * disc).sum(1)
    keep = idcg > 0
    return (dcg[keep] / idcg[keep]).sum(), keep.sum()


def worker(rank, world_size, args, packed, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    torch.manual_seed(0)

    arrays = dict(np.load(packed))
    train_ds, dev_ds = Lists(arrays, "train"), Lists(arrays, "dev")
    del arrays
    d, n_feat = train_ds.q.shape[1], train_ds.f.shape[2]

    model = Scorer(d, n_feat).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.queries_per_gpu, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    dev_loader = DataLoader(torch.utils.data.Subset(dev_ds, range(rank, len(dev_ds), world_size)),
                            batch_size=256, num_workers=2)

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for q, p, f, g in loader:
            q, p, f, g = (x.to(device, non_blocking=True) for x in (q, p, f, g))
            loss = list_mle(model(q, p, f), g)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        # eval on the unwrapped model: BN uses running stats, no cross-rank sync per batch
        model.module.eval()
        acc = torch.zeros(2, device=device)
        for q, p, f, g in dev_loader:
            q, p, f, g = (x.to(device, non_blocking=True) for x in (q, p, f, g))
            a, b = ndcg10(model.module(q, p, f), g)
            acc[0] += a
            acc[1] += b
        dist.all_reduce(acc)
        ndcg = (acc[0] / acc[1].clamp(min=1)).item()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} dev NDCG@10 {ndcg:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if ndcg > best:
                best = ndcg
                os.makedirs(args.out, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "ndcg": ndcg},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    packed = prepare(args.data, args.list_size)
    port = free_port()
    mp.spawn(worker, args=(args.gpus, args, packed, port), nprocs=args.gpus, join=True)
