#!/usr/bin/env python3
"""2D U-Net training for organ segmentation (CT slices stored as .npz).

The launcher starts one multiprocessing.Process per GPU ("spawn" context),
watches them and tears the group down if any of them fails.

    python 05_mp_process_unet.py --data /data/ct_slices --out /mnt/nfs/seg/unet_gn --gpus 4
"""
import argparse
import glob
import logging
import multiprocessing as mp
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_rank():
    if not dist.is_available():
        return 0
    return dist.get_rank()


def setup_logging(out_dir):
    rank = get_rank()
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s: %(message)s")
    logger = logging.getLogger("unet")
    logger.setLevel(logging.INFO)
    fh = logging.FileHandler(os.path.join(out_dir, "logs", f"train_rank{rank}.log"))
    fh.setFormatter(fmt)
    logger.addHandler(fh)
    if rank == 0:
        sh = logging.StreamHandler(sys.stdout)
        sh.setFormatter(fmt)
        logger.addHandler(sh)
    return logger


class CTSlices(Dataset):
    def __init__(self, files, augment=False):
        self.files = files
        self.augment = augment

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        z = np.load(self.files[i])
        img = np.clip(z["image"].astype(np.float32), -1000, 1000) / 1000.0
        mask = z["mask"].astype(np.int64)
        if self.augment and np.random.rand() < 0.5:
            img, mask = img[:, ::-1].copy(), mask[:, ::-1].copy()
        return torch.from_numpy(img)[None], torch.from_numpy(mask)


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.SiLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.SiLU(inplace=True))


class UNet(nn.Module):
    def __init__(self, n_classes, base=32):
        super().__init__()
        ch = [base, base * 2, base * 4, base * 8, base * 16]
        self.downs = nn.ModuleList()
        cin = 1
        for c in ch:
            self.downs.append(conv_block(cin, c))
            cin = c
        self.ups = nn.ModuleList()
        self.upconvs = nn.ModuleList()
        for c in reversed(ch[:-1]):
            self.upconvs.append(nn.ConvTranspose2d(cin, c, 2, stride=2))
            self.ups.append(conv_block(2 * c, c))
            cin = c
        self.head = nn.Conv2d(cin, n_classes, 1)

    def forward(self, x):
        skips = []
        for i, d in enumerate(self.downs):
            x = d(x)
            if i < len(self.downs) - 1:
                skips.append(x)
                x = F.max_pool2d(x, 2)
        for up, block in zip(self.upconvs, self.ups):
            x = up(x)
            x = block(torch.cat([x, skips.pop()], 1))
        return self.head(x)


def dice_loss(logits, target, eps=1.0):
    probs = logits.softmax(1)
    onehot = F.one_hot(target, logits.size(1)).permute(0, 3, 1, 2).float()
    inter = (probs * onehot).sum((0, 2, 3))
    denom = probs.sum((0, 2, 3)) + onehot.sum((0, 2, 3))
    return 1 - ((2 * inter + eps) / (denom + eps))[1:].mean()


@torch.no_grad()
def evaluate(model, loader, n_classes, device):
    model.eval()
    inter = torch.zeros(n_classes, device=device)
    union = torch.zeros(n_classes, device=device)
    for img, mask in loader:
        img, mask = img.to(device), mask.to(device)
        pred = model(img).argmax(1)
        for c in range(1, n_classes):
            p, t = pred == c, mask == c
            inter[c] += (p & t).sum()
            union[c] += p.sum() + t.sum()
    dist.all_reduce(inter)
    dist.all_reduce(union)
    model.train()
    return (2 * inter[1:] / union[1:].clamp(min=1)).cpu()


def worker(local_rank, world_size, port, args):
    log = setup_logging(args.out)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=local_rank, world_size=world_size)
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)

    files = sorted(glob.glob(os.path.join(args.data, "*.npz")))
    # split by patient id so slices of one scan never land on both sides
    patients = sorted({os.path.basename(f).split("_")[0] for f in files})
    val_patients = set(patients[:: args.val_every])
    train_files = [f for f in files if os.path.basename(f).split("_")[0] not in val_patients]
    val_files = [f for f in files if os.path.basename(f).split("_")[0] in val_patients]

    train_ds, val_ds = CTSlices(train_files, augment=True), CTSlices(val_files)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(local_rank, len(val_ds), world_size)),
                        batch_size=args.batch_size, num_workers=4)

    model = DDP(UNet(args.classes).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world_size, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    log.info("train %d slices, val %d slices, world %d", len(train_ds), len(val_ds), world_size)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(1, device=device)
        for img, mask in train_dl:
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            logits = model(img)
            loss = F.cross_entropy(logits, mask) + dice_loss(logits, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += loss.detach()
        sched.step()
        dist.all_reduce(running, op=dist.ReduceOp.AVG)
        dice = evaluate(model, val_dl, args.classes, device)
        log.info("epoch %d loss %.4f dice %s mean %.4f (%.0fs)", epoch, running.item() / len(train_dl),
                 np.round(dice.numpy(), 3).tolist(), dice.mean().item(), time.time() - t0)
        if local_rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
            if dice.mean().item() > best:
                best = dice.mean().item()
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "dice": best},
                           os.path.join(args.out, "best.pt"))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--classes", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--val-every", type=int, default=10, help="every n-th patient goes to validation")
    ap.add_argument("--port", type=int, default=29533)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, args.gpus, args.port, args), name=f"rank{r}")
             for r in range(args.gpus)]
    for p in procs:
        p.start()

    def shutdown(signum, _frame):
        for p in procs:
            if p.is_alive():
                p.terminate()
        sys.exit(128 + signum)

    signal.signal(signal.SIGINT, shutdown)
    signal.signal(signal.SIGTERM, shutdown)

    while True:
        codes = [p.exitcode for p in procs]
        if any(c not in (None, 0) for c in codes):
            bad = [p.name for p in procs if p.exitcode not in (None, 0)]
            print(f"worker(s) {bad} failed, terminating the rest", file=sys.stderr)
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join()
            sys.exit(1)
        if all(c == 0 for c in codes):
            break
        time.sleep(2)


if __name__ == "__main__":
    main()
