"""DeepFM for the feed CTR model.

Training window: N days of logs in TFRecord-converted .npz shards, evaluation on the
following day. Metrics are tracked in MLflow; the best model by validation AUC is
exported for the serving team.
"""
import argparse
import glob
import os
import time

import mlflow
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import log_loss, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class ShardedNpz(Dataset):
    def __init__(self, pattern):
        self.files = sorted(glob.glob(pattern))
        if not self.files:
            raise FileNotFoundError(pattern)
        parts = [np.load(f) for f in self.files]
        self.ids = np.concatenate([p["ids"] for p in parts]).astype(np.int64)
        self.vals = np.concatenate([p["vals"] for p in parts]).astype(np.float32)
        self.y = np.concatenate([p["label"] for p in parts]).astype(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.ids[i], self.vals[i], self.y[i]


class DeepFM(nn.Module):
    def __init__(self, num_features, num_fields, k, hidden, dropout):
        super().__init__()
        self.w0 = nn.Parameter(torch.zeros(1))
        self.w = nn.Embedding(num_features, 1)
        self.v = nn.Embedding(num_features, k)
        nn.init.zeros_(self.w.weight)
        nn.init.normal_(self.v.weight, std=1e-3)
        layers, prev = [], num_fields * k
        for h in hidden:
            layers += [nn.Linear(prev, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(dropout)]
            prev = h
        layers.append(nn.Linear(prev, 1))
        self.dnn = nn.Sequential(*layers)

    def forward(self, ids, vals):
        v = self.v(ids) * vals.unsqueeze(-1)                 # B, F, k
        first = (self.w(ids).squeeze(-1) * vals).sum(1)
        second = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(1)
        deep = self.dnn(v.flatten(1)).squeeze(1)
        return self.w0 + first + second + deep


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", default="/mnt/feed-logs/ctr/train/*.npz")
    ap.add_argument("--valid", default="/mnt/feed-logs/ctr/valid/*.npz")
    ap.add_argument("--num_features", type=int, default=5_000_000)
    ap.add_argument("--num_fields", type=int, default=39)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--hidden", default="400,400,400")
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--batch_size", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--export_dir", default="/mnt/feed-logs/models/deepfm")
    ap.add_argument("--experiment", default="feed-ctr-deepfm")
    return ap.parse_args()


@torch.no_grad()
def predict(net, loader, device):
    net.eval()
    preds, labels = [], []
    for ids, vals, y in loader:
        p = torch.sigmoid(net(ids.to(device, non_blocking=True), vals.to(device, non_blocking=True)))
        preds.append(p.float().cpu().numpy())
        labels.append(y.numpy())
    net.train()
    return np.concatenate(preds), np.concatenate(labels)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2023)

    train_ds = ShardedNpz(args.train)
    valid_ds = ShardedNpz(args.valid)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=6, pin_memory=True, drop_last=True)
    valid_dl = DataLoader(valid_ds, batch_size=8192, sampler=valid_sampler, num_workers=4,
                          pin_memory=True)

    net = DeepFM(args.num_features, args.num_fields, args.k,
                 [int(h) for h in args.hidden.split(",")], args.dropout)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        mlflow.set_experiment(args.experiment)
        mlflow.start_run()
        mlflow.log_params(vars(args) | {"world_size": world})
        os.makedirs(args.export_dir, exist_ok=True)

    best_auc = -1.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for ids, vals, y in train_dl:
            ids = ids.to(device, non_blocking=True)
            vals = vals.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(ids, vals), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and step % 200 == 0:
                mlflow.log_metric("train_loss", loss.item(), step=step)

        preds, labels = predict(model.module, valid_dl, device)
        val_auc = roc_auc_score(labels, preds)
        val_logloss = log_loss(labels, preds.astype(np.float64), labels=[0, 1])
        if rank == 0:
            mlflow.log_metrics({"val_auc": val_auc, "val_logloss": val_logloss,
                                "epoch_time_s": time.time() - t0}, step=epoch)
            print(f"[epoch {epoch}] val_auc={val_auc:.5f} val_logloss={val_logloss:.5f}",
                  flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.export_dir, "last.pt"))
            if val_auc > best_auc:
                best_auc = val_auc
                torch.save({"model": model.module.state_dict(), "epoch": epoch,
                            "val_auc": val_auc}, os.path.join(args.export_dir, "best.pt"))
                mlflow.log_metric("best_val_auc", best_auc, step=epoch)
        dist.barrier()

    if rank == 0:
        mlflow.end_run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
