"""Urban change detection on OSCD (Onera Satellite Change Detection), 13-band Sentinel-2 pairs.

Siamese ResNet-18 encoder (weights shared between the two dates), concatenated
multi-scale features, light decoder. The 24 OSCD cities differ in size (from ~300 to
~1200 px per side), so evaluation splits whole cities across ranks and predicts each
with an overlapping sliding window.

    torchrun --nproc_per_node=4 13_oscd_siamese_cd.py --root /data/OSCD --pretrained ssl4eo_rn18_s2.pth
"""
import argparse
import os
import time
from pathlib import Path

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

BANDS = ["B01", "B02", "B03", "B04", "B05", "B06", "B07", "B08", "B8A", "B09", "B10", "B11", "B12"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--pretrained", type=str, default="")
    p.add_argument("--resume", type=str, default="")
    p.add_argument("--out", type=Path, default=Path("work_dirs/oscd_siam_rn18"))
    p.add_argument("--crop", type=int, default=96)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--epochs", type=int, default=150)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--patience", type=int, default=25)
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


def read_city(city_dir):
    """Returns (img1, img2) as (13, H, W) float32 reflectance/1e4 and the change mask (H, W)."""
    dates = []
    for sub in ("imgs_1_rect", "imgs_2_rect"):
        bands = []
        for b in BANDS:
            with rasterio.open(city_dir / sub / f"{b}.tif") as src:
                bands.append(src.read(1).astype(np.float32))
        h = min(x.shape[0] for x in bands)
        w = min(x.shape[1] for x in bands)
        dates.append(np.stack([x[:h, :w] for x in bands]) / 10000.0)
    with rasterio.open(city_dir / "cm" / "cm.png") as src:
        cm = (src.read(1) > 1).astype(np.int64)
    h = min(dates[0].shape[1], dates[1].shape[1], cm.shape[0])
    w = min(dates[0].shape[2], dates[1].shape[2], cm.shape[1])
    return dates[0][:, :h, :w], dates[1][:, :h, :w], cm[:h, :w]


def city_list(root, split):
    with open(root / f"{split}.txt") as f:
        return [c.strip() for c in f.read().split(",") if c.strip()]


class RandomCropPairs(Dataset):
    def __init__(self, root, cities, crop, samples_per_epoch=8000):
        self.data = [read_city(root / c) for c in cities]
        self.crop, self.n = crop, samples_per_epoch

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        a, b, cm = self.data[i % len(self.data)]
        _, h, w = a.shape
        y, x = np.random.randint(0, h - self.crop + 1), np.random.randint(0, w - self.crop + 1)
        a = a[:, y:y + self.crop, x:x + self.crop]
        b = b[:, y:y + self.crop, x:x + self.crop]
        cm = cm[y:y + self.crop, x:x + self.crop]
        k = np.random.randint(4)
        a, b, cm = np.rot90(a, k, (1, 2)), np.rot90(b, k, (1, 2)), np.rot90(cm, k)
        return (torch.from_numpy(a.copy()), torch.from_numpy(b.copy()), torch.from_numpy(cm.copy()))


class SiamResNetCD(nn.Module):
    def __init__(self, in_ch=13):
        super().__init__()
        r = torchvision.models.resnet18(weights=None)
        r.conv1 = nn.Conv2d(in_ch, 64, 7, 2, 3, bias=False)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu)
        self.pool = r.maxpool
        self.layers = nn.ModuleList([r.layer1, r.layer2, r.layer3, r.layer4])
        self.lat = nn.ModuleList([nn.Conv2d(2 * c, 64, 1) for c in (64, 128, 256, 512)])
        self.fuse = nn.Sequential(nn.Conv2d(256, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(True),
                                  nn.Conv2d(64, 2, 1))

    def features(self, x):
        x = self.pool(self.stem(x))
        out = []
        for layer in self.layers:
            x = layer(x)
            out.append(x)
        return out

    def forward(self, a, b):
        size = a.shape[-2:]
        fa, fb = self.features(a), self.features(b)
        maps = [F.interpolate(l(torch.cat([x, y], 1)), scale_factor=2 ** (i + 2), mode="bilinear", align_corners=False)
                for i, (l, x, y) in enumerate(zip(self.lat, fa, fb))]
        return F.interpolate(self.fuse(torch.cat(maps, 1)), size=size, mode="bilinear", align_corners=False)


def remap_resnet_key(k):
    """torchvision ResNet key -> SiamResNetCD key."""
    if k.startswith("conv1."):
        return "stem.0." + k[len("conv1."):]
    if k.startswith("bn1."):
        return "stem.1." + k[len("bn1."):]
    if k.startswith("layer"):
        idx, rest = k[len("layer"):].split(".", 1)
        return f"layers.{int(idx) - 1}.{rest}"
    return k


@torch.no_grad()
def eval_cities(net, root, cities, device, rank, world, crop=256, overlap=64):
    net.eval()
    stats = torch.zeros(3, dtype=torch.float64, device=device)  # tp, fp, fn
    for city in cities[rank::world]:
        a, b, cm = read_city(root / city)
        a, b = torch.from_numpy(a).to(device), torch.from_numpy(b).to(device)
        cm = torch.from_numpy(cm).to(device)
        _, h, w = a.shape
        # pad small cities up to one window
        ph, pw = max(0, crop - h), max(0, crop - w)
        a = F.pad(a, (0, pw, 0, ph), mode="constant")
        b = F.pad(b, (0, pw, 0, ph), mode="constant")
        H, W = a.shape[-2:]
        prob = torch.zeros(H, W, device=device)
        cnt = torch.zeros(H, W, device=device)
        step = crop - overlap
        for y in sorted(set(list(range(0, H - crop + 1, step)) + [H - crop])):
            for x in sorted(set(list(range(0, W - crop + 1, step)) + [W - crop])):
                out = net(a[None, :, y:y + crop, x:x + crop], b[None, :, y:y + crop, x:x + crop])
                prob[y:y + crop, x:x + crop] += out[0].softmax(0)[1]
                cnt[y:y + crop, x:x + crop] += 1
        pred = (prob / cnt)[:h, :w] > 0.5
        gt = cm.bool()
        stats += torch.stack([(pred & gt).sum(), (pred & ~gt).sum(), (~pred & gt).sum()]).double()
    dist.all_reduce(stats)
    net.train()
    tp, fp, fn = stats.tolist()
    prec, rec = tp / max(tp + fp, 1), tp / max(tp + fn, 1)
    return 2 * prec * rec / max(prec + rec, 1e-9), prec, rec


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = RandomCropPairs(args.root, city_list(args.root, "train"), args.crop)
    test_cities = city_list(args.root, "test")
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = SiamResNetCD()
    if args.pretrained:
        sd = torch.load(args.pretrained, map_location="cpu")
        sd = {remap_resnet_key(k.replace("backbone.", "")): v for k, v in sd.get("state_dict", sd).items()}
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if rank == 0:
            print(f"pretrained encoder: {len(missing)} missing, {len(unexpected)} unexpected keys")
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    start_epoch, best_f1, since_best = 0, 0.0, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best_f1 = ckpt["epoch"] + 1, ckpt["best_f1"]
    model = DDP(model, device_ids=[local_rank])

    weight = torch.tensor([1.0, 10.0], device=device)  # ~4% of OSCD pixels changed
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for a, b, cm in loader:
            a, b, cm = a.to(device, non_blocking=True), b.to(device, non_blocking=True), cm.to(device, non_blocking=True)
            loss = F.cross_entropy(model(a, b), cm, weight=weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(running)

        f1, prec, rec = eval_cities(model.module, args.root, test_cities, device, rank, world)
        stop = torch.zeros(1, device=device)
        if rank == 0:
            print(f"ep {epoch:3d} loss {(running[0] / running[1]).item():.4f} F1 {f1:.4f} P {prec:.4f} R {rec:.4f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            if f1 > best_f1:
                best_f1, since_best = f1, 0
                torch.save(model.module.state_dict(), args.out / "best_model.pth")
            else:
                since_best += 1
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best_f1": best_f1}, args.out / "last.pth")
            stop.fill_(float(since_best >= args.patience))
        dist.broadcast(stop, src=0)
        if stop.item():
            if rank == 0:
                print(f"early stop at epoch {epoch}, best F1 {best_f1:.4f}")
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
