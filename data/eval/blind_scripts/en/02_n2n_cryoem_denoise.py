#!/usr/bin/env python
"""
Noise2Noise denoiser for cryo-EM micrographs (topaz-denoise style).

Input: motion-corrected even/odd frame sums from the Krios pipeline
(``<name>_even.mrc`` / ``<name>_odd.mrc``).  Micrographs are binned 2x,
normalised per micrograph and cached once as float16 .npy, then random tiles
are cut from memory-mapped arrays.

    torchrun --nnodes=1 --nproc_per_node=8 02_n2n_cryoem_denoise.py \
        --pairs /data/krios/EMPIAR-10025/halves --cache /scratch/n2n_cache \
        --out runs/n2n_10025
"""
import argparse
import glob
import logging
import os
import time
from contextlib import nullcontext

import mrcfile
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

logger = logging.getLogger(__name__)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", default="runs/n2n")
    ap.add_argument("--bin", type=int, default=2)
    ap.add_argument("--tile", type=int, default=512)
    ap.add_argument("--tiles-per-mic", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=4, help="per GPU, per micro-step")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--base-lr", type=float, default=1e-4, help="lr for a global batch of 16")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


# ----------------------------------------------------------------- data cache
def bin_image(x, b):
    if b == 1:
        return x
    h, w = (x.shape[0] // b) * b, (x.shape[1] // b) * b
    return x[:h, :w].reshape(h // b, b, w // b, b).mean(axis=(1, 3))


def build_cache(pair_dir, cache_dir, b):
    """bin + normalise every even/odd pair once and write float16 .npy files"""
    os.makedirs(cache_dir, exist_ok=True)
    evens = sorted(glob.glob(os.path.join(pair_dir, "*_even.mrc")))
    for f_even in evens:
        name = os.path.basename(f_even)[: -len("_even.mrc")]
        dst = os.path.join(cache_dir, name + ".npy")
        if os.path.exists(dst):
            continue
        with mrcfile.open(f_even, permissive=True) as m:
            even = bin_image(m.data.astype(np.float32), b)
        with mrcfile.open(f_even.replace("_even.mrc", "_odd.mrc"), permissive=True) as m:
            odd = bin_image(m.data.astype(np.float32), b)
        # one mean/std for the pair so the two halves stay on the same scale
        mu, sd = 0.5 * (even.mean() + odd.mean()), 0.5 * (even.std() + odd.std())
        pair = np.stack([(even - mu) / sd, (odd - mu) / sd]).astype(np.float16)
        np.save(dst + ".tmp.npy", pair)
        os.replace(dst + ".tmp.npy", dst)
    with open(os.path.join(cache_dir, "DONE"), "w") as fh:
        fh.write(str(len(evens)))


class PairTiles(Dataset):
    def __init__(self, files, tile, tiles_per_mic):
        self.files = files
        self.tile = tile
        self.tiles_per_mic = tiles_per_mic
        self._arrays = {}

    def __len__(self):
        return len(self.files) * self.tiles_per_mic

    def _get(self, i):
        # opened lazily so every DataLoader worker has its own memmap
        if i not in self._arrays:
            self._arrays[i] = np.load(self.files[i], mmap_mode="r")
        return self._arrays[i]

    def __getitem__(self, idx):
        pair = self._get(idx // self.tiles_per_mic)
        _, H, W = pair.shape
        t = self.tile
        y, x = np.random.randint(0, H - t + 1), np.random.randint(0, W - t + 1)
        a, b = np.array(pair[:, y:y + t, x:x + t], dtype=np.float32)
        if np.random.rand() < 0.5:  # random direction of the N2N mapping
            a, b = b, a
        k = np.random.randint(4)
        a, b = np.rot90(a, k).copy(), np.rot90(b, k).copy()
        return torch.from_numpy(a)[None], torch.from_numpy(b)[None]


# ---------------------------------------------------------------------- model
class DenoiseUNet(nn.Module):
    """the small U-Net from topaz denoise (L2 model), LeakyReLU, no normalisation"""

    def __init__(self, width=48):
        super().__init__()
        act = lambda: nn.LeakyReLU(0.1, inplace=True)  # noqa: E731
        self.enc1 = nn.Sequential(nn.Conv2d(1, width, 7, padding=3), act(), nn.MaxPool2d(2))
        self.enc2 = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), act(), nn.MaxPool2d(2))
        self.enc3 = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), act(), nn.MaxPool2d(2))
        self.mid = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), act())
        self.dec3 = nn.Sequential(nn.Conv2d(2 * width, 2 * width, 3, padding=1), act())
        self.dec2 = nn.Sequential(nn.Conv2d(3 * width, 2 * width, 3, padding=1), act())
        self.dec1 = nn.Sequential(nn.Conv2d(2 * width + 1, 64, 3, padding=1), act(),
                                  nn.Conv2d(64, 32, 3, padding=1), act(), nn.Conv2d(32, 1, 1))

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(e1)
        e3 = self.enc3(e2)
        m = self.mid(e3)
        d = F.interpolate(m, size=e2.shape[-2:])
        d = self.dec3(torch.cat([d, e2], 1))
        d = F.interpolate(d, size=e1.shape[-2:])
        d = self.dec2(torch.cat([d, e1], 1))
        d = F.interpolate(d, size=x.shape[-2:])
        return self.dec1(torch.cat([d, x], 1))


# ---------------------------------------------------------------------- train
def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")
    # DDP broadcasts rank 0's initial weights, so a per-rank seed only changes
    # the crops / flips drawn in the DataLoader workers
    torch.manual_seed(args.seed + rank)

    # the cache is written by one process; everyone else waits for it
    if rank == 0 and not os.path.exists(os.path.join(args.cache, "DONE")):
        logger.info("building cache in %s", args.cache)
        build_cache(args.pairs, args.cache, args.bin)
    dist.barrier()

    files = sorted(glob.glob(os.path.join(args.cache, "*.npy")))
    ds = PairTiles(files, args.tile, args.tiles_per_mic)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)

    model = DDP(DenoiseUNet().to(device), device_ids=[local_rank])
    global_batch = args.batch_size * args.accum * world
    lr = args.base_lr * global_batch / 16
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    steps_per_epoch = len(loader) // args.accum
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * steps_per_epoch)

    use_bf16 = torch.cuda.is_bf16_supported()
    amp_dtype = torch.bfloat16 if use_bf16 else torch.float16
    scaler = torch.cuda.amp.GradScaler(enabled=not use_bf16)

    writer = SummaryWriter(args.out) if rank == 0 else None
    logger.info("global batch %d, lr %.2e, %s autocast", global_batch, lr, amp_dtype)

    gstep = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros((), device=device)
        n_micro = steps_per_epoch * args.accum
        for i, (src, tgt) in enumerate(loader):
            if i >= n_micro:
                break
            src = src.to(device, non_blocking=True)
            tgt = tgt.to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            # skip the gradient all-reduce on the intermediate micro-steps
            ctx = nullcontext() if last_micro else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=amp_dtype):
                    out = model(src)
                    loss = F.mse_loss(out.float(), tgt) / args.accum
                scaler.scale(loss).backward()
            loss_sum += loss.detach()
            if last_micro:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                sched.step()
                gstep += 1

        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        epoch_loss = loss_sum.item() / max(steps_per_epoch, 1)
        if rank == 0:
            writer.add_scalar("train/loss", epoch_loss, epoch)
            writer.add_scalar("train/lr", sched.get_last_lr()[0], epoch)
            logger.info("epoch %3d  loss %.5f  (%.0fs)", epoch, epoch_loss, time.time() - t0)
            torch.save({"epoch": epoch, "step": gstep, "model": model.module.state_dict(),
                        "opt": opt.state_dict(), "bin": args.bin},
                       os.path.join(args.out, "n2n_last.pt"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
