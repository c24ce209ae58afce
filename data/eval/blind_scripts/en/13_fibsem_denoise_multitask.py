#!/usr/bin/env python
"""
FIB-SEM restoration with an optional organelle head (multi-task).

Every tile has a Noise2Noise target (the next, independently scanned frame of
the same slice), but only some regions were annotated for organelles.  The
segmentation head is only evaluated on batches that contain annotated tiles,
so in many steps its weights get no gradient.

Runs on two 8-GPU nodes; all paths are on the shared Lustre volume.
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=gpu-a01:29400 \
        13_fibsem_denoise_multitask.py --index /lustre/fibsem/cell3/tiles.csv \
        --out /lustre/fibsem/runs/cell3_mt --resume auto
"""
import argparse
import csv
import os
import time

import numpy as np
import tifffile
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_ORGANELLES = 4  # bg, mito, ER, nucleus envelope


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--index", required=True, help="csv: frame_a,frame_b,labels(optional),z,y,x")
    p.add_argument("--out", required=True)
    p.add_argument("--resume", default="", help="path, or 'auto' for <out>/last.pt")
    p.add_argument("--tile", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=6)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--seg-weight", type=float, default=1.0)
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing in the encoder")
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


class FibsemTiles(Dataset):
    def __init__(self, index_csv, tile):
        with open(index_csv) as fh:
            self.rows = list(csv.DictReader(fh))
        self.tile = tile

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        z, y, x, t = int(r["z"]), int(r["y"]), int(r["x"]), self.tile
        a = tifffile.memmap(r["frame_a"], mode="r")[z, y:y + t, x:x + t].astype(np.float32)
        b = tifffile.memmap(r["frame_b"], mode="r")[z, y:y + t, x:x + t].astype(np.float32)
        m, s = a.mean(), a.std() + 1e-6  # normalise both frames with frame a's stats
        a, b = (a - m) / s, (b - m) / s
        if r.get("labels"):
            lab = tifffile.memmap(r["labels"], mode="r")[z, y:y + t, x:x + t].astype(np.int64)
        else:
            lab = np.full((t, t), -1, dtype=np.int64)  # ignore_index
        return torch.from_numpy(a)[None], torch.from_numpy(b)[None], torch.from_numpy(lab)


class Block(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.GroupNorm(16, o), nn.SiLU(),
                                  nn.Conv2d(o, o, 3, padding=1), nn.GroupNorm(16, o), nn.SiLU())

    def forward(self, x):
        return self.body(x)


class MultiTaskUNet(nn.Module):
    def __init__(self, w=(32, 64, 128, 256), n_cls=N_ORGANELLES, grad_ckpt=False):
        super().__init__()
        self.grad_ckpt = grad_ckpt
        self.enc = nn.ModuleList([Block(1 if i == 0 else w[i - 1], w[i]) for i in range(len(w))])
        self.up = nn.ModuleList([nn.ConvTranspose2d(w[i + 1], w[i], 2, 2) for i in reversed(range(len(w) - 1))])
        self.dec = nn.ModuleList([Block(2 * w[i], w[i]) for i in reversed(range(len(w) - 1))])
        self.denoise_head = nn.Conv2d(w[0], 1, 1)
        self.seg_head = nn.Sequential(nn.Conv2d(w[0], w[0], 3, padding=1), nn.SiLU(), nn.Conv2d(w[0], n_cls, 1))

    def forward(self, x, with_seg=True):
        skips, h = [], x
        for i, e in enumerate(self.enc):
            h = h if i == 0 else F.max_pool2d(h, 2)
            h = checkpoint(e, h, use_reentrant=False) if (self.grad_ckpt and self.training) else e(h)
            skips.append(h)
        skips.pop()
        for u, d in zip(self.up, self.dec):
            h = d(torch.cat([u(h), skips.pop()], 1))
        den = x + self.denoise_head(h)
        seg = self.seg_head(h) if with_seg else None
        return den, seg


def load_checkpoint(path, model, opt):
    ck = torch.load(path, map_location="cpu")
    sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in ck["model"].items()}
    model.load_state_dict(sd)
    if opt is not None and "opt" in ck:
        opt.load_state_dict(ck["opt"])
    return ck.get("epoch", -1) + 1


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)  # from here on .cuda() means this rank's GPU
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    ds = FibsemTiles(args.index, args.tile)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True, persistent_workers=True)

    net = MultiTaskUNet(grad_ckpt=args.grad_ckpt).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr * world ** 0.5, weight_decay=1e-4)
    resume = os.path.join(args.out, "last.pt") if args.resume == "auto" else args.resume
    start_epoch = 0
    if resume and os.path.isfile(resume):
        start_epoch = load_checkpoint(resume, net, opt)
    # the seg head is skipped on batches without annotations
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, last_epoch=start_epoch - 1) \
        if start_epoch > 0 else torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(ds)} tiles on {world} GPUs, starting at epoch {start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(4).cuda()  # den loss sum, seg loss sum, n steps, n seg steps
        for a, b, lab in dl:
            a, b, lab = a.cuda(non_blocking=True), b.cuda(non_blocking=True), lab.cuda(non_blocking=True)
            has_seg = bool((lab >= 0).any())
            den, seg = model(a, with_seg=has_seg)
            loss_den = F.mse_loss(den, b)
            loss = loss_den
            if has_seg:
                loss_seg = F.cross_entropy(seg, lab, ignore_index=-1)
                loss = loss + args.seg_weight * loss_seg
                stats[1] += loss_seg.detach()
                stats[3] += 1
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats[0] += loss_den.detach()
            stats[2] += 1
        sched.step()
        dist.all_reduce(stats)

        if rank == 0:
            print(f"epoch {epoch:2d}  denoise {stats[0] / stats[2]:.5f}  "
                  f"seg {stats[1] / stats[3].clamp(min=1):.4f} ({int(stats[3])} seg steps)  "
                  f"{time.time() - t0:.0f}s", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict(),
                        "world_size": world}, os.path.join(args.out, "last.pt.tmp"))
            os.replace(os.path.join(args.out, "last.pt.tmp"), os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
