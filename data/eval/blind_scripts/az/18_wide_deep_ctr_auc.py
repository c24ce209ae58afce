"""Wide & Deep CTR model on a Criteo-style day split (13 dense + 26 categorical).

Keras original compiled with metrics=[tf.keras.metrics.AUC(), "binary_crossentropy"];
the AUC class below keeps the same thresholded-histogram approximation
(num_thresholds=200) so numbers are comparable with the old dashboards.

    torchrun --nproc_per_node=4 18_wide_deep_ctr_auc.py --train data/criteo/day_0_train.npz --val data/criteo/day_0_val.npz
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--hash-buckets", type=int, default=100_000)
    p.add_argument("--embed-dim", type=int, default=16)
    p.add_argument("--deep", default="512,256,128")
    p.add_argument("--batch-size", type=int, default=8192, help="per replica")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out", default="runs/wide_deep")
    return p.parse_args()


def load_npz(path, buckets):
    d = np.load(path)
    dense = np.log1p(np.clip(d["dense"].astype(np.float32), 0, None))
    cat = (d["cat"].astype(np.int64) % buckets)
    return TensorDataset(torch.from_numpy(dense), torch.from_numpy(cat), torch.from_numpy(d["label"].astype(np.float32)))


class WideDeep(nn.Module):
    def __init__(self, n_dense, n_cat, buckets, dim, deep):
        super().__init__()
        self.wide = nn.EmbeddingBag(n_cat * buckets, 1, mode="sum")
        self.emb = nn.ModuleList([nn.Embedding(buckets, dim) for _ in range(n_cat)])
        layers, d_in = [], n_dense + n_cat * dim
        for h in deep:
            layers += [nn.Linear(d_in, h), nn.ReLU(), nn.Dropout(0.1)]
            d_in = h
        layers.append(nn.Linear(d_in, 1))
        self.deep = nn.Sequential(*layers)
        self.wide_dense = nn.Linear(n_dense, 1)
        self.buckets = buckets
        self.register_buffer("offsets", torch.arange(n_cat) * buckets, persistent=False)

    def forward(self, dense, cat):
        wide = self.wide(cat + self.offsets) + self.wide_dense(dense)
        deep_in = torch.cat([dense] + [e(cat[:, i]) for i, e in enumerate(self.emb)], dim=1)
        return (wide + self.deep(deep_in)).squeeze(1)


class AUC:
    """Approximate ROC AUC from confusion counts at fixed thresholds (tf.keras.metrics.AUC)."""

    def __init__(self, device, num_thresholds=200):
        eps = 1e-7
        self.thresholds = torch.cat([torch.tensor([-eps]), torch.linspace(0, 1, num_thresholds - 2)[1:-1],
                                     torch.tensor([1 + eps])]).to(device)
        self.reset_state()

    def reset_state(self):
        n = self.thresholds.numel()
        dev = self.thresholds.device
        self.tp, self.fp = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
        self.tn, self.fn = torch.zeros(n, device=dev), torch.zeros(n, device=dev)

    def update_state(self, y_true, y_prob):
        pred = y_prob[None, :] > self.thresholds[:, None]
        pos = y_true[None, :] > 0.5
        self.tp += (pred & pos).sum(1)
        self.fp += (pred & ~pos).sum(1)
        self.fn += (~pred & pos).sum(1)
        self.tn += (~pred & ~pos).sum(1)

    def result(self):
        tpr = self.tp / (self.tp + self.fn).clamp(min=1)
        fpr = self.fp / (self.fp + self.tn).clamp(min=1)
        # thresholds ascending -> fpr descending; trapezoid rule
        return torch.trapz(tpr.flip(0), fpr.flip(0)).item()


class Mean:
    def __init__(self, device):
        self.s = torch.zeros(2, device=device)

    def reset_state(self):
        self.s.zero_()

    def update_state(self, value, n):
        self.s += torch.stack([value.detach() * n, torch.tensor(float(n), device=self.s.device)])

    def result(self):
        return (self.s[0] / self.s[1].clamp(min=1)).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds = load_npz(args.train, args.hash_buckets)
    val_ds = load_npz(args.val, args.hash_buckets)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, drop_last=True,
                          num_workers=4, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=32768, sampler=val_sampler, num_workers=4, pin_memory=True)

    n_dense, n_cat = train_ds.tensors[0].shape[1], train_ds.tensors[1].shape[1]
    net = WideDeep(n_dense, n_cat, args.hash_buckets, args.embed_dim, [int(h) for h in args.deep.split(",")])
    model = DDP(net.to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    bce = nn.BCEWithLogitsLoss()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train={len(train_ds):,} val={len(val_ds):,} params={sum(p.numel() for p in net.parameters()):,} "
              f"replicas={world}", flush=True)

    train_loss, val_loss, val_auc = Mean(device), Mean(device), AUC(device)
    best_auc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        train_loss.reset_state()
        t0 = time.time()
        for step, (dense, cat, y) in enumerate(train_dl):
            dense, cat, y = dense.to(device, non_blocking=True), cat.to(device, non_blocking=True), y.to(device)
            loss = bce(model(dense, cat), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            train_loss.update_state(loss, y.numel())
            if rank == 0 and step % 500 == 0:
                print(f"  epoch {epoch + 1} step {step}/{len(train_dl)} loss {loss.item():.5f}", flush=True)
        dist.all_reduce(train_loss.s)

        model.eval()
        val_loss.reset_state()
        val_auc.reset_state()
        with torch.no_grad():
            for dense, cat, y in val_dl:
                dense, cat, y = dense.to(device, non_blocking=True), cat.to(device, non_blocking=True), y.to(device)
                logits = model(dense, cat)
                val_loss.update_state(bce(logits, y), y.numel())
                val_auc.update_state(y, torch.sigmoid(logits))
        logs = {"loss": train_loss.result(), "val_loss": val_loss.result(), "val_auc": val_auc.result()}

        if rank == 0:
            print(f"Epoch {epoch + 1}/{args.epochs} ({time.time() - t0:.0f}s) "
                  + " - ".join(f"{k}: {v:.5f}" for k, v in logs.items()), flush=True)
            if logs["val_auc"] > best_auc:
                best_auc = logs["val_auc"]
                torch.save({"model": net.state_dict(), "epoch": epoch, "val_auc": best_auc},
                           os.path.join(args.out, "wide_deep_best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
