"""DLRM (dot interaction) with bf16 autocast on day-partitioned parquet.

Launch:
  torchrun --standalone --nproc_per_node=8 05_dlrm_amp_eval.py --train-days 1-6 --eval-days 7
"""
import argparse
import glob
import json
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_days(spec):
    out = []
    for part in spec.split(","):
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out


def build_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/ads/ctr_v5")
    p.add_argument("--meta", default="/data/ads/ctr_v5/meta.json")
    p.add_argument("--train-days", default="1-6")
    p.add_argument("--eval-days", default="7")
    p.add_argument("--emb-dim", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--eval-batch-size", type=int, default=16384)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--ckpt-dir", default="/mnt/fsx/ckpt/dlrm_amp")
    return p.parse_args()


def load_split(root, days, dense_cols, sparse_cols):
    ys, xd, xs = [], [], []
    for d in days:
        for f in sorted(glob.glob(f"{root}/day={d:02d}/*.parquet")):
            t = pq.read_table(f)
            ys.append(t.column("click").to_numpy().astype(np.float32))
            xd.append(np.stack([t.column(c).to_numpy(zero_copy_only=False) for c in dense_cols], 1).astype(np.float32))
            xs.append(np.stack([t.column(c).to_numpy() for c in sparse_cols], 1).astype(np.int64))
    dense = np.log1p(np.clip(np.nan_to_num(np.concatenate(xd)), 0, None))
    return TensorDataset(torch.from_numpy(dense), torch.from_numpy(np.concatenate(xs)),
                         torch.from_numpy(np.concatenate(ys)))


class DotInteraction(nn.Module):
    def forward(self, feats):
        n = feats.size(1)
        z = torch.bmm(feats, feats.transpose(1, 2))
        i, j = torch.tril_indices(n, n, offset=-1, device=feats.device)
        return z[:, i, j]


class DLRM(nn.Module):
    def __init__(self, n_dense, cardinalities, dim):
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(c, dim, mode="sum") for c in cardinalities)
        self.bot = nn.Sequential(nn.Linear(n_dense, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                 nn.Linear(256, dim), nn.ReLU())
        self.inter = DotInteraction()
        n = len(cardinalities) + 1
        self.top = nn.Sequential(nn.Linear(dim + n * (n - 1) // 2, 1024), nn.ReLU(),
                                 nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                 nn.Linear(256, 1))

    def forward(self, dense, sparse):
        b = self.bot(dense)
        embs = [t(sparse[:, k:k + 1]) for k, t in enumerate(self.tables)]
        feats = torch.stack([b] + embs, dim=1)
        return self.top(torch.cat([b, self.inter(feats)], dim=1)).squeeze(-1)


@torch.no_grad()
def evaluate(model, loader, device, n_rows):
    model.eval()
    probs, labels = [], []
    for dense, sparse, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logit = model(dense.to(device, non_blocking=True), sparse.to(device, non_blocking=True))
        probs.append(torch.sigmoid(logit.float()).cpu())
        labels.append(y)
    probs = torch.cat(probs)
    labels = torch.cat(labels)

    world = dist.get_world_size()
    all_probs = [torch.zeros_like(probs) for _ in range(world)]
    all_labels = [torch.zeros_like(labels) for _ in range(world)]
    dist.all_gather(all_probs, probs)
    dist.all_gather(all_labels, labels)
    model.train()

    p = torch.stack(all_probs, 1).reshape(-1)[:n_rows].numpy()
    y = torch.stack(all_labels, 1).reshape(-1)[:n_rows].numpy()
    eps = 1e-7
    ll = -np.mean(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps))
    return roc_auc_score(y, p), ll


def main():
    args = build_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(args.meta) as f:
        meta = json.load(f)
    dense_cols, sparse_cols = meta["dense"], meta["sparse"]
    cards = [meta["cardinality"][c] for c in sparse_cols]

    train_ds = load_split(args.root, parse_days(args.train_days), dense_cols, sparse_cols)
    eval_ds = load_split(args.root, parse_days(args.eval_days), dense_cols, sparse_cols)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=7)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    eval_loader = DataLoader(eval_ds, batch_size=args.eval_batch_size,
                             sampler=DistributedSampler(eval_ds, shuffle=False),
                             num_workers=4, pin_memory=True)

    model = DLRM(len(dense_cols), cards, args.emb_dim).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.0, 1 - s / total_steps))

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"{len(train_ds)} train rows / {len(eval_ds)} eval rows, {total_steps} steps on {world} GPUs")

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        tic = time.time()
        for dense, sparse, y in train_loader:
            dense = dense.to(device, non_blocking=True)
            sparse = sparse.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logit = model(dense, sparse)
            loss = F.binary_cross_entropy_with_logits(logit.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and step % 250 == 0:
                rate = 250 * args.batch_size * world / (time.time() - tic)
                print(f"step {step}/{total_steps} loss {loss.item():.5f} lr {scheduler.get_last_lr()[0]:.2e} "
                      f"{rate / 1e3:.1f}k ex/s", flush=True)
                tic = time.time()

            if step % 5000 == 0 or step == total_steps:
                auc, ll = evaluate(model, eval_loader, device, len(eval_ds))
                if rank == 0:
                    print(f"[eval] step {step} auc {auc:.5f} logloss {ll:.5f}", flush=True)
                    torch.save({"step": step, "model": model.module.state_dict(),
                                "optimizer": optimizer.state_dict(), "auc": auc},
                               os.path.join(args.ckpt_dir, f"step_{step:07d}.pt"))
                dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
