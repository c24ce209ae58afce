"""Inria Aerial Image Labeling: building / not-building on 5000x5000 0.3 m RGB tiles.

HRNet-W18-style backbone from timm with a light segmentation head. Validation uses
the first 5 tiles of every city (standard split), predicted whole with overlapping
windows; scores are IoU and pixel accuracy over all validation pixels.

    torchrun --nproc_per_node=8 09_inria_hrnet_seg.py --root /data/AerialImageDataset
"""
import argparse
import os
import random
import time

import numpy as np
import tifffile
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CITIES = ["austin", "chicago", "kitsap", "tyrol-w", "vienna"]
MEAN = torch.tensor([103.6, 109.3, 100.4]).view(3, 1, 1)
STD = torch.tensor([48.9, 44.8, 42.9]).view(3, 1, 1)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/AerialImageDataset")
    p.add_argument("--out", default="checkpoints/inria_hrnet18")
    p.add_argument("--crop", type=int, default=512)
    p.add_argument("--bs", type=int, default=12)
    p.add_argument("--samples-per-epoch", type=int, default=48000)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tile", type=int, default=1024)
    p.add_argument("--overlap", type=int, default=128)
    return p.parse_args()


def tile_names(split):
    ids = range(1, 6) if split == "val" else range(6, 37)
    return [f"{c}{i}" for c in CITIES for i in ids]


class RandomCrops(Dataset):
    def __init__(self, root, names, crop, n):
        self.root, self.names, self.crop, self.n = root, names, crop, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        name = random.choice(self.names)
        img = tifffile.memmap(os.path.join(self.root, "train", "images", f"{name}.tif"))
        gt = tifffile.memmap(os.path.join(self.root, "train", "gt", f"{name}.tif"))
        y, x = random.randint(0, 5000 - self.crop), random.randint(0, 5000 - self.crop)
        im = torch.from_numpy(np.array(img[y:y + self.crop, x:x + self.crop])).permute(2, 0, 1).float()
        lb = torch.from_numpy((np.array(gt[y:y + self.crop, x:x + self.crop]) > 0).astype(np.int64))
        if random.random() < 0.5:
            im, lb = im.flip(-1), lb.flip(-1)
        if random.random() < 0.5:
            im, lb = im.flip(-2), lb.flip(-2)
        return (im - MEAN) / STD, lb


class SegNet(nn.Module):
    def __init__(self, backbone="hrnet_w18_small_v2", n_classes=2):
        super().__init__()
        self.n_classes = n_classes
        self.backbone = timm.create_model(backbone, pretrained=True, features_only=True)
        chs = self.backbone.feature_info.channels()
        self.head = nn.Sequential(nn.Conv2d(sum(chs), 256, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True),
                                  nn.Conv2d(256, n_classes, 1))

    def forward(self, x):
        feats = self.backbone(x)
        size = feats[0].shape[-2:]
        f = torch.cat([feats[0]] + [F.interpolate(t, size=size, mode="bilinear", align_corners=False)
                                    for t in feats[1:]], 1)
        return F.interpolate(self.head(f), size=x.shape[-2:], mode="bilinear", align_corners=False)

    @torch.no_grad()
    def predict_large(self, img, tile, overlap):
        """img: (3, H, W) normalised tensor on the model's device -> (H, W) label map."""
        _, h, w = img.shape
        stride = tile - overlap
        probs = torch.zeros(self.n_classes, h, w, device=img.device)
        cnt = torch.zeros(1, h, w, device=img.device)
        ys = sorted({*range(0, h - tile, stride), h - tile})
        xs = sorted({*range(0, w - tile, stride), w - tile})
        for y in ys:
            batch = torch.stack([img[:, y:y + tile, x:x + tile] for x in xs])
            with torch.autocast("cuda", dtype=torch.float16):
                out = self(batch).float().softmax(1)
            for o, x in zip(out, xs):
                probs[:, y:y + tile, x:x + tile] += o
                cnt[:, y:y + tile, x:x + tile] += 1
        return (probs / cnt).argmax(0)


def evaluate(model, root, tile, overlap, device, rank, world):
    model.eval()
    stats = torch.zeros(4, dtype=torch.float64, device=device)  # tp, fp, fn, correct
    n_pix = torch.zeros(1, dtype=torch.float64, device=device)
    for name in tile_names("val")[rank::world]:
        img = torch.from_numpy(tifffile.imread(os.path.join(root, "train", "images", f"{name}.tif")))
        img = ((img.permute(2, 0, 1).float() - MEAN) / STD).to(device)
        gt = torch.from_numpy(tifffile.imread(os.path.join(root, "train", "gt", f"{name}.tif")) > 0).to(device)
        pred = model.predict_large(img, tile, overlap).bool()
        stats += torch.stack([(pred & gt).sum(), (pred & ~gt).sum(), (~pred & gt).sum(), (pred == gt).sum()]).double()
        n_pix += gt.numel()
    dist.all_reduce(stats)
    dist.all_reduce(n_pix)
    model.train()
    tp, fp, fn, correct = stats.tolist()
    return tp / max(tp + fp + fn, 1), correct / n_pix.item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)

    ds = RandomCrops(args.root, tile_names("train"), args.crop, args.samples_per_epoch)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True,
                    persistent_workers=True)

    model = SegNet()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(dl), eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_iou = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for im, lb in dl:
            im, lb = im.to(device, non_blocking=True), lb.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(im), lb)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            tot += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        if epoch % 5 == 4 or epoch == args.epochs - 1:
            iou, acc = evaluate(model, args.root, args.tile, args.overlap, device, rank, world)
            if rank == 0:
                print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} val IoU {iou:.4f} acc {acc:.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)
                if iou > best_iou:
                    best_iou = iou
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        elif rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.out, "final.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
