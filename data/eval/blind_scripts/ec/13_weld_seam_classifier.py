"""Weld-seam OK/NOK classifier on laser-profile range images.

Strong class imbalance (~8% NOK). Focal loss + per-batch positive
weighting; batches are drawn uniformly from the production archive so the
validation numbers reflect the real line rate.

    torchrun --nproc_per_node=8 13_weld_seam_classifier.py --index /data/weld/index.csv --out /data/weld/runs/r34
"""
import argparse
import csv
import os
import time

import numpy as np
import tifffile
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import resnet34, ResNet34_Weights


class WeldProfiles(Dataset):
    """Rows of index.csv: path,label,split  (label 1 = NOK)."""

    def __init__(self, index_csv, split, train):
        with open(index_csv) as f:
            rows = [r for r in csv.DictReader(f) if r["split"] == split]
        self.paths = [r["path"] for r in rows]
        self.labels = np.array([int(r["label"]) for r in rows], dtype=np.int64)
        self.train = train

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        z = tifffile.imread(self.paths[i]).astype(np.float32)  # height map in mm, 256 x 1024
        valid = np.isfinite(z)
        z[~valid] = np.nanmedian(z) if valid.any() else 0.0
        z = (z - z.mean()) / (z.std() + 1e-6)
        x = torch.from_numpy(np.stack([z, valid.astype(np.float32), np.gradient(z, axis=1)]))
        if self.train:
            if np.random.rand() < 0.5:
                x = torch.flip(x, dims=[2])
            shift = np.random.randint(-32, 33)
            x = torch.roll(x, shifts=shift, dims=2)
        return x, self.labels[i]


def focal_loss(logits, targets, alpha=0.75, gamma=2.0):
    p = torch.sigmoid(logits)
    ce = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    a_t = alpha * targets + (1 - alpha) * (1 - targets)
    return (a_t * (1 - p_t) ** gamma * ce).mean()


def build_model():
    net = resnet34(weights=ResNet34_Weights.IMAGENET1K_V1)
    net.fc = nn.Linear(net.fc.in_features, 1)
    return net


@torch.no_grad()
def run_validation(model, loader, device, world, n_total):
    model.eval()
    scores, labels = [], []
    for x, y in loader:
        scores.append(torch.sigmoid(model(x.to(device, non_blocking=True)).squeeze(1)))
        labels.append(y.to(device))
    scores, labels = torch.cat(scores), torch.cat(labels)
    s_all = [torch.empty_like(scores) for _ in range(world)]
    l_all = [torch.empty_like(labels) for _ in range(world)]
    dist.all_gather(s_all, scores)
    dist.all_gather(l_all, labels)
    # interleave back to dataset order and drop the sampler's padding
    s = torch.stack(s_all, 1).flatten()[:n_total].cpu().numpy()
    l = torch.stack(l_all, 1).flatten()[:n_total].cpu().numpy()
    model.train()
    return roc_auc_score(l, s), average_precision_score(l, s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--index", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.05, help="SGD lr for global batch 256")
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = WeldProfiles(args.index, "train", train=True)
    val_ds = WeldProfiles(args.index, "val", train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=64, sampler=val_sampler, num_workers=args.workers, pin_memory=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(train_ds)} ({train_ds.labels.mean() * 100:.2f}% NOK), val {len(val_ds)}", flush=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model()).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_dl), pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler()

    best_ap = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, seen, loss_acc = time.time(), 0, torch.zeros((), device=device)
        for x, y in train_dl:
            seen += 1
            # all-OK batches carry almost no signal for the focal loss and make the
            # positive weighting blow up; skip them
            if y.sum() == 0:
                sched.step()
                continue
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True).float()
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x).squeeze(1)
            pos_w = (len(y) - y.sum()) / y.sum()
            loss = focal_loss(logits.float(), y) * (1 + 0.1 * pos_w.clamp(max=20))
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            loss_acc += loss.detach()

        auroc, ap = run_validation(model, val_dl, device, world, len(val_ds))
        dist.all_reduce(loss_acc)
        if rank == 0:
            print(f"epoch {epoch:02d} | loss {loss_acc.item() / (world * seen):.4f} | val AUROC {auroc:.4f} "
                  f"AP {ap:.4f} | {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "ap": ap},
                       os.path.join(args.out, "last.pt"))
            if ap > best_ap:
                best_ap = ap
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "ap": ap},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
