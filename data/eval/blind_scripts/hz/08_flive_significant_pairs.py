"""Rank-only training on FLIVE (PaQ-2-PiQ) with statistically significant pairs.

Only pairs whose MOS difference is significant given the per-image rating
spread (z-test on mean opinion scores) are used, which keeps rater noise out of
the ranking loss. There is no regression term, so the output is an uncalibrated
quality score; SRCC/KRCC on the test split are what we track.

    torchrun --nproc_per_node=8 08_flive_significant_pairs.py --csv /data/flive/labels_image.csv \
        --img-dir /data/flive/images
"""
import argparse
import math
import os
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from scipy.stats import kendalltau, spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


class FLIVE(Dataset):
    def __init__(self, img_dir, df, size, train):
        self.img_dir = img_dir
        self.names = df["name_image"].tolist()
        self.mos = df["mos"].values.astype(np.float32)
        self.std = df["std"].values.astype(np.float32)
        self.n = df["n_ratings"].values.astype(np.float32)
        ops = [T.RandomResizedCrop(size, scale=(0.4, 1.0)), T.RandomHorizontalFlip()] if train \
            else [T.Resize(size), T.CenterCrop(size)]
        self.tf = T.Compose(ops + [T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_dir, self.names[i])).convert("RGB")
        return self.tf(img), self.mos[i], self.std[i], self.n[i], i


def significant_pairs(mos, std, n, z_thresh):
    i, j = torch.triu_indices(len(mos), len(mos), 1, device=mos.device)
    se = torch.sqrt(std[i] ** 2 / n[i] + std[j] ** 2 / n[j]).clamp(min=1e-6)
    z = (mos[i] - mos[j]) / se
    keep = z.abs() > z_thresh
    return i[keep], j[keep], torch.sign(z[keep])


def pair_loss(score, i, j, sign, margin):
    return F.relu(margin - sign * (score[i] - score[j])).mean()


@torch.no_grad()
def evaluate(model, loader, device, n_total):
    model.eval()
    parts = []
    for img, mos, _, _, idx in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            s = model(img.to(device, non_blocking=True)).float().squeeze(-1)
        parts.append(torch.stack([s, mos.to(device), idx.to(device).float()], 1))
    parts = torch.cat(parts)
    world = dist.get_world_size()
    out = [torch.empty_like(parts) for _ in range(world)]
    dist.all_gather(out, parts)
    arr = torch.cat(out).cpu().numpy()
    _, keep = np.unique(arr[:, 2].astype(np.int64), return_index=True)
    arr = arr[keep]
    assert len(arr) == n_total, (len(arr), n_total)
    model.train()
    return spearmanr(arr[:, 0], arr[:, 1])[0], kendalltau(arr[:, 0], arr[:, 1])[0]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--img-dir", required=True)
    p.add_argument("--arch", default="swin_tiny_patch4_window7_224.ms_in22k_ft_in1k")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--lr", type=float, default=4e-5)
    p.add_argument("--z", type=float, default=1.96)
    p.add_argument("--margin", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="ckpt/flive_rank")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    df = pd.read_csv(args.csv)
    train_df = df[df["set"] == "training"].reset_index(drop=True)
    test_df = df[df["set"] == "test"].reset_index(drop=True)
    train_ds = FLIVE(args.img_dir, train_df, args.size, train=True)
    test_ds = FLIVE(args.img_dir, test_df, args.size, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=3, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_ds, batch_size=64, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.arch, pretrained=True, num_classes=1).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.02)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_ds)} train / {len(test_ds)} test images, {world} GPUs", flush=True)

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(3, device=device)  # loss sum, steps, pairs
        for step, (img, mos, std, n, _) in enumerate(loader):
            mos, std, n = mos.to(device), std.to(device), n.to(device)
            pi, pj, sign = significant_pairs(mos, std, n, args.z)
            if pi.numel() == 0:
                continue
            img = img.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                score = model(img).float().squeeze(-1)
            loss = pair_loss(score, pi, pj, sign, args.margin)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            optimizer.step()
            sched.step()
            tot += torch.tensor([loss.item(), 1.0, float(pi.numel())], device=device)
            if rank == 0 and step % 100 == 0:
                print(f"  ep {epoch} step {step} loss {loss.item():.4f} pairs {pi.numel()}", flush=True)

        dist.all_reduce(tot)
        srcc, krcc = evaluate(model, test_loader, device, len(test_ds))
        if rank == 0:
            print(f"epoch {epoch}: loss {tot[0] / tot[1]:.4f} pairs/step {tot[2] / tot[1]:.1f} "
                  f"SRCC {srcc:.4f} KRCC {krcc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "srcc": srcc},
                       os.path.join(args.out, "last.pth"))
            if srcc > best:
                best = srcc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "srcc": srcc},
                           os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
