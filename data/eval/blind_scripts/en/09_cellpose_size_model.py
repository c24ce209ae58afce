#!/usr/bin/env python
"""
Flow network + size model trained together, on the 4-GPU analysis PC.

Like cellpose, the network produces (cellprob, dy, dx) and a 256-d style
vector; a small linear "size model" regresses log(cell diameter) from the
style so the GUI can pick the rescaling factor automatically.

Dataset layout (exported from the annotation tool):
    train/img_XXXX.tif   (2, H, W)  cyto + nuclei
    train/flow_XXXX.tif  (3, H, W)  cellprob, dy, dx
    train/diams.json     {"img_XXXX.tif": median diameter in px, ...}

Run with nn.DataParallel on all visible cards:
    CUDA_VISIBLE_DEVICES=0,1,2,3 python 09_cellpose_size_model.py --root /data/cp/train --out models/cp_size
"""
import argparse
import json
import os
import time

import numpy as np
import tifffile
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, random_split


def normalize99(x):
    x = x.astype(np.float32)
    for c in range(x.shape[0]):
        lo, hi = np.percentile(x[c], [1, 99])
        x[c] = (x[c] - lo) / (hi - lo + 1e-6)
    return x


class CPTiles(Dataset):
    def __init__(self, root, tile=224, diam_mean=30.0):
        with open(os.path.join(root, "diams.json")) as fh:
            self.diams = json.load(fh)
        self.names = sorted(self.diams)
        self.root = root
        self.tile = tile
        self.diam_mean = diam_mean

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        name = self.names[i]
        img = tifffile.imread(os.path.join(self.root, name))
        flow = tifffile.imread(os.path.join(self.root, name.replace("img_", "flow_"))).astype(np.float32)
        d = float(self.diams[name])
        # rescale so the cells have ~diam_mean px, then take a random tile
        s = self.diam_mean / max(d, 1.0)
        img_t = torch.from_numpy(normalize99(img))[None]
        flow_t = torch.from_numpy(flow)[None]
        img_t = F.interpolate(img_t, scale_factor=s, mode="bilinear", align_corners=False)[0]
        flow_t = F.interpolate(flow_t, scale_factor=s, mode="bilinear", align_corners=False)[0]
        _, H, W = img_t.shape
        t = self.tile
        if H < t or W < t:
            img_t = F.pad(img_t, (0, max(0, t - W), 0, max(0, t - H)))
            flow_t = F.pad(flow_t, (0, max(0, t - W), 0, max(0, t - H)))
            _, H, W = img_t.shape
        y, x = np.random.randint(0, H - t + 1), np.random.randint(0, W - t + 1)
        return img_t[:, y:y + t, x:x + t], flow_t[:, y:y + t, x:x + t], torch.tensor(np.log(d), dtype=torch.float32)


def resblock(cin, cout):
    return nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(True), nn.Conv2d(cin, cout, 3, padding=1),
                         nn.BatchNorm2d(cout), nn.ReLU(True), nn.Conv2d(cout, cout, 3, padding=1))


class CPnet(nn.Module):
    def __init__(self, nbase=(2, 32, 64, 128, 256), nout=3):
        super().__init__()
        self.down = nn.ModuleList([resblock(nbase[i], nbase[i + 1]) for i in range(len(nbase) - 1)])
        self.proj = nn.ModuleList([nn.Conv2d(nbase[i], nbase[i + 1], 1) for i in range(len(nbase) - 1)])
        self.up = nn.ModuleList([resblock(nbase[i + 1] + (nbase[i + 2] if i + 2 < len(nbase) else 0), nbase[i + 1])
                                 for i in reversed(range(len(nbase) - 1))])
        self.style_fc = nn.Linear(nbase[-1], nbase[-1])
        self.output = nn.Conv2d(nbase[1], nout, 1)
        self.last_style = None

    def forward(self, x):
        feats = []
        for i, (d, p) in enumerate(zip(self.down, self.proj)):
            if i:
                x = F.max_pool2d(x, 2)
            x = d(x) + p(x)
            feats.append(x)
        style = F.normalize(self.style_fc(feats[-1].mean((2, 3))), dim=1)
        self.last_style = style  # kept for the size model and for export
        y = feats[-1] + style[:, :, None, None]
        y = self.up[0](y)
        for blk, f in zip(self.up[1:], reversed(feats[:-1])):
            y = F.interpolate(y, size=f.shape[-2:], mode="nearest")
            y = blk(torch.cat([y, f], 1))
        return self.output(y)


class SizeModel(nn.Module):
    def __init__(self, nstyle=256):
        super().__init__()
        self.lin = nn.Linear(nstyle, 1)

    def forward(self, style):
        return self.lin(style).squeeze(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=32, help="split over the GPUs by DataParallel")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--size-weight", type=float, default=0.5)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    ds = CPTiles(args.root)
    n_val = max(8, len(ds) // 10)
    train_ds, val_ds = random_split(ds, [len(ds) - n_val, n_val], generator=torch.Generator().manual_seed(0))
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, num_workers=args.workers)

    device = torch.device("cuda")
    net = CPnet().to(device)
    size_model = SizeModel().to(device)
    model = nn.DataParallel(net)
    print(f"DataParallel on {torch.cuda.device_count()} GPUs, batch {args.batch_size}", flush=True)

    params = list(model.parameters()) + list(size_model.parameters())
    opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [args.epochs - 100, args.epochs - 50], gamma=0.5)

    best = float("inf")
    for epoch in range(args.epochs):
        model.train()
        size_model.train()
        t0 = time.time()
        tot = 0.0
        for img, flow, logd in train_dl:
            img, flow, logd = img.to(device), flow.to(device), logd.to(device)
            out = model(img)
            l_flow = F.mse_loss(out[:, 1:], 5.0 * flow[:, 1:])
            l_prob = F.binary_cross_entropy_with_logits(out[:, 0], (flow[:, 0] > 0.5).float())
            l_size = F.mse_loss(size_model(model.module.last_style), logd)
            loss = l_flow + l_prob + args.size_weight * l_size
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot += loss.item()
        sched.step()

        model.eval()
        size_model.eval()
        vl, vd, nb = 0.0, 0.0, 0
        with torch.no_grad():
            for img, flow, logd in val_dl:
                img, flow, logd = img.to(device), flow.to(device), logd.to(device)
                out = model(img)
                vl += (F.mse_loss(out[:, 1:], 5.0 * flow[:, 1:]) +
                       F.binary_cross_entropy_with_logits(out[:, 0], (flow[:, 0] > 0.5).float())).item()
                vd += (size_model(model.module.last_style) - logd).abs().mean().item()
                nb += 1
        vl, vd = vl / max(nb, 1), vd / max(nb, 1)
        print(f"epoch {epoch:3d}  train {tot / len(train_dl):.4f}  val {vl:.4f}  "
              f"size |dlog| {vd:.3f}  lr {sched.get_last_lr()[0]:.3f}  {time.time() - t0:.0f}s", flush=True)
        if vl < best:
            best = vl
            torch.save({"net": net.state_dict(), "size": size_model.state_dict(), "epoch": epoch,
                        "diam_mean": ds.diam_mean}, os.path.join(args.out, "cp_size_best.pt"))


if __name__ == "__main__":
    main()
