"""SIIM-ACR pneumothorax segmentation. smp Unet with an auxiliary "has pneumothorax" head
(used for the empty-mask trick at inference).

torchrun --nproc_per_node=4 17_siim_ptx_aux_head.py --fold 1 --encoder se_resnext50_32x4d
"""
import os
import time
import argparse

import cv2
import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
import albumentations as A
import segmentation_models_pytorch as smp


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/siim/png1024")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--encoder", default="se_resnext50_32x4d")
    p.add_argument("--size", type=int, default=768)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--cls_weight", type=float, default=0.0)
    p.add_argument("--min_area", type=int, default=2048)
    p.add_argument("--out", default="./siim_ckpt")
    return p.parse_args()


class PTXDataset(Dataset):
    def __init__(self, df, root, size, train):
        self.ids = df.ImageId.values
        self.root = root
        self.size = size
        self.aug = A.Compose([
            A.HorizontalFlip(),
            A.OneOf([A.RandomContrast(), A.RandomGamma(), A.RandomBrightness()], p=0.3),
            A.OneOf([A.ElasticTransform(alpha=120, sigma=6, alpha_affine=3.6),
                     A.GridDistortion(), A.OpticalDistortion(distort_limit=2, shift_limit=0.5)],
                    p=0.3),
            A.ShiftScaleRotate(),
        ]) if train else None

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = cv2.imread(f"{self.root}/train/{self.ids[i]}.png", cv2.IMREAD_GRAYSCALE)
        msk = cv2.imread(f"{self.root}/mask/{self.ids[i]}.png", cv2.IMREAD_GRAYSCALE)
        img = cv2.resize(img, (self.size, self.size))
        msk = cv2.resize(msk, (self.size, self.size), interpolation=cv2.INTER_NEAREST)
        if self.aug is not None:
            o = self.aug(image=img, mask=msk)
            img, msk = o["image"], o["mask"]
        img = np.repeat(img[None].astype(np.float32) / 255.0, 3, 0)
        img = (img - 0.5) / 0.25
        msk = (msk > 127).astype(np.float32)[None]
        return torch.from_numpy(img), torch.from_numpy(msk), torch.tensor(float(msk.any())), i


def soft_dice_loss(logits, target, eps=1.0):
    p = logits.sigmoid()
    inter = (p * target).sum((1, 2, 3))
    return (1 - (2 * inter + eps) / (p.sum((1, 2, 3)) + target.sum((1, 2, 3)) + eps)).mean()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    df = pd.read_csv(f"{args.root}/folds.csv")
    tr, va = df[df.fold != args.fold], df[df.fold == args.fold]
    ds_tr = PTXDataset(tr, args.root, args.size, True)
    ds_va = PTXDataset(va, args.root, args.size, False)
    s_tr = DistributedSampler(ds_tr, shuffle=True)
    s_va = DistributedSampler(ds_va, shuffle=False)
    dl_tr = DataLoader(ds_tr, args.bs, sampler=s_tr, num_workers=6, pin_memory=True, drop_last=True)
    dl_va = DataLoader(ds_va, args.bs, sampler=s_va, num_workers=6, pin_memory=True)

    net = smp.Unet(args.encoder, encoder_weights="imagenet", classes=1,
                   aux_params=dict(classes=1, dropout=0.2, pooling="avg"))
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = nn.parallel.DistributedDataParallel(net, device_ids=[local_rank])

    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=10, eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = -1.0
    for ep in range(args.epochs):
        s_tr.set_epoch(ep)
        model.train()
        t0 = time.time()
        meters = torch.zeros(2, device=device)
        for x, y, has, _ in dl_tr:
            x, y, has = x.to(device), y.to(device), has.to(device)
            with torch.cuda.amp.autocast():
                seg, cls = model(x)
                loss = F.binary_cross_entropy_with_logits(seg, y) + soft_dice_loss(seg, y)
                if args.cls_weight > 0:
                    loss = loss + args.cls_weight * F.binary_cross_entropy_with_logits(
                        cls.squeeze(1), has)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            meters[0] += loss.detach()
            meters[1] += 1
        sched.step()

        # competition dice: empty prediction on empty mask counts as 1
        net.eval()
        res = {}
        with torch.no_grad():
            for x, y, _, idx in dl_va:
                with torch.cuda.amp.autocast():
                    seg, _ = net(x.to(device))
                p = (seg.sigmoid() > 0.5).float()
                p[p.sum((1, 2, 3)) < args.min_area] = 0
                y = y.to(device)
                inter = (p * y).sum((1, 2, 3))
                den = p.sum((1, 2, 3)) + y.sum((1, 2, 3))
                d = torch.where(den == 0, torch.ones_like(den), 2 * inter / den.clamp(min=1))
                for k, v in zip(idx.tolist(), d.cpu().tolist()):
                    res[k] = v
        gathered = [None] * world
        dist.all_gather_object(gathered, res)
        merged = {}
        for g in gathered:
            merged.update(g)
        dice = float(np.mean(list(merged.values())))
        dist.all_reduce(meters)
        tl = (meters[0] / meters[1]).item()

        if rank == 0:
            print(f"ep {ep} loss {tl:.4f} dice {dice:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
            with open(f"{args.out}/log_f{args.fold}.csv", "a") as f:
                f.write(f"{ep},{tl:.5f},{dice:.5f}\n")
            if dice > best:
                best = dice
                torch.save(net.state_dict(), f"{args.out}/unet_{args.encoder}_f{args.fold}.pth")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
