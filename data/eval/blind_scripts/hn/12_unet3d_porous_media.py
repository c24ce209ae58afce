"""3D U-Net surrogate for CO2 plume migration in heterogeneous aquifers.

Inputs per sample (64 x 64 x 32 cells): log-permeability, porosity, injection-well mask.
Output: gas saturation at 8 report times (one channel per time).

    torchrun --standalone --nproc_per_node=8 12_unet3d_porous_media.py \
        --train /data/co2/train.h5 --val /data/co2/val.h5 --out runs/unet3d_co2
"""
import argparse
import json
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--out", default="runs/unet3d_co2")
    p.add_argument("--base", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=2, help="samples per GPU")
    p.add_argument("--epochs", type=int, default=150)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


class CO2Dataset(Dataset):
    def __init__(self, path):
        self.path = path
        with h5py.File(path, "r") as f:
            self.n = f["sg"].shape[0]
            self.logk_mean = float(f.attrs["logk_mean"])
            self.logk_std = float(f.attrs["logk_std"])
        self.h5 = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.h5 is None:
            self.h5 = h5py.File(self.path, "r")
        logk = (np.log(self.h5["perm"][i]) - self.logk_mean) / self.logk_std
        poro = self.h5["poro"][i]
        wells = self.h5["well_mask"][i]
        x = np.stack([logk, (poro - 0.2) / 0.05, wells]).astype(np.float32)
        y = self.h5["sg"][i].astype(np.float32)  # [8, X, Y, Z]
        return torch.from_numpy(x), torch.from_numpy(y)


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv3d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm3d(cout),
        nn.ReLU(inplace=True),
        nn.Conv3d(cout, cout, 3, padding=1, bias=False),
        nn.BatchNorm3d(cout),
        nn.ReLU(inplace=True),
    )


class UNet3D(nn.Module):
    def __init__(self, cin=3, cout=8, base=32):
        super().__init__()
        c = [base, base * 2, base * 4, base * 8]
        self.enc1 = conv_block(cin, c[0])
        self.enc2 = conv_block(c[0], c[1])
        self.enc3 = conv_block(c[1], c[2])
        self.bott = conv_block(c[2], c[3])
        self.up3 = nn.ConvTranspose3d(c[3], c[2], 2, stride=2)
        self.dec3 = conv_block(2 * c[2], c[2])
        self.up2 = nn.ConvTranspose3d(c[2], c[1], 2, stride=2)
        self.dec2 = conv_block(2 * c[1], c[1])
        self.up1 = nn.ConvTranspose3d(c[1], c[0], 2, stride=2)
        self.dec1 = conv_block(2 * c[0], c[0])
        self.head = nn.Conv3d(c[0], cout, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool3d(e1, 2))
        e3 = self.enc3(F.max_pool3d(e2, 2))
        b = self.bott(F.max_pool3d(e3, 2))
        d3 = self.dec3(torch.cat([self.up3(b), e3], 1))
        d2 = self.dec2(torch.cat([self.up2(d3), e2], 1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], 1))
        return torch.sigmoid(self.head(d1))  # saturation in [0, 1]


def plume_loss(pred, target):
    # MSE plus extra weight inside the plume, where the saturation front matters
    w = 1.0 + 4.0 * (target > 0.01).float()
    return (w * (pred - target) ** 2).mean()


@torch.no_grad()
def evaluate(model, loader, device, use_amp):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp):
            p = model(x)
        p = p.float()
        acc[0] += ((p - y) ** 2).sum().double()
        acc[1] += (y ** 2).sum().double()
        acc[2] += (p - y).abs().amax(dim=(1, 2, 3, 4)).sum().double()
    return acc


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(17)
    torch.backends.cudnn.benchmark = True

    train_ds, val_ds = CO2Dataset(args.train), CO2Dataset(args.val)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, drop_last=True,
                              num_workers=args.workers, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=args.batch_size,
                            shuffle=False, num_workers=2)

    model = UNet3D(base=args.base).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_loader), pct_start=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=1)
    history = []
    best = float("inf")

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        run = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
                pred = model(x)
            loss = plume_loss(pred.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])

        acc = evaluate(model.module, val_loader, device, args.amp)
        dist.all_reduce(run)
        dist.all_reduce(acc)
        if rank == 0:
            rel = (acc[0] / acc[1]).sqrt().item()
            max_err = acc[2].item() / len(val_ds)
            rec = {"epoch": epoch, "time": time.time() - tic, "train": (run[0] / run[1]).item(),
                   "val_rel_l2": rel, "val_max_abs": max_err}
            history.append(rec)
            print(json.dumps(rec), flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if rel < best:
                best = rel
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pt"))
            with open(os.path.join(args.out, "history.json"), "w") as f:
                json.dump(history, f)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
