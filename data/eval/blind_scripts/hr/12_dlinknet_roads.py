"""Road extraction (DeepGlobe Roads / Massachusetts Roads) with D-LinkNet34.

The network has a second 1x1 head that predicts road edges (from a Sobel of the
road mask) as auxiliary supervision; it can be switched on with --edge-weight.

    torchrun --nproc_per_node=4 12_dlinknet_roads.py --data /data/deepglobe_roads
"""
import argparse
import glob
import os
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/deepglobe_roads")
    p.add_argument("--out", default="weights/dlinknet34")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--epochs", type=int, default=160)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--edge-weight", type=float, default=0.0)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


class RoadTiles(Dataset):
    def __init__(self, ids, root, train):
        self.ids, self.root, self.train = ids, root, train

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        tid = self.ids[i]
        img = cv2.imread(os.path.join(self.root, "train", f"{tid}_sat.jpg"))
        msk = cv2.imread(os.path.join(self.root, "train", f"{tid}_mask.png"), cv2.IMREAD_GRAYSCALE)
        if self.train:
            if np.random.rand() < 0.5:
                img, msk = cv2.flip(img, 1), cv2.flip(msk, 1)
            if np.random.rand() < 0.5:
                img, msk = cv2.flip(img, 0), cv2.flip(msk, 0)
            k = np.random.randint(4)
            img, msk = np.rot90(img, k), np.rot90(msk, k)
            hsv = cv2.cvtColor(np.ascontiguousarray(img), cv2.COLOR_BGR2HSV).astype(np.int16)
            hsv[..., 0] = (hsv[..., 0] + np.random.randint(-15, 16)) % 180
            hsv[..., 1:] = np.clip(hsv[..., 1:] + np.random.randint(-15, 16, size=2), 0, 255)
            img = cv2.cvtColor(hsv.astype(np.uint8), cv2.COLOR_HSV2BGR)
        msk = (msk > 128).astype(np.float32)
        edge = cv2.morphologyEx(msk, cv2.MORPH_GRADIENT, np.ones((3, 3), np.uint8))
        img = np.ascontiguousarray(img, dtype=np.float32) / 255.0 * 3.2 - 1.6
        return (torch.from_numpy(img.transpose(2, 0, 1).copy()),
                torch.from_numpy(np.ascontiguousarray(msk))[None],
                torch.from_numpy(np.ascontiguousarray(edge))[None])


class Dblock(nn.Module):
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
        self.block = nn.Sequential(
            nn.Conv2d(cin, cin // 4, 1), nn.BatchNorm2d(cin // 4), nn.ReLU(True),
            nn.ConvTranspose2d(cin // 4, cin // 4, 3, stride=2, padding=1, output_padding=1),
            nn.BatchNorm2d(cin // 4), nn.ReLU(True),
            nn.Conv2d(cin // 4, cout, 1), nn.BatchNorm2d(cout), nn.ReLU(True))

    def forward(self, x):
        return self.block(x)


class DLinkNet34(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet34(weights=torchvision.models.ResNet34_Weights.IMAGENET1K_V1)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.e1, self.e2, self.e3, self.e4 = r.layer1, r.layer2, r.layer3, r.layer4
        self.center = Dblock(512)
        self.d4, self.d3, self.d2, self.d1 = DecoderBlock(512, 256), DecoderBlock(256, 128), DecoderBlock(128, 64), DecoderBlock(64, 64)
        self.final = nn.Sequential(nn.ConvTranspose2d(64, 32, 4, 2, 1), nn.ReLU(True),
                                   nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(True))
        self.road_head = nn.Conv2d(32, 1, 3, padding=1)
        self.edge_head = nn.Conv2d(32, 1, 3, padding=1)

    def forward(self, x):
        x = self.stem(x)
        e1 = self.e1(x)
        e2 = self.e2(e1)
        e3 = self.e3(e2)
        e4 = self.center(self.e4(e3))
        d4 = self.d4(e4) + e3
        d3 = self.d3(d4) + e2
        d2 = self.d2(d3) + e1
        f = self.final(self.d1(d2))
        return self.road_head(f), self.edge_head(f)


def dice_bce(logit, target):
    bce = F.binary_cross_entropy_with_logits(logit, target)
    p = logit.sigmoid()
    inter = (p * target).sum((1, 2, 3))
    dice = 1 - (2 * inter + 1.0) / (p.sum((1, 2, 3)) + target.sum((1, 2, 3)) + 1.0)
    return bce + dice.mean()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    ids = sorted(os.path.basename(p)[:-8] for p in glob.glob(os.path.join(args.data, "train", "*_sat.jpg")))
    rng = np.random.RandomState(2018)
    perm = rng.permutation(len(ids))
    n_val = len(ids) // 10
    val_ids = [ids[i] for i in perm[:n_val]]
    train_ids = [ids[i] for i in perm[n_val:]]

    train_ds = RoadTiles(train_ids, args.data, train=True)
    val_ds = RoadTiles(val_ids[rank::world], args.data, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=4, num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(DLinkNet34()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.2, patience=6)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_iou = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for img, msk, edge in train_dl:
            img, msk, edge = img.to(device, non_blocking=True), msk.to(device, non_blocking=True), edge.to(device, non_blocking=True)
            road_logit, edge_logit = model(img)
            loss = dice_bce(road_logit, msk)
            if args.edge_weight > 0:
                loss = loss + args.edge_weight * F.binary_cross_entropy_with_logits(edge_logit, edge)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        train_loss = (acc[0] / acc[1]).item()
        sched.step(train_loss)  # same value on every rank

        model.eval()
        s = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for img, msk, _ in val_dl:
                road_logit, _ = model.module(img.to(device))
                pred = road_logit.sigmoid() > 0.5
                gt = msk.to(device) > 0.5
                s += torch.stack([(pred & gt).sum(), (pred & ~gt).sum(), (~pred & gt).sum()]).double()
        dist.all_reduce(s)
        tp, fp, fn = s.tolist()
        iou = tp / max(tp + fp + fn, 1)

        if rank == 0:
            print(f"epoch {epoch:3d} loss {train_loss:.4f} road IoU {iou:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.out, "last.th"))
            if iou > best_iou:
                best_iou = iou
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.th"))
        if opt.param_groups[0]["lr"] < 5e-7:
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
