"""Large-patch 3D U-Net (nnU-Net-like) with deep supervision for whole-cell organelle
segmentation in cryo soft X-ray tomograms (nucleus, mitochondria, lipid droplets, vacuoles).

160^3 patches only fit with activation checkpointing of the encoder / decoder stages.

    torchrun --nproc_per_node=4 18_nnunet_like_ckpt_deepsup.py --data /data/sxt/preprocessed --fold 0 --out runs/sxt_f0
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

N_CLASSES = 5


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--patch", type=int, default=160)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--iters-per-epoch", type=int, default=250)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--grad-checkpoint", action="store_true", default=True)
    return ap.parse_args()


class CasePatches(Dataset):
    """Cases are preprocessed .npz (image float32, seg int8), one third of the patches forced to foreground."""

    def __init__(self, case_files, patch, length, oversample_fg=0.33):
        self.cases = [np.load(f, mmap_mode="r") for f in case_files]
        self.imgs = [c["image"] for c in self.cases]
        self.segs = [c["seg"] for c in self.cases]
        self.fg = [np.argwhere(s[::4, ::4, ::4] > 0) * 4 for s in self.segs]
        self.patch, self.length, self.fg_p = patch, length, oversample_fg

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        c = np.random.randint(len(self.imgs))
        img, seg = self.imgs[c], self.segs[c]
        p = self.patch
        shape = img.shape
        if np.random.rand() < self.fg_p and len(self.fg[c]):
            ctr = self.fg[c][np.random.randint(len(self.fg[c]))]
            o = [int(np.clip(ct - p // 2, 0, max(s - p, 0))) for ct, s in zip(ctr, shape)]
        else:
            o = [np.random.randint(0, max(s - p, 0) + 1) for s in shape]
        sl = tuple(slice(a, a + p) for a in o)
        x = np.zeros((p, p, p), np.float32)
        y = np.zeros((p, p, p), np.int64)
        xi, yi = img[sl], seg[sl]
        x[:xi.shape[0], :xi.shape[1], :xi.shape[2]] = xi
        y[:yi.shape[0], :yi.shape[1], :yi.shape[2]] = yi
        for ax in range(3):
            if np.random.rand() < 0.5:
                x, y = np.flip(x, ax), np.flip(y, ax)
        return torch.from_numpy(x.copy())[None], torch.from_numpy(y.copy())


class Stage(nn.Sequential):
    def __init__(self, i, o, stride=1):
        super().__init__(
            nn.Conv3d(i, o, 3, stride=stride, padding=1, bias=False), nn.InstanceNorm3d(o, affine=True),
            nn.LeakyReLU(0.01, inplace=True),
            nn.Conv3d(o, o, 3, padding=1, bias=False), nn.InstanceNorm3d(o, affine=True),
            nn.LeakyReLU(0.01, inplace=True))


class DSUNet(nn.Module):
    def __init__(self, n_classes, f=(32, 64, 128, 256, 320), grad_ckpt=False):
        super().__init__()
        self.grad_ckpt = grad_ckpt
        self.stem = nn.Conv3d(1, f[0], 3, padding=1)
        self.enc = nn.ModuleList([Stage(f[0], f[0])] + [Stage(f[i - 1], f[i], 2) for i in range(1, len(f))])
        self.up = nn.ModuleList([nn.ConvTranspose3d(f[i], f[i - 1], 2, 2) for i in range(len(f) - 1, 0, -1)])
        self.dec = nn.ModuleList([Stage(2 * f[i - 1], f[i - 1]) for i in range(len(f) - 1, 0, -1)])
        self.seg_heads = nn.ModuleList([nn.Conv3d(f[i - 1], n_classes, 1) for i in range(len(f) - 1, 0, -1)])

    def _stage(self, m, x):
        if self.grad_ckpt and self.training:
            return cp.checkpoint(m, x)
        return m(x)

    def forward(self, x):
        x = self.stem(x)
        skips = []
        for e in self.enc:
            x = self._stage(e, x)
            skips.append(x)
        x = skips.pop()
        outs = []
        for up, dec, head in zip(self.up, self.dec, self.seg_heads):
            x = self._stage(dec, torch.cat([up(x), skips.pop()], 1))
            outs.append(head(x))
        # highest resolution first
        return outs[::-1] if self.training else outs[-1]


def soft_dice(logits, y, eps=1e-5):
    p = logits.softmax(1)
    oh = F.one_hot(y, logits.shape[1]).permute(0, 4, 1, 2, 3).float()
    dims = (0, 2, 3, 4)
    d = (2 * (p * oh).sum(dims) + eps) / (p.sum(dims) + oh.sum(dims) + eps)
    return 1 - d[1:].mean()


def ds_loss(outs, y):
    weights = np.array([1 / 2 ** i for i in range(len(outs))])
    weights[-1] = 0
    weights = weights / weights.sum()
    total = 0.0
    for w, o in zip(weights, outs):
        if w == 0:
            continue
        yt = y if o.shape[2:] == y.shape[1:] else F.interpolate(y[:, None].float(), size=o.shape[2:],
                                                                mode="nearest")[:, 0].long()
        total = total + w * (F.cross_entropy(o, yt) + soft_dice(o, yt))
    return total


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(os.path.join(args.data, "splits_final.json")) as f:
        split = json.load(f)[args.fold]
    tr_files = [os.path.join(args.data, c + ".npz") for c in split["train"]]
    va_files = [os.path.join(args.data, c + ".npz") for c in split["val"]]
    train_ds = CasePatches(tr_files, args.patch, args.iters_per_epoch * args.batch_size * world)
    val_ds = CasePatches(va_files, args.patch, 50 * world, oversample_fg=0.5)
    sampler = DistributedSampler(train_ds)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                          drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), args.batch_size, num_workers=4)

    net = DSUNet(N_CLASSES, grad_ckpt=args.grad_checkpoint).to(device)
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.99, nesterov=True, weight_decay=3e-5)
    total_iters = args.epochs * args.iters_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: (1 - it / total_iters) ** 0.9)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_ema, ema = None, None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = ds_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 12)
            opt.step()
            sched.step()

        model.eval()
        tp = torch.zeros(N_CLASSES, device=device)
        fp = torch.zeros(N_CLASSES, device=device)
        fn = torch.zeros(N_CLASSES, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                pred = model.module(x.to(device)).argmax(1)
                y = y.to(device)
                for c in range(1, N_CLASSES):
                    tp[c] += ((pred == c) & (y == c)).sum()
                    fp[c] += ((pred == c) & (y != c)).sum()
                    fn[c] += ((pred != c) & (y == c)).sum()
        for t in (tp, fp, fn):
            dist.all_reduce(t)
        dice = (2 * tp[1:] / (2 * tp[1:] + fp[1:] + fn[1:]).clamp(min=1)).mean().item()
        ema = dice if ema is None else 0.9 * ema + 0.1 * dice

        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} pseudo dice {dice:.4f} ema {ema:.4f} "
                  f"lr {sched.get_last_lr()[0]:.5f} ({time.time() - t0:.0f}s)", flush=True)
            ck = {"network_weights": model.module.state_dict(), "optimizer_state": opt.state_dict(),
                  "epoch": epoch, "ema": ema}
            torch.save(ck, os.path.join(args.out, "checkpoint_latest.pth"))
            if best_ema is None or ema > best_ema:
                best_ema = ema
                torch.save(ck, os.path.join(args.out, "checkpoint_best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
