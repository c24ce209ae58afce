"""Spleen segmentation (MSD Task09) with a wide 3D UNet and activation checkpointing.

Single node, processes started with torch.multiprocessing.spawn:

    python 11_spleen_spawn_ckpt.py --data /data/Task09_Spleen --cache /data/cache/spleen --gpus 4 --fold 0
"""
import argparse
import datetime
import json
import os
import time

import nibabel as nib
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from scipy import ndimage
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from monai.inferers import sliding_window_inference

TARGET = (1.5, 1.5, 2.0)


def preprocess(data_dir, cache_dir):
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(data_dir, "dataset.json")) as f:
        items = json.load(f)["training"]
    for it in items:
        name = os.path.basename(it["image"]).replace(".nii.gz", "")
        out = os.path.join(cache_dir, name + ".npz")
        if os.path.exists(out):
            continue
        img_nii = nib.load(os.path.join(data_dir, it["image"]))
        zoom = [s / t for s, t in zip(img_nii.header.get_zooms()[:3], TARGET)]
        img = ndimage.zoom(img_nii.get_fdata(dtype=np.float32), zoom, order=3)
        seg = ndimage.zoom(np.asarray(nib.load(os.path.join(data_dir, it["label"])).dataobj, dtype=np.uint8),
                           zoom, order=0)
        img = (np.clip(img, -57, 164) - 99.0) / 39.0
        tmp = out + ".tmp.npz"
        np.savez(tmp, img=img.astype(np.float32), seg=seg)
        os.replace(tmp, out)


class SpleenPatches(Dataset):
    def __init__(self, cache_dir, cases, patch, fg_fraction=0.5, repeats=10):
        self.cache_dir, self.patch, self.fg_fraction = cache_dir, np.array(patch), fg_fraction
        self.items = [c for c in cases for _ in range(repeats)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        d = np.load(os.path.join(self.cache_dir, self.items[i] + ".npz"))
        img, seg = d["img"], d["seg"]
        pad = np.maximum(self.patch - np.array(img.shape), 0)
        img = np.pad(img, [(0, p) for p in pad], constant_values=img.min())
        seg = np.pad(seg, [(0, p) for p in pad])
        shape = np.array(img.shape)
        if np.random.rand() < self.fg_fraction and seg.any():
            fg = np.argwhere(seg)
            lo = np.clip(fg[np.random.randint(len(fg))] - self.patch // 2, 0, shape - self.patch)
        else:
            lo = np.array([np.random.randint(0, s - p + 1) for s, p in zip(shape, self.patch)])
        sl = tuple(slice(a, a + p) for a, p in zip(lo, self.patch))
        x, y = img[sl][None], seg[sl][None].astype(np.int64)
        if np.random.rand() < 0.5:
            x, y = x[:, ::-1], y[:, ::-1]
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


class Block(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv3d(cin, cout, 3, padding=1), nn.InstanceNorm3d(cout, affine=True), nn.LeakyReLU(0.01),
            nn.Conv3d(cout, cout, 3, padding=1), nn.InstanceNorm3d(cout, affine=True), nn.LeakyReLU(0.01))

    def forward(self, x):
        return self.body(x)


class WideUNet(nn.Module):
    def __init__(self, chs=(48, 96, 192, 384, 512), n_cls=2, grad_ckpt=True):
        super().__init__()
        self.grad_ckpt = grad_ckpt
        self.enc = nn.ModuleList([Block(1 if i == 0 else chs[i - 1], c) for i, c in enumerate(chs)])
        self.up = nn.ModuleList([nn.ConvTranspose3d(chs[i], chs[i - 1], 2, 2) for i in range(len(chs) - 1, 0, -1)])
        self.dec = nn.ModuleList([Block(2 * chs[i - 1], chs[i - 1]) for i in range(len(chs) - 1, 0, -1)])
        self.head = nn.Conv3d(chs[0], n_cls, 1)

    def _run(self, blk, x):
        if self.grad_ckpt and self.training:
            return checkpoint(blk, x, use_reentrant=False)
        return blk(x)

    def forward(self, x):
        skips = []
        for i, blk in enumerate(self.enc):
            x = self._run(blk, x if i == 0 else F.max_pool3d(x, 2))
            skips.append(x)
        x = skips.pop()
        for up, blk in zip(self.up, self.dec):
            x = self._run(blk, torch.cat([up(x), skips.pop()], 1))
        return self.head(x)


def dice_ce(logits, y):
    ce = F.cross_entropy(logits, y[:, 0])
    p = logits.softmax(1)[:, 1]
    g = (y[:, 0] == 1).float()
    dc = (2 * (p * g).sum() + 1e-5) / (p.sum() + g.sum() + 1e-5)
    return ce + 1 - dc


def worker(gpu, ngpus, args):
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", world_size=ngpus, rank=gpu,
                            timeout=datetime.timedelta(hours=2))
    device = torch.device("cuda", gpu)

    if gpu == 0:
        preprocess(args.data, args.cache)
    dist.barrier()

    with open(os.path.join(args.data, "folds.json")) as f:
        fold = json.load(f)[str(args.fold)]
    patch = (96, 96, 96)
    ds = SpleenPatches(args.cache, fold["train"], patch)
    sampler = DistributedSampler(ds, num_replicas=ngpus, rank=gpu, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True)

    net = WideUNet().to(device)
    model = DDP(net, device_ids=[gpu])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.99, nesterov=True, weight_decay=3e-5)
    poly = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: (1 - e / args.epochs) ** 0.9)
    os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        t0, tot = time.time(), torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = dice_ce(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 12)
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        poly.step()
        dist.all_reduce(tot)
        if gpu == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} lr {poly.get_last_lr()[0]:.5f} "
                  f"{time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.val_every == 0:
            net.eval()
            scores = []
            with torch.no_grad():
                for case in fold["val"][gpu::ngpus]:
                    d = np.load(os.path.join(args.cache, case + ".npz"))
                    x = torch.from_numpy(d["img"])[None, None].to(device)
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        pred = sliding_window_inference(x, patch, 4, net, overlap=0.5, mode="gaussian").argmax(1)[0]
                    g = torch.from_numpy(d["seg"]).to(device) == 1
                    p = pred == 1
                    scores.append((2 * (p & g).sum() / (p.sum() + g.sum()).clamp(min=1)).item())
            net.train()
            gathered = [None] * ngpus
            dist.all_gather_object(gathered, scores)
            if gpu == 0:
                flat = [s for part in gathered for s in part]
                mean = float(np.mean(flat))
                print(f"  val dice {mean:.4f} over {len(flat)} cases", flush=True)
                if mean > best:
                    best = mean
                    torch.save(net.state_dict(), os.path.join(args.out, f"fold{args.fold}_best.pt"))
                torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                           os.path.join(args.out, f"fold{args.fold}_last.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--out", default="out/spleen")
    parser.add_argument("--fold", type=int, default=0)
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--epochs", type=int, default=500)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--val_every", type=int, default=10)
    parser.add_argument("--port", type=int, default=29533)
    args = parser.parse_args()
    mp.spawn(worker, nprocs=args.gpus, args=(args.gpus, args))
