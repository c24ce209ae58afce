"""6-DOF GraspNet grasp sampler (conditional VAE on object point clouds).

Training data: per-object point clouds rendered from random viewpoints and the
successful grasps found for that object in the FleX/PyBullet simulation sweep.
Validation reports the coverage of ground-truth grasps by sampled grasps.

    torchrun --nproc_per_node=4 05_sixdof_graspnet_vae.py --data /data/sixdof --run-name vae_v3
"""
import argparse
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_opts():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--run-name", default="vae")
    p.add_argument("--ckpt-root", default="checkpoints")
    p.add_argument("--npoints", type=int, default=1024)
    p.add_argument("--grasps-per-pc", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--latent", type=int, default=2)
    p.add_argument("--kl-weight", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--num-workers", type=int, default=6)
    return p.parse_args()


def pose_to_control_points(pose):
    """pose: (..., 4, 4) -> (..., 5, 3) gripper control points used for the loss."""
    cp = torch.tensor([[0, 0, 0], [0.053, 0, 0.075], [-0.053, 0, 0.075],
                       [0.053, 0, 0.105], [-0.053, 0, 0.105]], dtype=pose.dtype, device=pose.device)
    return torch.einsum("...ij,kj->...ki", pose[..., :3, :3], cp) + pose[..., None, :3, 3]


def quat_trans_to_pose(q, t):
    q = F.normalize(q, dim=-1)
    w, x, y, z = q.unbind(-1)
    R = torch.stack([
        1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w),
        2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w),
        2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y),
    ], -1).reshape(*q.shape[:-1], 3, 3)
    T = torch.zeros(*q.shape[:-1], 4, 4, device=q.device, dtype=q.dtype)
    T[..., :3, :3] = R
    T[..., :3, 3] = t
    T[..., 3, 3] = 1
    return T


class ObjectGrasps(Dataset):
    def __init__(self, root, split, npoints, grasps_per_pc):
        with open(os.path.join(root, f"{split}.json")) as f:
            self.objects = json.load(f)
        self.root = root
        self.npoints = npoints
        self.k = grasps_per_pc

    def __len__(self):
        return len(self.objects)

    def __getitem__(self, i):
        obj = np.load(os.path.join(self.root, self.objects[i]))
        view = np.random.randint(obj["clouds"].shape[0])
        pc = obj["clouds"][view]
        pc = pc[np.random.choice(len(pc), self.npoints, replace=len(pc) < self.npoints)]
        cam = obj["cam_poses"][view]                     # world -> camera
        grasps = obj["grasps"][obj["success"] == 1]      # (G, 4, 4) in object frame
        grasps = cam[None] @ grasps
        sel = np.random.choice(len(grasps), self.k, replace=len(grasps) < self.k)
        mean = pc.mean(0)
        pc = pc - mean
        g = grasps[sel].copy()
        g[:, :3, 3] -= mean
        return torch.from_numpy(pc).float(), torch.from_numpy(g).float()


class PointEncoder(nn.Module):
    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(in_dim, 128, 1), nn.GroupNorm(8, 128), nn.ReLU(),
                                 nn.Conv1d(128, 256, 1), nn.GroupNorm(8, 256), nn.ReLU(),
                                 nn.Conv1d(256, out_dim, 1))

    def forward(self, x):  # B,N,C
        return self.net(x.transpose(1, 2)).max(2)[0]


class GraspVAE(nn.Module):
    def __init__(self, latent=2, feat=512):
        super().__init__()
        self.latent_size = latent
        self.pc_enc = PointEncoder(3, feat)
        self.grasp_enc = nn.Sequential(nn.Linear(feat + 15, 512), nn.ReLU(), nn.Linear(512, 2 * latent))
        self.decoder = nn.Sequential(nn.Linear(feat + latent, 512), nn.ReLU(),
                                     nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 7))

    def decode(self, pc_feat, z):
        out = self.decoder(torch.cat([pc_feat, z], -1))
        return quat_trans_to_pose(out[..., :4], out[..., 4:])

    def forward(self, pc, grasps):
        B, G = grasps.shape[:2]
        f = self.pc_enc(pc)[:, None].expand(B, G, -1)
        cps = pose_to_control_points(grasps).flatten(-2)
        mu, logvar = self.grasp_enc(torch.cat([f, cps], -1)).chunk(2, -1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return self.decode(f, z), mu, logvar

    @torch.no_grad()
    def sample_grasps(self, pc, n):
        f = self.pc_enc(pc)[:, None].expand(-1, n, -1)
        z = torch.randn(pc.shape[0], n, self.latent_size, device=pc.device)
        return self.decode(f, z)


def vae_loss(pred, gt, mu, logvar, kl_w):
    recon = (pose_to_control_points(pred) - pose_to_control_points(gt)).abs().sum(-1).mean()
    kl = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
    return recon + kl_w * kl, recon, kl


@torch.no_grad()
def coverage(generator, loader, device, n_samples=128, thresh=0.02):
    """Fraction of ground-truth grasps that have a sampled grasp within `thresh` (control point dist)."""
    covered = torch.zeros((), device=device)
    total = torch.zeros((), device=device)
    for pc, gt in loader:
        pc, gt = pc.to(device), gt.to(device)
        samples = generator.sample_grasps(pc, n_samples)
        d = torch.cdist(pose_to_control_points(gt).flatten(-2), pose_to_control_points(samples).flatten(-2))
        d = d / 5 ** 0.5
        covered += (d.min(-1)[0] < thresh).sum()
        total += gt.shape[0] * gt.shape[1]
    dist.all_reduce(covered)
    dist.all_reduce(total)
    return (covered / total).item()


def main():
    opts = get_opts()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    random.seed(1234)
    torch.manual_seed(1234)

    ckpt_dir = os.path.join(opts.ckpt_root, opts.run_name)
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)

    train_ds = ObjectGrasps(opts.data, "train", opts.npoints, opts.grasps_per_pc)
    val_ds = ObjectGrasps(opts.data, "val", opts.npoints, opts.grasps_per_pc)
    val_ds.objects = val_ds.objects[rank::world_size]
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=opts.batch_size, sampler=train_sampler,
                          num_workers=opts.num_workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=opts.batch_size, shuffle=False, num_workers=opts.num_workers)

    model = GraspVAE(latent=opts.latent).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optim = torch.optim.Adam(model.parameters(), lr=opts.lr * world_size, betas=(0.9, 0.999))

    best = 0.0
    for epoch in range(1, opts.epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        agg = torch.zeros(3, device=device)
        for pc, grasps in train_dl:
            pc, grasps = pc.to(device, non_blocking=True), grasps.to(device, non_blocking=True)
            pred, mu, logvar = model(pc, grasps)
            loss, recon, kl = vae_loss(pred, grasps, mu, logvar, opts.kl_weight)
            optim.zero_grad()
            loss.backward()
            optim.step()
            agg += torch.stack([recon.detach(), kl.detach(), torch.ones((), device=device)])
        dist.all_reduce(agg)
        if rank == 0:
            print(f"epoch {epoch:3d} recon {agg[0] / agg[2]:.4f} kl {agg[1] / agg[2]:.4f}", flush=True)

        if epoch % opts.eval_every == 0:
            model.eval()
            cov = coverage(model, val_dl, device)
            if rank == 0:
                print(f"  val coverage@2cm: {cov:.3f}", flush=True)
                state = {"epoch": epoch, "model": model.module.state_dict(), "optim": optim.state_dict(),
                         "opts": vars(opts)}
                torch.save(state, os.path.join(ckpt_dir, "latest.pth"))
                if cov > best:
                    best = cov
                    torch.save(state, os.path.join(ckpt_dir, "best.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
