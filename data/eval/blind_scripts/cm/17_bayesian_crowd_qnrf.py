"""
Bayesian Loss for crowd count estimation (Ma et al., ICCV'19), VGG19 backbone,
UCF-QNRF preprocessed to long side <= 2048 with point annotations in .npy.

Multi-GPU via torch.multiprocessing.spawn (one process per visible GPU):

    python 17_bayesian_crowd_qnrf.py --data-dir /data/UCF-Train-Val-Test --save-dir ckpt/bl_qnrf
"""
import argparse
import os
import random
import time
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms


def parse_args():
    p = argparse.ArgumentParser(description="Bayesian loss crowd counting")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--save-dir", default="ckpt/bl_qnrf")
    p.add_argument("--crop-size", type=int, default=512)
    p.add_argument("--downsample", type=int, default=8)
    p.add_argument("--sigma", type=float, default=8.0)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--max-epoch", type=int, default=1000)
    p.add_argument("--val-start", type=int, default=200)
    p.add_argument("--val-epoch", type=int, default=5)
    p.add_argument("--num-workers", type=int, default=6)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-url", default="tcp://127.0.0.1:23456")
    return p.parse_args()


class PointCrowd(Dataset):
    def __init__(self, root, split, crop_size, downsample, train):
        self.files = sorted(glob(os.path.join(root, split, "*.jpg")))
        self.crop, self.ds, self.train = crop_size, downsample, train
        self.tf = transforms.Compose([transforms.ToTensor(),
                                      transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(self.files[i]).convert("RGB")
        pts = np.load(self.files[i].replace(".jpg", ".npy")).astype(np.float32)[:, :2].reshape(-1, 2)
        if not self.train:
            return self.tf(img), len(pts), i
        w, h = img.size
        x0, y0 = random.randint(0, max(0, w - self.crop)), random.randint(0, max(0, h - self.crop))
        img = img.crop((x0, y0, x0 + self.crop, y0 + self.crop))
        pts = pts - [x0, y0]
        m = (pts[:, 0] >= 0) & (pts[:, 0] < self.crop) & (pts[:, 1] >= 0) & (pts[:, 1] < self.crop)
        pts = pts[m]
        if random.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
            pts[:, 0] = self.crop - pts[:, 0]
        return self.tf(img), torch.from_numpy(pts)


def train_collate(batch):
    imgs = torch.stack([b[0] for b in batch])
    return imgs, [b[1] for b in batch]


class VGG19Reg(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(*list(models.vgg19(weights="IMAGENET1K_V1").features.children())[:36])
        self.reg = nn.Sequential(nn.Conv2d(512, 256, 3, padding=1), nn.ReLU(inplace=True),
                                 nn.Conv2d(256, 128, 3, padding=1), nn.ReLU(inplace=True),
                                 nn.Conv2d(128, 1, 1))

    def forward(self, x):
        x = F.interpolate(self.features(x), scale_factor=2, mode="bilinear", align_corners=False)
        return torch.abs(self.reg(x))


class BayesianLoss(nn.Module):
    """Each annotated head should collect an expected count of one under the posterior."""

    def __init__(self, sigma, crop, stride):
        super().__init__()
        self.sigma = sigma
        coords = torch.arange(0, crop, stride, dtype=torch.float32) + stride / 2
        self.register_buffer("coords", coords)

    def forward(self, density, points_list):
        loss = density.new_zeros(())
        for den, pts in zip(density, points_list):
            den = den.flatten()
            if len(pts) == 0:
                loss = loss + den.abs().sum()
                continue
            dx = (pts[:, 0:1] - self.coords[None]) ** 2          # N x W
            dy = (pts[:, 1:2] - self.coords[None]) ** 2          # N x H
            dist2 = (dy[:, :, None] + dx[:, None, :]).flatten(1)  # N x HW
            post = F.softmax(-dist2 / (2 * self.sigma ** 2), dim=0)
            expected = (post * den[None]).sum(1)
            loss = loss + (1.0 - expected).abs().sum()
        return loss / len(points_list)


def main_worker(args, gpu, ngpus_per_node):
    args.gpu = gpu
    args.rank = args.node_rank * ngpus_per_node + gpu
    torch.cuda.set_device(gpu)
    dist.init_process_group(backend="nccl", init_method=args.dist_url,
                            world_size=args.world_size, rank=args.rank)

    train_set = PointCrowd(args.data_dir, "train", args.crop_size, args.downsample, train=True)
    val_set = PointCrowd(args.data_dir, "val", args.crop_size, args.downsample, train=False)
    train_sampler = DistributedSampler(train_set, num_replicas=args.world_size, rank=args.rank)
    val_sampler = DistributedSampler(val_set, num_replicas=args.world_size, rank=args.rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=train_collate, num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler, num_workers=2)

    model = VGG19Reg().cuda(gpu)
    model = DDP(model, device_ids=[gpu])
    criterion = BayesianLoss(args.sigma, args.crop_size, args.downsample).cuda(gpu)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    if args.rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best_mae = float("inf")
    for epoch in range(args.max_epoch):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for img, pts in train_loader:
            img = img.cuda(gpu, non_blocking=True)
            pts = [p.cuda(gpu, non_blocking=True) for p in pts]
            loss = criterion(model(img), pts)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if args.rank == 0:
            print(f"epoch {epoch} loss {loss.item():.3f} {time.time() - t0:.0f}s", flush=True)

        if epoch >= args.val_start and epoch % args.val_epoch == 0:
            model.eval()
            res = torch.zeros(len(val_set), 2, device=f"cuda:{gpu}")
            seen = torch.zeros(len(val_set), device=f"cuda:{gpu}")
            with torch.no_grad():
                for img, count, idx in val_loader:
                    res[idx] = torch.stack([model(img.cuda(gpu)).sum(), count.cuda(gpu).float().squeeze()])
                    seen[idx] = 1
            dist.all_reduce(res)
            dist.all_reduce(seen)
            res = res / seen[:, None]           # padded images were written by two ranks
            err = res[:, 0] - res[:, 1]
            mae, mse = err.abs().mean().item(), err.pow(2).mean().sqrt().item()
            if args.rank == 0:
                print(f"  val epoch {epoch}: MAE {mae:.2f} MSE {mse:.2f}", flush=True)
                torch.save(model.module.state_dict(), os.path.join(args.save_dir, "last.pth"))
                if mae < best_mae:
                    best_mae = mae
                    torch.save(model.module.state_dict(), os.path.join(args.save_dir, "best_model.pth"))

    dist.destroy_process_group()


def main():
    args = parse_args()
    ngpus_per_node = torch.cuda.device_count()
    args.world_size = ngpus_per_node * args.nodes
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(args, ngpus_per_node))


if __name__ == "__main__":
    main()
