"""Real-ESRNet style x4 blind SR (first, L1-only stage) with a second-order synthetic degradation
pipeline tuned to our phone sensor noise (shot/read noise, JPEG, sharpening halos).

    torchrun --nproc_per_node=8 09_realesrnet_degradation.py --hr-root /data/DF2K_OST_sub --iters 400000
"""
import argparse
import io
import logging
import math
import os
import random
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------- degradations
def random_gaussian_kernel(size=21):
    sx, sy = np.random.uniform(0.2, 3.0, 2)
    theta = np.random.uniform(-math.pi, math.pi)
    ax = np.arange(size) - size // 2
    xx, yy = np.meshgrid(ax, ax)
    c, s = math.cos(theta), math.sin(theta)
    xr, yr = c * xx + s * yy, -s * xx + c * yy
    k = np.exp(-0.5 * (xr ** 2 / sx ** 2 + yr ** 2 / sy ** 2))
    return (k / k.sum()).astype(np.float32)


def add_sensor_noise(img):
    # heteroscedastic: shot noise scales with signal, plus read noise
    shot = np.random.uniform(0.0005, 0.01)
    read = np.random.uniform(0.0001, 0.003)
    std = np.sqrt(np.clip(img, 0, 1) * shot + read)
    return img + np.random.randn(*img.shape).astype(np.float32) * std


def jpeg(img, q):
    ok, enc = cv2.imencode(".jpg", (np.clip(img, 0, 1) * 255).round().astype(np.uint8),
                           [int(cv2.IMWRITE_JPEG_QUALITY), int(q)])
    return cv2.imdecode(enc, cv2.IMREAD_COLOR).astype(np.float32) / 255.0


def degrade(hr, scale=4):
    h, w = hr.shape[:2]
    img = cv2.filter2D(hr, -1, random_gaussian_kernel())
    for order in range(2):
        f = np.random.uniform(0.3, 1.2) if order == 0 else np.random.uniform(0.6, 1.0)
        interp = random.choice([cv2.INTER_AREA, cv2.INTER_LINEAR, cv2.INTER_CUBIC])
        img = cv2.resize(img, (max(1, int(img.shape[1] * f)), max(1, int(img.shape[0] * f))), interpolation=interp)
        img = add_sensor_noise(img)
        img = jpeg(img, np.random.randint(30, 95))
        if order == 0 and random.random() < 0.8:
            img = cv2.filter2D(img, -1, random_gaussian_kernel())
    img = cv2.resize(img, (w // scale, h // scale), interpolation=random.choice([cv2.INTER_AREA, cv2.INTER_CUBIC]))
    return np.clip(img, 0, 1)


class RealDegradationDataset(Dataset):
    def __init__(self, root, gt_size=256, scale=4):
        self.files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs if f.endswith(".png"))
        self.gt_size, self.scale = gt_size, scale

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = cv2.imread(self.files[i], cv2.IMREAD_COLOR).astype(np.float32) / 255.0
        h, w = img.shape[:2]
        if min(h, w) < self.gt_size:
            img = cv2.copyMakeBorder(img, 0, max(0, self.gt_size - h), 0, max(0, self.gt_size - w),
                                     cv2.BORDER_REFLECT_101)
            h, w = img.shape[:2]
        y, x = random.randint(0, h - self.gt_size), random.randint(0, w - self.gt_size)
        gt = img[y:y + self.gt_size, x:x + self.gt_size]
        if random.random() < 0.5:
            gt = gt[:, ::-1]
        gt = np.ascontiguousarray(gt)
        lq = degrade(gt, self.scale)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a[:, :, ::-1].transpose(2, 0, 1)))
        return t(lq), t(gt)


# ----------------------------------------------------------------------------------- network
class RDB(nn.Module):
    def __init__(self, nf=64, gc=32):
        super().__init__()
        self.c = nn.ModuleList(nn.Conv2d(nf + i * gc, gc, 3, 1, 1) for i in range(4))
        self.out = nn.Conv2d(nf + 4 * gc, nf, 3, 1, 1)

    def forward(self, x):
        feats = [x]
        for conv in self.c:
            feats.append(F.leaky_relu(conv(torch.cat(feats, 1)), 0.2))
        return self.out(torch.cat(feats, 1)) * 0.2 + x


class RRDBNet(nn.Module):
    def __init__(self, nf=64, nb=23):
        super().__init__()
        self.conv_first = nn.Conv2d(3, nf, 3, 1, 1)
        self.body = nn.Sequential(*[nn.Sequential(RDB(nf), RDB(nf), RDB(nf)) for _ in range(nb)])
        self.conv_body = nn.Conv2d(nf, nf, 3, 1, 1)
        self.up1 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.up2 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_hr = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_last = nn.Conv2d(nf, 3, 3, 1, 1)

    def forward(self, x):
        f = self.conv_first(x)
        b = f
        for rrdb in self.body:
            b = rrdb(b) * 0.2 + b
        f = f + self.conv_body(b)
        f = F.leaky_relu(self.up1(F.interpolate(f, scale_factor=2, mode="nearest")), 0.2)
        f = F.leaky_relu(self.up2(F.interpolate(f, scale_factor=2, mode="nearest")), 0.2)
        return self.conv_last(F.leaky_relu(self.conv_hr(f), 0.2))


# ----------------------------------------------------------------------------------- train
def worker_init(worker_id):
    seed = torch.initial_seed() % 2 ** 32
    np.random.seed(seed)
    random.seed(seed)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hr-root", required=True)
    ap.add_argument("--out", default="experiments/realesrnet_x4_sensor")
    ap.add_argument("--pretrained", default="", help="RRDBNet checkpoint (params / params_ema) to start from")
    ap.add_argument("--iters", type=int, default=400000)
    ap.add_argument("--batch-per-gpu", type=int, default=12)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--save-every", type=int, default=5000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(levelname)s %(message)s")
    torch.manual_seed(0)
    np.random.seed(1000 + rank)
    random.seed(1000 + rank)

    ds = RealDegradationDataset(args.hr_root)
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=10,
                        pin_memory=True, drop_last=True, persistent_workers=True,
                        worker_init_fn=worker_init)

    net = RRDBNet().to(device)
    if args.pretrained:
        sd = torch.load(args.pretrained, map_location="cpu")
        net.load_state_dict(sd.get("params_ema", sd.get("params", sd)))
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[1000000], gamma=0.5)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    it, epoch = 0, 0
    t0 = time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for lq, gt in loader:
            lq, gt = lq.to(device, non_blocking=True), gt.to(device, non_blocking=True)
            # small USM sharpening on the target, as in Real-ESRGAN
            blur = F.avg_pool2d(F.pad(gt, (2, 2, 2, 2), mode="reflect"), 5, 1)
            gt_usm = (gt + 0.5 * (gt - blur)).clamp(0, 1)

            out = model(lq)
            l_pix = F.l1_loss(out, gt_usm)
            if not torch.isfinite(l_pix):
                logger.warning("non-finite loss at iter %d, skipping batch", it)
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.zero_grad(set_to_none=True)
            l_pix.backward()
            optimizer.step()
            scheduler.step()
            it += 1

            if rank == 0 and it % 100 == 0:
                logger.info("iter %d l_pix %.4f lr %.1e  %.2fs/it", it, l_pix.item(),
                            optimizer.param_groups[0]["lr"], (time.time() - t0) / 100)
                t0 = time.time()
            if rank == 0 and it % args.save_every == 0:
                torch.save({"params": net.state_dict(), "iter": it}, os.path.join(args.out, f"net_g_{it}.pth"))
                torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "iter": it},
                           os.path.join(args.out, f"state_{it}.pth"))
            if it >= args.iters:
                break
        epoch += 1

    if rank == 0:
        torch.save({"params": net.state_dict(), "iter": it}, os.path.join(args.out, "net_g_latest.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
