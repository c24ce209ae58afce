#!/usr/bin/env python
"""
Foreground + boundary segmentation for the Cell Tracking Challenge style
time-lapses the facility processes (Fluo-N2DH-*, in-house HeLa H2B-GFP).

Data: <root>/<seq>/t###.tif raw frames and <root>/<seq>_GT/SEG/man_seg###.tif
sparse full annotations.  Frames are large (up to 2048^2), training uses
random 320x320 tiles with per-tile percentile normalisation.

Validation is a full-frame evaluation (SEG-like matched IoU) that is slow and
needs scikit-image, so it runs on rank 0 only while the other ranks wait.

    torchrun --nproc_per_node=4 19_cell_tracking_seg.py --root /data/ctc/Fluo-N2DH-GOWT1 \
        --train-seqs 01 --val-seqs 02 --out runs/ctc_gowt1 [--resume]
"""
import argparse
import datetime
import glob
import os
import time

import numpy as np
import tifffile
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy import ndimage as ndi
from skimage.measure import label as cc_label
from skimage.segmentation import watershed
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--train-seqs", nargs="+", default=["01"])
    p.add_argument("--val-seqs", nargs="+", default=["02"])
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--tile", type=int, default=320)
    p.add_argument("--tiles-per-frame", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4, help="per GPU")
    p.add_argument("--lr", type=float, default=2e-4, help="per 4 tiles; scaled with the global batch")
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--val-every", type=int, default=5)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def pnorm(x):
    lo, hi = np.percentile(x, (1, 99.8))
    return (x.astype(np.float32) - lo) / max(hi - lo, 1.0)


def seg_pairs(root, seqs):
    pairs = []
    for s in seqs:
        for g in sorted(glob.glob(os.path.join(root, f"{s}_GT", "SEG", "man_seg*.tif"))):
            t = os.path.basename(g)[len("man_seg"):-4]
            pairs.append((os.path.join(root, s, f"t{t}.tif"), g))
    return pairs


def to_targets(inst):
    fg = inst > 0
    bnd = fg & (ndi.grey_dilation(inst, size=3) != ndi.grey_erosion(inst, size=3))
    return np.stack([fg, bnd]).astype(np.float32)


class CTCTiles(Dataset):
    def __init__(self, pairs, tile, per_frame):
        self.pairs, self.tile, self.per_frame = pairs, tile, per_frame

    def __len__(self):
        return len(self.pairs) * self.per_frame

    def __getitem__(self, i):
        raw_f, gt_f = self.pairs[i // self.per_frame]
        raw, gt = tifffile.imread(raw_f), tifffile.imread(gt_f)
        H, W = raw.shape
        t = self.tile
        y, x = np.random.randint(0, H - t + 1), np.random.randint(0, W - t + 1)
        img = pnorm(raw[y:y + t, x:x + t])
        tgt = to_targets(gt[y:y + t, x:x + t])
        k = np.random.randint(4)
        img, tgt = np.rot90(img, k), np.rot90(tgt, k, axes=(1, 2))
        if np.random.rand() < 0.5:
            img, tgt = img[:, ::-1], tgt[:, :, ::-1]
        return torch.from_numpy(img.copy())[None], torch.from_numpy(tgt.copy())


def cbr(i, o):
    return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(True),
                         nn.Conv2d(o, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(True))


class UNet(nn.Module):
    def __init__(self, w=(32, 64, 128, 256, 512)):
        super().__init__()
        self.enc = nn.ModuleList([cbr(1 if i == 0 else w[i - 1], w[i]) for i in range(len(w))])
        self.up = nn.ModuleList([nn.ConvTranspose2d(w[i + 1], w[i], 2, 2) for i in reversed(range(len(w) - 1))])
        self.dec = nn.ModuleList([cbr(2 * w[i], w[i]) for i in reversed(range(len(w) - 1))])
        self.out = nn.Conv2d(w[0], 2, 1)

    def forward(self, x):
        s = []
        for i, e in enumerate(self.enc):
            x = e(x if i == 0 else F.max_pool2d(x, 2))
            s.append(x)
        s.pop()
        for u, d in zip(self.up, self.dec):
            x = d(torch.cat([u(x), s.pop()], 1))
        return self.out(x)


@torch.no_grad()
def seg_score(net, pairs, device):
    """CTC SEG-like score: mean IoU of GT objects matched (IoU > 0.5) to predictions"""
    net.eval()
    scores = []
    for raw_f, gt_f in pairs:
        raw, gt = tifffile.imread(raw_f), tifffile.imread(gt_f)
        H, W = (raw.shape[0] // 16) * 16, (raw.shape[1] // 16) * 16
        x = torch.from_numpy(pnorm(raw[:H, :W]))[None, None].to(device)
        p = torch.sigmoid(net(x))[0].cpu().numpy()
        seeds = cc_label((p[0] > 0.5) & (p[1] < 0.3))
        pred = watershed(-p[0], seeds, mask=p[0] > 0.5)
        g = gt[:H, :W]
        for obj in np.unique(g)[1:]:
            m = g == obj
            ids, cnt = np.unique(pred[m], return_counts=True)
            best = ids[np.argmax(cnt)]
            if best == 0 or cnt.max() <= 0.5 * m.sum():
                scores.append(0.0)
                continue
            pm = pred == best
            scores.append((m & pm).sum() / (m | pm).sum())
    return float(np.mean(scores)) if scores else 0.0


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # rank 0's full-frame validation can take a while; the other ranks wait on a barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = CTCTiles(seg_pairs(args.root, args.train_seqs), args.tile, args.tiles_per_frame)
    val_pairs = seg_pairs(args.root, args.val_seqs)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True, persistent_workers=True)

    # 4 tiles per GPU is too few for per-GPU batch statistics
    net = nn.SyncBatchNorm.convert_sync_batchnorm(UNet()).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 4
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=lr * 0.01)

    ckpt_path = os.path.join(args.out, "last.pt")
    start_epoch, best = 0, 0.0
    if args.resume and os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_ds)} tiles, {len(val_pairs)} val frames, {world} GPUs, lr {lr:.2e}, "
              f"start epoch {start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for img, tgt in dl:
            img, tgt = img.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            logits = model(img)
            loss = F.binary_cross_entropy_with_logits(logits, tgt, pos_weight=torch.tensor([1.0, 4.0], device=device)[:, None, None])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(acc)

        if rank == 0:
            msg = f"epoch {epoch:3d}  loss {(acc[0] / acc[1]).item():.4f}"
            if (epoch + 1) % args.val_every == 0:
                score = seg_score(model.module, val_pairs, device)
                msg += f"  SEG {score:.4f}"
                if score > best:
                    best = score
                    torch.save({"model": model.module.state_dict(), "epoch": epoch, "seg": score},
                               os.path.join(args.out, "best.pt"))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best": best}, ckpt_path)
            print(msg + f"  {time.time() - t0:.0f}s", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
