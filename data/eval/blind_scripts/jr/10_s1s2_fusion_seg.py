#!/usr/bin/env python
"""SEN12MS / DFC2020 land-cover segmentation with late S1+S2 fusion.

Two ResNet encoders (S1: VV/VH, S2: 13 bands) whose features are summed per scale and fed to
a shared U-Net style decoder. Modality dropout: during training one of the two branches is
dropped for a batch, so the model still works when only radar (clouds) or only optical is
available at inference.

    torchrun --nproc_per_node=4 10_s1s2_fusion_seg.py --root /data/sen12ms --val-root /data/dfc2020
"""
import argparse
import glob
import os
import random
import time

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from segmentation_models_pytorch.encoders import get_encoder
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

# IGBP simplified scheme used by DFC2020 (1..10), mapped to 0..7; savanna (3) and snow (8) are not in the val set
DFC_MAP = np.full(256, 255, dtype=np.int64)
for new, old in enumerate([1, 2, 4, 5, 6, 7, 9, 10]):
    DFC_MAP[old] = new
NUM_CLASSES = 8


class S1S2Dataset(Dataset):
    def __init__(self, root, train):
        self.s2 = sorted(glob.glob(os.path.join(root, "**", "s2_*", "*.tif"), recursive=True))
        self.train = train

    def __len__(self):
        return len(self.s2)

    @staticmethod
    def _read(path):
        with rasterio.open(path) as src:
            return src.read().astype(np.float32)

    def __getitem__(self, i):
        p2 = self.s2[i]
        s2 = np.clip(self._read(p2), 0, 10000) / 10000.0
        s1 = self._read(p2.replace("s2_", "s1_").replace("_s2_", "_s1_"))
        s1 = (np.clip(s1, -25, 0) + 25) / 25.0
        lc = self._read(p2.replace("s2_", "dfc_").replace("_s2_", "_dfc_"))[0].astype(np.int64)
        lc = DFC_MAP[lc]
        if self.train:
            if random.random() < 0.5:
                s1, s2, lc = s1[..., ::-1], s2[..., ::-1], lc[..., ::-1]
            if random.random() < 0.5:
                s1, s2, lc = s1[..., ::-1, :], s2[..., ::-1, :], lc[..., ::-1, :]
        return (torch.from_numpy(s1.copy()), torch.from_numpy(s2.copy()), torch.from_numpy(lc.copy()))


class DecoderBlock(nn.Module):
    def __init__(self, cin, cskip, cout):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(cin + cskip, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    def forward(self, x, skip):
        x = F.interpolate(x, size=skip.shape[-2:], mode="nearest")
        return self.conv(torch.cat([x, skip], 1))


class FusionUNet(nn.Module):
    def __init__(self, encoder="resnet34", num_classes=NUM_CLASSES, p_drop=0.3):
        super().__init__()
        self.enc_s1 = get_encoder(encoder, in_channels=2, depth=5, weights=None)
        self.enc_s2 = get_encoder(encoder, in_channels=13, depth=5, weights=None)
        ch = self.enc_s2.out_channels  # (13, 64, 64, 128, 256, 512) for resnet34
        self.p_drop = p_drop
        self.dec = nn.ModuleList([
            DecoderBlock(ch[5], ch[4], 256),
            DecoderBlock(256, ch[3], 128),
            DecoderBlock(128, ch[2], 64),
            DecoderBlock(64, ch[1], 32),
        ])
        self.head = nn.Conv2d(32, num_classes, 1)

    def forward(self, s1, s2):
        use_s1, use_s2 = True, True
        if self.training and random.random() < self.p_drop:
            if random.random() < 0.5:
                use_s1 = False
            else:
                use_s2 = False
        feats = None
        if use_s1:
            feats = self.enc_s1(s1)
        if use_s2:
            f2 = self.enc_s2(s2)
            feats = f2 if feats is None else [a + b for a, b in zip(feats, f2)]
        x = feats[5]
        for blk, skip in zip(self.dec, (feats[4], feats[3], feats[2], feats[1])):
            x = blk(x, skip)
        x = self.head(x)
        return F.interpolate(x, size=s2.shape[-2:], mode="bilinear", align_corners=False)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    conf = torch.zeros(NUM_CLASSES, NUM_CLASSES, device=device, dtype=torch.long)
    for s1, s2, y in loader:
        s1, s2, y = s1.to(device), s2.to(device), y.to(device)
        pred = model(s1, s2).argmax(1)
        ok = y != 255
        conf += torch.bincount(y[ok] * NUM_CLASSES + pred[ok], minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, -1)
    dist.all_reduce(conf)
    conf = conf.double()
    iou = conf.diag() / (conf.sum(0) + conf.sum(1) - conf.diag()).clamp(min=1)
    aa = (conf.diag() / conf.sum(1).clamp(min=1)).mean()
    return iou.mean().item(), aa.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--val-root", required=True)
    ap.add_argument("--out", default="runs/s1s2_fusion")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--p-drop", type=float, default=0.3)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(17 + rank)
    torch.manual_seed(17)

    train_ds = S1S2Dataset(args.root, train=True)
    val_ds = S1S2Dataset(args.val_root, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, list(range(rank, len(val_ds), world))), batch_size=args.bs,
                        num_workers=args.workers)

    model = FusionUNet(p_drop=args.p_drop).to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.epochs * len(train_dl))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for s1, s2, y in train_dl:
            s1 = s1.to(device, non_blocking=True)
            s2 = s2.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            logits = model(s1, s2)
            loss = F.cross_entropy(logits, y, ignore_index=255)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_acc)
        miou, aa = evaluate(model.module, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch:02d} train_loss {loss_acc[0].item() / loss_acc[1].item():.4f} "
                  f"val_mIoU {miou:.4f} val_AA {aa:.4f} [{time.time() - t0:.0f}s]", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if miou > best:
                best = miou
                torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "best.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
