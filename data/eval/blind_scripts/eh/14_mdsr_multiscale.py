"""MDSR: one network for x2/x3/x4 (shared body, scale-specific pre-processing and upsamplers).

Each iteration trains one scale; scales are visited round-robin so every scale sees the same
number of updates.

    torchrun --nproc_per_node=4 14_mdsr_multiscale.py --div2k /data/DIV2K
"""
import argparse
import math
import os
import random

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def default_conv(cin, cout, k, bias=True):
    return nn.Conv2d(cin, cout, k, padding=k // 2, bias=bias)


class MeanShift(nn.Conv2d):
    def __init__(self, sign, rgb_mean=(0.4488, 0.4371, 0.4040), rgb_range=255):
        super().__init__(3, 3, 1)
        self.weight.data = torch.eye(3).view(3, 3, 1, 1)
        self.bias.data = sign * rgb_range * torch.tensor(rgb_mean)
        self.requires_grad_(False)


class ResBlock(nn.Module):
    def __init__(self, nf, k=3, res_scale=1.0):
        super().__init__()
        self.body = nn.Sequential(default_conv(nf, nf, k), nn.ReLU(True), default_conv(nf, nf, k))
        self.res_scale = res_scale

    def forward(self, x):
        return x + self.body(x).mul(self.res_scale)


class Upsampler(nn.Sequential):
    def __init__(self, scale, nf):
        m = []
        if scale & (scale - 1) == 0:
            for _ in range(int(math.log2(scale))):
                m += [default_conv(nf, 4 * nf, 3), nn.PixelShuffle(2)]
        elif scale == 3:
            m += [default_conv(nf, 9 * nf, 3), nn.PixelShuffle(3)]
        else:
            raise NotImplementedError(scale)
        super().__init__(*m)


class MDSR(nn.Module):
    def __init__(self, scales=(2, 3, 4), nf=64, n_resblocks=80):
        super().__init__()
        self.scales = scales
        self.sub_mean, self.add_mean = MeanShift(-1), MeanShift(1)
        self.head = default_conv(3, nf, 3)
        self.pre_process = nn.ModuleList(nn.Sequential(ResBlock(nf, 5), ResBlock(nf, 5)) for _ in scales)
        self.body = nn.Sequential(*[ResBlock(nf) for _ in range(n_resblocks)], default_conv(nf, nf, 3))
        self.upsample = nn.ModuleList(Upsampler(s, nf) for s in scales)
        self.tail = default_conv(nf, 3, 3)

    def forward(self, x, scale_idx):
        x = self.head(self.sub_mean(x))
        x = self.pre_process[scale_idx](x)
        x = x + self.body(x)
        x = self.upsample[scale_idx](x)
        return self.add_mean(self.tail(x))


class DIV2KScale(Dataset):
    def __init__(self, root, scale, split="train", patch=96, repeat=10):
        first, last = (1, 800) if split == "train" else (801, 810)
        self.ids = [f"{i:04d}" for i in range(first, last + 1)]
        sub = "train" if split == "train" else "valid"
        self.hr_dir = os.path.join(root, f"DIV2K_{sub}_HR")
        self.lr_dir = os.path.join(root, f"DIV2K_{sub}_LR_bicubic", f"X{scale}")
        self.scale, self.patch, self.repeat = scale, patch, (repeat if split == "train" else 1)
        self.train = split == "train"

    def __len__(self):
        return len(self.ids) * self.repeat

    def __getitem__(self, idx):
        name = self.ids[idx % len(self.ids)]
        hr = imageio.imread(os.path.join(self.hr_dir, f"{name}.png"))
        lr = imageio.imread(os.path.join(self.lr_dir, f"{name}x{self.scale}.png"))
        if self.train:
            lp = self.patch // self.scale
            y, x = random.randrange(lr.shape[0] - lp + 1), random.randrange(lr.shape[1] - lp + 1)
            lr = lr[y:y + lp, x:x + lp]
            hr = hr[y * self.scale:(y + lp) * self.scale, x * self.scale:(x + lp) * self.scale]
            if random.random() < 0.5:
                lr, hr = lr[:, ::-1], hr[:, ::-1]
            if random.random() < 0.5:
                lr, hr = lr[::-1], hr[::-1]
        else:
            hr = hr[: lr.shape[0] * self.scale, : lr.shape[1] * self.scale]
        f = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))).float()
        return f(lr), f(hr)


def psnr_y(sr, hr, scale, rgb_range=255.0):
    diff = (sr - hr) / rgb_range
    gray = diff.new_tensor([65.738, 129.057, 25.064]).view(1, 3, 1, 1) / 256
    diff = (diff * gray).sum(1)[..., scale:-scale, scale:-scale]
    return -10 * torch.log10(diff.pow(2).mean())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--div2k", required=True)
    ap.add_argument("--scales", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--batch-per-gpu", type=int, default=4)
    ap.add_argument("--iters", type=int, default=600000)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--save", default="experiment/mdsr")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)
    random.seed(1 + rank)

    samplers, loaders, iters = [], [], []
    for s in args.scales:
        ds = DIV2KScale(args.div2k, s, "train")
        smp = DistributedSampler(ds, shuffle=True)
        dl = DataLoader(ds, batch_size=args.batch_per_gpu, sampler=smp, num_workers=4, pin_memory=True,
                        drop_last=True)
        samplers.append(smp)
        loaders.append(dl)
        iters.append(iter(dl))
    epochs = [0] * len(args.scales)
    val_sets = [DIV2KScale(args.div2k, s, "val") for s in args.scales]

    net = MDSR(tuple(args.scales)).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                 betas=(0.9, 0.999), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=200000, gamma=0.5)
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)

    for it in range(1, args.iters + 1):
        si = it % len(args.scales)
        try:
            lr, hr = next(iters[si])
        except StopIteration:
            epochs[si] += 1
            samplers[si].set_epoch(epochs[si])
            iters[si] = iter(loaders[si])
            lr, hr = next(iters[si])
        lr, hr = lr.to(device, non_blocking=True), hr.to(device, non_blocking=True)

        sr = model(lr, si)
        loss = F.l1_loss(sr, hr)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()

        if rank == 0 and it % 300 == 0:
            print(f"[{it}/{args.iters}] x{args.scales[si]} L1 {loss.item():.3f}", flush=True)

        if it % 20000 == 0:
            net.eval()
            res = torch.zeros(len(args.scales), 2, device=device, dtype=torch.float64)
            with torch.no_grad():
                for k, vs in enumerate(val_sets):
                    for j in range(rank, len(vs), world):
                        vlr, vhr = vs[j]
                        out = net(vlr[None].to(device), k).clamp(0, 255).round()
                        res[k, 0] += psnr_y(out, vhr[None].to(device), args.scales[k])
                        res[k, 1] += 1
            net.train()
            dist.all_reduce(res)
            if rank == 0:
                msg = "  ".join(f"x{s}: {(res[k, 0] / res[k, 1]).item():.3f}" for k, s in enumerate(args.scales))
                print(f"[{it}] DIV2K-val(801-810) PSNR {msg}", flush=True)
                torch.save({"model": net.state_dict(), "it": it}, os.path.join(args.save, "model_latest.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
