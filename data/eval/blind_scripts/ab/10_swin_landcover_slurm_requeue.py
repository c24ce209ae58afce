"""Swin-T land-cover + cloud-flag model on Sentinel-2 tiles, Slurm with requeue.

#!/bin/bash
#SBATCH --job-name=swin-landcover
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=04:00:00
#SBATCH --requeue
#SBATCH --open-mode=append
head=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)
srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=8 --rdzv-id=$SLURM_JOB_ID \
     --rdzv-backend=c10d --rdzv-endpoint=$head:29500 10_swin_landcover_slurm_requeue.py
"""
import argparse
import os
import subprocess
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--tiles", default="/lustre/eo/s2_tiles_v2")
    # local NVMe is much faster than lustre for the frequent checkpoints
    p.add_argument("--ckpt-dir", default=f"/local_nvme/{os.environ.get('USER', 'user')}/ckpt/swin_landcover")
    p.add_argument("--log-dir", default="/lustre/eo/runs/swin_landcover")
    p.add_argument("--classes", type=int, default=11)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--cloud-weight", type=float, default=0.2)
    p.add_argument("--save-every", type=int, default=1000)
    p.add_argument("--budget-min", type=float, default=230,
                   help="stop, checkpoint and requeue after this many minutes (job limit is 240)")
    return p.parse_args()


class S2Tiles(Dataset):
    """Pre-chipped 13-band 224x224 tiles stored as .npy with a labels.npz index."""

    def __init__(self, root, split):
        meta = np.load(os.path.join(root, f"{split}_labels.npz"))
        self.files = meta["files"]
        self.landcover = meta["landcover"]
        self.cloudy = meta["cloudy"].astype(np.float32)
        self.root, self.train = root, split == "train"
        self.mean = np.load(os.path.join(root, "band_mean.npy"))[:, None, None]
        self.std = np.load(os.path.join(root, "band_std.npy"))[:, None, None]

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        x = np.load(os.path.join(self.root, self.files[i])).astype(np.float32)
        x = (x - self.mean) / self.std
        if self.train:
            if np.random.rand() < 0.5:
                x = x[:, :, ::-1]
            if np.random.rand() < 0.5:
                x = x[:, ::-1, :]
            x = np.rot90(x, k=np.random.randint(4), axes=(1, 2))
        return torch.from_numpy(np.ascontiguousarray(x)), int(self.landcover[i]), self.cloudy[i]


class LandCoverNet(nn.Module):
    def __init__(self, n_cls):
        super().__init__()
        self.body = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False,
                                      in_chans=13, num_classes=0)
        d = self.body.num_features
        self.cls_head = nn.Linear(d, n_cls)
        self.cloud_head = nn.Linear(d, 1)

    def forward(self, x):
        f = self.body(x)
        return self.cls_head(f), self.cloud_head(f).squeeze(-1)


def save_state(path, model, opt, sched, epoch, step, best):
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict(), "epoch": epoch, "step": step, "best": best},
               path + ".tmp")
    os.replace(path + ".tmp", path)


@torch.no_grad()
def evaluate(model, loader, device, n_cls):
    model.eval()
    s = torch.zeros(3, device=device)
    for x, y, c in loader:
        x, y, c = x.to(device), y.to(device), c.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lc, lcloud = model.module(x)
        s[0] += (lc.argmax(1) == y).sum()
        s[1] += ((lcloud > 0).float() == c).sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    args = get_args()
    deadline = time.time() + args.budget_min * 60
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if local_rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    if rank == 0:
        os.makedirs(args.log_dir, exist_ok=True)
    dist.barrier()

    train_ds, val_ds = S2Tiles(args.tiles, "train"), S2Tiles(args.tiles, "val")
    sampler = DistributedSampler(train_ds, shuffle=True, seed=123, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=7,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=128,
                        num_workers=4, pin_memory=True)

    model = DDP(LandCoverNet(args.classes).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.05)

    latest = os.path.join(args.ckpt_dir, "latest.pt")
    epoch, step_in_epoch, best = 0, 0, 0.0
    if os.path.isfile(latest):
        ck = torch.load(latest, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        epoch, step_in_epoch, best = ck["epoch"], ck["step"], ck["best"]
        print(f"[rank {rank}] resumed from {latest}: epoch {epoch} step {step_in_epoch}", flush=True)

    flag = torch.zeros(1, device=device)
    while epoch < args.epochs:
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y, c) in enumerate(train_dl):
            if i < step_in_epoch:
                continue
            x, y, c = x.to(device, non_blocking=True), y.to(device, non_blocking=True), c.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                lc, lcloud = model(x)
                loss = F.cross_entropy(lc, y, label_smoothing=0.1) + \
                    args.cloud_weight * F.binary_cross_entropy_with_logits(lcloud.float(), c)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()

            flag.fill_(float(time.time() > deadline))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                if rank == 0:
                    save_state(latest, model, opt, sched, epoch, i + 1, best)
                    print(f"time limit near: saved epoch {epoch} step {i + 1}, requeueing", flush=True)
                    subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)
                dist.barrier()
                dist.destroy_process_group()
                return

            if (i + 1) % args.save_every == 0:
                if rank == 0:
                    save_state(latest, model, opt, sched, epoch, i + 1, best)
                dist.barrier()
            if rank == 0 and i % 50 == 0:
                print(f"ep {epoch} it {i}/{len(train_dl)} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / (i + 1 - step_in_epoch):.3f}s/it", flush=True)

        acc, cloud_acc = evaluate(model, val_dl, device, args.classes)
        epoch += 1
        step_in_epoch = 0
        if rank == 0:
            print(f"epoch {epoch - 1}: landcover_acc {acc:.4f} cloud_acc {cloud_acc:.4f}", flush=True)
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(args.log_dir, "best.pt"))
            save_state(latest, model, opt, sched, epoch, 0, best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
