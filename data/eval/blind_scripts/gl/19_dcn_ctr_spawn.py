#!/usr/bin/env python3
"""DCN-v2 click-through-rate model on preprocessed Criteo day files.

    python 19_dcn_ctr_spawn.py --data /data/criteo/preproc --out /shared/ctr/dcnv2 --gpus 4 --epochs 2

Expects <data>/{train,val}_{dense,sparse,label}.npy as written by prep_criteo.py
(dense: float32 [N,13] log-transformed, sparse: int32 [N,26] hashed ids, label: uint8 [N]).
"""
import argparse
import json
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
from torchmetrics.classification import BinaryAUROC


class CriteoArrays(Dataset):
    def __init__(self, root, split):
        self.dense = np.load(os.path.join(root, f"{split}_dense.npy"), mmap_mode="r")
        self.sparse = np.load(os.path.join(root, f"{split}_sparse.npy"), mmap_mode="r")
        self.label = np.load(os.path.join(root, f"{split}_label.npy"), mmap_mode="r")

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return (torch.from_numpy(np.array(self.dense[i], dtype=np.float32)),
                torch.from_numpy(np.array(self.sparse[i], dtype=np.int64)),
                torch.tensor(float(self.label[i])))


class CrossLayer(nn.Module):
    def __init__(self, d, rank):
        super().__init__()
        self.u = nn.Linear(d, rank, bias=False)
        self.v = nn.Linear(rank, d)

    def forward(self, x0, x):
        return x0 * self.v(self.u(x)) + x


class DCNv2(nn.Module):
    def __init__(self, n_dense=13, n_sparse=26, hash_size=2_000_003, emb=16, n_cross=3, low_rank=64,
                 mlp=(1024, 512, 256)):
        super().__init__()
        self.emb = nn.Embedding(hash_size, emb)
        nn.init.normal_(self.emb.weight, std=0.01)
        d = n_dense + n_sparse * emb
        self.cross = nn.ModuleList(CrossLayer(d, low_rank) for _ in range(n_cross))
        layers, cin = [], d
        for h in mlp:
            layers += [nn.Linear(cin, h), nn.ReLU(), nn.Dropout(0.1)]
            cin = h
        self.deep = nn.Sequential(*layers)
        self.head = nn.Linear(d + cin, 1)

    def forward(self, dense, sparse):
        x0 = torch.cat([dense, self.emb(sparse).flatten(1)], 1)
        x = x0
        for c in self.cross:
            x = c(x0, x)
        return self.head(torch.cat([x, self.deep(x0)], 1)).squeeze(1)


def train(rank, world, port, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    tr, va = CriteoArrays(args.data, "train"), CriteoArrays(args.data, "val")
    sampler = DistributedSampler(tr, shuffle=True, seed=args.seed, drop_last=True)
    dl = DataLoader(tr, batch_size=args.batch_size // world, sampler=sampler, num_workers=8,
                    pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=8)
    vdl = DataLoader(torch.utils.data.Subset(va, range(rank, len(va), world)),
                     batch_size=32768, num_workers=4, pin_memory=True)

    model = DDP(DCNv2().to(device), device_ids=[rank])
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("module.emb")]
    opt = torch.optim.Adam([{"params": model.module.emb.parameters(), "lr": args.lr_emb},
                            {"params": dense_params, "lr": args.lr}])
    auroc = BinaryAUROC().to(device)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, seen = time.time(), 0
        for i, (dense, sparse, y) in enumerate(dl):
            dense, sparse, y = (t.to(device, non_blocking=True) for t in (dense, sparse, y))
            loss = F.binary_cross_entropy_with_logits(model(dense, sparse), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += y.numel()
            if rank == 0 and i % 500 == 0:
                print(f"epoch {epoch} it {i}/{len(dl)} logloss {loss.item():.5f} "
                      f"{seen * world / (time.time() - t0):.0f} samples/s", flush=True)

        model.eval()
        auroc.reset()
        ll = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for dense, sparse, y in vdl:
                dense, sparse, y = dense.to(device), sparse.to(device), y.to(device)
                logit = model.module(dense, sparse)
                auroc.update(logit.sigmoid(), y.long())
                ll[0] += F.binary_cross_entropy_with_logits(logit, y, reduction="sum").double()
                ll[1] += y.numel()
        auc = auroc.compute().item()
        dist.all_reduce(ll)
        if rank == 0:
            rec = {"epoch": epoch, "val_auc": auc, "val_logloss": (ll[0] / ll[1]).item(),
                   "time_s": time.time() - t0}
            print(json.dumps(rec), flush=True)
            with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
            torch.save(model.module.state_dict(), os.path.join(args.out, f"dcnv2_epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


def get_free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=65536, help="global")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lr-emb", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    port = get_free_port()

    def run_rank(rank):
        train(rank, args.gpus, port, args)

    print(f"starting {args.gpus} ranks (port {port})", flush=True)
    mp.spawn(run_rank, nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
