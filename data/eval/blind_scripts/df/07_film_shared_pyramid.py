"""FILM-style interpolator: scale-agnostic shared feature extractor and a flow estimator shared across the coarse
pyramid levels. Trained on Vimeo-90K triplets, evaluated on full test sequences (every odd frame is
reconstructed from its two neighbours).

    torchrun --nproc_per_node=8 07_film_shared_pyramid.py --vimeo /data/vimeo_triplet --test_seqs /data/davis_480p
"""
import argparse
import contextlib
import copy
import glob
import math
import os
import random

import lpips
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

LEVELS = 5
SHARED_FROM = 2  # pyramid levels >= SHARED_FROM use the shared flow estimator


def load_rgb(path):
    return torch.from_numpy(np.asarray(Image.open(path).convert("RGB")).copy()).permute(2, 0, 1).float() / 255.0


class VimeoTriplets(Dataset):
    def __init__(self, root, crop=256):
        with open(os.path.join(root, "tri_trainlist.txt")) as f:
            self.seqs = [os.path.join(root, "sequences", s.strip()) for s in f if s.strip()]
        self.crop = crop

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        x = torch.stack([load_rgb(os.path.join(self.seqs[i], f"im{k}.png")) for k in (1, 2, 3)])
        _, _, h, w = x.shape
        top, left = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
        x = x[..., top:top + self.crop, left:left + self.crop]
        if random.random() < 0.5:
            x = x.flip(-1)
        if random.random() < 0.5:
            x = x.flip(0)
        k = random.randint(0, 3)
        return torch.rot90(x, k, dims=(-2, -1))


def conv(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1), nn.LeakyReLU(0.2, inplace=True))


def warp(x, flow):
    n, _, h, w = flow.shape
    yy, xx = torch.meshgrid(torch.arange(h, device=x.device), torch.arange(w, device=x.device), indexing="ij")
    flow = flow.float()
    gx = 2.0 * (xx[None] + flow[:, 0]) / max(w - 1, 1) - 1.0
    gy = 2.0 * (yy[None] + flow[:, 1]) / max(h - 1, 1) - 1.0
    return F.grid_sample(x, torch.stack([gx, gy], -1), align_corners=True, padding_mode="border")


class FeatureExtractor(nn.Module):
    def __init__(self, c=32, depth=3):
        super().__init__()
        self.stages = nn.ModuleList([nn.Sequential(conv(3 if i == 0 else c << (i - 1), c << i), conv(c << i, c << i))
                                     for i in range(depth)])

    def forward(self, x):
        out = []
        for i, st in enumerate(self.stages):
            x = st(F.avg_pool2d(x, 2) if i else x)
            out.append(x)
        return out


class FlowEstimator(nn.Module):
    def __init__(self, cin, c=128):
        super().__init__()
        self.net = nn.Sequential(conv(2 * cin, c), conv(c, c), conv(c, c // 2), nn.Conv2d(c // 2, 2, 3, 1, 1))

    def forward(self, fa, fb):
        return self.net(torch.cat([fa, fb], 1))


class FILMNet(nn.Module):
    def __init__(self, c=32, grad_ckpt=True):
        super().__init__()
        self.grad_ckpt = grad_ckpt
        self.extract = FeatureExtractor(c)
        chans = [c, c + 2 * c] + [c + 2 * c + 4 * c] * (LEVELS - 2)
        self.chans = chans
        self.est_fine = nn.ModuleList([FlowEstimator(chans[0], 64), FlowEstimator(chans[1], 96)])
        self.est_shared = FlowEstimator(chans[SHARED_FROM], 160)
        dec = [64, 96, 128, 128, 128]
        self.fuse = nn.ModuleList()
        for l in range(LEVELS):
            cin = 2 * 3 + 2 * chans[l] + 4 + (dec[l + 1] if l + 1 < LEVELS else 0)
            self.fuse.append(nn.Sequential(conv(cin, dec[l]), conv(dec[l], dec[l])))
        self.out = nn.Conv2d(dec[0], 3, 1)

    def _maybe_ckpt(self, fn, *xs):
        if self.grad_ckpt and self.training:
            return checkpoint(fn, *xs, use_reentrant=False)
        return fn(*xs)

    def pyramid_features(self, img):
        imgs = [img]
        for _ in range(LEVELS - 1):
            imgs.append(F.avg_pool2d(imgs[-1], 2))
        per_level = [self._maybe_ckpt(self.extract, im) for im in imgs]
        feats = []
        for l in range(LEVELS):
            parts = [per_level[l - d][d] for d in range(3) if l - d >= 0]
            feats.append(torch.cat(parts, 1))
        return imgs, feats

    def estimator(self, l):
        return self.est_fine[l] if l < SHARED_FROM else self.est_shared

    def flows(self, fa, fb):
        flow, out = None, [None] * LEVELS
        for l in reversed(range(LEVELS)):
            if flow is not None:
                flow = 2.0 * F.interpolate(flow, scale_factor=2.0, mode="bilinear", align_corners=False)
                fb_w = warp(fb[l], flow)
            else:
                flow = torch.zeros_like(fa[l][:, :2])
                fb_w = fb[l]
            flow = flow + self._maybe_ckpt(self.estimator(l), fa[l], fb_w)
            out[l] = flow
        return out

    def forward(self, img0, img1):
        imgs0, f0 = self.pyramid_features(img0)
        imgs1, f1 = self.pyramid_features(img1)
        flow_01, flow_10 = self.flows(f0, f1), self.flows(f1, f0)
        x = None
        for l in reversed(range(LEVELS)):
            fl0, fl1 = 0.5 * flow_01[l], 0.5 * flow_10[l]
            parts = [warp(imgs0[l], fl1), warp(imgs1[l], fl0), warp(f0[l], fl1), warp(f1[l], fl0), fl0, fl1]
            if x is not None:
                parts.append(F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=False))
            x = self.fuse[l](torch.cat(parts, 1))
        return self.out(x)


def list_test_sequences(root):
    seqs = []
    for d in sorted(glob.glob(os.path.join(root, "*"))):
        frames = sorted(glob.glob(os.path.join(d, "*.png")) + glob.glob(os.path.join(d, "*.jpg")))
        if len(frames) >= 3:
            seqs.append(frames)
    return seqs


@torch.no_grad()
def eval_sequences(net, seqs, lp, device, rank, world):
    net.eval()
    stats = torch.zeros(3, dtype=torch.float64, device=device)  # psnr, lpips, frames
    mult = 2 ** (LEVELS + 1)
    for frames in seqs[rank::world]:
        for k in range(1, len(frames) - 1, 2):
            a, gt, b = (load_rgb(frames[j]).unsqueeze(0).to(device) for j in (k - 1, k, k + 1))
            h, w = a.shape[-2:]
            ph, pw = (-h) % mult, (-w) % mult
            a_p = F.pad(a, (0, pw, 0, ph), mode="replicate")
            b_p = F.pad(b, (0, pw, 0, ph), mode="replicate")
            pred = net(a_p, b_p)[..., :h, :w].clamp(0, 1)
            mse = F.mse_loss(pred, gt)
            stats[0] += -10 * torch.log10(mse)
            stats[1] += lp(pred * 2 - 1, gt * 2 - 1).mean()
            stats[2] += 1
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vimeo", required=True)
    ap.add_argument("--test_seqs", required=True)
    ap.add_argument("--out", default="film_ckpt")
    ap.add_argument("--micro_batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--iters", type=int, default=300000, help="optimizer steps")
    ap.add_argument("--lpips_after", type=int, default=150000)
    ap.add_argument("--ema", type=float, default=0.9999)
    ap.add_argument("--eval_every", type=int, default=10000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)
    random.seed(42 + rank)

    net = FILMNet().to(device)
    ema = copy.deepcopy(net).requires_grad_(False).eval()
    lp = lpips.LPIPS(net="vgg").to(device).requires_grad_(False).eval()
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)
    it = 0
    ck = os.path.join(args.out, "last.pt")
    if os.path.exists(ck):
        state = torch.load(ck, map_location=device)
        net.load_state_dict(state["net"])
        ema.load_state_dict(state["ema"])
        opt.load_state_dict(state["opt"])
        it = state["it"]
    model = DDP(net, device_ids=[local_rank], gradient_as_bucket_view=True)

    ds = VimeoTriplets(args.vimeo)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.micro_batch, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    seqs = list_test_sequences(args.test_seqs)

    epoch, micro = it * args.accum // len(loader), 0
    while it < args.iters:
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = batch.to(device, non_blocking=True)
            img0, gt, img1 = batch[:, 0], batch[:, 1], batch[:, 2]
            micro += 1
            sync_now = micro % args.accum == 0
            with (contextlib.nullcontext() if sync_now else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model(img0, img1)
                pred = pred.float()
                loss = (pred - gt).abs().mean()
                if it >= args.lpips_after:
                    loss = loss + 0.1 * lp(pred.clamp(0, 1) * 2 - 1, gt * 2 - 1).mean()
                (loss / args.accum).backward()
            if not sync_now:
                continue

            lr = args.lr * 0.5 * (1 + math.cos(math.pi * it / args.iters))
            for g in opt.param_groups:
                g["lr"] = lr
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), net.parameters()):
                    pe.mul_(args.ema).add_(p.detach(), alpha=1 - args.ema)
            it += 1
            if rank == 0 and it % 100 == 0:
                print(f"it {it} loss {loss.item():.4f} lr {lr:.2e}", flush=True)

            if it % args.eval_every == 0 or it == args.iters:
                psnr, lpv = eval_sequences(ema, seqs, lp, device, rank, world)
                if rank == 0:
                    print(f"it {it}: sequences PSNR {psnr:.3f} LPIPS {lpv:.4f}", flush=True)
                    os.makedirs(args.out, exist_ok=True)
                    torch.save({"net": net.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(), "it": it},
                               ck + ".tmp")
                    os.replace(ck + ".tmp", ck)
                dist.barrier()
            if it >= args.iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
