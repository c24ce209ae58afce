"""Slow-only R50 (8x8) on Kinetics-400 with a cached video index.

Opening 240k mp4 files just to learn their frame counts takes ~20 minutes, so the first
run writes `<list>.meta.pkl` next to the list file (frame count, fps, and which files are
unreadable) and later runs load it. Clips are then sampled from the cached frame counts.

    torchrun --nproc_per_node=8 18_slow_r50_k400_meta_cache.py --root /datasets/k400 --epochs 150
"""
import argparse
import os
import pickle
import random
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from pytorchvideo.models.hub import slow_r50
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset


def probe(path):
    try:
        vr = VideoReader(path, ctx=cpu(0), num_threads=1)
        return len(vr), float(vr.get_avg_fps())
    except Exception:
        return 0, 0.0


def build_or_load_meta(root, list_file, threads=32):
    cache = list_file + ".meta.pkl"
    if os.path.exists(cache):
        with open(cache, "rb") as f:
            return pickle.load(f)
    with open(list_file) as f:
        rows = [line.split() for line in f if line.strip()]
    paths = [os.path.join(root, r[0]) for r in rows]
    with ThreadPoolExecutor(threads) as ex:
        probed = list(ex.map(probe, paths))
    meta = [{"path": p, "label": int(r[1]), "num_frames": n, "fps": fps}
            for p, r, (n, fps) in zip(paths, rows, probed) if n > 0]
    with open(cache, "wb") as f:
        pickle.dump(meta, f)
    return meta


class IndexedKinetics(Dataset):
    def __init__(self, meta, train, num_frames=8, rate=8, crop=224):
        self.meta, self.train = meta, train
        self.num_frames, self.rate, self.crop = num_frames, rate, crop

    def __len__(self):
        return len(self.meta)

    def __getitem__(self, i):
        m = self.meta[i]
        n, span = m["num_frames"], self.num_frames * self.rate
        st = random.randint(0, max(n - span, 0)) if self.train else max(n - span, 0) // 2
        idx = np.minimum(np.arange(st, st + span, self.rate), n - 1)
        vr = VideoReader(m["path"], ctx=cpu(0), num_threads=1)
        x = torch.from_numpy(vr.get_batch(idx).asnumpy()).permute(3, 0, 1, 2).float() / 255.0
        x = (x - 0.45) / 0.225
        short = random.randint(256, 320) if self.train else 256
        x = F.interpolate(x, scale_factor=short / min(x.shape[-2:]), mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        if self.train:
            y0, x0 = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
        else:
            y0, x0 = (h - self.crop) // 2, (w - self.crop) // 2
        x = x[..., y0:y0 + self.crop, x0:x0 + self.crop]
        if self.train and random.random() < 0.5:
            x = x.flip(-1)
        return x, m["label"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--train-list", default="")
    p.add_argument("--val-list", default="")
    p.add_argument("--epochs", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="runs/slow_r50")
    a = p.parse_args()
    a.train_list = a.train_list or os.path.join(a.root, "train_list.txt")
    a.val_list = a.val_list or os.path.join(a.root, "val_list.txt")
    return a


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    t0 = time.time()
    train_meta = build_or_load_meta(os.path.join(args.root, "train"), args.train_list)
    val_meta = build_or_load_meta(os.path.join(args.root, "val"), args.val_list)
    if rank == 0:
        print(f"index ready in {time.time() - t0:.0f}s: {len(train_meta)} train / {len(val_meta)} val videos",
              flush=True)

    train_set, val_set = IndexedKinetics(train_meta, True), IndexedKinetics(val_meta, False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=args.batch_size,
                            num_workers=args.workers, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(slow_r50(pretrained=False)).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    iters = len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=args.epochs * iters,
                                                    pct_start=34 / 196, anneal_strategy="cos",
                                                    div_factor=10.0, final_div_factor=100.0)
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} {it}/{iters} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.4f} "
                      f"{(time.time() - tic) / (it + 1):.2f}s/it", flush=True)

        model.eval()
        hit = torch.zeros(3, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    top5 = model.module(x).topk(5, 1).indices
                hit += torch.stack([(top5[:, 0] == y).sum(), (top5 == y[:, None]).any(1).sum(),
                                    torch.tensor(y.numel(), device=device)]).float()
        dist.all_reduce(hit)
        if rank == 0:
            print(f"epoch {epoch}: top1 {100 * hit[0] / hit[2]:.2f} top5 {100 * hit[1] / hit[2]:.2f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
