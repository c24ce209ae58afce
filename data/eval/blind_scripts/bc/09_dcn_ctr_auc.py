"""DCN-v2 click-through-rate model, daily retrain job on the 5% sampled impression logs.

    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=$MASTER:29500 \
        train_ctr.py --train-days 2024-05-22:2024-05-28 --eval-day 2024-05-29 --run-dir /fsx/ctr/runs/0529
"""
import argparse
import datetime as dt
import json
import os
import time

import fsspec
import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from sklearn.metrics import log_loss, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DENSE = [f"i{i}" for i in range(13)]
SPARSE = [f"c{i}" for i in range(26)]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--bucket", default="s3://ads-logs/ctr/parquet")
    p.add_argument("--train-days", required=True)
    p.add_argument("--eval-day", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--hash-size", type=int, default=2_000_000)
    p.add_argument("--emb-dim", type=int, default=32)
    p.add_argument("--cross-layers", type=int, default=3)
    p.add_argument("--mlp", default="1024,512,256")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--wandb-project", default="ctr-daily")
    return p.parse_args()


def day_range(spec):
    a, b = (dt.date.fromisoformat(s) for s in spec.split(":"))
    return [(a + dt.timedelta(days=i)).isoformat() for i in range((b - a).days + 1)]


class ParquetCTR(Dataset):
    def __init__(self, urls):
        dense, sparse, label = [], [], []
        for url in urls:
            with fsspec.open(url, "rb") as f:
                t = pq.read_table(f, columns=DENSE + SPARSE + ["label"])
            dense.append(np.stack([t[c].to_numpy(zero_copy_only=False) for c in DENSE], 1))
            sparse.append(np.stack([t[c].to_numpy(zero_copy_only=False) for c in SPARSE], 1))
            label.append(t["label"].to_numpy())
        self.dense = torch.from_numpy(np.log1p(np.clip(np.concatenate(dense), 0, None)).astype(np.float32))
        self.sparse = torch.from_numpy(np.concatenate(sparse).astype(np.int32))
        self.label = torch.from_numpy(np.concatenate(label).astype(np.float32))

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return self.dense[i], self.sparse[i].long(), self.label[i]


class CrossNet(nn.Module):
    def __init__(self, dim, layers):
        super().__init__()
        self.w = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x0):
        x = x0
        for lin in self.w:
            x = x0 * lin(x) + x
        return x


class DCNv2(nn.Module):
    def __init__(self, hash_size, emb_dim, cross_layers, mlp_dims):
        super().__init__()
        self.hash_size = hash_size
        self.emb = nn.ModuleList(nn.Embedding(hash_size, emb_dim) for _ in SPARSE)
        in_dim = len(DENSE) + len(SPARSE) * emb_dim
        self.cross = CrossNet(in_dim, cross_layers)
        layers, d = [], in_dim
        for h in mlp_dims:
            layers += [nn.Linear(d, h), nn.ReLU()]
            d = h
        self.mlp = nn.Sequential(*layers)
        self.out = nn.Linear(in_dim + d, 1)

    def forward(self, dense, sparse):
        sparse = sparse % self.hash_size
        embs = [e(sparse[:, i]) for i, e in enumerate(self.emb)]
        x = torch.cat([dense] + embs, dim=1)
        return self.out(torch.cat([self.cross(x), self.mlp(x)], dim=1)).squeeze(1)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    preds, labels = [], []
    for dense, sparse, y in loader:
        logits = net(dense.to(device, non_blocking=True), sparse.to(device, non_blocking=True))
        preds.append(torch.sigmoid(logits).float().cpu())
        labels.append(y)
    net.train()
    p = torch.cat(preds).numpy()
    y = torch.cat(labels).numpy()
    return {"auc": roc_auc_score(y, p), "logloss": log_loss(y, p, labels=[0, 1]), "n": len(y)}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_urls = [f"{args.bucket}/day={d}/part-0.parquet" for d in day_range(args.train_days)]
    eval_urls = [f"{args.bucket}/day={args.eval_day}/part-0.parquet"]
    train_ds = ParquetCTR(train_urls)
    eval_ds = ParquetCTR(eval_urls)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    eval_sampler = DistributedSampler(eval_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    eval_loader = DataLoader(eval_ds, batch_size=4 * args.batch_size, sampler=eval_sampler,
                             num_workers=4, pin_memory=True)

    net = DCNv2(args.hash_size, args.emb_dim, args.cross_layers,
                [int(h) for h in args.mlp.split(",")]).to(device)
    model = DDP(net, device_ids=[local_rank], gradient_as_bucket_view=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    bce = nn.BCEWithLogitsLoss()

    os.makedirs(args.run_dir, exist_ok=True)
    ckpt_path = os.path.join(args.run_dir, "last.pt")
    start_epoch, best_auc = 0, 0.0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_auc = ckpt["epoch"] + 1, ckpt["best_auc"]

    if rank == 0:
        wandb.init(project=args.wandb_project, name=f"dcn-{args.eval_day}", config=vars(args),
                   dir=args.run_dir)

    step = start_epoch * len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for dense, sparse, y in train_loader:
            dense, sparse = dense.to(device, non_blocking=True), sparse.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = bce(model(dense, sparse), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % 500 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    qps = 500 * args.batch_size * world / (time.time() - t0)
                    wandb.log({"train/logloss": l.item(), "train/examples_per_s": qps}, step=step)
                    t0 = time.time()

        metrics = evaluate(net, eval_loader, device)
        if rank == 0:
            wandb.log({f"eval/{k}": v for k, v in metrics.items()}, step=step)
            print(json.dumps({"epoch": epoch, **metrics}), flush=True)
            if metrics["auc"] > best_auc:
                best_auc = metrics["auc"]
                torch.save(net.state_dict(), os.path.join(args.run_dir, "model_best.pt"))
                with open(os.path.join(args.run_dir, "best_metrics.json"), "w") as f:
                    json.dump({"epoch": epoch, **metrics}, f)
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "best_auc": best_auc}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
