"""
DeepGlobe road extraction with D-LinkNet34 (ResNet-34 encoder + dilated center block).

    torchrun --nproc_per_node=4 train_dlinknet.py --root /data/deepglobe_road/train --epochs 160
"""
import argparse
import os
import random
import time

import cv2
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torchvision import models
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    parser = argparse.ArgumentParser(description="D-LinkNet road extraction")
    parser.add_argument("--root", required=True)
    parser.add_argument("--val-list", default=None)
    parser.add_argument("--batch-size", type=int, default=4, help="per GPU")
    parser.add_argument("--epochs", type=int, default=160)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--save", default="weights/dlinknet34")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def color_jitter(img, hue=15, sat=15, val=15):
    hsv = cv2.cvtColor(img, cv2.COLOR_BGR2HSV).astype(np.int16)
    hsv[..., 0] = (hsv[..., 0] + random.randint(-hue, hue)) % 180
    hsv[..., 1] = np.clip(hsv[..., 1] + random.randint(-sat, sat), 0, 255)
    hsv[..., 2] = np.clip(hsv[..., 2] + random.randint(-val, val), 0, 255)
    return cv2.cvtColor(hsv.astype(np.uint8), cv2.COLOR_HSV2BGR)


class RoadDataset(Dataset):
    def __init__(self, root, ids, train=True):
        self.root, self.ids, self.train = root, ids, train

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = cv2.imread(os.path.join(self.root, f"{self.ids[i]}_sat.jpg"))
        mask = cv2.imread(os.path.join(self.root, f"{self.ids[i]}_mask.png"), cv2.IMREAD_GRAYSCALE)
        if self.train:
            img = color_jitter(img)
            if random.random() < 0.5:
                img, mask = cv2.flip(img, 1), cv2.flip(mask, 1)
            if random.random() < 0.5:
                img, mask = cv2.flip(img, 0), cv2.flip(mask, 0)
            if random.random() < 0.5:
                img, mask = np.rot90(img).copy(), np.rot90(mask).copy()
        img = img.astype(np.float32).transpose(2, 0, 1) / 255.0 * 3.2 - 1.6
        mask = (mask > 128).astype(np.float32)[None]
        return torch.from_numpy(img), torch.from_numpy(mask)


class DBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.d = nn.ModuleList([nn.Conv2d(c, c, 3, dilation=r, padding=r) for r in (1, 2, 4, 8)])

    def forward(self, x):
        out, h = x, x
        for conv in self.d:
            h = F.relu(conv(h), inplace=True)
            out = out + h
        return out


class DecoderBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cin // 4, 1), nn.BatchNorm2d(cin // 4), nn.ReLU(True),
            nn.ConvTranspose2d(cin // 4, cin // 4, 3, stride=2, padding=1, output_padding=1),
            nn.BatchNorm2d(cin // 4), nn.ReLU(True),
            nn.Conv2d(cin // 4, cout, 1), nn.BatchNorm2d(cout), nn.ReLU(True))

    def forward(self, x):
        return self.body(x)


class DLinkNet34(nn.Module):
    def __init__(self):
        super().__init__()
        r = models.resnet34(weights=models.ResNet34_Weights.IMAGENET1K_V1)
        self.firstconv, self.firstbn, self.firstrelu, self.firstpool = r.conv1, r.bn1, r.relu, r.maxpool
        self.enc1, self.enc2, self.enc3, self.enc4 = r.layer1, r.layer2, r.layer3, r.layer4
        self.dblock = DBlock(512)
        self.dec4, self.dec3 = DecoderBlock(512, 256), DecoderBlock(256, 128)
        self.dec2, self.dec1 = DecoderBlock(128, 64), DecoderBlock(64, 64)
        self.final = nn.Sequential(nn.ConvTranspose2d(64, 32, 4, 2, 1), nn.ReLU(True),
                                   nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(True), nn.Conv2d(32, 1, 3, padding=1))

    def forward(self, x):
        x = self.firstpool(self.firstrelu(self.firstbn(self.firstconv(x))))
        e1 = self.enc1(x)
        e2 = self.enc2(e1)
        e3 = self.enc3(e2)
        e4 = self.dblock(self.enc4(e3))
        d4 = self.dec4(e4) + e3
        d3 = self.dec3(d4) + e2
        d2 = self.dec2(d3) + e1
        d1 = self.dec1(d2)
        return self.final(d1)


def dice_bce(logits, target):
    bce = F.binary_cross_entropy_with_logits(logits, target)
    p = torch.sigmoid(logits)
    inter = (p * target).sum((1, 2, 3))
    dice = 1 - (2 * inter + 1) / (p.sum((1, 2, 3)) + target.sum((1, 2, 3)) + 1)
    return bce + dice.mean()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    all_ids = sorted(f[:-8] for f in os.listdir(args.root) if f.endswith("_sat.jpg"))
    if args.val_list:
        with open(args.val_list) as f:
            val_ids = {l.strip() for l in f}
    else:
        val_ids = set(all_ids[::20])
    train_ids = [i for i in all_ids if i not in val_ids]
    val_ids = sorted(val_ids)

    train_ds = RoadDataset(args.root, train_ids, train=True)
    val_ds = RoadDataset(args.root, val_ids, train=False)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=args.workers)

    model = DLinkNet34()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
    best_iou, no_improve, lr = 0.0, 0, args.lr
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for img, mask in train_loader:
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            loss = dice_bce(model(img), mask)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += torch.tensor([loss.item(), 1.0], device=device)

        model.eval()
        iu = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for img, mask in val_loader:
                img, mask = img.to(device), mask.to(device)
                pred = (model(img) > 0).float()
                iu[0] += (pred * mask).sum()
                iu[1] += ((pred + mask) > 0).float().sum()
        dist.all_reduce(iu)
        dist.all_reduce(loss_sum)
        iou = (iu[0] / iu[1].clamp(min=1)).item()

        # D-LinkNet schedule: divide lr by 5 after plateaus
        if iou > best_iou:
            best_iou, no_improve = iou, 0
            if rank == 0:
                torch.save(model.module.state_dict(), os.path.join(args.save, "best.th"))
        else:
            no_improve += 1
        if no_improve >= 6:
            lr /= 5.0
            for g in optimizer.param_groups:
                g["lr"] = lr
            no_improve = 0
        if rank == 0:
            print(f"epoch {epoch} loss {(loss_sum[0] / loss_sum[1]).item():.4f} IoU {iou:.4f} "
                  f"lr {lr:.2e} ({time.time() - t0:.0f}s)", flush=True)
        if lr < 5e-7:
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
