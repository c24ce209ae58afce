"""MDSR: one network for x2, x3 and x4 bicubic SR (shared body, scale-specific heads and tails).

Batches alternate between scales: iteration i trains scale SCALES[i % 3].

    torchrun --nproc_per_node=4 11_mdsr_multiscale.py --data /data/DIV2K --out experiments/mdsr
"""
import argparse
import itertools
import math
import os
import random
import time
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SCALES = (2, 3, 4)


class ResBlock(nn.Module):
    def __init__(self, c, k=3):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, k, padding=k // 2), nn.ReLU(True), nn.Conv2d(c, c, k, padding=k // 2))

    def forward(self, x):
        return x + self.body(x)


def make_upsampler(scale, c):
    if scale == 3:
        return nn.Sequential(nn.Conv2d(c, 9 * c, 3, padding=1), nn.PixelShuffle(3))
    layers = []
    for _ in range(int(math.log2(scale))):
        layers += [nn.Conv2d(c, 4 * c, 3, padding=1), nn.PixelShuffle(2)]
    return nn.Sequential(*layers)


class MDSR(nn.Module):
    def __init__(self, n_feats=64, n_resblocks=80):
        super().__init__()
        self.register_buffer("rgb_mean", torch.tensor([0.4488, 0.4371, 0.4040]).view(1, 3, 1, 1))
        self.head = nn.Conv2d(3, n_feats, 3, padding=1)
        self.pre_process = nn.ModuleDict({str(s): nn.Sequential(ResBlock(n_feats, 5), ResBlock(n_feats, 5))
                                          for s in SCALES})
        self.body = nn.Sequential(*[ResBlock(n_feats) for _ in range(n_resblocks)],
                                  nn.Conv2d(n_feats, n_feats, 3, padding=1))
        self.upsample = nn.ModuleDict({str(s): make_upsampler(s, n_feats) for s in SCALES})
        self.tail = nn.Conv2d(n_feats, 3, 3, padding=1)

    def forward(self, x, scale):
        x = self.head(x - self.rgb_mean)
        x = self.pre_process[str(scale)](x)
        x = x + self.body(x)
        return self.tail(self.upsample[str(scale)](x)) + self.rgb_mean


class DIV2KScale(Dataset):
    def __init__(self, root, scale, split="train", lr_patch=48, repeat=20):
        sub = "DIV2K_train" if split == "train" else "DIV2K_valid"
        self.hr = sorted(glob(os.path.join(root, f"{sub}_HR", "*.png")))
        self.lr = [os.path.join(root, f"{sub}_LR_bicubic", f"X{scale}",
                                os.path.basename(p).replace(".png", f"x{scale}.png")) for p in self.hr]
        self.scale, self.lr_patch = scale, lr_patch
        self.train = split == "train"
        self.repeat = repeat if self.train else 1

    def __len__(self):
        return len(self.hr) * self.repeat

    def __getitem__(self, i):
        i %= len(self.hr)
        hr = np.asarray(Image.open(self.hr[i]).convert("RGB"), np.float32) / 255.0
        lr = np.asarray(Image.open(self.lr[i]).convert("RGB"), np.float32) / 255.0
        s = self.scale
        if self.train:
            p = self.lr_patch
            y, x = random.randrange(lr.shape[0] - p + 1), random.randrange(lr.shape[1] - p + 1)
            lr, hr = lr[y:y + p, x:x + p], hr[y * s:(y + p) * s, x * s:(x + p) * s]
            if random.random() < 0.5:
                lr, hr = lr[:, ::-1], hr[:, ::-1]
            if random.random() < 0.5:
                lr, hr = lr.transpose(1, 0, 2), hr.transpose(1, 0, 2)
        else:
            hr = hr[:lr.shape[0] * s, :lr.shape[1] * s]
        return (torch.from_numpy(np.ascontiguousarray(lr.transpose(2, 0, 1))),
                torch.from_numpy(np.ascontiguousarray(hr.transpose(2, 0, 1))))


def infinite(loader, sampler):
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def psnr_rgb(sr, hr, shave):
    sr = (sr.clamp(0, 1) * 255).round()
    diff = (sr - hr * 255)[..., shave:-shave, shave:-shave]
    return 10 * torch.log10(255.0 ** 2 / diff.pow(2).mean())


@torch.no_grad()
def evaluate(net, val_sets, device, rank, world, n_images=10):
    net.eval()
    res = torch.zeros(len(SCALES), 2, device=device)
    for k, s in enumerate(SCALES):
        for i in range(rank, min(n_images, len(val_sets[s])), world):
            lr, hr = val_sets[s][i]
            sr = net(lr.unsqueeze(0).to(device), s)
            res[k, 0] += psnr_rgb(sr, hr.unsqueeze(0).to(device), s + 6)
            res[k, 1] += 1
    dist.all_reduce(res)
    net.train()
    return {s: (res[k, 0] / res[k, 1]).item() for k, s in enumerate(SCALES)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/DIV2K")
    ap.add_argument("--out", default="experiments/mdsr")
    ap.add_argument("--batch_size", type=int, default=16, help="total, split over GPUs")
    ap.add_argument("--iters", type=int, default=600000)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval_every", type=int, default=10000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    model = DDP(MDSR().to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=200000, gamma=0.5)

    streams, val_sets = {}, {}
    for s in SCALES:
        ds = DIV2KScale(args.data, s, "train")
        sampler = DistributedSampler(ds, shuffle=True, seed=s)
        loader = DataLoader(ds, batch_size=args.batch_size // world, sampler=sampler, num_workers=3,
                            pin_memory=True, drop_last=True)
        streams[s] = infinite(loader, sampler)
        val_sets[s] = DIV2KScale(args.data, s, "valid")

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    for it in range(1, args.iters + 1):
        scale = SCALES[it % len(SCALES)]
        lr, hr = next(streams[scale])
        lr, hr = lr.to(device, non_blocking=True), hr.to(device, non_blocking=True)
        loss = F.l1_loss(model(lr, scale), hr)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()

        if rank == 0 and it % 300 == 0:
            print(f"it {it} x{scale} L1 {loss.item():.4f} ({time.time() - t0:.1f}s)", flush=True)
            t0 = time.time()
        if it % args.eval_every == 0:
            res = evaluate(model.module, val_sets, device, rank, world)
            if rank == 0:
                print(f"[eval {it}] " + "  ".join(f"x{s}: {p:.3f}dB" for s, p in res.items()), flush=True)
                torch.save({"it": it, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict()}, os.path.join(args.out, "mdsr_latest.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
