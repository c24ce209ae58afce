"""
BraTS 2021 glioma segmentation -- 3D U-Net, Dice + CE, DDP training.

Usage:
    torchrun --nnodes=1 --nproc_per_node=4 04_brats_unet3d.py --config configs/brats_unet.yaml
"""
import argparse
import glob
import json
import os
import random
import time

import nibabel as nib
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from monai.inferers import sliding_window_inference
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

MODALITIES = ("flair", "t1", "t1ce", "t2")


def load_case(case_dir):
    cid = os.path.basename(case_dir)
    img = np.stack([nib.load(os.path.join(case_dir, f"{cid}_{m}.nii.gz")).get_fdata(dtype=np.float32)
                    for m in MODALITIES])
    seg = nib.load(os.path.join(case_dir, f"{cid}_seg.nii.gz")).get_fdata().astype(np.uint8)
    seg[seg == 4] = 3
    mask = img.sum(0) > 0
    for c in range(img.shape[0]):  # z-score inside the brain mask
        v = img[c][mask]
        img[c][mask] = (v - v.mean()) / (v.std() + 1e-8)
    return img, seg


class BratsPatches(Dataset):
    def __init__(self, cases, patch, fg_prob=0.33, train=True):
        self.cases, self.patch, self.fg_prob, self.train = cases, patch, fg_prob, train

    def __len__(self):
        return len(self.cases)

    def __getitem__(self, i):
        img, seg = load_case(self.cases[i])
        if not self.train:
            return torch.from_numpy(img), torch.from_numpy(seg[None].astype(np.int64))
        pad = [(0, 0)] + [(0, max(0, p - s)) for p, s in zip(self.patch, seg.shape)]
        img, seg = np.pad(img, pad), np.pad(seg, pad[1:])
        if random.random() < self.fg_prob and seg.any():
            fg = np.argwhere(seg > 0)
            c = fg[random.randrange(len(fg))]
            start = [int(np.clip(c[d] - self.patch[d] // 2, 0, seg.shape[d] - self.patch[d])) for d in range(3)]
        else:
            start = [random.randint(0, seg.shape[d] - self.patch[d]) for d in range(3)]
        sl = tuple(slice(s, s + p) for s, p in zip(start, self.patch))
        x, y = img[(slice(None),) + sl], seg[sl]
        for ax in range(3):
            if random.random() < 0.5:
                x, y = np.flip(x, ax + 1), np.flip(y, ax)
        x = x * random.uniform(0.9, 1.1) + random.uniform(-0.1, 0.1)
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy()[None].astype(np.int64))


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv3d(cin, cout, 3, padding=1, bias=False), nn.InstanceNorm3d(cout, affine=True), nn.LeakyReLU(0.01, True),
        nn.Conv3d(cout, cout, 3, padding=1, bias=False), nn.InstanceNorm3d(cout, affine=True), nn.LeakyReLU(0.01, True),
    )


class UNet3D(nn.Module):
    def __init__(self, in_ch=4, n_cls=4, base=32, depth=5):
        super().__init__()
        chs = [min(base * 2 ** i, 320) for i in range(depth)]
        self.down = nn.ModuleList([conv_block(in_ch if i == 0 else chs[i - 1], chs[i]) for i in range(depth)])
        self.pool = nn.MaxPool3d(2)
        self.up = nn.ModuleList([nn.ConvTranspose3d(chs[i + 1], chs[i], 2, 2) for i in reversed(range(depth - 1))])
        self.dec = nn.ModuleList([conv_block(2 * chs[i], chs[i]) for i in reversed(range(depth - 1))])
        self.head = nn.Conv3d(chs[0], n_cls, 1)

    def forward(self, x):
        skips = []
        for i, blk in enumerate(self.down):
            x = blk(x if i == 0 else self.pool(x))
            skips.append(x)
        x = skips.pop()
        for up, dec in zip(self.up, self.dec):
            x = dec(torch.cat([up(x), skips.pop()], 1))
        return self.head(x)


def dice_ce_loss(logits, target, n_cls, eps=1e-5):
    ce = F.cross_entropy(logits, target[:, 0])
    p = logits.softmax(1)
    oh = F.one_hot(target[:, 0], n_cls).permute(0, 4, 1, 2, 3).float()
    inter = (p * oh).sum((0, 2, 3, 4))
    dice = (2 * inter + eps) / (p.sum((0, 2, 3, 4)) + oh.sum((0, 2, 3, 4)) + eps)
    return ce + 1 - dice[1:].mean()


def brats_regions(lbl):
    # whole tumour, tumour core, enhancing tumour
    return [lbl > 0, (lbl == 1) | (lbl == 3), lbl == 3]


def region_dice(pred, gt):
    out = []
    for p, g in zip(brats_regions(pred), brats_regions(gt)):
        s = p.sum() + g.sum()
        out.append(1.0 if s == 0 else (2.0 * (p & g).sum() / s).item())
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    random.seed(cfg["seed"] + rank)
    np.random.seed(cfg["seed"] + rank)
    torch.manual_seed(cfg["seed"])

    with open(cfg["splits"]) as f:  # 5-fold splits generated once, see tools/make_splits.py
        split = json.load(f)[cfg["fold"]]
    train_cases = [os.path.join(cfg["data_root"], c) for c in split["train"]]
    val_cases = [os.path.join(cfg["data_root"], c) for c in split["val"]]
    patch = cfg["patch_size"]

    train_ds = BratsPatches(train_cases, patch, fg_prob=cfg["oversample_foreground"])
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"])
    loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler,
                        num_workers=cfg["workers"], pin_memory=True, drop_last=True, persistent_workers=True)
    val_ds = BratsPatches(val_cases[rank::world], patch, train=False)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=2)

    model = UNet3D(in_ch=4, n_cls=4).to(device)
    model = DDP(model, device_ids=[args.local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=1e-5)
    max_epochs = cfg["epochs"]
    poly = torch.optim.lr_scheduler.LambdaLR(optim, lambda e: (1 - e / max_epochs) ** 0.9)

    writer = SummaryWriter(cfg["log_dir"]) if rank == 0 else None
    best_mean = 0.0
    for epoch in range(max_epochs):
        sampler.set_epoch(epoch)
        model.train()
        t = time.time()
        tot = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = dice_ce_loss(logits.float(), y, 4)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 12)
            optim.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        poly.step()
        dist.all_reduce(tot)
        if rank == 0:
            writer.add_scalar("train/loss", (tot[0] / tot[1]).item(), epoch)
            writer.add_scalar("train/lr", optim.param_groups[0]["lr"], epoch)
            print(f"epoch {epoch}: loss {(tot[0] / tot[1]).item():.4f} ({time.time() - t:.0f}s)", flush=True)

        if epoch % cfg["val_every"] == 0 or epoch == max_epochs - 1:
            net = model.module
            net.eval()
            acc = torch.zeros(4, device=device)  # WT, TC, ET, n_cases
            with torch.no_grad():
                for x, y in val_loader:
                    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                        logits = sliding_window_inference(x.to(device), patch, 4, net, overlap=0.5, mode="gaussian")
                    pred = logits.argmax(1)[0]
                    d = region_dice(pred, y[0, 0].to(device))
                    acc += torch.tensor(d + [1.0], device=device)
            dist.all_reduce(acc)
            wt, tc, et = (acc[:3] / acc[3]).tolist()
            mean = (wt + tc + et) / 3
            if rank == 0:
                print(f"  val WT {wt:.4f} TC {tc:.4f} ET {et:.4f} mean {mean:.4f}", flush=True)
                for k, v in zip(("WT", "TC", "ET", "mean"), (wt, tc, et, mean)):
                    writer.add_scalar(f"val/{k}", v, epoch)
                if mean > best_mean:
                    best_mean = mean
                    torch.save(net.state_dict(), os.path.join(cfg["log_dir"], f"best_fold{cfg['fold']}.pt"))

        if rank == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optim": optim.state_dict(),
                        "sched": poly.state_dict()}, os.path.join(cfg["log_dir"], "last.pt"))

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
