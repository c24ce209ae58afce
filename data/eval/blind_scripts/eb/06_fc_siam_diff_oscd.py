"""FC-Siam-diff (Daudt et al. 2018) on OSCD-style Sentinel-2 city pairs, multi-GPU.

We train on large 512x512 crops (more urban context than the original 96 px
patches), which limits the batch to a few crops per GPU.

    torchrun --nproc_per_node=8 06_fc_siam_diff_oscd.py --data /data/oscd_ext --bs 4
"""
import argparse
import os
import random

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

BANDS = ["B01", "B02", "B03", "B04", "B05", "B06", "B07", "B08", "B8A", "B09", "B10", "B11", "B12"]


def read_city(root, city):
    def stack(d):
        out = []
        for b in BANDS:
            with rasterio.open(os.path.join(root, city, d, f"{b}.tif")) as src:
                out.append(src.read(1).astype(np.float32))
        h = min(a.shape[0] for a in out)
        w = min(a.shape[1] for a in out)
        x = np.stack([a[:h, :w] for a in out])
        return (x - x.mean((1, 2), keepdims=True)) / (x.std((1, 2), keepdims=True) + 1e-6)
    i1, i2 = stack("imgs_1_rect"), stack("imgs_2_rect")
    with rasterio.open(os.path.join(root, city, "cm", "cm.tif")) as src:
        cm = (src.read(1) > 1).astype(np.int64)
    h, w = min(i1.shape[1], i2.shape[1], cm.shape[0]), min(i1.shape[2], i2.shape[2], cm.shape[1])
    return i1[:, :h, :w], i2[:, :h, :w], cm[:h, :w]


class OSCDCrops(Dataset):
    """Random crops for training, a fixed grid for validation."""

    def __init__(self, root, cities, crop, train, crops_per_city=64):
        self.data = [read_city(root, c) for c in cities]
        self.crop, self.train = crop, train
        if train:
            self.index = [(k, None, None) for k in range(len(self.data)) for _ in range(crops_per_city)]
        else:
            self.index = []
            for k, (_, _, cm) in enumerate(self.data):
                h, w = cm.shape
                for r in range(0, max(1, h - crop + 1), crop):
                    for c in range(0, max(1, w - crop + 1), crop):
                        self.index.append((k, r, c))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        k, r, c = self.index[i]
        i1, i2, cm = self.data[k]
        h, w = cm.shape
        if r is None:
            r, c = random.randint(0, max(0, h - self.crop)), random.randint(0, max(0, w - self.crop))
        s = (slice(r, r + self.crop), slice(c, c + self.crop))
        a, b, y = i1[(slice(None),) + s], i2[(slice(None),) + s], cm[s]
        pad_h, pad_w = self.crop - y.shape[0], self.crop - y.shape[1]
        if pad_h or pad_w:
            a = np.pad(a, ((0, 0), (0, pad_h), (0, pad_w)))
            b = np.pad(b, ((0, 0), (0, pad_h), (0, pad_w)))
            y = np.pad(y, ((0, pad_h), (0, pad_w)), constant_values=-100)
        if self.train:
            if random.random() < 0.5:
                a, b, y = a[..., ::-1], b[..., ::-1], y[..., ::-1]
            k = random.randint(0, 3)
            a, b, y = np.rot90(a, k, (1, 2)), np.rot90(b, k, (1, 2)), np.rot90(y, k)
        t = lambda v: torch.from_numpy(np.ascontiguousarray(v))
        return t(a), t(b), t(y)


def conv_bn(cin, cout):
    return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True), nn.Dropout2d(0.2)]


class FCSiamDiff(nn.Module):
    def __init__(self, in_ch=13, n_cls=2):
        super().__init__()
        self.e1 = nn.Sequential(*conv_bn(in_ch, 16), *conv_bn(16, 16))
        self.e2 = nn.Sequential(*conv_bn(16, 32), *conv_bn(32, 32))
        self.e3 = nn.Sequential(*conv_bn(32, 64), *conv_bn(64, 64), *conv_bn(64, 64))
        self.e4 = nn.Sequential(*conv_bn(64, 128), *conv_bn(128, 128), *conv_bn(128, 128))
        self.u4 = nn.ConvTranspose2d(128, 128, 3, stride=2, padding=1, output_padding=1)
        self.d4 = nn.Sequential(*conv_bn(256, 128), *conv_bn(128, 128), *conv_bn(128, 64))
        self.u3 = nn.ConvTranspose2d(64, 64, 3, stride=2, padding=1, output_padding=1)
        self.d3 = nn.Sequential(*conv_bn(128, 64), *conv_bn(64, 64), *conv_bn(64, 32))
        self.u2 = nn.ConvTranspose2d(32, 32, 3, stride=2, padding=1, output_padding=1)
        self.d2 = nn.Sequential(*conv_bn(64, 32), *conv_bn(32, 16))
        self.u1 = nn.ConvTranspose2d(16, 16, 3, stride=2, padding=1, output_padding=1)
        self.d1 = nn.Sequential(*conv_bn(32, 16), nn.Conv2d(16, n_cls, 3, padding=1))

    def encode(self, x):
        s1 = self.e1(x)
        s2 = self.e2(F.max_pool2d(s1, 2))
        s3 = self.e3(F.max_pool2d(s2, 2))
        s4 = self.e4(F.max_pool2d(s3, 2))
        return [s1, s2, s3, s4], F.max_pool2d(s4, 2)

    def forward(self, x1, x2):
        (a1, a2, a3, a4), _ = self.encode(x1)
        (b1, b2, b3, b4), bott = self.encode(x2)
        y = self.d4(torch.cat([self.u4(bott), torch.abs(a4 - b4)], 1))
        y = self.d3(torch.cat([self.u3(y), torch.abs(a3 - b3)], 1))
        y = self.d2(torch.cat([self.u2(y), torch.abs(a2 - b2)], 1))
        return self.d1(torch.cat([self.u1(y), torch.abs(a1 - b1)], 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/oscd_ext")
    ap.add_argument("--logdir", default="runs/fcsiamdiff")
    ap.add_argument("--crop", type=int, default=512)
    ap.add_argument("--bs", type=int, default=4, help="crops per GPU")
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    with open(os.path.join(args.data, "train.txt")) as f:
        train_cities = f.read().split()
    with open(os.path.join(args.data, "test.txt")) as f:
        val_cities = f.read().split()
    train_ds = OSCDCrops(args.data, train_cities, args.crop, train=True)
    val_ds = OSCDCrops(args.data, val_cities, args.crop, train=False)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=args.bs,
                            num_workers=4, pin_memory=True)

    model = FCSiamDiff().to(device)
    model = DDP(model, device_ids=[local_rank])
    # scale lr with the global batch (reference: 32 crops)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * args.bs * world / 32, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.98)
    criterion = nn.NLLLoss(weight=torch.tensor([0.12, 0.88], device=device), ignore_index=-100)

    writer = SummaryWriter(args.logdir) if rank == 0 else None
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (a, b, y) in enumerate(train_loader):
            a, b, y = a.to(device, non_blocking=True), b.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = F.log_softmax(model(a, b), dim=1)
            loss = criterion(out, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if writer and step % 20 == 0:
                writer.add_scalar("loss", loss.item(), epoch * len(train_loader) + step)
        scheduler.step()

        model.eval()
        c = torch.zeros(4, device=device, dtype=torch.float64)
        with torch.no_grad():
            for a, b, y in val_loader:
                a, b, y = a.to(device), b.to(device), y.to(device)
                p = model.module(a, b).argmax(1)
                m = y != -100
                p, t = p[m], y[m]
                c += torch.stack([((p == 1) & (t == 1)).sum(), ((p == 1) & (t == 0)).sum(),
                                  ((p == 0) & (t == 1)).sum(), ((p == 0) & (t == 0)).sum()]).double()
        dist.all_reduce(c)
        tp, fp, fn, tn = c.tolist()
        prec, rec = tp / max(1, tp + fp), tp / max(1, tp + fn)
        f1 = 2 * prec * rec / max(1e-9, prec + rec)
        if rank == 0:
            writer.add_scalars("val", {"precision": prec, "recall": rec, "f1": f1,
                                       "acc": (tp + tn) / max(1, tp + fp + fn + tn)}, epoch)
            print(f"epoch {epoch} P {prec:.3f} R {rec:.3f} F1 {f1:.3f}", flush=True)
            if f1 > best:
                best = f1
                torch.save(model.module.state_dict(), os.path.join(args.logdir, "fcsiamdiff_best.pth"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
