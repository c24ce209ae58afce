"""Basset-style CNN on one-hot DNA (600 bp) predicting accessibility in 164 cell types.

Single node, one process per visible GPU, started with mp.spawn:

    python 03_dna_cnn_syncbn_spawn.py --h5 /data/basset/er.h5 --out runs/basset
"""
import argparse
import os
import socket

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--h5", required=True, help="file with train_in/train_out/valid_in/valid_out")
    ap.add_argument("--out", default="runs/basset")
    ap.add_argument("--batch_size", type=int, default=64, help="per GPU")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--workers", type=int, default=4)
    return ap.parse_args()


class H5Split(Dataset):
    """Opens the HDF5 file lazily so every DataLoader worker gets its own handle."""

    def __init__(self, path, split):
        self.path, self.split = path, split
        self.h5 = None
        with h5py.File(path, "r") as f:
            self.n = f[f"{split}_in"].shape[0]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.h5 is None:
            self.h5 = h5py.File(self.path, "r")
        x = self.h5[f"{self.split}_in"][i].astype(np.float32)  # (4, 1, 600) in the Basset files
        y = self.h5[f"{self.split}_out"][i].astype(np.float32)
        return torch.from_numpy(x).squeeze(1), torch.from_numpy(y), i


class Basset(nn.Module):
    def __init__(self, n_targets=164):
        super().__init__()

        def block(cin, cout, k, pool):
            return nn.Sequential(nn.Conv1d(cin, cout, k, padding=k // 2), nn.BatchNorm1d(cout),
                                 nn.ReLU(inplace=True), nn.MaxPool1d(pool))

        self.conv = nn.Sequential(block(4, 300, 19, 3), block(300, 200, 11, 4), block(200, 200, 7, 4))
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(200 * 12, 1000), nn.BatchNorm1d(1000), nn.ReLU(),
                                nn.Dropout(0.3), nn.Linear(1000, 1000), nn.BatchNorm1d(1000), nn.ReLU(),
                                nn.Dropout(0.3), nn.Linear(1000, n_targets))

    def forward(self, x):
        return self.fc(self.conv(x))


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@torch.no_grad()
def evaluate(model, loader, device, world_size, n_items):
    model.eval()
    preds, targets, idxs = [], [], []
    for x, y, i in loader:
        logits = model(x.to(device, non_blocking=True))
        preds.append(torch.sigmoid(logits).float())
        targets.append(y.to(device))
        idxs.append(i.to(device))
    preds, targets, idxs = torch.cat(preds), torch.cat(targets), torch.cat(idxs)
    # DistributedSampler pads so every rank has the same count -> equal shapes for all_gather
    out = []
    for t in (preds, targets, idxs):
        buf = [torch.empty_like(t) for _ in range(world_size)]
        dist.all_gather(buf, t)
        out.append(torch.cat(buf).cpu().numpy())
    p, y, i = out
    # drop the duplicated samples the sampler added for padding
    _, first = np.unique(i, return_index=True)
    p, y = p[first], y[first]
    assert len(p) == n_items
    keep = (y.sum(0) > 0) & (y.sum(0) < len(y))
    model.train()
    return roc_auc_score(y[:, keep], p[:, keep], average="macro"), \
        average_precision_score(y[:, keep], p[:, keep], average="macro")


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)

    train_ds, valid_ds = H5Split(args.h5, "train"), H5Split(args.h5, "valid")
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    valid_sampler = DistributedSampler(valid_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    valid_loader = DataLoader(valid_ds, batch_size=256, sampler=valid_sampler, num_workers=args.workers)

    model = Basset().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[rank])

    # linear scaling of the single-GPU rate (tuned at batch 64)
    lr = args.lr * world_size
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_loader), pct_start=0.1)
    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        running = torch.zeros(2, device=device)
        for x, y, _ in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)
        auroc, auprc = evaluate(model, valid_loader, device, world_size, len(valid_ds))
        if rank == 0:
            print(f"epoch {epoch:02d} train bce {running[0] / running[1]:.4f} "
                  f"valid auROC {auroc:.4f} auPRC {auprc:.4f}", flush=True)
            if auroc > best:
                best = auroc
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "auroc": auroc},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = get_args()
    os.makedirs(args.out, exist_ok=True)
    world_size = torch.cuda.device_count()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
