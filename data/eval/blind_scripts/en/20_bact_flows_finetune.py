#!/usr/bin/env python
"""
Fine-tuning a cellpose-like flow model on a user project (bacteria in phase
contrast), with tiled whole-image validation and export for the napari plugin.

Images: <root>/images/*.tif (H, W) phase contrast, <root>/masks/*.tif instances.
Flows (dy, dx, cellprob) are computed once with ``cellpose.dynamics`` and kept in
memory (projects are small: 50-300 images).

    torchrun --nproc_per_node=2 20_bact_flows_finetune.py --root /projects/u123/bact_phase \
        --pretrained models/flows_base.pt --out /projects/u123/models/bact_ft
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
from cellpose import dynamics
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def norm99(x):
    lo, hi = np.percentile(x, (1, 99))
    return (x.astype(np.float32) - lo) / max(hi - lo, 1e-3)


class FlowData(Dataset):
    def __init__(self, imgs, flows, tile=224):
        self.imgs, self.flows, self.tile = imgs, flows, tile

    def __len__(self):
        return len(self.imgs) * 8

    def __getitem__(self, i):
        img, fl = self.imgs[i // 8], self.flows[i // 8]
        H, W = img.shape
        t = self.tile
        y, x = np.random.randint(0, H - t + 1), np.random.randint(0, W - t + 1)
        im = norm99(img[y:y + t, x:x + t])
        f = fl[:, y:y + t, x:x + t].copy()
        if np.random.rand() < 0.5:
            im, f = im[:, ::-1], f[:, :, ::-1]
            f[1] = -f[1]
        return torch.from_numpy(im.copy())[None], torch.from_numpy(f.copy())


class FlowUNet(nn.Module):
    def __init__(self, nbase=(32, 64, 128, 256), diam_mean=17.0):
        super().__init__()
        self.diam_mean = diam_mean  # bacteria default
        blk = lambda i, o: nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.GroupNorm(8, o), nn.ReLU(True),  # noqa
                                         nn.Conv2d(o, o, 3, padding=1), nn.GroupNorm(8, o), nn.ReLU(True))
        self.down = nn.ModuleList([blk(1 if i == 0 else nbase[i - 1], nbase[i]) for i in range(len(nbase))])
        self.up = nn.ModuleList([blk(nbase[i] + nbase[i + 1], nbase[i]) for i in reversed(range(len(nbase) - 1))])
        self.out = nn.Conv2d(nbase[0], 3, 1)

    def forward(self, x):
        s = []
        for i, d in enumerate(self.down):
            x = d(x if i == 0 else F.max_pool2d(x, 2))
            s.append(x)
        s.pop()
        for u in self.up:
            r = s.pop()
            x = u(torch.cat([F.interpolate(x, size=r.shape[-2:]), r], 1))
        return self.out(x)

    @torch.no_grad()
    def predict_tiled(self, img, tile=224, overlap=0.1):
        """img: normalised (H, W) array -> (3, H, W) flows + cellprob, averaged over tile overlaps"""
        dev = next(self.parameters()).device
        H, W = img.shape
        step = int(tile * (1 - overlap))
        ys = sorted(set(list(range(0, max(H - tile, 0) + 1, step)) + [max(H - tile, 0)]))
        xs = sorted(set(list(range(0, max(W - tile, 0) + 1, step)) + [max(W - tile, 0)]))
        acc = torch.zeros(3, H, W, device=dev)
        cnt = torch.zeros(1, H, W, device=dev)
        x_full = torch.from_numpy(img)[None, None].to(dev)
        for y in ys:
            for x in xs:
                acc[:, y:y + tile, x:x + tile] += self(x_full[..., y:y + tile, x:x + tile])[0]
                cnt[:, y:y + tile, x:x + tile] += 1
        return (acc / cnt).cpu().numpy()


def compute_flows(masks):
    out = []
    for m in masks:
        fl = dynamics.labels_to_flows([m])[0]  # (4, H, W): labels, cellprob, dy, dx
        out.append(np.stack([fl[2], fl[3], (fl[1] > 0.5).astype(np.float32)]).astype(np.float32))
    return out


def flow_loss(pred, tgt):
    return F.mse_loss(pred[:, :2], 5 * tgt[:, :2]) + F.binary_cross_entropy_with_logits(pred[:, 2], tgt[:, 2])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--pretrained", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--n-val", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    img_files = sorted(glob.glob(os.path.join(args.root, "images", "*.tif")))
    msk_files = [f.replace("/images/", "/masks/") for f in img_files]
    imgs = [tifffile.imread(f) for f in img_files]
    masks = [tifffile.imread(f) for f in msk_files]
    val_imgs, val_masks = imgs[-args.n_val:], masks[-args.n_val:]
    train_ds = FlowData(imgs[:-args.n_val], compute_flows(masks[:-args.n_val]))

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, drop_last=True)

    model = FlowUNet()
    if args.pretrained:
        sd = torch.load(args.pretrained, map_location="cpu")
        model.load_state_dict(sd["model"] if "model" in sd else sd)
    model = DDP(model.to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.01, total_iters=args.epochs)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=dev)
        for img, fl in dl:
            img, fl = img.to(dev, non_blocking=True), fl.to(dev, non_blocking=True)
            loss = flow_loss(model(img), fl)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=dev)])
        sched.step()
        dist.all_reduce(acc)

        if (epoch + 1) % 20 == 0 or epoch == args.epochs - 1:
            # whole-image validation: each rank takes every world-th validation image
            model.eval()
            stats = torch.zeros(2, device=dev)
            for im, m in list(zip(val_imgs, val_masks))[rank::world]:
                pred = model.predict_tiled(norm99(im), tile=224)
                prob = 1 / (1 + np.exp(-pred[2]))
                fg_pred, fg_gt = prob > 0.5, m > 0
                stats += torch.tensor([(fg_pred & fg_gt).sum(), (fg_pred | fg_gt).sum()], device=dev,
                                      dtype=torch.float32)
            dist.all_reduce(stats)
            if rank == 0:
                print(f"epoch {epoch}  loss {(acc[0] / acc[1]).item():.4f}  fg IoU {(stats[0] / stats[1]).item():.3f}",
                      flush=True)
                torch.save({"model": model.module.state_dict(), "diam_mean": model.diam_mean, "epoch": epoch},
                           os.path.join(args.out, f"flows_ft_e{epoch:03d}.pt"))
        elif rank == 0:
            print(f"epoch {epoch}  loss {(acc[0] / acc[1]).item():.4f}  ({time.time() - t0:.0f}s)", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
