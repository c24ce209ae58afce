"""Monocular depth estimation on NYU-Depth-v2 (ResNet-50 U-Net decoder, SILog loss).

    torchrun --nproc_per_node=4 train_depth.py --data /data/nyu_v2 --epochs 25 --bs 8
"""
import argparse
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import resnet50, ResNet50_Weights

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
MIN_DEPTH, MAX_DEPTH = 1e-3, 10.0


class NYUDepth(Dataset):
    """Reads the official labeled .mat (HDF5) plus the extra training frames exported as .h5 files."""

    def __init__(self, root, split, train=True):
        with open(os.path.join(root, f"{split}_files.txt")) as f:
            self.files = [os.path.join(root, l.strip()) for l in f if l.strip()]
        self.train = train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with h5py.File(self.files[i], "r") as f:
            rgb = np.array(f["rgb"], dtype=np.float32) / 255.0      # 3,H,W
            depth = np.array(f["depth"], dtype=np.float32)           # H,W  (meters)
        rgb, depth = torch.from_numpy(rgb), torch.from_numpy(depth)[None]
        if self.train:
            if torch.rand(1) < 0.5:
                rgb, depth = rgb.flip(-1), depth.flip(-1)
            rgb = rgb * (0.9 + 0.2 * torch.rand(3, 1, 1))
            rgb = rgb.clamp(0, 1)
        rgb = (rgb - torch.tensor([0.485, 0.456, 0.406])[:, None, None]) / torch.tensor([0.229, 0.224, 0.225])[:, None, None]
        return rgb, depth


class UpBlock(nn.Module):
    def __init__(self, cin, cskip, cout):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(cin + cskip, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.LeakyReLU(0.2),
                                  nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.LeakyReLU(0.2))

    def forward(self, x, skip):
        x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=True)
        return self.conv(torch.cat([x, skip], 1))


class DepthNet(nn.Module):
    def __init__(self):
        super().__init__()
        r = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu)
        self.pool = r.maxpool
        self.enc = nn.ModuleList([r.layer1, r.layer2, r.layer3, r.layer4])
        self.up4 = UpBlock(2048, 1024, 512)
        self.up3 = UpBlock(512, 512, 256)
        self.up2 = UpBlock(256, 256, 128)
        self.up1 = UpBlock(128, 64, 64)
        self.head = nn.Conv2d(64, 1, 3, padding=1)

    def forward(self, x):
        s0 = self.stem(x)
        s1 = self.enc[0](self.pool(s0))
        s2 = self.enc[1](s1)
        s3 = self.enc[2](s2)
        s4 = self.enc[3](s3)
        d = self.up1(self.up2(self.up3(self.up4(s4, s3), s2), s1), s0)
        d = F.interpolate(self.head(d), size=x.shape[-2:], mode="bilinear", align_corners=True)
        return MIN_DEPTH + torch.sigmoid(d) * MAX_DEPTH


def silog_loss(pred, gt, variance_focus=0.85):
    mask = gt > MIN_DEPTH
    d = torch.log(pred[mask]) - torch.log(gt[mask])
    return torch.sqrt((d ** 2).mean() - variance_focus * d.mean() ** 2) * 10.0


def to_device(batch):
    return [t.to(DEVICE, non_blocking=True) for t in batch]


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    sums = torch.zeros(5, dtype=torch.float64, device=DEVICE)  # abs_rel, sq_rel, rmse, delta1, n
    for rgb, gt in loader:
        rgb, gt = to_device((rgb, gt))
        pred = model(rgb)
        pred = 0.5 * (pred + model(rgb.flip(-1)).flip(-1))
        for p, g in zip(pred, gt):
            m = (g > MIN_DEPTH) & (g < MAX_DEPTH)
            p, g = p[m].clamp(MIN_DEPTH, MAX_DEPTH), g[m]
            thresh = torch.max(g / p, p / g)
            sums += torch.stack([((g - p).abs() / g).mean(), ((g - p) ** 2 / g).mean(),
                                 ((g - p) ** 2).mean().sqrt(), (thresh < 1.25).float().mean(),
                                 torch.ones((), device=p.device)]).double()
    dist.all_reduce(sums)
    model.train()
    n = sums[4].item()
    return {"abs_rel": sums[0].item() / n, "sq_rel": sums[1].item() / n,
            "rmse": sums[2].item() / n, "d1": sums[3].item() / n}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--bs", type=int, default=8, help="per GPU")
    ap.add_argument("--lr", type=float, default=3.57e-4, help="max lr for total batch 32")
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--save-dir", default="checkpoints/depth_r50")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    train_set = NYUDepth(args.data, "train", train=True)
    test_set = NYUDepth(args.data, "test", train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    # 654 test images: padded by DistributedSampler, fine for monitoring; final numbers use eval_depth.py
    test_loader = DataLoader(test_set, batch_size=4, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=2)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(DepthNet()).cuda(local_rank)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    max_lr = args.lr * args.bs * world / 32
    optimizer = torch.optim.AdamW(model.parameters(), lr=max_lr, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader), cycle_momentum=True,
                                                    base_momentum=0.85, max_momentum=0.95, div_factor=25,
                                                    final_div_factor=100)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    best_rmse = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=DEVICE)
        for step, batch in enumerate(train_loader):
            rgb, gt = to_device(batch)
            pred = model(rgb)
            loss = silog_loss(pred, gt)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()
            scheduler.step()
            running += torch.stack([loss.detach(), torch.ones((), device=DEVICE)])
        dist.all_reduce(running)
        metrics = evaluate(model, test_loader)
        if rank == 0:
            print(f"epoch {epoch} silog {(running[0] / running[1]).item():.4f} "
                  + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()) + f" ({time.time() - t0:.0f}s)", flush=True)
            state = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state, os.path.join(args.save_dir, "last.pt"))
            if metrics["rmse"] < best_rmse:
                best_rmse = metrics["rmse"]
                torch.save(state, os.path.join(args.save_dir, "best.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
