# HuBMAP vasculature segmentation - smp Unet, encoder at lower LR, dice eval
# launch: torchrun --nproc_per_node=8 05_hubmap_unet_difflr.py --fold 0 --encoder tu-convnext_small
import os
import json
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


def get_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/hubmap/tiles512")
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--encoder", default="tu-convnext_small")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--enc_lr_mult", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--out", default="./work_dirs/unet")
    return ap.parse_args()


aug_train = A.Compose([
    A.RandomRotate90(),
    A.HorizontalFlip(),
    A.VerticalFlip(),
    A.ShiftScaleRotate(shift_limit=0.1, scale_limit=0.2, rotate_limit=30, p=0.5),
    A.OneOf([A.RandomBrightnessContrast(), A.HueSaturationValue(), A.RandomGamma()], p=0.6),
    A.GaussNoise(p=0.2),
])


class TileDS(Dataset):
    def __init__(self, ids, root, aug=None):
        self.ids = list(ids)
        self.root = root
        self.aug = aug

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        tid = self.ids[i]
        img = cv2.imread(f"{self.root}/images/{tid}.png")[:, :, ::-1]
        msk = cv2.imread(f"{self.root}/masks/{tid}.png", cv2.IMREAD_GRAYSCALE)
        if self.aug is not None:
            r = self.aug(image=img, mask=msk)
            img, msk = r["image"], r["mask"]
        img = (img.astype(np.float32) / 255.0 - 0.5) / 0.25
        img = torch.from_numpy(img.transpose(2, 0, 1).copy())
        msk = torch.from_numpy((msk > 127).astype(np.float32))[None]
        return img, msk


class DiceBCE(nn.Module):
    def __init__(self, w=0.5):
        super().__init__()
        self.w = w
        self.dice = smp.losses.DiceLoss("binary", from_logits=True)

    def forward(self, logits, target):
        return self.w * F.binary_cross_entropy_with_logits(logits, target) + \
            (1 - self.w) * self.dice(logits, target)


def setup():
    lr = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr)
    dist.init_process_group("nccl")
    return dist.get_rank(), dist.get_world_size(), lr


def main():
    cfg = get_cfg()
    rank, world, local_rank = setup()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    meta = pd.read_csv(f"{cfg.data}/tiles.csv")
    tr_ids = meta.loc[meta.fold != cfg.fold, "id"].values
    va_ids = meta.loc[meta.fold == cfg.fold, "id"].values
    ds_tr = TileDS(tr_ids, cfg.data, aug_train)
    # eval split without padding so every tile is counted exactly once
    ds_va = TileDS(va_ids[rank::world], cfg.data)
    s_tr = DistributedSampler(ds_tr, shuffle=True)
    dl_tr = DataLoader(ds_tr, batch_size=cfg.bs, sampler=s_tr, num_workers=cfg.workers,
                       pin_memory=True, drop_last=True)
    dl_va = DataLoader(ds_va, batch_size=cfg.bs, shuffle=False, num_workers=cfg.workers,
                       pin_memory=True)

    model = smp.Unet(cfg.encoder, encoder_weights="imagenet", classes=1, decoder_attention_type="scse")
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

    optim = torch.optim.AdamW([
        {"params": model.encoder.parameters(), "lr": cfg.lr * cfg.enc_lr_mult},
        {"params": model.decoder.parameters(), "lr": cfg.lr},
        {"params": model.segmentation_head.parameters(), "lr": cfg.lr},
    ], weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        optim, max_lr=[cfg.lr * cfg.enc_lr_mult, cfg.lr, cfg.lr],
        total_steps=cfg.epochs * len(dl_tr), pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler()
    crit = DiceBCE()

    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        with open(f"{cfg.out}/cfg_f{cfg.fold}.json", "w") as f:
            json.dump(vars(cfg), f, indent=2)

    best_dice = 0.0
    for epoch in range(cfg.epochs):
        s_tr.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for img, msk in dl_tr:
            img = img.to(device, non_blocking=True)
            msk = msk.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = crit(model(img), msk)
            optim.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optim)
            scaler.update()
            sched.step()
            loss_acc[0] += loss.detach()
            loss_acc[1] += 1

        # global dice: sum intersections / unions over all ranks
        net = model.module
        net.eval()
        stats = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for img, msk in dl_va:
                img = img.to(device)
                msk = msk.to(device)
                with torch.cuda.amp.autocast():
                    pr = (net(img).sigmoid() > 0.5).float()
                stats[0] += (pr * msk).sum()
                stats[1] += pr.sum() + msk.sum()
        dist.all_reduce(stats)
        dist.all_reduce(loss_acc)
        dice = (2 * stats[0] / (stats[1] + 1e-6)).item()

        if rank == 0:
            print(f"ep {epoch:02d} | loss {(loss_acc[0] / loss_acc[1]).item():.4f} | "
                  f"dice {dice:.4f} | {time.time() - t0:.0f}s", flush=True)
            with open(f"{cfg.out}/log_f{cfg.fold}.txt", "a") as f:
                f.write(f"{epoch}\t{(loss_acc[0] / loss_acc[1]).item():.5f}\t{dice:.5f}\n")
            if dice > best_dice:
                best_dice = dice
                torch.save(model.module.state_dict(), f"{cfg.out}/best_f{cfg.fold}.pth")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
