#!/usr/bin/env python3
"""PCN point completion (coarse + folding fine output) on the PCN ShapeNet benchmark.

torchrun --nproc_per_node=4 09_pcn_completion.py --root data/PCN --exp pcn_baseline
"""
import argparse
import json
import logging
import os
import random

import numpy as np
import open3d as o3d
import torch
import torch.distributed as dist
import torch.nn as nn
from chamfer_distance import ChamferDistance  # compiled CUDA op shipped with the repo
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

chamfer = ChamferDistance()


def cd_l1(p, q):
    d1, d2 = chamfer(p, q)
    return (d1.clamp(min=0).sqrt().mean(1) + d2.clamp(min=0).sqrt().mean(1)) / 2  # per sample


class PCNDataset(Dataset):
    def __init__(self, root, split, n_partial=2048, n_views=8):
        with open(os.path.join(root, "PCN.json")) as f:
            taxonomy = json.load(f)
        self.samples = []
        for tax in taxonomy:
            for mid in tax[split]:
                self.samples.append((tax["taxonomy_id"], mid))
        self.root, self.split, self.n_partial, self.n_views = root, split, n_partial, n_views

    def __len__(self):
        return len(self.samples)

    @staticmethod
    def read_pcd(path):
        return np.asarray(o3d.io.read_point_cloud(path).points, dtype=np.float32)

    def __getitem__(self, i):
        tax, mid = self.samples[i]
        view = random.randrange(self.n_views) if self.split == "train" else 0
        partial = self.read_pcd(os.path.join(self.root, self.split, "partial", tax, mid, f"{view:02d}.pcd"))
        gt = self.read_pcd(os.path.join(self.root, self.split, "complete", tax, f"{mid}.pcd"))
        idx = np.random.choice(len(partial), self.n_partial, replace=len(partial) < self.n_partial)
        partial = partial[idx]
        if self.split == "train" and random.random() < 0.5:  # mirror augmentation
            partial[:, 2] *= -1
            gt[:, 2] *= -1
        return torch.from_numpy(partial), torch.from_numpy(gt)


class PCN(nn.Module):
    def __init__(self, latent=1024, n_coarse=1024, grid=4):
        super().__init__()
        self.n_coarse, self.grid = n_coarse, grid
        self.first = nn.Sequential(nn.Conv1d(3, 128, 1), nn.ReLU(inplace=True), nn.Conv1d(128, 256, 1))
        self.second = nn.Sequential(nn.Conv1d(512, 512, 1), nn.ReLU(inplace=True), nn.Conv1d(512, latent, 1))
        self.coarse = nn.Sequential(nn.Linear(latent, 1024), nn.ReLU(inplace=True),
                                    nn.Linear(1024, 1024), nn.ReLU(inplace=True),
                                    nn.Linear(1024, 3 * n_coarse))
        self.fold = nn.Sequential(nn.Conv1d(latent + 3 + 2, 512, 1), nn.ReLU(inplace=True),
                                  nn.Conv1d(512, 512, 1), nn.ReLU(inplace=True), nn.Conv1d(512, 3, 1))
        a = torch.linspace(-0.05, 0.05, grid)
        self.register_buffer("folding_seed", torch.stack(torch.meshgrid(a, a, indexing="ij"), 0).view(1, 2, -1))

    def forward(self, xyz):
        B, N, _ = xyz.shape
        f = self.first(xyz.transpose(2, 1))
        g = f.max(2, keepdim=True)[0]
        f = self.second(torch.cat([g.expand(-1, -1, N), f], 1))
        feat = f.max(2)[0]
        coarse = self.coarse(feat).view(B, self.n_coarse, 3)
        gs = self.grid ** 2
        pt = coarse.unsqueeze(2).expand(-1, -1, gs, -1).reshape(B, -1, 3).transpose(2, 1)
        seed = self.folding_seed.unsqueeze(2).expand(B, -1, self.n_coarse, -1).reshape(B, 2, -1)
        feat = feat.unsqueeze(2).expand(-1, -1, pt.shape[2])
        fine = self.fold(torch.cat([feat, seed, pt], 1)) + pt
        return coarse, fine.transpose(1, 2).contiguous()


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--exp", required=True)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--alpha_steps", default="10000,20000,50000")
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def alpha_at(step, milestones):
    for m, a in zip(milestones, (0.01, 0.1, 0.5)):
        if step < m:
            return a
    return 1.0


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    total, count = 0.0, 0
    for partial, gt in loader:
        partial, gt = partial.to(device), gt.to(device)
        _, fine = model(partial)
        total += cd_l1(fine, gt).sum().item()
        count += partial.shape[0]
    model.train()
    return total / count * 1e3


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    exp_dir = os.path.join("experiments", args.exp)
    if rank == 0:
        os.makedirs(exp_dir, exist_ok=True)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s %(message)s")

    train_ds, val_ds = PCNDataset(args.root, "train"), PCNDataset(args.root, "val")
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs, sampler=val_sampler, num_workers=args.workers)

    model = DDP(PCN().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.7)
    milestones = [int(s) for s in args.alpha_steps.split(",")]

    best_cd, step = float("inf"), 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for partial, gt in train_dl:
            partial, gt = partial.to(device, non_blocking=True), gt.to(device, non_blocking=True)
            coarse, fine = model(partial)
            loss = cd_l1(coarse, gt).mean() + alpha_at(step, milestones) * cd_l1(fine, gt).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 200 == 0:
                logging.info("epoch %d step %d loss %.5f", epoch, step, loss.item())
        sched.step()

        val_cd = validate(model, val_dl, device)
        if rank == 0:
            logging.info("epoch %d  val CD-L1 x1e3 = %.4f", epoch, val_cd)
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "epoch": epoch, "step": step, "val_cd": val_cd}
            torch.save(ckpt, os.path.join(exp_dir, "last.pth"))
            if val_cd < best_cd:
                best_cd = val_cd
                torch.save(ckpt, os.path.join(exp_dir, "best.pth"))
                logging.info("new best")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
