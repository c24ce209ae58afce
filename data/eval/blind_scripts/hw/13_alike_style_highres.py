"""ALIKE-style keypoint + descriptor training at high resolution (800px) with homographic pairs.

    torchrun --nproc_per_node=8 13_alike_style_highres.py --image_list lists/oxparis_train.txt --out runs/alike_n800
"""
import argparse
import math
import os
import random

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--image_list", required=True)
    p.add_argument("--out", default="runs/alike")
    p.add_argument("--size", type=int, default=800)
    p.add_argument("--batch_size", type=int, default=2, help="pairs per GPU (memory bound at 800px)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--radius", type=int, default=2, help="DKD soft-argmax radius")
    p.add_argument("--top_k", type=int, default=1024)
    p.add_argument("--temp", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class HomographyPairs(Dataset):
    def __init__(self, list_file, size):
        with open(list_file) as f:
            self.paths = [l.strip() for l in f if l.strip()]
        self.size = size

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = cv2.imread(self.paths[i], cv2.IMREAD_COLOR)
        img = cv2.cvtColor(cv2.resize(img, (self.size, self.size), interpolation=cv2.INTER_AREA), cv2.COLOR_BGR2RGB)
        s = self.size
        src = np.float32([[0, 0], [s, 0], [s, s], [0, s]])
        dst = src + np.random.uniform(-0.2 * s, 0.2 * s, (4, 2)).astype(np.float32)
        H = cv2.getPerspectiveTransform(src, dst)
        warped = cv2.warpPerspective(img, H, (s, s))
        if random.random() < 0.5:
            warped = np.clip(warped.astype(np.float32) * random.uniform(0.6, 1.4), 0, 255).astype(np.uint8)
        to_t = lambda a: torch.from_numpy(a).permute(2, 0, 1).float() / 255.0
        return to_t(img), to_t(warped), torch.from_numpy(H.astype(np.float32))


class ResBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.skip = nn.Conv2d(cin, cout, 1, bias=False) if cin != cout else nn.Identity()

    def forward(self, x):
        return F.selu(self.b2(self.c2(F.selu(self.b1(self.c1(x))))) + self.skip(x))


class ALikeNet(nn.Module):
    def __init__(self, c=(32, 64, 128, 128), dim=128):
        super().__init__()
        self.block1 = nn.Sequential(nn.Conv2d(3, c[0], 3, padding=1), nn.BatchNorm2d(c[0]), nn.SELU(),
                                    nn.Conv2d(c[0], c[0], 3, padding=1), nn.BatchNorm2d(c[0]), nn.SELU())
        self.block2 = ResBlock(c[0], c[1])
        self.block3 = ResBlock(c[1], c[2])
        self.block4 = ResBlock(c[2], c[3])
        self.conv1 = nn.Conv2d(c[0], dim // 4, 1)
        self.conv2 = nn.Conv2d(c[1], dim // 4, 1)
        self.conv3 = nn.Conv2d(c[2], dim // 4, 1)
        self.conv4 = nn.Conv2d(c[3], dim // 4, 1)
        self.head = nn.Conv2d(dim, dim + 1, 1)

    def forward(self, x):
        x1 = self.block1(x)
        x2 = self.block2(F.max_pool2d(x1, 2))
        x3 = self.block3(F.max_pool2d(x2, 4))
        x4 = self.block4(F.max_pool2d(x3, 4))
        up = lambda t: F.interpolate(t, size=x1.shape[-2:], mode="bilinear", align_corners=True)
        f = torch.cat([F.selu(self.conv1(x1)), up(F.selu(self.conv2(x2))),
                       up(F.selu(self.conv3(x3))), up(F.selu(self.conv4(x4)))], 1)
        out = self.head(f)
        return torch.sigmoid(out[:, -1:]), F.normalize(out[:, :-1], dim=1)


def dkd(scores, radius, top_k, temp=0.1):
    """Differentiable keypoint detection: NMS picks, then soft-argmax refinement in (2r+1)^2 patches."""
    b, _, h, w = scores.shape
    k = 2 * radius + 1
    nms = scores == F.max_pool2d(scores, k, 1, radius)
    border = torch.zeros_like(nms)
    border[..., radius:-radius, radius:-radius] = True
    flat = (scores * (nms & border)).flatten(1)
    idx = flat.topk(top_k, dim=1).indices
    ys, xs = (idx // w).float(), (idx % w).float()
    patches = F.unfold(scores, k, padding=radius).view(b, k * k, h * w)
    p = patches.gather(2, idx[:, None].expand(-1, k * k, -1)).transpose(1, 2)
    soft = ((p - p.max(-1, keepdim=True).values) / temp).softmax(-1)
    off = torch.stack(torch.meshgrid(torch.arange(-radius, radius + 1), torch.arange(-radius, radius + 1),
                                     indexing="xy"), -1).reshape(-1, 2).float().to(scores.device)
    kpts = torch.stack([xs, ys], -1) + soft @ off
    return kpts, scores.flatten(1).gather(1, idx)


def sample_desc(desc, kpts):
    h, w = desc.shape[-2:]
    g = torch.stack([kpts[..., 0] / (w - 1), kpts[..., 1] / (h - 1)], -1) * 2 - 1
    return F.normalize(F.grid_sample(desc, g[:, None], align_corners=True)[:, :, 0].transpose(1, 2), dim=-1)


def warp(k, H):
    p = torch.cat([k, torch.ones_like(k[..., :1])], -1) @ H.transpose(1, 2)
    return p[..., :2] / p[..., 2:]


def losses(s0, d0, s1, d1, H, args):
    k0, sc0 = dkd(s0, args.radius, args.top_k)
    k1, sc1 = dkd(s1, args.radius, args.top_k)
    k0w = warp(k0, H)
    dist_mat = torch.cdist(k0w, k1)
    nn_d, nn_i = dist_mat.min(2)
    inside = (k0w >= 0).all(-1) & (k0w < args.size - 1).all(-1)
    close = inside & (nn_d < 5)
    # reprojection loss on matched keypoints (pulls soft keypoints together)
    l_rp = (nn_d * close).sum() / close.sum().clamp(min=1)
    # descriptor: dual softmax over keypoints, positives = nearest reprojected keypoint
    f0, f1 = sample_desc(d0, k0), sample_desc(d1, k1)
    sim = f0 @ f1.transpose(1, 2) / args.temp
    logp = sim.log_softmax(2) + sim.log_softmax(1)
    l_ds = -(logp.gather(2, nn_i[..., None])[..., 0] * close).sum() / close.sum().clamp(min=1)
    # score supervision: matched keypoints should have high score, others low (ALIKE "reliability")
    rel = torch.exp(logp.gather(2, nn_i[..., None])[..., 0]).detach()
    l_sc = F.binary_cross_entropy(sc0.clamp(1e-6, 1 - 1e-6), (rel * close).clamp(0, 1))
    # peaky loss over score patches
    l_pk = 1 - (F.max_pool2d(s0, 5, 1, 2) - F.avg_pool2d(s0, 5, 1, 2)).mean()
    return l_rp + l_ds + l_sc + 0.5 * l_pk, close.float().mean()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(42)
    random.seed(42 + rank)
    np.random.seed(42 + rank)

    ds = HomographyPairs(args.image_list, args.size)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True,
                    worker_init_fn=lambda w: np.random.seed((torch.initial_seed() + w) % 2 ** 32))

    model = DDP(ALikeNet().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    steps = args.epochs * len(dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    writer = SummaryWriter(args.out) if rank == 0 else None

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for im0, im1, H in dl:
            im0, im1, H = im0.to(device, non_blocking=True), im1.to(device, non_blocking=True), H.to(device)
            s, d = model(torch.cat([im0, im1]))
            b = im0.size(0)
            loss, ratio = losses(s[:b], d[:b], s[b:], d[b:], H, args)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if step % 50 == 0:
                t = torch.stack([loss.detach(), ratio.detach()])
                dist.all_reduce(t)
                t /= world
                if rank == 0:
                    writer.add_scalar("train/loss", t[0].item(), step)
                    writer.add_scalar("train/matched_ratio", t[1].item(), step)
            step += 1
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"alike_e{epoch:02d}.pt"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
