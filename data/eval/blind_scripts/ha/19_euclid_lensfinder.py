"""Strong-lens finder for Euclid-like VIS + NISP (Y, J, H) cutouts.

Training set: simulated lenses injected into real LRG cutouts (positives) and
non-lensed galaxies (negatives), both stored in lens_sims_v3.h5 as
images [N, 4, 100, 100] and is_lens [N].

    torchrun --nproc_per_node=4 19_euclid_lensfinder.py --h5 /data/euclid/lens_sims_v3.h5 --out runs/lensfinder
"""
import argparse
import os
import random

import h5py
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset, random_split
from torch.utils.data.distributed import DistributedSampler


class LensCutouts(Dataset):
    def __init__(self, path, augment=True):
        self.path = path
        self.augment = augment
        with h5py.File(path, "r") as f:
            self.labels = f["is_lens"][:].astype(np.float32)
        self.h5 = None

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        if self.h5 is None:
            self.h5 = h5py.File(self.path, "r")
        img = torch.from_numpy(self.h5["images"][idx].astype(np.float32))
        # per-band robust scaling
        med = img.flatten(1).median(1).values[:, None, None]
        mad = (img - med).abs().flatten(1).median(1).values[:, None, None] + 1e-6
        img = torch.clamp((img - med) / (1.4826 * mad), -5, 50)
        if self.augment:
            img = torch.rot90(img, random.randint(0, 3), dims=(1, 2))
            if random.random() < 0.5:
                img = torch.flip(img, dims=(2,))
        return img, torch.tensor(self.labels[idx])


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return local_rank, dist.get_rank(), dist.get_world_size()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_datasets(path, val_frac):
    full = LensCutouts(path, augment=True)
    n_val = int(val_frac * len(full))
    train_set, val_set = random_split(full, [len(full) - n_val, n_val])
    return train_set, val_set


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--h5", required=True)
    p.add_argument("--out", default="runs/lensfinder")
    p.add_argument("--arch", default="resnet34")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=3)
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    scores, labels = [], []
    for img, y in loader:
        scores.append(torch.sigmoid(model(img.to(device, non_blocking=True)).squeeze(1)))
        labels.append(y.to(device))
    local = (torch.cat(scores).cpu().numpy(), torch.cat(labels).cpu().numpy())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    s = np.concatenate([g[0] for g in gathered])
    y = np.concatenate([g[1] for g in gathered])
    tpr_at = {}
    for fpr_target in (1e-3, 1e-2):
        thr = np.quantile(s[y == 0], 1 - fpr_target)
        tpr_at[fpr_target] = float((s[y == 1] > thr).mean())
    return roc_auc_score(y, s), tpr_at


def main():
    args = parse()
    local_rank, rank, world = setup()
    device = torch.device("cuda", local_rank)
    # different augmentation stream on every rank
    seed_everything(args.seed + rank)

    train_set, val_set = build_datasets(args.h5, args.val_frac)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_shard = Subset(val_set, list(range(rank, len(val_set), world)))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_shard, batch_size=256, shuffle=False, num_workers=4, pin_memory=True)

    model = timm.create_model(args.arch, pretrained=False, in_chans=4, num_classes=1)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    n_pos = float(np.sum(train_set.dataset.labels[train_set.indices]))
    pos_weight = torch.tensor((len(train_set) - n_pos) / max(n_pos, 1.0), device=device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(train_set)} (lenses {int(n_pos)}), val {len(val_set)}", flush=True)

    best_auc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for img, y in train_loader:
            img, y = img.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(img).squeeze(1), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += torch.stack([loss.detach(), torch.ones_like(loss)])
        sched.step()
        dist.all_reduce(loss_sum)

        auc, tpr_at = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch:03d} loss {(loss_sum[0] / loss_sum[1]).item():.4f} val AUC {auc:.4f} "
                  f"TPR@FPR=1e-3 {tpr_at[1e-3]:.3f} TPR@FPR=1e-2 {tpr_at[1e-2]:.3f}", flush=True)
            if auc > best_auc:
                best_auc = auc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "auc": auc},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
