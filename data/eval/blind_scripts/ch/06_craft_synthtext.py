"""CRAFT character-region / affinity training on SynthText (strong char-level supervision).

    torchrun --nproc_per_node=8 06_craft_synthtext.py --synth-root /datasets/SynthText
"""
import argparse
import math
import os
import random
import time

import cv2
import numpy as np
import scipy.io as sio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import vgg16_bn, VGG16_BN_Weights


# ----------------------------------------------------------------- targets
def gaussian_template(size=64, sigma=0.35):
    xs = np.linspace(-1, 1, size)
    xx, yy = np.meshgrid(xs, xs)
    g = np.exp(-(xx ** 2 + yy ** 2) / (2 * sigma ** 2))
    return (g / g.max()).astype(np.float32)


GAUSS = gaussian_template()
SRC_PTS = np.float32([[0, 0], [63, 0], [63, 63], [0, 63]])


def paint_box(heatmap, quad):
    quad = np.float32(quad)
    M = cv2.getPerspectiveTransform(SRC_PTS, quad)
    warped = cv2.warpPerspective(GAUSS, M, (heatmap.shape[1], heatmap.shape[0]))
    np.maximum(heatmap, warped, out=heatmap)


def affinity_quad(c1, c2):
    cen1, cen2 = c1.mean(0), c2.mean(0)
    tri = lambda c, cen, a, b: (c[a] + c[b] + cen) / 3.0
    return np.float32([tri(c1, cen1, 0, 1), tri(c2, cen2, 0, 1), tri(c2, cen2, 2, 3), tri(c1, cen1, 2, 3)])


class SynthTextChars(Dataset):
    def __init__(self, root, crop=768, max_items=None):
        gt = sio.loadmat(os.path.join(root, "gt.mat"))
        self.root = root
        self.names = gt["imnames"][0]
        self.char_bb = gt["charBB"][0]
        self.txt = gt["txt"][0]
        if max_items:
            self.names, self.char_bb, self.txt = self.names[:max_items], self.char_bb[:max_items], self.txt[:max_items]
        self.crop = crop

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        img = cv2.imread(os.path.join(self.root, self.names[i][0]))[:, :, ::-1]
        cbb = self.char_bb[i]
        cbb = cbb.reshape(2, 4, -1) if cbb.ndim == 2 else cbb
        chars = cbb.transpose(2, 1, 0).astype(np.float32)  # N, 4, 2
        words = [w for line in self.txt[i] for w in " ".join(line.split()).split()]

        h, w = img.shape[:2]
        scale = self.crop / max(h, w) * random.uniform(0.8, 1.6)
        img = cv2.resize(img, (int(w * scale), int(h * scale)))
        chars *= scale
        h, w = img.shape[:2]
        y0 = random.randint(0, max(0, h - self.crop))
        x0 = random.randint(0, max(0, w - self.crop))
        canvas = np.zeros((self.crop, self.crop, 3), np.uint8)
        patch = img[y0:y0 + self.crop, x0:x0 + self.crop]
        canvas[:patch.shape[0], :patch.shape[1]] = patch
        chars -= np.float32([x0, y0])

        out = self.crop // 2
        region = np.zeros((out, out), np.float32)
        affinity = np.zeros((out, out), np.float32)
        k = 0
        for word in words:
            wc = chars[k:k + len(word)] / 2.0
            k += len(word)
            for q in wc:
                paint_box(region, q)
            for a, b in zip(wc[:-1], wc[1:]):
                paint_box(affinity, affinity_quad(a, b))

        x = torch.from_numpy(np.ascontiguousarray(canvas)).permute(2, 0, 1).float() / 255.0
        x = (x - torch.tensor([0.485, 0.456, 0.406])[:, None, None]) / torch.tensor([0.229, 0.224, 0.225])[:, None, None]
        return x, torch.from_numpy(region), torch.from_numpy(affinity)


# -------------------------------------------------------------------- model
class DoubleConv(nn.Sequential):
    def __init__(self, cin, cmid, cout):
        super().__init__(
            nn.Conv2d(cin + cmid, cmid, 1), nn.BatchNorm2d(cmid), nn.ReLU(inplace=True),
            nn.Conv2d(cmid, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class CRAFT(nn.Module):
    def __init__(self):
        super().__init__()
        f = vgg16_bn(weights=VGG16_BN_Weights.IMAGENET1K_V1).features
        self.s1, self.s2, self.s3, self.s4 = f[:12], f[12:19], f[19:29], f[29:39]
        self.s5 = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(512, 1024, 3, padding=6, dilation=6),
                                nn.Conv2d(1024, 1024, 1))
        self.up1 = DoubleConv(1024, 512, 256)
        self.up2 = DoubleConv(512, 256, 128)
        self.up3 = DoubleConv(256, 128, 64)
        self.up4 = DoubleConv(128, 64, 32)
        self.cls = nn.Sequential(
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(32, 16, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(16, 16, 1), nn.ReLU(inplace=True),
            nn.Conv2d(16, 2, 1))

    def forward(self, x):
        h1 = self.s1(x)
        h2 = self.s2(h1)
        h3 = self.s3(h2)
        h4 = self.s4(h3)
        h5 = self.s5(h4)
        y = self.up1(torch.cat([h5, h4], 1))
        y = F.interpolate(y, size=h3.shape[2:], mode="bilinear", align_corners=False)
        y = self.up2(torch.cat([y, h3], 1))
        y = F.interpolate(y, size=h2.shape[2:], mode="bilinear", align_corners=False)
        y = self.up3(torch.cat([y, h2], 1))
        y = F.interpolate(y, size=h1.shape[2:], mode="bilinear", align_corners=False)
        y = self.up4(torch.cat([y, h1], 1))
        return self.cls(y)  # B, 2, H/2, W/2


def ohem_mse(pred, gt, neg_ratio=3, pos_thresh=0.1):
    loss = (pred - gt) ** 2
    total = loss.new_zeros(())
    for l, g in zip(loss, gt):
        pos = g > pos_thresh
        n_pos = int(pos.sum())
        neg_losses = l[~pos]
        n_neg = min(neg_losses.numel(), max(n_pos * neg_ratio, 500))
        hard_neg = neg_losses.topk(n_neg).values
        total = total + (l[pos].sum() + hard_neg.sum()) / (n_pos + n_neg)
    return total / loss.shape[0]


@torch.no_grad()
def validate(net, loader, dev):
    net.eval()
    tot = torch.zeros(2, device=dev)
    for x, region, affinity in loader:
        x = x.to(dev, non_blocking=True)
        region, affinity = region.to(dev), affinity.to(dev)
        out = net(x).float()
        tot[0] += (F.mse_loss(out[:, 0], region) + F.mse_loss(out[:, 1], affinity)) * x.shape[0]
        tot[1] += x.shape[0]
    dist.all_reduce(tot)
    net.train()
    return (tot[0] / tot[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--synth-root", required=True)
    ap.add_argument("--save-dir", default="weights/craft_synth")
    ap.add_argument("--crop", type=int, default=768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=50000)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=5000)
    ap.add_argument("--val-items", type=int, default=2000)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    random.seed(rank)
    np.random.seed(rank)

    full = SynthTextChars(args.synth_root, args.crop)
    n_train = len(full) - args.val_items
    ds = torch.utils.data.Subset(full, range(n_train))
    val_ds = torch.utils.data.Subset(full, range(n_train + rank, len(full), world))
    val_loader = DataLoader(val_ds, batch_size=args.batch, num_workers=4)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    net = CRAFT()
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(dev)
    net = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(net.parameters(), lr=args.lr, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[int(args.iters * 0.6), int(args.iters * 0.85)],
                                                 gamma=0.2)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    it, epoch = 0, 0
    t0 = time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for x, region, affinity in loader:
            if region.max() == 0:
                # random crop landed on background only
                continue
            x = x.to(dev, non_blocking=True)
            region, affinity = region.to(dev, non_blocking=True), affinity.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = net(x)
            out = out.float()
            loss = ohem_mse(out[:, 0], region) + ohem_mse(out[:, 1], affinity)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            it += 1
            if rank == 0 and it % 50 == 0:
                el = time.time() - t0
                print(f"iter {it}/{args.iters} ep {epoch} loss {loss.item():.5f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {el / it:.2f}s/it", flush=True)
            if it % args.save_every == 0:
                val_loss = validate(net, val_loader, dev)
                if rank == 0:
                    print(f"iter {it} val mse {val_loss:.5f}", flush=True)
                    torch.save({"net": net.module.state_dict(), "iter": it, "val_loss": val_loss},
                               os.path.join(args.save_dir, f"craft_{it:06d}.pth"))
            if it >= args.iters:
                break
        epoch += 1

    if rank == 0:
        torch.save({"net": net.module.state_dict(), "iter": it}, os.path.join(args.save_dir, "craft_final.pth"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
