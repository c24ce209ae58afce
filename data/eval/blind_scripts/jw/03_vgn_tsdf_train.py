"""Volumetric Grasping Network (VGN) training, multi-GPU.

Scenes are rendered in PyBullet, fused into a 40^3 TSDF, and each grasp attempt
in the simulator gives one labelled sample (voxel index, orientation, width,
success).  The raw grasps.csv is large, so it is turned into a tensor cache once.

    torchrun --nproc_per_node=4 03_vgn_tsdf_train.py --dataset data/raw/blocks --logdir runs/vgn_blocks
"""
import argparse
import os
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from scipy.spatial.transform import Rotation
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", type=Path, required=True)
    p.add_argument("--logdir", type=Path, default=Path("runs/vgn"))
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--accum-steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--augment", action="store_true")
    p.add_argument("--resume", type=Path, default=None)
    p.add_argument("--wandb-project", type=str, default="vgn")
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


def build_cache(root: Path, cache_file: Path):
    df = pd.read_csv(root / "grasps.csv")
    scene_ids = sorted(df["scene_id"].unique())
    scene_index = {s: i for i, s in enumerate(scene_ids)}
    tsdf = np.stack([np.load(root / "scenes" / f"{s}.npz")["grid"][0] for s in scene_ids]).astype(np.float16)
    quat = df[["qx", "qy", "qz", "qw"]].to_numpy(np.float32)
    torch.save({
        "tsdf": torch.from_numpy(tsdf),
        "scene": torch.tensor(df["scene_id"].map(scene_index).to_numpy(), dtype=torch.long),
        "index": torch.tensor(df[["i", "j", "k"]].to_numpy(), dtype=torch.long),
        "quat": torch.from_numpy(quat),
        "width": torch.tensor(df["width"].to_numpy(), dtype=torch.float32),
        "label": torch.tensor(df["label"].to_numpy(), dtype=torch.float32),
    }, cache_file)


class GraspTSDFDataset(Dataset):
    def __init__(self, cache, augment=False):
        self.c = cache
        self.augment = augment

    def __len__(self):
        return len(self.c["label"])

    def __getitem__(self, i):
        grid = self.c["tsdf"][self.c["scene"][i]].float()
        ijk = self.c["index"][i].clone()
        quat = self.c["quat"][i].numpy()
        if self.augment:
            # rotate the grid by a multiple of 90 deg about z and move the grasp with it
            k = np.random.randint(4)
            grid = torch.rot90(grid, k, dims=(0, 1))
            for _ in range(k):
                ijk = torch.tensor([39 - ijk[1], ijk[0], ijk[2]])
            rz = Rotation.from_euler("z", k * np.pi / 2)
            quat = (rz * Rotation.from_quat(quat)).as_quat().astype(np.float32)
        return grid[None], ijk, torch.from_numpy(quat), self.c["width"][i], self.c["label"][i]


def conv_bn(cin, cout, k, stride=1):
    return nn.Sequential(nn.Conv3d(cin, cout, k, stride, padding=k // 2), nn.BatchNorm3d(cout), nn.ReLU(inplace=True))


class VGN(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(conv_bn(1, 16, 5, 2), conv_bn(16, 32, 3, 2), conv_bn(32, 64, 3, 2))
        self.decoder = nn.Sequential(
            nn.Upsample(scale_factor=2), conv_bn(64, 64, 3),
            nn.Upsample(scale_factor=2), conv_bn(64, 32, 3),
            nn.Upsample(size=40), conv_bn(32, 16, 5),
        )
        self.qual = nn.Conv3d(16, 1, 5, padding=2)
        self.rot = nn.Conv3d(16, 4, 5, padding=2)
        self.width = nn.Conv3d(16, 1, 5, padding=2)

    def forward(self, x):
        h = self.decoder(self.encoder(x))
        return torch.sigmoid(self.qual(h)), F.normalize(self.rot(h), dim=1), self.width(h)


def select(out, ijk):
    q, r, w = out
    b = torch.arange(ijk.shape[0], device=ijk.device)
    i, j, k = ijk[:, 0], ijk[:, 1], ijk[:, 2]
    return q[b, 0, i, j, k], r[b, :, i, j, k], w[b, 0, i, j, k]


def vgn_loss(q, r, w, quat, width, label):
    l_q = F.binary_cross_entropy(q, label)
    # gripper is symmetric about its approach axis: accept q or q rotated by pi
    # (x, y, z, w) * (0, 0, 1, 0) = (y, -x, w, -z)
    quat_flip = quat[:, [1, 0, 3, 2]] * torch.tensor([1.0, -1.0, 1.0, -1.0], device=quat.device)
    l_r = torch.min(1 - (r * quat).sum(1).abs(), 1 - (r * quat_flip).sum(1).abs())
    l_w = F.mse_loss(w, width * 25.0, reduction="none")
    return (l_q + label * (l_r + 0.01 * l_w)).mean()


def run_eval(model, loader, device):
    model.eval()
    stats = torch.zeros(4, device=device)  # loss*n, correct, n, positives
    with torch.no_grad():
        for grid, ijk, quat, width, label in loader:
            grid, ijk, quat = grid.to(device), ijk.to(device), quat.to(device)
            width, label = width.to(device), label.to(device)
            q, r, w = select(model(grid), ijk)
            loss = vgn_loss(q, r, w, quat, width, label)
            stats[0] += loss * len(label)
            stats[1] += ((q > 0.5).float() == label).sum()
            stats[2] += len(label)
            stats[3] += label.sum()
    dist.all_reduce(stats)
    model.train()
    return {"val/loss": (stats[0] / stats[2]).item(), "val/accuracy": (stats[1] / stats[2]).item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    cache_file = args.dataset / "cache_v2.pt"
    if is_main and not cache_file.exists():
        print(f"building {cache_file} ...", flush=True)
        tmp = cache_file.with_suffix(".tmp")
        build_cache(args.dataset, tmp)
        os.replace(tmp, cache_file)
    dist.barrier()
    cache = torch.load(cache_file, map_location="cpu")

    full = GraspTSDFDataset(cache, augment=args.augment)
    g = torch.Generator().manual_seed(42)
    perm = torch.randperm(len(full), generator=g).tolist()
    n_val = int(args.val_frac * len(full))
    train_set = Subset(full, perm[n_val:])
    val_set = Subset(GraspTSDFDataset(cache, augment=False), perm[:n_val][rank::world])

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    model = VGN()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world)

    start_epoch = 0
    if args.resume is not None:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1

    if is_main:
        args.logdir.mkdir(parents=True, exist_ok=True)
        wandb.init(project=args.wandb_project, dir=str(args.logdir), config=vars(args),
                   resume="allow" if args.resume else None)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        tot = torch.zeros(2, device=device)
        optimizer.zero_grad(set_to_none=True)
        for step, (grid, ijk, quat, width, label) in enumerate(train_loader):
            grid, ijk, quat = grid.to(device, non_blocking=True), ijk.to(device), quat.to(device)
            width, label = width.to(device), label.to(device)
            sync_now = (step + 1) % args.accum_steps == 0
            if sync_now:
                q, r, w = select(model(grid), ijk)
                loss = vgn_loss(q, r, w, quat, width, label) / args.accum_steps
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                with model.no_sync():
                    q, r, w = select(model(grid), ijk)
                    loss = vgn_loss(q, r, w, quat, width, label) / args.accum_steps
                    loss.backward()
            tot[0] += loss.detach() * args.accum_steps
            tot[1] += 1

        dist.all_reduce(tot)
        metrics = {"train/loss": (tot[0] / tot[1]).item(), "epoch": epoch}
        metrics.update(run_eval(model, val_loader, device))

        if is_main:
            wandb.log(metrics, step=epoch)
            print(metrics, flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, args.logdir / f"vgn_{epoch:03d}.pt")

    if is_main:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
