#!/usr/bin/env python3
"""DLRM driven by a feature spec (feature_spec.yaml written by the preprocessing job).

feature_spec.yaml:
    numerical: [num_0, ..., num_12]
    categorical:
      cat_0: {cardinality: 39884406}
      ...
    files: {train: [...], test: [...]}

Raw categorical ids in the binary files are < cardinality. Very large tables are capped at
--max_table_size rows to fit in GPU memory next to the optimizer state.

    torchrun --nproc_per_node=8 19_dlrm_feature_spec.py --spec /raid/criteo/binary/feature_spec.yaml
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def load_spec(path):
    with open(path) as f:
        spec = yaml.safe_load(f)
    base = os.path.dirname(path)
    spec["numerical"] = list(spec["numerical"])
    spec["cat_names"] = list(spec["categorical"].keys())
    spec["cardinalities"] = [int(spec["categorical"][c]["cardinality"]) for c in spec["cat_names"]]
    spec["train_files"] = [os.path.join(base, f) for f in spec["files"]["train"]]
    spec["test_files"] = [os.path.join(base, f) for f in spec["files"]["test"]]
    return spec


class BinaryPart(Dataset):
    """One .npz part: `num` float16 [N,13], `cat` int32 [N,26], `label` bool [N]."""

    def __init__(self, path, cardinalities):
        z = np.load(path)
        self.num = np.log1p(np.maximum(z["num"].astype(np.float32), 0.0))
        self.cat = z["cat"].astype(np.int64) % np.asarray(cardinalities, dtype=np.int64)
        self.label = z["label"].astype(np.float32)

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return torch.from_numpy(self.num[i]), torch.from_numpy(self.cat[i]), torch.tensor(self.label[i])


def mlp(sizes, final_relu=True):
    mods = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        mods.append(nn.Linear(a, b))
        nn.init.normal_(mods[-1].weight, 0.0, np.sqrt(2.0 / (a + b)))
        nn.init.normal_(mods[-1].bias, 0.0, np.sqrt(1.0 / b))
        if final_relu or i < len(sizes) - 2:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


class DLRM(nn.Module):
    def __init__(self, num_dense, table_sizes, dim, bottom, top):
        super().__init__()
        self.bottom = mlp([num_dense] + bottom + [dim])
        self.tables = nn.ModuleList()
        for n in table_sizes:
            t = nn.Embedding(n, dim)
            nn.init.uniform_(t.weight, -np.sqrt(1.0 / n), np.sqrt(1.0 / n))
            self.tables.append(t)
        f = len(table_sizes) + 1
        self.top = mlp([dim + f * (f - 1) // 2] + top + [1], final_relu=False)
        li, lj = torch.tril_indices(f, f, offset=-1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)

    def forward(self, num, cat):
        x = self.bottom(num)
        ly = [t(cat[:, k]) for k, t in enumerate(self.tables)]
        T = torch.stack([x] + ly, dim=1)
        Z = torch.bmm(T, T.transpose(1, 2))[:, self.li, self.lj]
        return self.top(torch.cat([x, Z], dim=1)).squeeze(1)


@torch.no_grad()
def evaluate(net, loader, device, n_bins=10000):
    net.eval()
    pos = torch.zeros(n_bins, dtype=torch.float64, device=device)
    neg = torch.zeros(n_bins, dtype=torch.float64, device=device)
    loss = torch.zeros(2, dtype=torch.float64, device=device)
    for num, cat, y in loader:
        num, cat, y = num.to(device), cat.to(device), y.to(device)
        logit = net(num, cat)
        loss[0] += F.binary_cross_entropy_with_logits(logit, y, reduction="sum")
        loss[1] += y.numel()
        b = (torch.sigmoid(logit) * n_bins).long().clamp(max=n_bins - 1)
        pos += torch.bincount(b, weights=y.double(), minlength=n_bins)
        neg += torch.bincount(b, weights=(1 - y).double(), minlength=n_bins)
    for t in (pos, neg, loss):
        dist.all_reduce(t)
    net.train()
    auc = (pos * (torch.cumsum(neg, 0) - 0.5 * neg)).sum() / (pos.sum() * neg.sum())
    return (loss[0] / loss[1]).item(), auc.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="/raid/criteo/binary/feature_spec.yaml")
    ap.add_argument("--max_table_size", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--bottom", type=int, nargs="+", default=[512, 256])
    ap.add_argument("--top", type=int, nargs="+", default=[1024, 1024, 512, 256])
    ap.add_argument("--batch_size", type=int, default=8192, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--eval_every", type=int, default=20000)
    ap.add_argument("--out", default="/raid/criteo/runs/dlrm_spec")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    spec = load_spec(args.spec)
    table_sizes = [min(c, args.max_table_size) for c in spec["cardinalities"]]
    if rank == 0:
        print("table sizes:", table_sizes, flush=True)
        os.makedirs(args.out, exist_ok=True)

    train_ds = ConcatDataset([BinaryPart(p, spec["cardinalities"]) for p in spec["train_files"]])
    test_ds = ConcatDataset([BinaryPart(p, spec["cardinalities"]) for p in spec["test_files"]])
    n_test = len(test_ds) // world
    test_part = torch.utils.data.Subset(test_ds, range(rank * n_test, (rank + 1) * n_test))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    test_dl = DataLoader(test_part, batch_size=32768, num_workers=4, pin_memory=True)

    torch.manual_seed(0)
    model = DDP(DLRM(len(spec["numerical"]), table_sizes, args.dim, args.bottom, args.top).to(device),
                device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)

    sampler.set_epoch(0)
    best_auc, t0 = 0.0, time.time()
    for step, (num, cat, y) in enumerate(train_dl, start=1):
        num, cat, y = num.to(device, non_blocking=True), cat.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.binary_cross_entropy_with_logits(model(num, cat), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and step % 1000 == 0:
            print(f"step {step}/{len(train_dl)} loss {loss.item():.5f} "
                  f"{1000 * args.batch_size * world / (time.time() - t0):.0f} ex/s", flush=True)
            t0 = time.time()
        if step % args.eval_every == 0 or step == len(train_dl):
            logloss, auc = evaluate(model.module, test_dl, device)
            if rank == 0:
                print(f"[eval] step {step} logloss {logloss:.5f} auc {auc:.5f}", flush=True)
                if auc > best_auc:
                    best_auc = auc
                    torch.save({"model": model.module.state_dict(), "step": step, "auc": auc,
                                "table_sizes": table_sizes}, os.path.join(args.out, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
