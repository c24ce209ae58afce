"""DeepFM on Criteo-Kaggle (display advertising challenge), DDP on one 8-GPU node.

    torchrun --standalone --nproc_per_node=8 19_deepfm_eval_auc.py --data /data/criteo_kaggle/parquet
"""
import argparse
import glob
import logging
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import log_loss, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DENSE = [f"I{i}" for i in range(1, 14)]
SPARSE = [f"C{i}" for i in range(1, 27)]

log = logging.getLogger("deepfm")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/criteo_kaggle/parquet")
    ap.add_argument("--embed-dim", type=int, default=16)
    ap.add_argument("--mlp", default="400,400,400")
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--l2", type=float, default=1e-6)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--out", default="ckpt/deepfm")
    return ap.parse_args()


class CriteoParquet(Dataset):
    def __init__(self, files):
        tables = [pq.read_table(f, columns=DENSE + SPARSE + ["label"]) for f in files]
        self.dense = np.concatenate([np.stack([t[c].to_numpy() for c in DENSE], 1) for t in tables]).astype(np.float32)
        self.sparse = np.concatenate([np.stack([t[c].to_numpy() for c in SPARSE], 1) for t in tables]).astype(np.int64)
        self.label = np.concatenate([t["label"].to_numpy() for t in tables]).astype(np.float32)

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return self.dense[i], self.sparse[i], self.label[i]


class DeepFM(nn.Module):
    def __init__(self, field_dims, dense_dim, k, mlp):
        super().__init__()
        self.offsets = nn.Parameter(torch.tensor(np.concatenate([[0], np.cumsum(field_dims)[:-1]])), requires_grad=False)
        total = int(sum(field_dims))
        self.lin = nn.Embedding(total, 1)
        self.emb = nn.Embedding(total, k)
        self.dense_lin = nn.Linear(dense_dim, 1)
        self.dense_proj = nn.Linear(dense_dim, k)
        nn.init.xavier_uniform_(self.emb.weight)
        layers, c = [], (len(field_dims) + 1) * k
        for h in mlp:
            layers += [nn.Linear(c, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(0.2)]
            c = h
        layers.append(nn.Linear(c, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, dense, sparse):
        idx = sparse + self.offsets
        e = torch.cat([self.emb(idx), self.dense_proj(dense).unsqueeze(1)], 1)  # B F+1 k
        first = self.lin(idx).sum(1) + self.dense_lin(dense)
        fm = 0.5 * (e.sum(1).pow(2) - e.pow(2).sum(1)).sum(1, keepdim=True)
        deep = self.mlp(e.flatten(1))
        return (first + fm + deep).squeeze(1)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    ps, ys = [], []
    for d, s, y in loader:
        ps.append(torch.sigmoid(model(d.to(device), s.to(device))).cpu())
        ys.append(y)
    model.train()
    p, y = torch.cat(ps).numpy(), torch.cat(ys).numpy()
    return roc_auc_score(y, p), log_loss(y, np.clip(p, 1e-7, 1 - 1e-7))


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(message)s")

    field_dims = np.load(os.path.join(args.data, "field_dims.npy")).tolist()
    files = sorted(glob.glob(os.path.join(args.data, "part-*.parquet")))
    n_val = max(1, len(files) // 10)
    train_ds, val_ds = CriteoParquet(files[:-n_val]), CriteoParquet(files[-n_val:])
    # log-transform of counts done once here so workers do not repeat it
    for ds in (train_ds, val_ds):
        ds.dense = np.log1p(np.maximum(ds.dense, 0))

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=8192, sampler=val_sampler, num_workers=4, pin_memory=True)

    model = DeepFM(field_dims, len(DENSE), args.embed_dim, [int(x) for x in args.mlp.split(",")])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.l2)
    crit = nn.BCEWithLogitsLoss()

    best_auc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (d, s, y) in enumerate(train_loader):
            d, s, y = d.to(device, non_blocking=True), s.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = crit(model(d, s), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if i % 1000 == 0:
                log.info("epoch %d iter %d/%d loss %.5f", epoch, i, len(train_loader), loss.item())

        auc, ll = evaluate(model.module, val_loader, device)
        log.info("epoch %d val AUC %.5f logloss %.5f (%.0fs)", epoch, auc, ll, time.time() - t0)
        if rank == 0 and auc > best_auc:
            best_auc = auc
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "auc": auc},
                       os.path.join(args.out, "best.pt"))
        dist.barrier()

    log.info("best val AUC %.5f", best_auc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
