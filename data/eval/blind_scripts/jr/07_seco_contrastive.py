"""
Seasonal-contrast (SeCo-style) pretraining of a 12-band ResNet-50 on Sentinel-2 L2A.
Positive pairs are two acquisitions of the same location from different seasons.

Data layout (GeoTIFF, one per acquisition):
    <root>/<location_id>/<YYYYMMDD>.tif      12 bands, uint16, 264x264

Launch (one node, 8 GPUs):
    torchrun --standalone --nproc_per_node 8 07_seco_contrastive.py --root /nfs/seco_1m --out /nfs/runs/seco_r50
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import rasterio
import timm
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--max-nodata", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--stats-samples", type=int, default=20000)
    return p.parse_args()


def build_index(root, max_nodata):
    """Locations with >= 2 acquisitions that are mostly valid. Takes ~20 min on 1M locations."""
    cache = os.path.join(root, f"index_nodata{max_nodata:.2f}.json")
    if os.path.exists(cache):
        with open(cache) as f:
            return json.load(f)
    index = {}
    for loc in sorted(os.listdir(root)):
        loc_dir = os.path.join(root, loc)
        if not os.path.isdir(loc_dir):
            continue
        good = []
        for name in sorted(os.listdir(loc_dir)):
            with rasterio.open(os.path.join(loc_dir, name)) as src:
                b4 = src.read(4, out_shape=(66, 66))
            if (b4 == 0).mean() <= max_nodata:
                good.append(name)
        if len(good) >= 2:
            index[loc] = good
    with open(cache, "w") as f:
        json.dump(index, f)
    return index


def band_stats(root, index, n_samples, seed=0):
    cache = os.path.join(root, "band_stats.json")
    if os.path.exists(cache):
        with open(cache) as f:
            s = json.load(f)
        return np.array(s["mean"], np.float32), np.array(s["std"], np.float32)
    rng = random.Random(seed)
    locs = rng.sample(sorted(index), min(n_samples, len(index)))
    acc, acc2, n = np.zeros(12), np.zeros(12), 0
    for loc in locs:
        with rasterio.open(os.path.join(root, loc, index[loc][0])) as src:
            x = src.read().reshape(12, -1).astype(np.float64)
        acc += x.sum(1)
        acc2 += (x ** 2).sum(1)
        n += x.shape[1]
    mean = acc / n
    std = np.sqrt(acc2 / n - mean ** 2)
    with open(cache, "w") as f:
        json.dump({"mean": mean.tolist(), "std": std.tolist()}, f)
    return mean.astype(np.float32), std.astype(np.float32)


class SeasonalPairs(Dataset):
    def __init__(self, root, index, mean, std, crop=224):
        self.root = root
        self.locs = sorted(index)
        self.index = index
        self.mean = mean[:, None, None]
        self.std = std[:, None, None]
        self.crop = crop

    def __len__(self):
        return len(self.locs)

    def _load(self, loc, name):
        with rasterio.open(os.path.join(self.root, loc, name)) as src:
            x = src.read().astype(np.float32)
        return (x - self.mean) / self.std

    def _augment(self, x):
        _, h, w = x.shape
        y0, x0 = np.random.randint(0, h - self.crop + 1), np.random.randint(0, w - self.crop + 1)
        x = x[:, y0:y0 + self.crop, x0:x0 + self.crop]
        if np.random.rand() < 0.5:
            x = x[:, :, ::-1]
        if np.random.rand() < 0.5:
            x = x[:, ::-1, :]
        # per-band brightness / contrast jitter
        x = x * np.random.uniform(0.8, 1.2, size=(x.shape[0], 1, 1)) + np.random.uniform(-0.2, 0.2, (x.shape[0], 1, 1))
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))

    def __getitem__(self, i):
        loc = self.locs[i]
        a, b = random.sample(self.index[loc], 2)
        return self._augment(self._load(loc, a)), self._augment(self._load(loc, b))


class SeCoNet(nn.Module):
    def __init__(self, arch, in_chans=12, proj_dim=128):
        super().__init__()
        self.backbone = timm.create_model(arch, pretrained=False, in_chans=in_chans, num_classes=0)
        d = self.backbone.num_features
        self.head = nn.Sequential(nn.Linear(d, 2048), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
                                  nn.Linear(2048, proj_dim))

    def forward(self, x):
        return F.normalize(self.head(self.backbone(x)), dim=1)


def nt_xent(z1, z2, temperature, rank):
    # gather with gradient so negatives come from the whole global batch
    all_z2 = torch.cat(dist_fn.all_gather(z2), dim=0)
    logits = z1 @ all_z2.t() / temperature
    labels = torch.arange(z1.size(0), device=z1.device) + rank * z1.size(0)
    return F.cross_entropy(logits, labels)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    index = build_index(args.root, args.max_nodata)
    mean, std = band_stats(args.root, index, args.stats_samples)
    ds = SeasonalPairs(args.root, index, mean, std)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True, persistent_workers=True)

    model = SeCoNet(args.arch)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    total = args.epochs * len(dl)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(ds)} locations, global batch {args.batch_size * world}, lr {lr:.3f}", flush=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x1, x2 in dl:
            x1 = x1.to(device, non_blocking=True)
            x2 = x2.to(device, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / total))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                z = model(torch.cat([x1, x2]))
            z1, z2 = z.float().chunk(2)
            loss = 0.5 * (nt_xent(z1, z2, args.temperature, rank) + nt_xent(z2, z1, args.temperature, rank))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step}/{total} loss {loss.item():.4f}", flush=True)
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s", flush=True)
            torch.save({"epoch": epoch, "backbone": model.module.backbone.state_dict(),
                        "model": model.module.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.out, "checkpoint.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
