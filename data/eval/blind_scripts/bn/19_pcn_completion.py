"""
PCN (Point Completion Network) on the PCN ShapeNet benchmark: partial 2048 pts -> complete 16384 pts.

    torchrun --nproc_per_node=4 train_pcn.py --root data/PCN --ckpt_dir experiments/pcn
"""
import argparse
import json
import logging
import os
import random
import time

import numpy as np
import open3d as o3d
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pytorch3d.loss import chamfer_distance
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/PCN")
    p.add_argument("--ckpt_dir", default="experiments/pcn")
    p.add_argument("--batch_size", type=int, default=32, help="per GPU")
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--num_coarse", type=int, default=1024)
    p.add_argument("--grid_size", type=int, default=4)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--val_every", type=int, default=5)
    return p.parse_args()


def read_pcd(path):
    return np.asarray(o3d.io.read_point_cloud(path).points, dtype=np.float32)


def resample(pc, n):
    idx = np.random.permutation(len(pc))
    if len(idx) < n:
        idx = np.concatenate([idx, np.random.randint(len(pc), size=n - len(pc))])
    return pc[idx[:n]]


class PCNDataset(Dataset):
    def __init__(self, root, split, n_partial=2048):
        with open(os.path.join(root, "PCN.json")) as f:
            cats = json.load(f)
        self.split, self.n_partial = split, n_partial
        self.items = []
        for c in cats:
            for model_id in c[split]:
                n_views = 8 if split == "train" else 1
                self.items.append((c["taxonomy_id"], model_id, n_views))
        self.root = root

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        tax, mid, n_views = self.items[i]
        view = random.randrange(n_views) if self.split == "train" else 0
        partial = read_pcd(os.path.join(self.root, self.split, "partial", tax, mid, f"{view:02d}.pcd"))
        gt = read_pcd(os.path.join(self.root, self.split, "complete", tax, f"{mid}.pcd"))
        partial = resample(partial, self.n_partial)
        if self.split == "train" and random.random() < 0.5:
            partial[:, 2] *= -1
            gt[:, 2] *= -1
        return torch.from_numpy(partial), torch.from_numpy(gt), tax


class PCN(nn.Module):
    def __init__(self, num_coarse=1024, grid_size=4, latent=1024):
        super().__init__()
        self.num_coarse, self.grid_size = num_coarse, grid_size
        self.num_dense = num_coarse * grid_size ** 2
        self.first = nn.Sequential(nn.Conv1d(3, 128, 1), nn.BatchNorm1d(128), nn.ReLU(True), nn.Conv1d(128, 256, 1))
        self.second = nn.Sequential(nn.Conv1d(512, 512, 1), nn.BatchNorm1d(512), nn.ReLU(True),
                                    nn.Conv1d(512, latent, 1))
        self.mlp = nn.Sequential(nn.Linear(latent, 1024), nn.ReLU(True), nn.Linear(1024, 1024), nn.ReLU(True),
                                 nn.Linear(1024, 3 * num_coarse))
        self.folding = nn.Sequential(nn.Conv1d(latent + 3 + 2, 512, 1), nn.BatchNorm1d(512), nn.ReLU(True),
                                     nn.Conv1d(512, 512, 1), nn.BatchNorm1d(512), nn.ReLU(True),
                                     nn.Conv1d(512, 3, 1))
        a = torch.linspace(-0.05, 0.05, grid_size)
        self.register_buffer("folding_seed", torch.stack(torch.meshgrid(a, a, indexing="ij")).view(1, 2, -1))

    def forward(self, xyz):
        b, n, _ = xyz.shape
        f = self.first(xyz.transpose(2, 1))
        g = f.max(2, keepdim=True)[0]
        f = self.second(torch.cat([g.expand(-1, -1, n), f], 1))
        feat = f.max(2)[0]
        coarse = self.mlp(feat).view(b, self.num_coarse, 3)
        pts = coarse.unsqueeze(2).expand(-1, -1, self.grid_size ** 2, -1).reshape(b, self.num_dense, 3)
        seed = self.folding_seed.unsqueeze(2).expand(b, -1, self.num_coarse, -1).reshape(b, 2, self.num_dense)
        feat_exp = feat.unsqueeze(2).expand(-1, -1, self.num_dense)
        fine = self.folding(torch.cat([feat_exp, seed, pts.transpose(1, 2)], 1)) + pts.transpose(1, 2)
        return coarse.contiguous(), fine.transpose(1, 2).contiguous()


def cd_l1(a, b):
    # PCN reports the symmetric L1 chamfer (sqrt of squared nearest distances), x1000
    from pytorch3d.ops import knn_points
    d_ab = knn_points(a, b, K=1).dists.squeeze(-1).clamp(min=1e-12).sqrt().mean(1)
    d_ba = knn_points(b, a, K=1).dists.squeeze(-1).clamp(min=1e-12).sqrt().mean(1)
    return (d_ab + d_ba) / 2


def save_checkpoint(state, ckpt_dir, name):
    os.makedirs(ckpt_dir, exist_ok=True)
    torch.save(state, os.path.join(ckpt_dir, name))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    log = logging.getLogger("pcn")

    train_set, val_set = PCNDataset(args.root, "train"), PCNDataset(args.root, "val")
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              drop_last=True, pin_memory=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)), batch_size=32,
                            num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PCN(args.num_coarse, args.grid_size)).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world, betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.7)

    start_epoch, best_cd = 0, float("inf")
    last_path = os.path.join(args.ckpt_dir, "ckpt-last.pth")
    if args.resume and os.path.exists(last_path):
        ckpt = torch.load(last_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_cd = ckpt["epoch"] + 1, ckpt["best_cd"]
        log.info(f"resumed from epoch {ckpt['epoch']}")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        # alpha schedule for the fine loss, as in the paper
        alpha = 0.01 if epoch < 20 else 0.1 if epoch < 50 else 0.5 if epoch < 100 else 1.0
        acc = torch.zeros(2, device=device)
        for partial, gt, _ in train_loader:
            partial, gt = partial.to(device, non_blocking=True), gt.to(device, non_blocking=True)
            coarse, fine = model(partial)
            gt_coarse = gt[:, torch.randperm(gt.shape[1], device=device)[: args.num_coarse]]
            loss_coarse, _ = chamfer_distance(coarse, gt_coarse)
            loss = loss_coarse + alpha * cd_l1(fine, gt).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(acc)
        log.info(f"[epoch {epoch}] loss {(acc[0] / acc[1]).item():.5f} ({time.time() - t0:.0f}s)")

        if (epoch + 1) % args.val_every == 0:
            model.eval()
            cd_sum = torch.zeros(2, device=device)
            with torch.no_grad():
                for partial, gt, _ in val_loader:
                    _, fine = model.module(partial.to(device))
                    cd = cd_l1(fine, gt.to(device)) * 1000
                    cd_sum += torch.stack([cd.sum(), torch.tensor(float(len(cd)), device=device)])
            dist.all_reduce(cd_sum)
            val_cd = (cd_sum[0] / cd_sum[1]).item()
            log.info(f"[epoch {epoch}] val CD-L1 x1000 {val_cd:.3f}")
            state = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "best_cd": min(best_cd, val_cd)}
            if val_cd < best_cd:
                best_cd = val_cd
                save_checkpoint(state, args.ckpt_dir, "ckpt-best.pth")
            save_checkpoint(state, args.ckpt_dir, "ckpt-last.pth")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
