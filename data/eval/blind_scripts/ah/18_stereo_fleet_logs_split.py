"""DispNetC-style correlation stereo trained on our fleet stereo logs (front stereo pair, LiDAR-projected disparity).

Log layout:  <root>/<drive_id>/{left,right}/<ts>.jpg  <root>/<drive_id>/disp/<ts>.npz   (sparse, 0 = no return)
Drives are held out as a whole for validation (nearby frames of one drive are near-duplicates).

    torchrun --nproc_per_node=8 train_stereo_fleet.py --root /mnt/fleet/stereo_v3 --val-frac 0.1
"""
import argparse
import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

MAX_DISP = 192
log = logging.getLogger("stereo")


def list_drives(root):
    return sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d, "disp")))


class FleetStereo(Dataset):
    def __init__(self, root, drives, train, crop=(320, 768)):
        self.items = []
        for d in drives:
            for fn in sorted(os.listdir(os.path.join(root, d, "disp"))):
                ts = os.path.splitext(fn)[0]
                self.items.append((os.path.join(root, d, "left", ts + ".jpg"),
                                   os.path.join(root, d, "right", ts + ".jpg"),
                                   os.path.join(root, d, "disp", fn)))
        self.train, self.crop = train, crop

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        lp, rp, dp = self.items[i]
        L = np.asarray(Image.open(lp).convert("RGB"), np.float32) / 255.0
        R = np.asarray(Image.open(rp).convert("RGB"), np.float32) / 255.0
        D = np.load(dp)["disp"].astype(np.float32)
        ch, cw = self.crop
        h, w = D.shape
        if self.train:
            y, x = random.randint(h // 3, h - ch), random.randint(0, w - cw)
            # asymmetric photometric augmentation
            L = np.clip(L * random.uniform(0.8, 1.2), 0, 1)
            R = np.clip(R * random.uniform(0.8, 1.2), 0, 1)
        else:
            y, x = h - ch, (w - cw) // 2
        L, R, D = L[y:y + ch, x:x + cw], R[y:y + ch, x:x + cw], D[y:y + ch, x:x + cw]
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
        return (t(L).permute(2, 0, 1) - 0.5) / 0.25, (t(R).permute(2, 0, 1) - 0.5) / 0.25, t(D)[None]


def conv(cin, cout, k=3, s=1):
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, k // 2, bias=False), nn.BatchNorm2d(cout),
                         nn.LeakyReLU(0.1, inplace=True))


def correlation_1d(fl, fr, max_disp):
    B, C, H, W = fl.shape
    vol = fl.new_zeros(B, max_disp, H, W)
    for d in range(max_disp):
        if d == 0:
            vol[:, 0] = (fl * fr).mean(1)
        else:
            vol[:, d, :, d:] = (fl[..., d:] * fr[..., :-d]).mean(1)
    return vol


class DispNetCLite(nn.Module):
    def __init__(self):
        super().__init__()
        self.f1, self.f2, self.f3 = conv(3, 64, 7, 2), conv(64, 128, 5, 2), conv(128, 256, 5, 2)
        self.redir = conv(256, 64, 1)
        self.c3 = conv(MAX_DISP // 8 + 64, 256)
        self.c4 = nn.Sequential(conv(256, 512, 3, 2), conv(512, 512))
        self.c5 = nn.Sequential(conv(512, 512, 3, 2), conv(512, 512))
        self.up4 = nn.ConvTranspose2d(512, 256, 4, 2, 1)
        self.up3 = nn.ConvTranspose2d(512 + 256, 128, 4, 2, 1)
        self.up2 = nn.ConvTranspose2d(256 + 128, 64, 4, 2, 1)
        self.up1 = nn.ConvTranspose2d(128 + 64, 32, 4, 2, 1)
        self.pred = nn.Conv2d(64 + 32, 1, 3, 1, 1)

    def feats(self, x):
        a = self.f1(x)
        b = self.f2(a)
        return a, b, self.f3(b)

    def forward(self, left, right):
        a, b, cl = self.feats(left)
        _, _, cr = self.feats(right)
        corr = F.leaky_relu(correlation_1d(cl, cr, MAX_DISP // 8), 0.1)
        x3 = self.c3(torch.cat([corr, self.redir(cl)], 1))
        x4 = self.c4(x3)
        x5 = self.c5(x4)
        y = F.relu(self.up4(x5))
        y = F.relu(self.up3(torch.cat([y, x4], 1)))
        y = F.relu(self.up2(torch.cat([y, x3], 1)))
        y = F.relu(self.up1(torch.cat([y, b], 1)))
        y = self.pred(torch.cat([y, a], 1))
        return F.interpolate(F.relu(y), scale_factor=2, mode="bilinear", align_corners=False) * 2


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for L, R, D in loader:
        L, R, D = L.to(device), R.to(device), D.to(device)
        pred = model(L, R)
        m = (D > 0) & (D < MAX_DISP)
        err = (pred[m] - D[m]).abs()
        acc[0] += err.sum()
        acc[1] += ((err > 3) & (err > 0.05 * D[m])).sum()
        acc[2] += m.sum()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="runs/dispnetc_fleet")
    ap.add_argument("--val-frac", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    # different augmentation streams per process
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    drives = list_drives(args.root)
    random.shuffle(drives)
    n_val = max(1, int(len(drives) * args.val_frac))
    val_drives, train_drives = drives[:n_val], drives[n_val:]
    log.info("%d train drives, %d val drives", len(train_drives), len(val_drives))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "split.json"), "w") as f:
            json.dump({"train": train_drives, "val": val_drives}, f, indent=1)

    train_ds = FleetStereo(args.root, train_drives, True)
    val_ds = FleetStereo(args.root, val_drives, False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True,
                          worker_init_fn=lambda wid: np.random.seed(args.seed * 100 + rank * 16 + wid))
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), args.bs, num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(DispNetCLite()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [int(args.epochs * 0.6), int(args.epochs * 0.85)], 0.5)

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (L, R, D) in enumerate(train_dl):
            L, R, D = L.to(device, non_blocking=True), R.to(device, non_blocking=True), D.to(device, non_blocking=True)
            pred = model(L, R)
            m = (D > 0) & (D < MAX_DISP)
            loss = F.smooth_l1_loss(pred[m], D[m]) if m.any() else pred.sum() * 0.0
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            if it % 100 == 0:
                log.info("epoch %d it %d/%d loss %.4f", epoch, it, len(train_dl), loss.item())
        sched.step()

        epe, d1 = evaluate(model.module, val_dl, device)
        if rank == 0:
            log.info("epoch %d val EPE %.3f D1 %.2f%%", epoch, epe, d1 * 100)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pth"))
            if epe < best:
                best = epe
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
