"""Bi-temporal change detection on OSCD-style Sentinel-2 pairs.

Each city folder holds two co-registered 13-band stacks and a binary change mask:
    <root>/<city>/pair/img1.tif, img2.tif, cm/cm.tif  (cm: 1 = no change, 2 = change)

Random 128x128 crops are drawn from the pairs for training; validation runs a
sliding window over whole cities and accumulates a global confusion matrix.

    torchrun --standalone --nproc_per_node=4 02_oscd_siamese_change.py \
        --root /data/shared/oscd --accum-steps 2
"""
import argparse
import contextlib
import math
import os
import random
from pathlib import Path

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TRAIN_CITIES = ["abudhabi", "aguasclaras", "beihai", "beirut", "bercy", "bordeaux",
                "cupertino", "hongkong", "mumbai", "nantes", "paris", "pisa",
                "rennes", "saclay_e"]
VAL_CITIES = ["brasilia", "chongqing", "dubai", "lasvegas", "milano",
              "montpellier", "norcia", "rio", "saclay_w", "valencia"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="/data/shared/experiments/oscd_siam")
    ap.add_argument("--crop", type=int, default=128)
    ap.add_argument("--crops-per-city", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--accum-steps", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--pos-weight", type=float, default=8.0)
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def read_stack(path):
    with rasterio.open(path) as src:
        arr = src.read(out_dtype="float32")
    # per-image standardisation: OSCD pairs come from different processing levels
    mean = arr.reshape(arr.shape[0], -1).mean(1)[:, None, None]
    std = arr.reshape(arr.shape[0], -1).std(1)[:, None, None] + 1e-6
    return (arr - mean) / std


class OSCDPairs(Dataset):
    def __init__(self, root, cities, crop, crops_per_city, train):
        self.crop, self.train = crop, train
        self.items = []
        for city in cities:
            d = Path(root) / city / "pair"
            a, b = read_stack(d / "img1.tif"), read_stack(d / "img2.tif")
            with rasterio.open(d / "cm" / "cm.tif") as src:
                cm = (src.read(1) == 2).astype(np.float32)
            self.items.append((a, b, cm))
        self.crops_per_city = crops_per_city if train else 1

    def __len__(self):
        return len(self.items) * self.crops_per_city

    def __getitem__(self, i):
        a, b, cm = self.items[i // self.crops_per_city]
        if not self.train:
            return torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(cm)
        h, w = cm.shape
        y = random.randint(0, h - self.crop)
        x = random.randint(0, w - self.crop)
        sl = (slice(y, y + self.crop), slice(x, x + self.crop))
        pa, pb, pm = a[(slice(None),) + sl], b[(slice(None),) + sl], cm[sl]
        if random.random() < 0.5:
            pa, pb, pm = pa[..., ::-1], pb[..., ::-1], pm[..., ::-1]
        if random.random() < 0.5:  # temporal swap: change is symmetric
            pa, pb = pb, pa
        return (torch.from_numpy(pa.copy()), torch.from_numpy(pb.copy()),
                torch.from_numpy(pm.copy()))


def seed_worker(worker_id):
    # torch already gives each worker base_seed + worker_id; make it differ per rank too
    seed = (torch.initial_seed() + 7919 * int(os.environ.get("RANK", 0))) % 2 ** 32
    random.seed(seed)
    np.random.seed(seed)


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
    )


class SiamUNetDiff(nn.Module):
    """FC-Siam-diff: one shared encoder for both dates, decoder on |f1 - f2|."""

    def __init__(self, in_ch=13, widths=(32, 64, 128, 256), grad_ckpt=False):
        super().__init__()
        self.grad_ckpt = grad_ckpt
        self.enc = nn.ModuleList()
        c = in_ch
        for w in widths:
            self.enc.append(conv_block(c, w))
            c = w
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        for w_hi, w_lo in zip(widths[::-1][:-1], widths[::-1][1:]):
            self.up.append(nn.ConvTranspose2d(w_hi, w_lo, 2, stride=2))
            self.dec.append(conv_block(2 * w_lo, w_lo))
        self.head = nn.Conv2d(widths[0], 1, 1)

    def encode(self, x):
        feats = []
        for i, block in enumerate(self.enc):
            if i > 0:
                x = F.max_pool2d(x, 2)
            if self.grad_ckpt and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
            feats.append(x)
        return feats

    def forward(self, a, b):
        fa, fb = self.encode(a), self.encode(b)
        diffs = [torch.abs(x - y) for x, y in zip(fa, fb)]
        x = diffs[-1]
        for up, dec, skip in zip(self.up, self.dec, diffs[-2::-1]):
            x = up(x)
            x = dec(torch.cat([x, skip], 1))
        return self.head(x).squeeze(1)


@torch.no_grad()
def sliding_predict(model, a, b, tile=256, overlap=32):
    _, _, h, w = a.shape
    out = torch.zeros(h, w, device=a.device)
    cnt = torch.zeros(h, w, device=a.device)
    stride = tile - overlap
    ys = list(range(0, max(h - tile, 0) + 1, stride))
    xs = list(range(0, max(w - tile, 0) + 1, stride))
    if ys[-1] + tile < h:
        ys.append(h - tile)
    if xs[-1] + tile < w:
        xs.append(w - tile)
    for y in ys:
        for x in xs:
            pa = a[..., y:y + tile, x:x + tile]
            pb = b[..., y:y + tile, x:x + tile]
            ph, pw = pa.shape[-2:]
            pa = F.pad(pa, (0, tile - pw, 0, tile - ph), mode="reflect")
            pb = F.pad(pb, (0, tile - pw, 0, tile - ph), mode="reflect")
            logit = model(pa, pb)[0, :ph, :pw]
            out[y:y + ph, x:x + pw] += torch.sigmoid(logit)
            cnt[y:y + ph, x:x + pw] += 1
    return out / cnt


@torch.no_grad()
def validate(net, val_set, rank, world, device):
    net.eval()
    stats = torch.zeros(4, dtype=torch.float64, device=device)  # tp fp fn tn
    for i in range(rank, len(val_set), world):
        a, b, cm = val_set[i]
        prob = sliding_predict(net, a[None].to(device), b[None].to(device))
        pred, gt = prob > 0.5, cm.to(device) > 0.5
        stats += torch.stack([(pred & gt).sum(), (pred & ~gt).sum(),
                              (~pred & gt).sum(), (~pred & ~gt).sum()]).double()
    dist.all_reduce(stats)
    tp, fp, fn, _ = stats.tolist()
    prec = tp / max(tp + fp, 1)
    rec = tp / max(tp + fn, 1)
    return {"precision": prec, "recall": rec,
            "f1": 2 * prec * rec / max(prec + rec, 1e-9),
            "iou_change": tp / max(tp + fp + fn, 1)}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    random.seed(args.seed + rank)          # different crops on every rank
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)           # identical initial weights

    train_set = OSCDPairs(args.root, TRAIN_CITIES, args.crop, args.crops_per_city, train=True)
    val_set = OSCDPairs(args.root, VAL_CITIES, args.crop, 1, train=False)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True,
                        worker_init_fn=seed_worker)

    net = SiamUNetDiff(grad_ckpt=args.grad_ckpt)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).cuda()
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)

    # --lr is for 32 crops per optimizer update; scale with the effective batch
    lr = args.lr * args.batch_size * args.accum_steps * world / 32
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-4)
    updates_per_epoch = math.ceil(len(loader) / args.accum_steps)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * updates_per_epoch)
    pos_weight = torch.tensor(args.pos_weight, device=device)

    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    start_epoch, best_f1 = 0, -1.0
    last = out / "last.pt"
    if last.exists():
        state = torch.load(last, map_location=device)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start_epoch, best_f1 = state["epoch"] + 1, state["best_f1"]
    dist.barrier()

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        opt.zero_grad(set_to_none=True)
        n_batches = len(loader)
        for it, (a, b, m) in enumerate(loader):
            a = a.to(device, non_blocking=True)
            b = b.to(device, non_blocking=True)
            m = m.to(device, non_blocking=True)
            is_update = (it + 1) % args.accum_steps == 0 or (it + 1) == n_batches
            ctx = contextlib.nullcontext() if is_update else model.no_sync()
            with ctx:
                logits = model(a, b)
                loss = F.binary_cross_entropy_with_logits(logits, m, pos_weight=pos_weight)
                (loss / args.accum_steps).backward()
            if is_update:
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"[{epoch}] it {it}/{n_batches} loss {loss.item():.4f}", flush=True)

        if (epoch + 1) % 5 == 0 or epoch == args.epochs - 1:
            metrics = validate(net, val_set, rank, world, device)
            if rank == 0:
                print(f"[{epoch}] val " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()),
                      flush=True)
                if metrics["f1"] > best_f1:
                    best_f1 = metrics["f1"]
                    torch.save(net.state_dict(), out / "best.pt")
            best_f1 = max(best_f1, metrics["f1"])
        if rank == 0:
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "best_f1": best_f1},
                       out / "last.pt.tmp")
            os.replace(out / "last.pt.tmp", out / "last.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
