"""PointNet auto-encoder (Achlioptas et al. style) on ShapeNet point clouds, Chamfer loss.

    torchrun --standalone --nproc_per_node=4 04_pointnet_ae.py --data data/shapenet_pc_2048.h5
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
from pytorch3d.loss import chamfer_distance
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class H5PointClouds(Dataset):
    def __init__(self, path, split, augment=False):
        self.path = path
        self.split = split
        self.augment = augment
        with h5py.File(path, "r") as f:
            self.length = f[split]["points"].shape[0]
        self._h5 = None

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        if self._h5 is None:  # open lazily, once per worker
            self._h5 = h5py.File(self.path, "r")
        pc = self._h5[self.split]["points"][i].astype(np.float32)
        if self.augment:
            theta = np.random.uniform(0, 2 * np.pi)
            c, s = np.cos(theta), np.sin(theta)
            rot = np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]], dtype=np.float32)
            pc = pc @ rot.T
            pc = pc * np.random.uniform(0.9, 1.1, size=(1, 3)).astype(np.float32)
        return torch.from_numpy(pc)


class PointNetEncoder(nn.Module):
    def __init__(self, zdim=128):
        super().__init__()
        chans = [3, 64, 128, 128, 256]
        layers = []
        for cin, cout in zip(chans[:-1], chans[1:]):
            layers += [nn.Conv1d(cin, cout, 1), nn.BatchNorm1d(cout), nn.ReLU(inplace=True)]
        layers += [nn.Conv1d(chans[-1], zdim, 1)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x.transpose(1, 2)).max(dim=2)[0]


class FCDecoder(nn.Module):
    def __init__(self, zdim=128, n_points=2048):
        super().__init__()
        self.n_points = n_points
        self.net = nn.Sequential(
            nn.Linear(zdim, 256), nn.ReLU(inplace=True),
            nn.Linear(256, 256), nn.ReLU(inplace=True),
            nn.Linear(256, n_points * 3),
        )

    def forward(self, z):
        return self.net(z).view(-1, self.n_points, 3)


class PointAE(nn.Module):
    def __init__(self, zdim, n_points):
        super().__init__()
        self.encoder = PointNetEncoder(zdim)
        self.decoder = FCDecoder(zdim, n_points)

    def forward(self, x):
        return self.decoder(self.encoder(x))


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/pointnet_ae")
    p.add_argument("--zdim", type=int, default=128)
    p.add_argument("--n_points", type=int, default=2048)
    p.add_argument("--batch_size", type=int, default=50, help="per-GPU batch")
    p.add_argument("--base_lr", type=float, default=5e-4, help="lr for one GPU")
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--eval_every", type=int, default=10)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    total, n = 0.0, 0
    for pc in loader:
        pc = pc.to(device)
        rec = net(pc)
        cd, _ = chamfer_distance(rec, pc, batch_reduction="sum")
        total += cd.item()
        n += pc.shape[0]
    net.train()
    return total / max(n, 1)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    train_ds = H5PointClouds(args.data, "train", augment=True)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True)

    model = PointAE(args.zdim, args.n_points)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    lr = args.base_lr * world  # linear scaling with the global batch
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=lr * 0.01)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
        tb = SummaryWriter(args.out)
        val_dl = DataLoader(H5PointClouds(args.data, "val"), batch_size=100, num_workers=2)
    best = float("inf")

    step = 0
    for epoch in range(args.epochs):
        model.train()
        tic = time.time()
        for pc in train_dl:
            pc = pc.to(device, non_blocking=True)
            rec = model(pc)
            loss, _ = chamfer_distance(rec, pc)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                tb.add_scalar("train/chamfer", loss.item(), step)
                tb.add_scalar("train/lr", opt.param_groups[0]["lr"], step)
        sched.step()

        if rank == 0:
            print(f"epoch {epoch:4d}  loss {loss.item():.5f}  {time.time() - tic:.1f}s", flush=True)
            if (epoch + 1) % args.eval_every == 0:
                cd = validate(model.module, val_dl, device)
                tb.add_scalar("val/chamfer", cd, step)
                ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "args": vars(args)}
                torch.save(ckpt, os.path.join(args.out, "last.pt"))
                if cd < best:
                    best = cd
                    torch.save(ckpt, os.path.join(args.out, "best.pt"))
                print(f"  val chamfer {cd:.5f} (best {best:.5f})", flush=True)
        dist.barrier()

    if rank == 0:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
