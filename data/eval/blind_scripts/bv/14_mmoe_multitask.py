"""MMoE ranker for the short-video feed: click, like and finish (watched to the end).

`finish` only exists for video impressions (image posts have finish = -1), so
its tower only gets a loss on batches that contain videos; the towers that get
no loss in a step are handled by DDP's unused-parameter detection.

    torchrun --standalone --nproc_per_node=8 14_mmoe_multitask.py --resume auto
"""
import argparse
import glob
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TASKS = ["click", "like", "finish"]
SPARSE = ["user_h", "item_h", "author_h", "music_h", "city_h", "device_h", "hour", "item_type"]
DENSE = ["duration_s", "author_fans_log", "item_age_h", "user_active_days"]


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--train", default="/mnt/nas/feed/mtl/train")
    p.add_argument("--valid", default="/mnt/nas/feed/mtl/valid")
    p.add_argument("--vocab", type=int, default=1 << 22)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--experts", type=int, default=6)
    p.add_argument("--expert-dim", type=int, default=256)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--task-weights", default="1.0,0.5,0.5")
    p.add_argument("--ckpt-dir", default="/mnt/nas/feed/mtl/ckpt")
    p.add_argument("--resume", default="", help="path, or 'auto' for <ckpt-dir>/last.pt")
    return p.parse_args()


class Impressions(Dataset):
    def __init__(self, folder):
        df = pd.concat([pd.read_parquet(f) for f in sorted(glob.glob(f"{folder}/*.parquet"))],
                       ignore_index=True)
        self.sparse = df[SPARSE].to_numpy(np.int64)
        self.dense = np.log1p(df[DENSE].clip(lower=0).to_numpy(np.float32))
        self.labels = df[TASKS].to_numpy(np.float32)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.sparse[i], self.dense[i], self.labels[i]


class MMoE(nn.Module):
    def __init__(self, vocab, dim, n_experts, expert_dim):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        d_in = len(SPARSE) * dim + len(DENSE)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d_in, 512), nn.ReLU(), nn.Linear(512, expert_dim), nn.ReLU())
            for _ in range(n_experts))
        self.gates = nn.ModuleDict({t: nn.Linear(d_in, n_experts) for t in TASKS})
        self.towers = nn.ModuleDict({t: nn.Sequential(nn.Linear(expert_dim, 128), nn.ReLU(), nn.Linear(128, 1))
                                     for t in TASKS})

    def forward(self, sparse, dense, tasks=TASKS):
        x = torch.cat([self.emb(sparse).flatten(1), dense], dim=1)
        ex = torch.stack([e(x) for e in self.experts], dim=1)            # B, E, H
        out = {}
        for t in tasks:
            g = torch.softmax(self.gates[t](x), dim=-1).unsqueeze(-1)    # B, E, 1
            out[t] = self.towers[t]((g * ex).sum(1)).squeeze(-1)
        return out


@torch.no_grad()
def evaluate(model, loader, device, n):
    model.eval()
    rows = []
    for sparse, dense, y in loader:
        logits = model(sparse.to(device), dense.to(device))
        rows.append(torch.cat([torch.stack([torch.sigmoid(logits[t]) for t in TASKS], 1), y.to(device)], 1))
    local = torch.cat(rows)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    allr = torch.stack(parts, 1).reshape(-1, local.size(1))[:n].cpu().numpy()
    model.train()
    res = {}
    for j, t in enumerate(TASKS):
        p, y = allr[:, j], allr[:, len(TASKS) + j]
        keep = y >= 0
        res[t] = roc_auc_score(y[keep], p[keep])
    return res


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    weights = dict(zip(TASKS, map(float, args.task_weights.split(","))))

    train, valid = Impressions(args.train), Impressions(args.valid)
    sampler = DistributedSampler(train, shuffle=True, seed=3)
    train_loader = DataLoader(train, batch_size=args.batch, sampler=sampler, num_workers=6,
                              pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid, batch_size=8192, sampler=DistributedSampler(valid, shuffle=False),
                              num_workers=4, pin_memory=True)

    model = MMoE(args.vocab, args.dim, args.experts, args.expert_dim).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    start_epoch = 0
    resume = os.path.join(args.ckpt_dir, "last.pt") if args.resume == "auto" else args.resume
    if resume and os.path.exists(resume):
        state = torch.load(resume, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start_epoch = state["epoch"] + 1
        if rank == 0:
            print(f"resumed {resume} at epoch {start_epoch}", flush=True)

    # the finish tower (and its gate) has no loss on image-only batches
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    best = -1.0
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (sparse, dense, y) in enumerate(train_loader):
            sparse, dense, y = sparse.to(device), dense.to(device), y.to(device)
            has_finish = bool((y[:, 2] >= 0).any())
            tasks = TASKS if has_finish else ["click", "like"]
            logits = model(sparse, dense, tasks)
            loss = weights["click"] * F.binary_cross_entropy_with_logits(logits["click"], y[:, 0])
            loss = loss + weights["like"] * F.binary_cross_entropy_with_logits(logits["like"], y[:, 1])
            if has_finish:
                m = y[:, 2] >= 0
                loss = loss + weights["finish"] * F.binary_cross_entropy_with_logits(logits["finish"][m], y[m, 2])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and it % 300 == 0:
                print(f"ep {epoch} it {it} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)

        aucs = evaluate(model, valid_loader, device, len(valid))
        if rank == 0:
            print(f"ep {epoch} valid " + " ".join(f"{t}_auc={v:.4f}" for t, v in aucs.items()), flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "auc": aucs}
            torch.save(state, os.path.join(args.ckpt_dir, "last.pt"))
            if aucs["click"] > best:
                best = aucs["click"]
                torch.save(state, os.path.join(args.ckpt_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
