"""Rice blast (leaf/neck) detection from UAV plot images with per-field reporting.

The breeders want the val accuracy broken down by field, since the
disease pressure differs a lot between sites; overall accuracy alone hides
the sites where the model fails.

    torchrun --nproc_per_node=4 19_rice_blast_per_field_eval.py --meta /data/blast/meta.csv --images /data/blast/img
"""
import argparse
import json
import os
import time
from collections import defaultdict

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from timm.data import create_transform
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["healthy", "leaf_blast", "neck_blast"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--meta", required=True, help="csv: image, field, season, label, split")
    ap.add_argument("--images", required=True)
    ap.add_argument("--arch", default="regnety_016")
    ap.add_argument("--img-size", type=int, default=288)
    ap.add_argument("--epochs", type=int, default=35)
    ap.add_argument("--batch-size", type=int, default=48)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="runs/blast")
    return ap.parse_args()


class BlastPlots(Dataset):
    def __init__(self, df, root, tf):
        self.df = df.reset_index(drop=True)
        self.root = root
        self.tf = tf
        self.label_idx = {c: i for i, c in enumerate(CLASSES)}

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        img = Image.open(os.path.join(self.root, r.image)).convert("RGB")
        return self.tf(img), self.label_idx[r.label], r.field


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    overall = torch.zeros(2, device=device)
    per_field = defaultdict(lambda: torch.zeros(2, device=device))
    for x, y, fields in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = net(x).argmax(1)
        hit = (pred == y).float()
        overall += torch.stack([hit.sum(), torch.tensor(float(len(y)), device=device)])
        for f, h in zip(fields, hit):
            per_field[f] += torch.stack([h, torch.ones((), device=device)])
    dist.all_reduce(overall)
    for f in sorted(per_field):
        dist.all_reduce(per_field[f])
    acc = (overall[0] / overall[1]).item()
    field_acc = {f: (v[0] / v[1]).item() for f, v in per_field.items()}
    return acc, field_acc


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(rank)

    meta = pd.read_csv(args.meta)
    train_tf = create_transform(args.img_size, is_training=True, auto_augment="rand-m7-mstd0.5",
                                re_prob=0.2, vflip=0.5, scale=(0.4, 1.0))
    val_tf = create_transform(args.img_size, is_training=False, crop_pct=1.0)
    train_ds = BlastPlots(meta[meta.split == "train"], args.images, train_tf)
    val_ds = BlastPlots(meta[meta.split == "val"].sort_values(["field", "image"]), args.images, val_tf)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    # val images are stored field by field; contiguous chunks keep each rank's reads in few folders
    val_chunk = np.array_split(np.arange(len(val_ds)), world)[rank].tolist()
    val_loader = DataLoader(Subset(val_ds, val_chunk), batch_size=96, num_workers=args.workers, pin_memory=True)

    net = timm.create_model(args.arch, pretrained=True, num_classes=len(CLASSES), drop_rate=0.2)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world, momentum=0.9, weight_decay=5e-5,
                                nesterov=True)
    iters = len(train_loader)
    warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=2 * iters)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=(args.epochs - 2) * iters)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, cos], milestones=[2 * iters])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, y, _ in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            run += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(run)

        acc, field_acc = evaluate(net, val_loader, device)
        if rank == 0:
            worst = min(field_acc, key=field_acc.get)
            print(f"epoch {epoch} loss {(run[0] / run[1]).item():.4f} val acc {acc:.4f} "
                  f"worst field {worst} ({field_acc[worst]:.3f}) [{time.time() - t0:.0f}s]", flush=True)
            with open(os.path.join(args.out, "per_field.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "acc": acc, "fields": field_acc}) + "\n")
            if acc > best:
                best = acc
                torch.save({"model": net.state_dict(), "arch": args.arch, "epoch": epoch, "acc": acc},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
