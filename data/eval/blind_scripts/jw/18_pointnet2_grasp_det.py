"""Point-wise 6-DoF grasp detection with a PointNet++ backbone (pointnet2_ops CUDA kernels).

For every seed point the network scores a fixed set of approach views (Fibonacci
sphere), and for the best view regresses in-plane rotation, depth and width.
Ground truth comes from the simulated grasp sweep (success under shaking).

    torchrun --nproc_per_node=4 18_pointnet2_grasp_det.py --data /data/sim_grasps --exp pn2_det
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pointnet2_ops.pointnet2_modules import PointnetFPModule, PointnetSAModule
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
NUM_VIEW = 120
NUM_SEED = 1024


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--exp", default="pn2_det")
    p.add_argument("--num-points", type=int, default=20000)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def generate_grasp_views(n, r=1.0):
    """Approximately uniform approach directions on the unit sphere (Fibonacci lattice)."""
    phi = (math.sqrt(5) - 1) / 2
    i = torch.arange(n, dtype=torch.float32)
    z = (2 * i + 1) / n - 1
    x = torch.sqrt(1 - z ** 2) * torch.cos(2 * math.pi * i * phi)
    y = torch.sqrt(1 - z ** 2) * torch.sin(2 * math.pi * i * phi)
    return torch.stack([x, y, z], 1) * r


class SimGraspScenes(Dataset):
    def __init__(self, root, split, num_points):
        self.files = sorted(os.path.join(root, split, f) for f in os.listdir(os.path.join(root, split)))
        self.num_points = num_points

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        n = len(d["xyz"])
        sel = np.random.choice(n, self.num_points, replace=n < self.num_points)
        return (torch.from_numpy(d["xyz"][sel].astype(np.float32)),
                torch.from_numpy(d["approach"][sel].astype(np.float32)),   # best successful approach (unit vec)
                torch.from_numpy(d["angle_bin"][sel].astype(np.int64)),
                torch.from_numpy(d["depth"][sel].astype(np.float32)),
                torch.from_numpy(d["width"][sel].astype(np.float32)),
                torch.from_numpy(d["graspable"][sel].astype(np.float32)))


class PN2Grasp(nn.Module):
    def __init__(self):
        super().__init__()
        self.sa1 = PointnetSAModule(npoint=2048, radius=0.04, nsample=64, mlp=[0, 64, 64, 128], use_xyz=True)
        self.sa2 = PointnetSAModule(npoint=NUM_SEED, radius=0.1, nsample=32, mlp=[128, 128, 128, 256], use_xyz=True)
        self.sa3 = PointnetSAModule(npoint=256, radius=0.2, nsample=16, mlp=[256, 256, 256, 256], use_xyz=True)
        self.fp = PointnetFPModule(mlp=[256 + 256, 256, 256])
        self.graspable = nn.Conv1d(256, 1, 1)
        self.view = nn.Conv1d(256, NUM_VIEW, 1)
        self.angle = nn.Conv1d(256, 12, 1)
        self.depth_width = nn.Conv1d(256, 2, 1)

    def forward(self, xyz):
        x1, f1 = self.sa1(xyz, None)
        x2, f2 = self.sa2(x1, f1)
        x3, f3 = self.sa3(x2, f2)
        f = self.fp(x2, x3, f2, f3)           # features at the NUM_SEED seeds
        return x2, {"graspable": self.graspable(f).squeeze(1), "view": self.view(f).transpose(1, 2),
                    "angle": self.angle(f), "dw": self.depth_width(f).transpose(1, 2)}


class GraspLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.views = generate_grasp_views(NUM_VIEW).to(DEVICE)

    def forward(self, seeds_xyz, out, xyz, approach, angle, depth, width, graspable):
        # labels are per input point: take the label of the nearest input point to each seed
        nn_idx = torch.cdist(seeds_xyz, xyz).argmin(-1)
        take = lambda t: torch.gather(t, 1, nn_idx if t.dim() == 2 else nn_idx[..., None].expand(-1, -1, t.shape[-1]))
        g, a, ang = take(graspable), take(approach), take(angle)
        d, w = take(depth), take(width)
        l_g = F.binary_cross_entropy_with_logits(out["graspable"], g)
        # soft view target: similarity of each template view to the successful approach direction
        sim = a @ self.views.T
        view_target = F.softmax(sim / 0.05, dim=-1)
        pos = g > 0.5
        npos = pos.sum().clamp(min=1)
        l_v = -(view_target * F.log_softmax(out["view"], -1)).sum(-1)
        l_a = F.cross_entropy(out["angle"], ang, reduction="none")
        l_dw = F.smooth_l1_loss(out["dw"], torch.stack([d, w], -1) * 10, reduction="none").sum(-1)
        l_pos = ((l_v + l_a + l_dw) * pos).sum() / npos
        return l_g + l_pos, l_g.detach(), l_pos.detach()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    out_dir = os.path.join("experiments", args.exp)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    train_ds = SimGraspScenes(args.data, "train", args.num_points)
    val_ds = SimGraspScenes(args.data, "val", args.num_points)
    val_ds.files = val_ds.files[rank::world]
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, num_workers=args.workers)

    # the pointnet2_ops shared MLPs use BatchNorm2d; batches are only 4 scenes per GPU
    model = nn.SyncBatchNorm.convert_sync_batchnorm(PN2Grasp()).to(device)
    model = DDP(model, device_ids=[local_rank])
    criterion = GraspLoss()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        agg = torch.zeros(3, device=device)
        for batch in train_dl:
            xyz, approach, angle, depth, width, graspable = [t.to(device, non_blocking=True) for t in batch]
            seeds, out = model(xyz)
            loss, lg, lp = criterion(seeds, out, xyz, approach, angle, depth, width, graspable)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            agg += torch.stack([lg, lp, torch.ones((), device=device)])
        sched.step()

        model.eval()
        val = torch.zeros(2, device=device)
        with torch.no_grad():
            for batch in val_dl:
                xyz, approach, angle, depth, width, graspable = [t.to(device) for t in batch]
                seeds, out = model.module(xyz)
                loss, _, _ = criterion(seeds, out, xyz, approach, angle, depth, width, graspable)
                val += torch.stack([loss * xyz.shape[0], torch.tensor(float(xyz.shape[0]), device=device)])
        dist.all_reduce(agg)
        dist.all_reduce(val)
        val_loss = (val[0] / val[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: graspable {agg[0] / agg[2]:.4f} pos {agg[1] / agg[2]:.4f} "
                  f"val {val_loss:.4f} ({time.time() - t0:.0f}s)", flush=True)
            state = {"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict()}
            torch.save(state, os.path.join(out_dir, "last.pth"))
            if val_loss < best:
                best = val_loss
                torch.save(state, os.path.join(out_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
