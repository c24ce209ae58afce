"""Lightweight iterative stereo network (RAFT-Stereo-like 1D correlation + GRU)
for full-resolution Middlebury/ETH3D/InStereo2K fine-tuning.

Memory tricks: non-reentrant activation checkpointing of each GRU update and
gradient accumulation over `--accum` micro-batches.

    torchrun --nproc_per_node=8 17_stereo_gru_ckpt_accum.py --root /data/stereo_hr --accum 4
"""
import argparse
import os
import pickle
import time
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from utils.frame_io import read_image, read_disp  # local helpers: uint8 HWC image, float32 HW disparity


# --------------------------------------------------------------------------- data
def build_index(root, cache_path):
    """Scan once on rank 0; other ranks wait and read the finished file."""
    if dist.get_rank() == 0 and not os.path.exists(cache_path):
        items = []
        for sub in ("middlebury", "eth3d", "instereo2k"):
            for left in sorted(glob(os.path.join(root, sub, "**", "im0.png"), recursive=True)):
                d = os.path.dirname(left)
                items.append({"left": left, "right": os.path.join(d, "im1.png"),
                              "disp": os.path.join(d, "disp0GT.pfm"), "source": sub})
        tmp = cache_path + f".tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            pickle.dump(items, f)
        os.replace(tmp, cache_path)
    dist.barrier()
    with open(cache_path, "rb") as f:
        return pickle.load(f)


class HighResStereo(Dataset):
    def __init__(self, items, crop=(512, 768)):
        self.items = items
        self.crop = crop

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        left, right = read_image(it["left"]), read_image(it["right"])
        disp = read_disp(it["disp"])
        h, w = disp.shape
        ch, cw = self.crop
        # Middlebury full-res is ~2x the others: random downscale keeps disparity ranges comparable
        s = np.random.uniform(0.5, 1.0) if it["source"] == "middlebury" else np.random.uniform(0.8, 1.2)
        s = max(s, ch / h + 1e-3, cw / w + 1e-3)
        tensors = [torch.from_numpy(np.ascontiguousarray(a)).permute(2, 0, 1).float()[None] for a in (left, right)]
        size = (int(h * s), int(w * s))
        left, right = [F.interpolate(t, size=size, mode="bilinear", align_corners=False)[0] for t in tensors]
        disp = torch.from_numpy(np.nan_to_num(disp, posinf=0.0))[None, None]
        disp = F.interpolate(disp, size=size, mode="nearest")[0] * s
        y = np.random.randint(0, size[0] - ch + 1)
        x = np.random.randint(0, size[1] - cw + 1)
        sl = (slice(None), slice(y, y + ch), slice(x, x + cw))
        disp = disp[sl]
        return left[sl], right[sl], disp, (disp[0] > 0).float()


# --------------------------------------------------------------------------- model
def conv(cin, cout, s=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, s, 1), nn.InstanceNorm2d(cout), nn.ReLU(inplace=True))


class FeatEncoder(nn.Module):
    def __init__(self, out=128):
        super().__init__()
        self.body = nn.Sequential(conv(3, 48, 2), conv(48, 64), conv(64, 96, 2), conv(96, 96), nn.Conv2d(96, out, 1))

    def forward(self, x):
        return self.body(x)


class Corr1D:
    def __init__(self, f1, f2, levels=4, radius=4):
        b, c, h, w = f1.shape
        corr = torch.einsum("bchi,bchj->bhij", f1, f2) / c ** 0.5  # (b, h, w1, w2)
        corr = corr.reshape(b * h * w, 1, 1, w)
        self.pyr = [corr]
        for _ in range(levels - 1):
            corr = F.avg_pool2d(corr, (1, 2), (1, 2))
            self.pyr.append(corr)
        self.r = radius

    def __call__(self, disp):
        b, _, h, w = disp.shape
        x0 = torch.arange(w, device=disp.device, dtype=disp.dtype).view(1, 1, 1, w) - disp
        dx = torch.linspace(-self.r, self.r, 2 * self.r + 1, device=disp.device, dtype=disp.dtype)
        feats = []
        for i, corr in enumerate(self.pyr):
            W = corr.shape[-1]
            xs = x0.permute(0, 2, 3, 1).reshape(b * h * w, 1, 1, 1) / 2 ** i + dx.view(1, 1, -1, 1)
            grid = torch.cat([2 * xs / max(W - 1, 1) - 1, torch.zeros_like(xs)], -1)
            feats.append(F.grid_sample(corr, grid, align_corners=True).view(b, h, w, -1))
        return torch.cat(feats, -1).permute(0, 3, 1, 2)


class Update(nn.Module):
    def __init__(self, corr_ch, hid=96):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(corr_ch + 1, 96, 3, padding=1), nn.ReLU(inplace=True))
        self.zr = nn.Conv2d(hid + 96 + hid, 2 * hid, 3, padding=1)
        self.q = nn.Conv2d(hid + 96 + hid, hid, 3, padding=1)
        self.head = nn.Sequential(nn.Conv2d(hid, 128, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(128, 1, 3, padding=1))

    def forward(self, h, ctx, corr, disp):
        x = torch.cat([self.enc(torch.cat([corr, disp], 1)), ctx], 1)
        z, r = torch.sigmoid(self.zr(torch.cat([h, x], 1))).chunk(2, 1)
        q = torch.tanh(self.q(torch.cat([r * h, x], 1)))
        h = (1 - z) * h + z * q
        return h, self.head(h)


class IterStereo(nn.Module):
    def __init__(self, levels=4, radius=4, grad_ckpt=True):
        super().__init__()
        self.fnet, self.cnet = FeatEncoder(128), FeatEncoder(192)
        self.update = Update(levels * (2 * radius + 1))
        self.levels, self.radius, self.grad_ckpt = levels, radius, grad_ckpt

    def forward(self, left, right, iters=12):
        left, right = 2 * left / 255.0 - 1, 2 * right / 255.0 - 1
        f1, f2 = self.fnet(torch.cat([left, right])).chunk(2)
        h, ctx = self.cnet(left).split([96, 96], 1)
        h, ctx = torch.tanh(h), F.relu(ctx)
        corr_fn = Corr1D(f1.float(), f2.float(), self.levels, self.radius)
        disp = torch.zeros_like(f1[:, :1])
        preds = []
        for _ in range(iters):
            disp = disp.detach()
            corr = corr_fn(disp)
            if self.grad_ckpt and self.training:
                h, delta = checkpoint(self.update, h, ctx, corr, disp, use_reentrant=False)
            else:
                h, delta = self.update(h, ctx, corr, disp)
            disp = F.relu(disp + delta)
            preds.append(4.0 * F.interpolate(disp, scale_factor=4, mode="bilinear", align_corners=False))
        return preds


# --------------------------------------------------------------------------- train
def seq_loss(preds, gt, valid, gamma=0.9):
    n = len(preds)
    m = valid[:, None].bool() & (gt < 512)
    return sum(gamma ** (n - i - 1) * (p - gt).abs()[m].mean() for i, p in enumerate(preds))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="runs/iterstereo_hr")
    ap.add_argument("--init", default=None)
    ap.add_argument("--steps", type=int, default=40000, help="optimizer steps")
    ap.add_argument("--bs", type=int, default=1, help="micro-batch per GPU")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--iters", type=int, default=16)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    np.random.seed(17 + rank)

    items = build_index(args.root, os.path.join(args.root, "index_hr.pkl"))
    ds = HighResStereo(items)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)

    net = IterStereo().to(dev)
    if args.init:
        net.load_state_dict(torch.load(args.init, map_location="cpu"))
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, args.steps + 100, pct_start=0.02,
                                                cycle_momentum=False, anneal_strategy="linear")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step, epoch, micro = 0, 0, 0
    t0 = time.time()
    loss_acc = torch.zeros(2, device=dev)
    model.train()
    opt.zero_grad(set_to_none=True)
    while step < args.steps:
        sampler.set_epoch(epoch)
        for left, right, disp, valid in dl:
            left, right = left.to(dev, non_blocking=True), right.to(dev, non_blocking=True)
            disp, valid = disp.to(dev, non_blocking=True), valid.to(dev, non_blocking=True)
            micro += 1
            last_micro = micro % args.accum == 0
            if last_micro:
                loss = seq_loss(model(left, right, iters=args.iters), disp, valid) / args.accum
                loss.backward()
            else:
                with model.no_sync():  # local accumulation, all-reduce only on the last micro-batch
                    loss = seq_loss(model(left, right, iters=args.iters), disp, valid) / args.accum
                    loss.backward()
            loss_acc += torch.stack([loss.detach() * args.accum, torch.ones((), device=dev)])
            if not last_micro:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0:
                dist.all_reduce(loss_acc)
                if rank == 0:
                    print(f"step {step} loss {(loss_acc[0] / loss_acc[1]).item():.4f} "
                          f"{(time.time() - t0) / 50:.2f}s/step", flush=True)
                loss_acc.zero_()
                t0 = time.time()
            if step % 2000 == 0 and rank == 0:
                torch.save({"model": model.module.state_dict(), "step": step},
                           os.path.join(args.out, f"iterstereo_{step:06d}.pth"))
            if step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        torch.save({"model": model.module.state_dict(), "step": step}, os.path.join(args.out, "final.pth"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
