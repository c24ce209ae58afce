#!/usr/bin/env python
"""3D convolutional VAE on 64^3 ShapeNet voxels (binvox), for shape generation / interpolation.

Usage:
    torchrun --nproc_per_node=4 13_voxel_vae_split.py --voxel_root data/ShapeNetVox64 --cat 03001627
"""
import argparse
import glob
import os
import random

import binvox_rw
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class BinvoxDataset(Dataset):
    def __init__(self, files, augment=False):
        self.files = files
        self.augment = augment

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with open(self.files[i], "rb") as f:
            vox = binvox_rw.read_as_3d_array(f).data.astype(np.float32)
        if self.augment and random.random() < 0.5:
            vox = vox[::-1].copy()  # left/right mirror
        return torch.from_numpy(vox).unsqueeze(0)


def down(cin, cout):
    return nn.Sequential(nn.Conv3d(cin, cout, 4, 2, 1), nn.GroupNorm(8, cout), nn.LeakyReLU(0.2, True))


def up(cin, cout):
    return nn.Sequential(nn.ConvTranspose3d(cin, cout, 4, 2, 1), nn.GroupNorm(8, cout), nn.ReLU(True))


class VoxelVAE(nn.Module):
    def __init__(self, zdim=256):
        super().__init__()
        self.enc = nn.Sequential(down(1, 32), down(32, 64), down(64, 128), down(128, 256))  # 64 -> 4
        self.fc_mu = nn.Linear(256 * 4 ** 3, zdim)
        self.fc_lv = nn.Linear(256 * 4 ** 3, zdim)
        self.fc_dec = nn.Linear(zdim, 256 * 4 ** 3)
        self.dec = nn.Sequential(up(256, 128), up(128, 64), up(64, 32), nn.ConvTranspose3d(32, 1, 4, 2, 1))

    def encode(self, x):
        h = self.enc(x).flatten(1)
        return self.fc_mu(h), self.fc_lv(h).clamp(-10, 10)

    def decode(self, z):
        return self.dec(self.fc_dec(z).view(-1, 256, 4, 4, 4))

    def forward(self, x):
        mu, logvar = self.encode(x)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return self.decode(z), mu, logvar


def vae_loss(logits, x, mu, logvar, beta, gamma=0.97):
    # weighted BCE, occupied voxels are rare
    w = gamma * x + (1 - gamma) * (1 - x)
    rec = (F.binary_cross_entropy_with_logits(logits, x, reduction="none") * w).sum((1, 2, 3, 4)).mean()
    kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1).mean()
    return rec + beta * kl, rec, kl


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--voxel_root", required=True)
    p.add_argument("--cat", default="03001627")
    p.add_argument("--val_frac", type=float, default=0.1)
    p.add_argument("--zdim", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--beta_max", type=float, default=1.0)
    p.add_argument("--beta_warmup", type=int, default=50)
    p.add_argument("--out", default="runs/voxel_vae")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wandb_project", default="voxel-vae")
    return p.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed + rank)

    files = sorted(glob.glob(os.path.join(args.voxel_root, args.cat, "*", "model.binvox")))
    random.shuffle(files)
    n_val = int(len(files) * args.val_frac)
    val_files, train_files = files[:n_val], files[n_val:]

    train_ds = BinvoxDataset(train_files, augment=True)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True)

    model = DDP(VoxelVAE(args.zdim).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "val_files.txt"), "w") as f:
            f.write("\n".join(val_files))
        wandb.init(project=args.wandb_project, config=vars(args), dir=args.out)
        val_dl = DataLoader(BinvoxDataset(val_files), batch_size=32, num_workers=4)

    best_iou = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        beta = args.beta_max * min(1.0, epoch / max(args.beta_warmup, 1))
        acc = torch.zeros(3, device=device)
        for x in train_dl:
            x = x.to(device, non_blocking=True)
            logits, mu, logvar = model(x)
            loss, rec, kl = vae_loss(logits, x, mu, logvar, beta)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([rec.detach(), kl.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)

        if rank == 0:
            model.eval()
            inter = union = 0.0
            with torch.no_grad():
                for x in val_dl:
                    x = x.to(device)
                    mu, _ = model.module.encode(x)
                    pred = model.module.decode(mu) > 0
                    gt = x > 0.5
                    inter += (pred & gt).sum().item()
                    union += (pred | gt).sum().item()
                samples = torch.sigmoid(model.module.decode(torch.randn(4, args.zdim, device=device)))
            model.train()
            val_iou = inter / max(union, 1)
            wandb.log({"train/rec": (acc[0] / acc[2]).item(), "train/kl": (acc[1] / acc[2]).item(),
                       "beta": beta, "val/iou": val_iou, "epoch": epoch})
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if val_iou > best_iou:
                best_iou = val_iou
                torch.save(state, os.path.join(args.out, "best.pt"))
                np.save(os.path.join(args.out, "samples_best.npy"), samples.cpu().numpy())
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
