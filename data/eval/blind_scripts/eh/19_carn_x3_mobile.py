"""CARN-M x3 for the mobile 3x digital-zoom path (runs in the NPU budget after int8 export).

    torchrun --nproc_per_node=4 19_carn_x3_mobile.py --data /data/DIV2K --epochs 600
"""
import argparse
import os
import random
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser(description="CARN-M training")
    p.add_argument("--data", default="/data/DIV2K")
    p.add_argument("--h5", default="DIV2K_train_x3.h5", help="packed HR/LR arrays (scripts/div2h5.py)")
    p.add_argument("--val", default="/data/benchmark/B100")
    p.add_argument("--scale", type=int, default=3)
    p.add_argument("--patch", type=int, default=64, help="LR patch size")
    p.add_argument("--batch", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=600)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--ckpt", default="checkpoint/carn_m_x3")
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


class EResidualBlock(nn.Module):
    def __init__(self, c, group):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, 1, 1, groups=group), nn.ReLU(True),
                                  nn.Conv2d(c, c, 3, 1, 1, groups=group), nn.ReLU(True),
                                  nn.Conv2d(c, c, 1))

    def forward(self, x):
        return F.relu(self.body(x) + x)


class CascadingBlock(nn.Module):
    def __init__(self, c, group):
        super().__init__()
        self.b1, self.b2, self.b3 = EResidualBlock(c, group), EResidualBlock(c, group), EResidualBlock(c, group)
        self.c1 = nn.Conv2d(2 * c, c, 1)
        self.c2 = nn.Conv2d(3 * c, c, 1)
        self.c3 = nn.Conv2d(4 * c, c, 1)

    def forward(self, x):
        c0 = o0 = x
        b1 = self.b1(o0)
        c1 = torch.cat([c0, b1], 1)
        o1 = F.relu(self.c1(c1))
        b2 = self.b2(o1)
        c2 = torch.cat([c1, b2], 1)
        o2 = F.relu(self.c2(c2))
        b3 = self.b3(o2)
        c3 = torch.cat([c2, b3], 1)
        return F.relu(self.c3(c3))


class CARNM(nn.Module):
    def __init__(self, scale=3, c=64, group=4):
        super().__init__()
        self.sub_mean = nn.Parameter(torch.tensor([0.4488, 0.4371, 0.4040]).view(1, 3, 1, 1), requires_grad=False)
        self.entry = nn.Conv2d(3, c, 3, 1, 1)
        self.b1, self.b2, self.b3 = CascadingBlock(c, group), CascadingBlock(c, group), CascadingBlock(c, group)
        self.c1 = nn.Conv2d(2 * c, c, 1)
        self.c2 = nn.Conv2d(3 * c, c, 1)
        self.c3 = nn.Conv2d(4 * c, c, 1)
        self.upsample = nn.Sequential(nn.Conv2d(c, c * scale * scale, 3, 1, 1, groups=group), nn.ReLU(True),
                                      nn.PixelShuffle(scale))
        self.exit = nn.Conv2d(c, 3, 3, 1, 1)

    def forward(self, x):
        x = self.entry(x - self.sub_mean)
        c0 = o0 = x
        c1 = torch.cat([c0, self.b1(o0)], 1)
        o1 = F.relu(self.c1(c1))
        c2 = torch.cat([c1, self.b2(o1)], 1)
        o2 = F.relu(self.c2(c2))
        c3 = torch.cat([c2, self.b3(o2)], 1)
        o3 = F.relu(self.c3(c3))
        return self.exit(self.upsample(o3)) + self.sub_mean


class H5Patches(Dataset):
    """HR/LR images of DIV2K packed into one HDF5 file: /HR/<id>, /LR/<id>."""

    def __init__(self, h5_path, scale, patch):
        self.h5_path, self.scale, self.patch = h5_path, scale, patch
        with h5py.File(h5_path, "r") as f:
            self.keys = sorted(f["HR"].keys())
        self.f = None

    def __len__(self):
        return len(self.keys) * 20

    def __getitem__(self, idx):
        if self.f is None:
            self.f = h5py.File(self.h5_path, "r")
        key = self.keys[idx % len(self.keys)]
        hr_ds, lr_ds = self.f["HR"][key], self.f["LR"][key]
        p, s = self.patch, self.scale
        y, x = random.randint(0, lr_ds.shape[0] - p), random.randint(0, lr_ds.shape[1] - p)
        lr = lr_ds[y:y + p, x:x + p]
        hr = hr_ds[y * s:(y + p) * s, x * s:(x + p) * s]
        if random.random() < 0.5:
            lr, hr = np.flip(lr, 1), np.flip(hr, 1)
        if random.random() < 0.5:
            lr, hr = np.rot90(lr), np.rot90(hr)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a).transpose(2, 0, 1).copy()).float() / 255.0
        return t(lr), t(hr)


def load_benchmark(folder, scale):
    import imageio.v2 as imageio
    names = sorted(os.listdir(os.path.join(folder, "HR")))
    pairs = []
    for n in names:
        hr = imageio.imread(os.path.join(folder, "HR", n))
        lr = imageio.imread(os.path.join(folder, "LR_bicubic", f"X{scale}", n.replace(".png", f"x{scale}.png")))
        hr = hr[: lr.shape[0] * scale, : lr.shape[1] * scale]
        pairs.append((lr, hr))
    return pairs


def psnr_y(sr, hr, s):
    sr = sr.astype(np.float64) / 255.0
    hr = hr.astype(np.float64) / 255.0
    coef = np.array([65.481, 128.553, 24.966]) / 255.0
    d = ((sr - hr) @ coef)[s:-s, s:-s]
    return 10 * np.log10(1.0 / np.mean(d ** 2))


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    random.seed(rank)
    torch.manual_seed(0)

    train_set = H5Patches(os.path.join(args.data, args.h5), args.scale, args.patch)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler, num_workers=4, pin_memory=True,
                        drop_last=True)
    bench = load_benchmark(args.val, args.scale)

    net = CARNM(args.scale, group=args.group).to(device)
    model = DDP(net, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(filter(lambda p: p.requires_grad, model.parameters()), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=200, gamma=0.5)

    if rank == 0:
        os.makedirs(args.ckpt, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for lr, hr in loader:
            lr, hr = lr.to(device, non_blocking=True), hr.to(device, non_blocking=True)
            loss = F.l1_loss(model(lr), hr)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
        scheduler.step()

        if epoch % 10 == 0:
            net.eval()
            acc = torch.zeros(2, device=device, dtype=torch.float64)
            with torch.no_grad():
                for lr_np, hr_np in bench[rank::world]:
                    inp = torch.from_numpy(lr_np.transpose(2, 0, 1).copy()).float().div(255)[None].to(device)
                    sr = net(inp).clamp(0, 1)[0].permute(1, 2, 0).mul(255).round().byte().cpu().numpy()
                    acc[0] += psnr_y(sr, hr_np, args.scale)
                    acc[1] += 1
            dist.all_reduce(acc)
            if rank == 0:
                print(f"epoch {epoch}: loss {loss.item():.4f}  B100 PSNR-Y {(acc[0] / acc[1]).item():.3f} "
                      f"({time.time() - t0:.0f}s)", flush=True)
                torch.save(net.state_dict(), os.path.join(args.ckpt, f"carn_m_{epoch:04d}.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
