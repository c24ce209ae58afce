#!/usr/bin/env python
"""Content-aware blind IQA on KonIQ-10k.

ResNet-50 multi-level features -> quality regressor, trained with L1 + in-batch
pairwise ranking loss. Evaluated with five-crop averaging, SRCC / PLCC over the
full validation split.

    torchrun --nproc_per_node=4 01_koniq_hyper_regressor.py --data-root /data/koniq10k
"""
import argparse
import json
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from scipy import stats
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--csv", default="koniq10k_scores_and_distributions.csv")
    p.add_argument("--out-dir", default="runs/koniq_hyper")
    p.add_argument("--train-ratio", type=float, default=0.8)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=24, help="per GPU")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--head-lr-mult", type=float, default=10.0)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--rank-weight", type=float, default=0.5)
    p.add_argument("--crop", type=int, default=384)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=2023)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def split_koniq(csv_path, train_ratio):
    df = pd.read_csv(csv_path)
    names = df["image_name"].tolist()
    random.shuffle(names)
    n_train = int(len(names) * train_ratio)
    train_names = set(names[:n_train])
    train_df = df[df["image_name"].isin(train_names)].reset_index(drop=True)
    val_df = df[~df["image_name"].isin(train_names)].reset_index(drop=True)
    return train_df, val_df


class KonIQ(Dataset):
    def __init__(self, root, df, transform, mos_range=(1.0, 5.0)):
        self.root = root
        self.names = df["image_name"].tolist()
        lo, hi = mos_range
        self.mos = ((df["MOS"].values - lo) / (hi - lo)).astype(np.float32)
        self.transform = transform

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, "1024x768", self.names[i])).convert("RGB")
        return self.transform(img), torch.tensor(self.mos[i]), i


class MultiLevelIQA(nn.Module):
    def __init__(self):
        super().__init__()
        r = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V2)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1)
        self.layer2, self.layer3, self.layer4 = r.layer2, r.layer3, r.layer4
        self.proj2 = nn.Conv2d(512, 128, 1)
        self.proj3 = nn.Conv2d(1024, 256, 1)
        self.head = nn.Sequential(
            nn.Linear(128 + 256 + 2048, 512), nn.GELU(), nn.Dropout(0.2), nn.Linear(512, 1)
        )

    def forward(self, x):
        x = self.stem(x)
        f2 = self.layer2(x)
        f3 = self.layer3(f2)
        f4 = self.layer4(f3)
        g = torch.cat([
            F.adaptive_avg_pool2d(self.proj2(f2), 1).flatten(1),
            F.adaptive_avg_pool2d(self.proj3(f3), 1).flatten(1),
            F.adaptive_avg_pool2d(f4, 1).flatten(1),
        ], dim=1)
        return self.head(g).squeeze(-1)


def pairwise_rank_loss(pred, mos, margin=0.0):
    dp = pred.unsqueeze(1) - pred.unsqueeze(0)
    dm = mos.unsqueeze(1) - mos.unsqueeze(0)
    mask = dm.abs() > 1e-3
    if mask.sum() == 0:
        return pred.sum() * 0.0
    return F.relu(margin - torch.sign(dm[mask]) * dp[mask]).mean()


@torch.no_grad()
def evaluate(model, loader, device, n_total):
    model.eval()
    preds, moss, idxs = [], [], []
    for crops, mos, idx in loader:
        b, n = crops.shape[:2]
        crops = crops.to(device, non_blocking=True).flatten(0, 1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(crops).float().view(b, n).mean(1)
        preds.append(out)
        moss.append(mos.to(device))
        idxs.append(idx.to(device))
    local = torch.stack([torch.cat(preds), torch.cat(moss), torch.cat(idxs).float()], 0)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    allv = torch.cat(gathered, 1).cpu().numpy()
    _, keep = np.unique(allv[2].astype(np.int64), return_index=True)
    p, m = allv[0][keep], allv[1][keep]
    assert len(p) == n_total
    srcc = stats.spearmanr(p, m)[0]
    plcc = stats.pearsonr(p, m)[0]
    return float(srcc), float(plcc)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different augmentation stream on every rank
    seed_everything(args.seed + rank)

    train_df, val_df = split_koniq(os.path.join(args.data_root, args.csv), args.train_ratio)
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomCrop(args.crop),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        norm,
    ])
    val_tf = transforms.Compose([
        transforms.FiveCrop(args.crop),
        transforms.Lambda(lambda cs: torch.stack([norm(transforms.functional.to_tensor(c)) for c in cs])),
    ])
    train_ds = KonIQ(args.data_root, train_df, train_tf)
    val_ds = KonIQ(args.data_root, val_df, val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=8, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = MultiLevelIQA()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    backbone_params = [p for n, p in model.named_parameters() if not n.startswith(("head", "proj"))]
    head_params = [p for n, p in model.named_parameters() if n.startswith(("head", "proj"))]
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW([
        {"params": backbone_params, "lr": args.lr},
        {"params": head_params, "lr": args.lr * args.head_lr_mult},
    ], weight_decay=args.weight_decay)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=[args.lr, args.lr * args.head_lr_mult], total_steps=total_steps, pct_start=0.05)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"train={len(train_ds)} val={len(val_ds)} world={world}", flush=True)

    best_srcc = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for step, (img, mos, _) in enumerate(train_loader):
            img = img.to(device, non_blocking=True)
            mos = mos.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(img).float()
            loss = F.l1_loss(pred, mos) + args.rank_weight * pairwise_rank_loss(pred, mos, margin=0.05)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            loss_sum[0] += loss.detach()
            loss_sum[1] += 1

        dist.all_reduce(loss_sum)
        srcc, plcc = evaluate(model, val_loader, device, len(val_ds))
        if rank == 0:
            log = {"epoch": epoch, "loss": (loss_sum[0] / loss_sum[1]).item(),
                   "srcc": srcc, "plcc": plcc, "time": time.time() - t0}
            print(json.dumps(log), flush=True)
            with open(os.path.join(args.out_dir, "log.jsonl"), "a") as f:
                f.write(json.dumps(log) + "\n")
            state = {"model": model.module.state_dict(), "epoch": epoch, "srcc": srcc, "plcc": plcc}
            torch.save(state, os.path.join(args.out_dir, "last.pth"))
            if srcc > best_srcc:
                best_srcc = srcc
                torch.save(state, os.path.join(args.out_dir, "best.pth"))
        dist.barrier()

    if rank == 0:
        print(f"best SRCC {best_srcc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
