"""Colon cancer segmentation (MSD Task10_Colon), nnU-Net-like plain conv U-Net with deep supervision.

    torchrun --nproc_per_node=4 15_colon_ds_wrapper.py --pp /data/colon_pp --fold 3 --out results/colon
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from monai.inferers import sliding_window_inference

PATCH = (56, 192, 160)
POOL = [(1, 1, 1), (1, 2, 2), (2, 2, 2), (2, 2, 2), (2, 2, 2), (1, 2, 2)]
FEATURES = [32, 64, 128, 256, 320, 320]


class Stage(nn.Sequential):
    def __init__(self, cin, cout, stride):
        super().__init__(
            nn.Conv3d(cin, cout, 3, stride, 1), nn.InstanceNorm3d(cout, affine=True), nn.LeakyReLU(inplace=True),
            nn.Conv3d(cout, cout, 3, 1, 1), nn.InstanceNorm3d(cout, affine=True), nn.LeakyReLU(inplace=True))


class PlainConvUNet(nn.Module):
    def __init__(self, in_ch, n_cls, features=FEATURES, pool=POOL, deep_supervision=True):
        super().__init__()
        self.deep_supervision = deep_supervision
        self.encoder = nn.ModuleList(
            [Stage(in_ch if i == 0 else features[i - 1], f, pool[i]) for i, f in enumerate(features)])
        self.transpconvs, self.stages, self.seg_layers = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        for s in range(1, len(features)):
            below, skip = features[-s], features[-(s + 1)]
            self.transpconvs.append(nn.ConvTranspose3d(below, skip, pool[-s], pool[-s]))
            self.stages.append(Stage(2 * skip, skip, 1))
            self.seg_layers.append(nn.Conv3d(skip, n_cls, 1))

    def forward(self, x):
        skips = []
        for st in self.encoder:
            x = st(x)
            skips.append(x)
        lres = skips[-1]
        seg_outputs = []
        for s in range(len(self.stages)):
            x = self.stages[s](torch.cat((self.transpconvs[s](lres), skips[-(s + 2)]), 1))
            if self.deep_supervision:
                seg_outputs.append(self.seg_layers[s](x))
            elif s == len(self.stages) - 1:
                seg_outputs.append(self.seg_layers[-1](x))
            lres = x
        seg_outputs = seg_outputs[::-1]
        return seg_outputs if self.deep_supervision else seg_outputs[0]


class DC_and_CE(nn.Module):
    def forward(self, net_output, target):
        ce = F.cross_entropy(net_output, target[:, 0].long())
        p = torch.softmax(net_output.float(), 1)
        oh = torch.zeros_like(p).scatter_(1, target.long(), 1)
        ax = (0, 2, 3, 4)
        dc = (2 * (p * oh).sum(ax) + 1e-5) / (p.sum(ax) + oh.sum(ax) + 1e-5)
        return ce - dc[1:].mean()


class DeepSupervisionWrapper(nn.Module):
    def __init__(self, loss, weight_factors):
        super().__init__()
        self.loss = loss
        self.weight_factors = tuple(weight_factors)

    def forward(self, outputs, targets):
        return sum(self.weight_factors[i] * self.loss(o, t)
                   for i, (o, t) in enumerate(zip(outputs, targets)) if self.weight_factors[i] != 0.0)


def deep_supervision_scales():
    cum = np.cumprod(np.vstack(POOL), axis=0)
    return [tuple(1 / c) for c in cum[:-1]]


def build_loss():
    scales = deep_supervision_scales()
    weights = np.array([1 / (2 ** i) for i in range(len(scales))])
    weights[-1] = 0  # the lowest resolution output is too coarse to be useful
    weights = weights / weights.sum()
    return DeepSupervisionWrapper(DC_and_CE(), weights), scales


class ColonPatches(Dataset):
    def __init__(self, folder, keys, fg_frac=0.33, per_case=20):
        self.folder, self.keys, self.fg_frac = folder, keys, fg_frac
        self.len = len(keys) * per_case

    def __len__(self):
        return self.len

    def __getitem__(self, i):
        key = self.keys[i % len(self.keys)]
        img = np.load(os.path.join(self.folder, key + "_data.npy"), mmap_mode="r")  # (1, Z, Y, X)
        seg = np.load(os.path.join(self.folder, key + "_seg.npy"), mmap_mode="r")   # (1, Z, Y, X)
        with open(os.path.join(self.folder, key + "_fg.json")) as f:
            fg = json.load(f)
        shp, P = np.array(img.shape[1:]), np.array(PATCH)
        hi = np.maximum(shp - P, 0)
        if fg and np.random.rand() < self.fg_frac:
            c = np.array(fg[np.random.randint(len(fg))])
            lo = np.clip(c - P // 2, 0, hi)
        else:
            lo = np.array([np.random.randint(0, h + 1) for h in hi])
        sl = (slice(None),) + tuple(slice(a, a + p) for a, p in zip(lo, P))
        x, y = np.asarray(img[sl], dtype=np.float32), np.asarray(seg[sl], dtype=np.int64)
        pad = [(0, 0)] + [(0, int(p - s)) for p, s in zip(P, x.shape[1:])]
        x, y = np.pad(x, pad), np.pad(y, pad)
        for ax in (1, 2, 3):
            if np.random.rand() < 0.5:
                x, y = np.flip(x, ax), np.flip(y, ax)
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", required=True)
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--out", default="results/colon")
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--val_every", type=int, default=50)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)

    with open(os.path.join(args.pp, "splits_final.json")) as f:
        split = json.load(f)[args.fold]
    ds = ColonPatches(args.pp, split["train"])
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                        persistent_workers=True)

    net = PlainConvUNet(1, 2).to(dev)
    model = DDP(net, device_ids=[local_rank])
    loss_fn, scales = build_loss()
    opt = torch.optim.SGD(model.parameters(), args.lr, momentum=0.99, nesterov=True, weight_decay=3e-5)
    scaler = torch.cuda.amp.GradScaler()
    out_dir = os.path.join(args.out, f"fold_{args.fold}")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    best = -1.0
    for epoch in range(args.epochs):
        lr = args.lr * (1 - epoch / args.epochs) ** 0.9
        for g in opt.param_groups:
            g["lr"] = lr
        model.train()
        sampler.set_epoch(epoch)
        t0, acc = time.time(), torch.zeros(2, device=dev)
        for x, y in loader:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True).float()
            targets = [y] + [F.interpolate(y, scale_factor=s, mode="nearest") for s in scales[1:]]
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), targets)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 12)
            scaler.step(opt)
            scaler.update()
            acc += torch.stack([loss.detach().float(), torch.ones((), device=dev)])
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} lr {lr:.5f} loss {(acc[0] / acc[1]).item():.4f} {time.time() - t0:.0f}s",
                  flush=True)

        if (epoch + 1) % args.val_every == 0 or epoch == args.epochs - 1:
            net.eval()
            net.deep_supervision = False
            local = []
            with torch.no_grad():
                for key in split["val"][rank::world]:
                    img = torch.from_numpy(np.load(os.path.join(args.pp, key + "_data.npy")))[None].to(dev)
                    gt = torch.from_numpy(np.load(os.path.join(args.pp, key + "_seg.npy"))[0]).to(dev)
                    with torch.autocast("cuda", dtype=torch.float16):
                        pred = sliding_window_inference(img, PATCH, 2, net, overlap=0.5, mode="gaussian").argmax(1)[0]
                    p, g = pred == 1, gt == 1
                    local.append(float("nan") if not g.any() else (2 * (p & g).sum() / (p.sum() + g.sum())).item())
            net.deep_supervision = True
            net.train()
            gathered = [None] * world
            dist.all_gather_object(gathered, local)
            if rank == 0:
                dice = float(np.nanmean([d for part in gathered for d in part]))
                print(f"  val tumour dice {dice:.4f}", flush=True)
                ckpt = {"network_weights": net.state_dict(), "optimizer_state": opt.state_dict(),
                        "grad_scaler_state": scaler.state_dict(), "current_epoch": epoch}
                torch.save(ckpt, os.path.join(out_dir, "checkpoint_latest.pth"))
                if dice > best:
                    best = dice
                    torch.save(ckpt, os.path.join(out_dir, "checkpoint_best.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
