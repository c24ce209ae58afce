#!/usr/bin/env python
"""
Synaptic cleft / vesicle cloud segmentation on ATUM-SEM sections.

Training uses random 2D tiles; validation runs tiled (sliding-window) inference
on whole held-out sections, exactly as the production inference script does,
so the validation F1 matches what users get.

    torchrun --nproc_per_node=4 15_synapse_seg_ddp.py --sections /data/atum/secs \
        --labels /data/atum/syn_labels --val-sections 3 --out runs/syn_v2
"""
import argparse
import glob
import os
import time

import numpy as np
import tifffile
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
TILE = 512
OVERLAP = 64


def percentile_norm(x):
    lo, hi = np.percentile(x, (0.5, 99.5))
    return np.clip((x.astype(np.float32) - lo) / max(hi - lo, 1.0), -0.5, 1.5)


@torch.no_grad()
def sliding_window_predict(net, image, tile=TILE, overlap=OVERLAP, batch=8):
    """tiled inference with linear blending; image is a 2D numpy array"""
    H, W = image.shape
    step = tile - overlap
    ys = list(range(0, max(H - tile, 0) + 1, step)) + ([H - tile] if (H - tile) % step else [])
    xs = list(range(0, max(W - tile, 0) + 1, step)) + ([W - tile] if (W - tile) % step else [])
    ramp = torch.ones(tile, device=DEVICE)
    ramp[:overlap] = torch.linspace(0, 1, overlap, device=DEVICE)
    ramp[-overlap:] = torch.linspace(1, 0, overlap, device=DEVICE)
    weight = (ramp[:, None] * ramp[None, :]).clamp(min=1e-3)
    out = torch.zeros((H, W), device=DEVICE)
    norm = torch.zeros((H, W), device=DEVICE)
    coords = [(y, x) for y in ys for x in xs]
    for i in range(0, len(coords), batch):
        cs = coords[i:i + batch]
        tiles = np.stack([percentile_norm(image[y:y + tile, x:x + tile]) for y, x in cs])
        prob = torch.sigmoid(net(torch.from_numpy(tiles)[:, None].to(DEVICE)))[:, 0]
        for (y, x), p in zip(cs, prob):
            out[y:y + tile, x:x + tile] += p * weight
            norm[y:y + tile, x:x + tile] += weight
    return (out / norm).cpu().numpy()


class SectionTiles(Dataset):
    def __init__(self, secs, labs, n_tiles, tile=TILE):
        self.secs = [tifffile.memmap(s, mode="r") for s in secs]
        self.labs = [tifffile.memmap(l, mode="r") for l in labs]
        self.n, self.tile = n_tiles, tile

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        k = np.random.randint(len(self.secs))
        img, lab = self.secs[k], self.labs[k]
        H, W = img.shape
        t = self.tile
        # oversample tiles with synapses (they cover <1% of the section)
        if np.random.rand() < 0.5:
            ys, xs = np.nonzero(lab[::16, ::16])
            if len(ys):
                j = np.random.randint(len(ys))
                y = int(np.clip(ys[j] * 16 - t // 2, 0, H - t))
                x = int(np.clip(xs[j] * 16 - t // 2, 0, W - t))
            else:
                y, x = np.random.randint(H - t), np.random.randint(W - t)
        else:
            y, x = np.random.randint(H - t), np.random.randint(W - t)
        im = percentile_norm(img[y:y + t, x:x + t])
        lb = (lab[y:y + t, x:x + t] > 0).astype(np.float32)
        k = np.random.randint(4)
        return torch.from_numpy(np.rot90(im, k).copy())[None], torch.from_numpy(np.rot90(lb, k).copy())[None]


class SynUNet(nn.Module):
    def __init__(self, c=32):
        super().__init__()
        conv = lambda i, o: nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.GroupNorm(8, o), nn.ReLU(True),  # noqa
                                          nn.Conv2d(o, o, 3, padding=1), nn.GroupNorm(8, o), nn.ReLU(True))
        self.d1, self.d2, self.d3, self.d4 = conv(1, c), conv(c, 2 * c), conv(2 * c, 4 * c), conv(4 * c, 8 * c)
        self.u3, self.c3 = nn.ConvTranspose2d(8 * c, 4 * c, 2, 2), conv(8 * c, 4 * c)
        self.u2, self.c2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, 2), conv(4 * c, 2 * c)
        self.u1, self.c1 = nn.ConvTranspose2d(2 * c, c, 2, 2), conv(2 * c, c)
        self.out = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        a = self.d1(x)
        b = self.d2(F.max_pool2d(a, 2))
        c = self.d3(F.max_pool2d(b, 2))
        d = self.d4(F.max_pool2d(c, 2))
        y = self.c3(torch.cat([self.u3(d), c], 1))
        y = self.c2(torch.cat([self.u2(y), b], 1))
        y = self.c1(torch.cat([self.u1(y), a], 1))
        return self.out(y)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", required=True)
    ap.add_argument("--labels", required=True)
    ap.add_argument("--val-sections", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiles-per-epoch", type=int, default=8000)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    secs = sorted(glob.glob(os.path.join(args.sections, "*.tif")))
    labs = [os.path.join(args.labels, os.path.basename(s)) for s in secs]
    nv = args.val_sections
    train_ds = SectionTiles(secs[:-nv], labs[:-nv], args.tiles_per_epoch)
    val_pairs = list(zip(secs[-nv:], labs[-nv:]))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True)

    model = DDP(SynUNet().to(dev), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=25)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_f1 = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for img, lab in dl:
            img, lab = img.to(dev, non_blocking=True), lab.to(dev, non_blocking=True)
            logits = model(img)
            loss = F.binary_cross_entropy_with_logits(logits, lab, pos_weight=torch.tensor([5.0], device=dev))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        # every rank predicts its share of the validation sections
        model.eval()
        tp_fp_fn = torch.zeros(3, device=dev)
        for sec, lab in val_pairs[rank::world]:
            prob = sliding_window_predict(model.module, tifffile.imread(sec))
            gt = tifffile.imread(lab) > 0
            pr = prob > 0.5
            tp_fp_fn += torch.tensor([(pr & gt).sum(), (pr & ~gt).sum(), (~pr & gt).sum()],
                                     dtype=torch.float32, device=dev)
        dist.all_reduce(tp_fp_fn)
        tp, fp, fn = tp_fp_fn.tolist()
        f1 = 2 * tp / max(2 * tp + fp + fn, 1.0)

        if rank == 0:
            print(f"epoch {epoch:3d}  val F1 {f1:.4f}  {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if f1 > best_f1:
                best_f1 = f1
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "f1": f1},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
