# Severstal steel defect segmentation (4 classes, multilabel masks)
# smp Unet / FPN + SyncBN, defect-oversampling sampler, AMP, grad accumulation, resume
#
#   torchrun --nproc_per_node=4 09_severstal_unet_syncbn.py --fold 0 --arch Unet --encoder efficientnet-b4
#   (resume) ... --resume runs/Unet_efficientnet-b4_f0/last.pth
import os
import math
import time
import argparse

import cv2
import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader, Sampler
from torch.nn.parallel import DistributedDataParallel as DDP
import albumentations as A
import segmentation_models_pytorch as smp

H, W = 256, 1600


def rle2mask(rle, h=H, w=W):
    m = np.zeros(h * w, dtype=np.uint8)
    if isinstance(rle, str):
        s = list(map(int, rle.split()))
        for st, ln in zip(s[0::2], s[1::2]):
            m[st - 1:st - 1 + ln] = 1
    return m.reshape(w, h).T


class SteelDS(Dataset):
    def __init__(self, df, img_dir, aug=None):
        self.df = df.reset_index(drop=True)
        self.img_dir = img_dir
        self.aug = aug

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        img = cv2.imread(os.path.join(self.img_dir, r.ImageId))
        mask = np.stack([rle2mask(r[f"e{c}"]) for c in range(1, 5)], -1)
        if self.aug:
            o = self.aug(image=img, mask=mask)
            img, mask = o["image"], o["mask"]
        img = torch.from_numpy(img.transpose(2, 0, 1).astype(np.float32) / 255.0)
        mask = torch.from_numpy(mask.transpose(2, 0, 1).astype(np.float32))
        return img, mask


class DistributedOversampler(Sampler):
    """Draws a weighted epoch (same draw on every rank) and gives each rank its slice."""

    def __init__(self, weights, num_replicas, rank, num_samples=None, seed=0):
        self.w = torch.as_tensor(weights, dtype=torch.double)
        self.num_replicas = num_replicas
        self.rank = rank
        total = num_samples or len(weights)
        self.per_rank = total // num_replicas
        self.total = self.per_rank * num_replicas
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        idx = torch.multinomial(self.w, self.total, replacement=True, generator=g).tolist()
        return iter(idx[self.rank:self.total:self.num_replicas])

    def __len__(self):
        return self.per_rank


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/severstal")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--arch", default="Unet", choices=["Unet", "FPN", "UnetPlusPlus"])
    p.add_argument("--encoder", default="efficientnet-b4")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--defect_weight", type=float, default=3.0)
    p.add_argument("--resume", default="")
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


def main():
    a = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    out_dir = f"runs/{a.arch}_{a.encoder}_f{a.fold}"
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    df = pd.read_csv(os.path.join(a.root, "train_wide_folds.csv"))
    tr, va = df[df.fold != a.fold], df[df.fold == a.fold]
    aug = A.Compose([A.HorizontalFlip(), A.VerticalFlip(),
                     A.RandomBrightnessContrast(0.1, 0.1, p=0.5), A.RandomCrop(256, 800)])
    ds_tr = SteelDS(tr, os.path.join(a.root, "train_images"), aug)
    # every rank scores a disjoint, unpadded part of the validation set
    ds_va = SteelDS(va.iloc[rank::world], os.path.join(a.root, "train_images"))
    has_defect = tr[[f"e{c}" for c in range(1, 5)]].notna().any(axis=1).values
    weights = np.where(has_defect, a.defect_weight, 1.0)
    sampler = DistributedOversampler(weights, world, rank, seed=17)
    dl_tr = DataLoader(ds_tr, batch_size=a.bs, sampler=sampler, num_workers=a.workers,
                       pin_memory=True, drop_last=True)
    dl_va = DataLoader(ds_va, batch_size=a.bs, shuffle=False, num_workers=a.workers)

    net = getattr(smp, a.arch)(a.encoder, encoder_weights="imagenet", classes=4, activation=None)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(dev)
    model = DDP(net, device_ids=[local_rank])

    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    n_upd = a.epochs * (len(dl_tr) // a.accum)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, n_upd) / n_upd)))
    scaler = torch.cuda.amp.GradScaler()
    dice_loss = smp.losses.DiceLoss("multilabel", from_logits=True)
    bce = nn.BCEWithLogitsLoss()

    start_ep, best = 0, 0.0
    if a.resume:
        ck = torch.load(a.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        start_ep, best = ck["epoch"] + 1, ck["best"]

    for ep in range(start_ep, a.epochs):
        sampler.set_epoch(ep)
        model.train()
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        for it, (x, y) in enumerate(dl_tr):
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            last_micro = (it + 1) % a.accum == 0
            if last_micro:
                with torch.cuda.amp.autocast():
                    o = model(x)
                    loss = (bce(o, y) + dice_loss(o, y)) / a.accum
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                sched.step()
            else:
                with model.no_sync():
                    with torch.cuda.amp.autocast():
                        o = model(x)
                        loss = (bce(o, y) + dice_loss(o, y)) / a.accum
                    scaler.scale(loss).backward()

        # per-image, per-class dice as in the competition metric
        net.eval()
        acc = torch.zeros(2, device=dev, dtype=torch.float64)
        with torch.no_grad():
            for x, y in dl_va:
                x, y = x.to(dev), y.to(dev)
                with torch.cuda.amp.autocast():
                    p = (torch.sigmoid(net(x)) > 0.5).float()
                inter = (p * y).sum((2, 3))
                den = p.sum((2, 3)) + y.sum((2, 3))
                d = torch.where(den == 0, torch.ones_like(den), 2 * inter / den.clamp(min=1))
                acc[0] += d.sum()
                acc[1] += d.numel()
        dist.all_reduce(acc)
        dice = (acc[0] / acc[1]).item()

        if rank == 0:
            print(f"[{a.arch}/{a.encoder} f{a.fold}] ep {ep} dice {dice:.4f} "
                  f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)
            with open(f"{out_dir}/log.csv", "a") as f:
                f.write(f"{ep},{dice:.5f}\n")
            if dice > best:
                best = dice
                torch.save(net.state_dict(), f"{out_dir}/best.pth")
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": ep, "best": best}, f"{out_dir}/last.pth")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
