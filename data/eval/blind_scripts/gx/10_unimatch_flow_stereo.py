"""Joint optical-flow / stereo training of one matching network (shared encoder).

Flow (FlyingThings3D) and stereo (SceneFlow disparity) batches alternate step by
step, the shared feature encoder sees both tasks.

    torchrun --nproc_per_node=8 10_unimatch_flow_stereo.py --things_root /data/FlyingThings3D \
        --out checkpoints/joint_flow_stereo
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from data.things import ThingsFlow, ThingsDisparity


def conv_block(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1), nn.InstanceNorm2d(cout), nn.ReLU(inplace=True))


class Encoder(nn.Module):
    """CNN features at 1/8 resolution."""

    def __init__(self, dim=128):
        super().__init__()
        self.net = nn.Sequential(
            conv_block(3, 64, 2), conv_block(64, 64),
            conv_block(64, 96, 2), conv_block(96, 96),
            conv_block(96, dim, 2), conv_block(dim, dim),
            nn.Conv2d(dim, dim, 1))

    def forward(self, x):
        return self.net(x)


def coords_grid(b, h, w, device):
    ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    return torch.stack([xs, ys], 0).float()[None].repeat(b, 1, 1, 1)


def global_flow(f0, f1):
    """softmax matching over all positions -> flow (GMFlow style)."""
    b, c, h, w = f0.shape
    q = f0.flatten(2).transpose(1, 2)          # b, hw, c
    k = f1.flatten(2)                          # b, c, hw
    prob = torch.softmax(torch.bmm(q, k) / c ** 0.5, dim=-1)
    grid = coords_grid(b, h, w, f0.device).flatten(2).transpose(1, 2)
    matched = torch.bmm(prob, grid)
    return (matched - grid).transpose(1, 2).reshape(b, 2, h, w)


def global_disparity(f0, f1):
    """softmax matching along the same row only (rectified stereo)."""
    b, c, h, w = f0.shape
    q = f0.permute(0, 2, 3, 1)                 # b, h, w, c
    k = f1.permute(0, 2, 1, 3)                 # b, h, c, w
    scores = torch.matmul(q, k) / c ** 0.5      # b, h, w, w
    # only matches to the left are allowed
    mask = torch.triu(torch.ones(w, w, device=f0.device, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(mask, -1e4)
    prob = torch.softmax(scores, dim=-1)
    xs = torch.arange(w, device=f0.device, dtype=f0.dtype)
    matched_x = torch.matmul(prob, xs)
    disp = xs.view(1, 1, w) - matched_x
    return disp[:, None].clamp(min=0)


class Refine(nn.Module):
    def __init__(self, dim, out_ch):
        super().__init__()
        self.net = nn.Sequential(conv_block(dim + out_ch, 128), conv_block(128, 128), nn.Conv2d(128, out_ch, 3, 1, 1))
        self.mask = nn.Sequential(conv_block(dim, 128), nn.Conv2d(128, 64 * 9, 1))

    def forward(self, feat, est):
        return est + self.net(torch.cat([feat, est], 1)), 0.25 * self.mask(feat)


def convex_upsample(x, mask, factor=8):
    b, c, h, w = x.shape
    mask = torch.softmax(mask.view(b, 1, 9, factor, factor, h, w), dim=2)
    up = F.unfold(factor * x, [3, 3], padding=1).view(b, c, 9, 1, 1, h, w)
    up = torch.sum(mask * up, dim=2).permute(0, 1, 4, 2, 5, 3)
    return up.reshape(b, c, factor * h, factor * w)


class UniMatcher(nn.Module):
    def __init__(self, dim=128, refine_iters=3):
        super().__init__()
        self.encoder = Encoder(dim)
        self.flow_refine = Refine(dim, 2)
        self.disp_refine = Refine(dim, 1)
        self.refine_iters = refine_iters

    def forward(self, img0, img1, task="flow"):
        x = torch.cat([img0, img1], 0)
        x = (x / 255.0 - 0.5) / 0.5
        f0, f1 = self.encoder(x).chunk(2, 0)
        if task == "flow":
            est, refine = global_flow(f0, f1), self.flow_refine
        else:
            est, refine = global_disparity(f0, f1), self.disp_refine
        preds = [F.interpolate(est, scale_factor=8, mode="bilinear", align_corners=True) * 8]
        for _ in range(self.refine_iters):
            est, up_mask = refine(f0, est)
            preds.append(convex_upsample(est, up_mask))
        return preds


def sequence_loss(preds, gt, valid, gamma=0.9):
    n = len(preds)
    loss = 0.0
    for i, p in enumerate(preds):
        loss = loss + gamma ** (n - i - 1) * ((p - gt).abs().sum(1) * valid).sum() / valid.sum().clamp(min=1)
    epe = ((preds[-1] - gt) ** 2).sum(1).sqrt()
    return loss, (epe * valid).sum() / valid.sum().clamp(min=1)


def infinite(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
        epoch += 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--things_root", required=True)
    ap.add_argument("--out", default="checkpoints/joint")
    ap.add_argument("--batch_size", type=int, default=4, help="per GPU, per task")
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--num_steps", type=int, default=200000)
    ap.add_argument("--flow_crop", type=int, nargs=2, default=[384, 768])
    ap.add_argument("--stereo_crop", type=int, nargs=2, default=[288, 576])
    ap.add_argument("--max_disp", type=float, default=400.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--save_every", type=int, default=10000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    np.random.seed(rank)

    flow_set = ThingsFlow(args.things_root, crop_size=args.flow_crop, split="train")
    disp_set = ThingsDisparity(args.things_root, crop_size=args.stereo_crop, split="train")
    flow_sampler = DistributedSampler(flow_set, shuffle=True)
    disp_sampler = DistributedSampler(disp_set, shuffle=True)
    flow_iter = infinite(DataLoader(flow_set, args.batch_size, sampler=flow_sampler, num_workers=args.workers,
                                    pin_memory=True, drop_last=True), flow_sampler)
    disp_iter = infinite(DataLoader(disp_set, args.batch_size, sampler=disp_sampler, num_workers=args.workers,
                                    pin_memory=True, drop_last=True), disp_sampler)

    model = UniMatcher().to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 10, pct_start=0.05,
                                                    cycle_momentum=False, anneal_strategy="cos")

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))

    t0 = time.time()
    for step in range(1, args.num_steps + 1):
        task = "flow" if step % 2 == 1 else "stereo"
        if task == "flow":
            img0, img1, gt, valid = [t.to(device, non_blocking=True) for t in next(flow_iter)]
            valid = valid * (gt.norm(dim=1) < 400).float()
        else:
            img0, img1, gt, valid = [t.to(device, non_blocking=True) for t in next(disp_iter)]
            valid = valid * (gt[:, 0] < args.max_disp).float()

        preds = model(img0, img1, task=task)
        loss, epe = sequence_loss(preds, gt, valid)

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()

        if step % 100 <= 1:
            stats = torch.stack([loss.detach(), epe.detach()])
            dist.all_reduce(stats)
            stats /= world
            if rank == 0:
                writer.add_scalar(f"{task}/loss", stats[0].item(), step)
                writer.add_scalar(f"{task}/epe", stats[1].item(), step)
                print(f"step {step} [{task}] loss {stats[0]:.3f} epe {stats[1]:.3f} "
                      f"{(time.time() - t0) / step:.2f}s/it", flush=True)

        if step % args.save_every == 0 and rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                       os.path.join(args.out, f"step_{step:06d}.pth"))

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.out, "final.pth"))
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
