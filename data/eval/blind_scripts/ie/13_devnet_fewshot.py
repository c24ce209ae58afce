"""Deviation network (DevNet) with a few labelled defects, tablet-press line.

~2000 nominal tablet crops and ~40 labelled defect crops (chipped edge,
capping, contamination). The defects are split into a training part and a
validation part; validation also gets a fixed share of nominal crops.

    torchrun --nproc_per_node=4 devnet_train.py --root /data/tablets/press_b --n-val-defects 12
"""
import argparse
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", default="/data/tablets/models/devnet")
    p.add_argument("--n-val-defects", type=int, default=12)
    p.add_argument("--val-nominal-frac", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--steps-per-epoch", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=48, help="per GPU")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


train_tf = transforms.Compose([transforms.Resize((224, 224)), transforms.RandomRotation(180),
                               transforms.ColorJitter(0.15, 0.15), transforms.ToTensor(),
                               transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
eval_tf = transforms.Compose([transforms.Resize((224, 224)), transforms.ToTensor(),
                              transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])


class CropSet(Dataset):
    def __init__(self, items, tf):
        self.items, self.tf = items, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, y = self.items[i]
        return self.tf(Image.open(f).convert("RGB")), torch.tensor(y, dtype=torch.float32)


class BalancedDistributedSampler(torch.utils.data.Sampler):
    """Each batch is half nominal, half defect (defects re-drawn with replacement)."""

    def __init__(self, labels, batch_size, steps, rank, world, seed):
        self.normal = np.flatnonzero(np.asarray(labels) == 0)
        self.defect = np.flatnonzero(np.asarray(labels) == 1)
        self.batch_size, self.steps = batch_size, steps
        self.rank, self.world, self.seed, self.epoch = rank, world, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = np.random.default_rng(self.seed + 1000 * self.epoch + self.rank)
        for _ in range(self.steps):
            half = self.batch_size // 2
            batch = np.concatenate([rng.choice(self.normal, half), rng.choice(self.defect, self.batch_size - half)])
            yield from batch.tolist()

    def __len__(self):
        return self.steps * self.batch_size


class DevNet(nn.Module):
    def __init__(self):
        super().__init__()
        r = models.resnet50(weights=models.ResNet50_Weights.IMAGENET2K_V2)
        r.fc = nn.Identity()
        self.backbone = r
        self.score = nn.Sequential(nn.Linear(2048, 256), nn.ReLU(inplace=True), nn.Dropout(0.2), nn.Linear(256, 1))

    def forward(self, x):
        return self.score(self.backbone(x)).squeeze(1)


def deviation_loss(scores, y, ref_n=5000, margin=5.0):
    ref = torch.randn(ref_n, device=scores.device)
    dev = (scores - ref.mean()) / ref.std()
    inlier = torch.abs(dev)
    outlier = torch.clamp(margin - dev, min=0)
    return torch.mean((1 - y) * inlier + y * outlier)


def split_files(root, n_val_defects, val_nominal_frac):
    root = Path(root)
    nominal = sorted((root / "good").glob("*.png"))
    defects = sorted(f for d in sorted(root.iterdir()) if d.is_dir() and d.name != "good" for f in d.glob("*.png"))
    random.shuffle(nominal)
    random.shuffle(defects)
    n_val_nom = int(len(nominal) * val_nominal_frac)
    val = [(f, 0) for f in nominal[:n_val_nom]] + [(f, 1) for f in defects[:n_val_defects]]
    train = [(f, 0) for f in nominal[n_val_nom:]] + [(f, 1) for f in defects[n_val_defects:]]
    return train, val


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different augmentation streams per rank
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    train_items, val_items = split_files(args.root, args.n_val_defects, args.val_nominal_frac)
    train_ds, val_ds = CropSet(train_items, train_tf), CropSet(val_items, eval_tf)
    sampler = BalancedDistributedSampler([y for _, y in train_items], args.batch_size, args.steps_per_epoch,
                                         rank, world, args.seed)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4)
    if rank == 0:
        n_def = sum(y for _, y in train_items)
        print(f"train: {len(train_items) - n_def} nominal / {n_def} defect, val: {len(val_items)} crops")

    model = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(DevNet()).to(device), device_ids=[local_rank])
    optimizer = torch.optim.RMSprop(model.parameters(), lr=args.lr, weight_decay=1e-5)

    out_dir = Path(args.out)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    best_ap = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = deviation_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)

        model.eval()
        preds = []
        with torch.no_grad():
            for x, y in val_loader:
                preds.append(torch.stack([model.module(x.to(device)), y.to(device)], 1))
        preds = torch.cat(preds)
        gathered = [torch.empty_like(preds) for _ in range(world)]
        dist.all_gather(gathered, preds)
        if rank == 0:
            # DistributedSampler pads with the first few samples; cut back to the real size
            allp = torch.stack(gathered, 1).reshape(-1, 2)[: len(val_ds)].cpu().numpy()
            auroc = roc_auc_score(allp[:, 1], allp[:, 0])
            ap = average_precision_score(allp[:, 1], allp[:, 0])
            print(f"epoch {epoch} loss {(running[0] / running[1]).item():.4f} val AUROC {auroc:.4f} "
                  f"AP {ap:.4f} ({time.time() - t0:.0f}s)")
            if ap > best_ap:
                best_ap = ap
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_ap": ap,
                            "val_files": [str(f) for f, _ in val_items]}, out_dir / "devnet_best.pt")
        dist.barrier()

    if rank == 0:
        json.dump({"best_val_ap": best_ap}, open(out_dir / "summary.json", "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
