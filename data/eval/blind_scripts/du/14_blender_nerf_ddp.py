"""NeRF on the Blender synthetic scenes, epoch-based DDP training.

    torchrun --nproc_per_node=4 14_blender_nerf_ddp.py --root_dir /data/nerf_synthetic/chair --exp_name chair
"""
import argparse
import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms as T


def get_opts():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root_dir", type=str, required=True)
    parser.add_argument("--exp_name", type=str, required=True)
    parser.add_argument("--img_wh", nargs=2, type=int, default=[400, 400])
    parser.add_argument("--N_samples", type=int, default=64)
    parser.add_argument("--N_importance", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=4096, help="rays per step summed over GPUs")
    parser.add_argument("--num_epochs", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--num_workers", type=int, default=8)
    return parser.parse_args()


class BlenderRays(Dataset):
    """All rays of the training split, kept on the GPU for fast indexing."""

    def __init__(self, root_dir, img_wh, device):
        self.w, self.h = img_wh
        with open(os.path.join(root_dir, "transforms_train.json")) as f:
            meta = json.load(f)
        focal = 0.5 * 800 / np.tan(0.5 * meta["camera_angle_x"]) * self.w / 800
        i, j = np.meshgrid(np.arange(self.w), np.arange(self.h), indexing="xy")
        dirs = np.stack([(i - self.w / 2) / focal, -(j - self.h / 2) / focal, -np.ones_like(i)], -1).astype(np.float32)
        to_tensor = T.ToTensor()
        rays, rgbs = [], []
        for fr in meta["frames"]:
            c2w = np.array(fr["transform_matrix"], dtype=np.float32)[:3, :4]
            img = Image.open(os.path.join(root_dir, fr["file_path"] + ".png")).resize(img_wh, Image.LANCZOS)
            img = to_tensor(img).view(4, -1).permute(1, 0)
            img = img[:, :3] * img[:, -1:] + (1 - img[:, -1:])
            d = dirs @ c2w[:, :3].T
            d = d / np.linalg.norm(d, axis=-1, keepdims=True)
            o = np.broadcast_to(c2w[:, 3], d.shape)
            rays.append(torch.from_numpy(np.concatenate([o, d], -1).reshape(-1, 6)))
            rgbs.append(img)
        self.rays = torch.cat(rays).to(device)
        self.rgbs = torch.cat(rgbs).to(device)

    def __len__(self):
        return self.rays.shape[0]

    def __getitem__(self, idx):
        return self.rays[idx], self.rgbs[idx]


class Embedding(nn.Module):
    def __init__(self, n_freqs):
        super().__init__()
        self.register_buffer("freq_bands", 2 ** torch.linspace(0, n_freqs - 1, n_freqs), persistent=False)

    def forward(self, x):
        out = [x]
        for f in self.freq_bands:
            out += [torch.sin(f * x), torch.cos(f * x)]
        return torch.cat(out, -1)


class NeRFMLP(nn.Module):
    def __init__(self, D=8, W=256, in_xyz=63, in_dir=27, skips=(4,)):
        super().__init__()
        self.skips = skips
        self.xyz = nn.ModuleList([nn.Linear(in_xyz if i == 0 else W + (in_xyz if i in skips else 0), W) for i in range(D)])
        self.xyz_final = nn.Linear(W, W)
        self.dir_enc = nn.Sequential(nn.Linear(W + in_dir, W // 2), nn.ReLU(True))
        self.sigma = nn.Linear(W, 1)
        self.rgb = nn.Sequential(nn.Linear(W // 2, 3), nn.Sigmoid())

    def forward(self, x, d):
        h = x
        for i, l in enumerate(self.xyz):
            if i in self.skips:
                h = torch.cat([x, h], -1)
            h = F.relu(l(h))
        return self.rgb(self.dir_enc(torch.cat([self.xyz_final(h), d], -1))), self.sigma(h).squeeze(-1)


class NeRFSystem(nn.Module):
    def __init__(self, n_samples, n_importance, near=2.0, far=6.0):
        super().__init__()
        self.emb_xyz, self.emb_dir = Embedding(10), Embedding(4)
        self.coarse, self.fine = NeRFMLP(), NeRFMLP()
        self.n_samples, self.n_importance, self.near, self.far = n_samples, n_importance, near, far

    def run(self, mlp, o, d, z):
        pts = o[:, None] + d[:, None] * z[..., None]
        rgb, sigma = mlp(self.emb_xyz(pts), self.emb_dir(d)[:, None].expand(-1, z.shape[1], -1))
        delta = torch.cat([z[:, 1:] - z[:, :-1], 1e10 * torch.ones_like(z[:, :1])], -1)
        if self.training:
            sigma = sigma + torch.randn_like(sigma)  # raw noise regulariser
        alpha = 1 - torch.exp(-F.relu(sigma) * delta)
        w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
        return (w[..., None] * rgb).sum(1) + 1 - w.sum(-1, keepdim=True), w

    def forward(self, rays):
        o, d = rays[:, :3], rays[:, 3:6]
        t = torch.linspace(0, 1, self.n_samples, device=o.device)
        z = (self.near * (1 - t) + self.far * t).expand(o.shape[0], -1)
        if self.training:
            mids = 0.5 * (z[:, 1:] + z[:, :-1])
            z = torch.cat([z[:, :1], mids], -1) + (torch.cat([mids, z[:, -1:]], -1) - torch.cat([z[:, :1], mids], -1)) * torch.rand_like(z)
        rgb_c, w = self.run(self.coarse, o, d, z)
        # hierarchical sampling
        mids = 0.5 * (z[:, 1:] + z[:, :-1])
        pdf = w[:, 1:-1].detach() + 1e-5
        cdf = torch.cat([torch.zeros_like(pdf[:, :1]), torch.cumsum(pdf / pdf.sum(-1, keepdim=True), -1)], -1)
        u = torch.rand(o.shape[0], self.n_importance, device=o.device).contiguous()
        inds = torch.searchsorted(cdf, u, right=True)
        below, above = (inds - 1).clamp(min=0), inds.clamp(max=cdf.shape[1] - 1)
        cdf_b, cdf_a = cdf.gather(1, below), cdf.gather(1, above)
        bin_b, bin_a = mids.gather(1, below), mids.gather(1, above)
        denom = torch.where(cdf_a - cdf_b < 1e-5, torch.ones_like(cdf_a), cdf_a - cdf_b)
        z_imp = bin_b + (u - cdf_b) / denom * (bin_a - bin_b)
        z_all = torch.sort(torch.cat([z, z_imp.detach()], -1), -1)[0]
        rgb_f, _ = self.run(self.fine, o, d, z_all)
        return rgb_c, rgb_f


def main():
    hp = get_opts()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = BlenderRays(hp.root_dir, tuple(hp.img_wh), device)
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=hp.batch_size // world, sampler=sampler,
                        num_workers=hp.num_workers, drop_last=True)

    system = NeRFSystem(hp.N_samples, hp.N_importance).to(device)
    system = DDP(system, device_ids=[local_rank])
    optimizer = torch.optim.Adam(system.parameters(), lr=hp.lr, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=hp.num_epochs * len(loader), eta_min=1e-6)

    log_dir = os.path.join("logs", hp.exp_name)
    ckpt_dir = os.path.join("ckpts", hp.exp_name)
    logger = None
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        logger = SummaryWriter(log_dir)

    global_step = 0
    for epoch in range(hp.num_epochs):
        sampler.set_epoch(epoch)
        system.train()
        for rays, rgbs in loader:
            rays, rgbs = rays.to(device), rgbs.to(device)
            rgb_c, rgb_f = system(rays)
            loss = F.mse_loss(rgb_c, rgbs) + F.mse_loss(rgb_f, rgbs)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            global_step += 1

            if global_step % 100 == 0:
                with torch.no_grad():
                    psnr = -10.0 * torch.log10(F.mse_loss(rgb_f, rgbs))
                dist.all_reduce(psnr, op=dist.ReduceOp.AVG)
                if rank == 0:
                    logger.add_scalar("train/loss", loss.item(), global_step)
                    logger.add_scalar("train/psnr", psnr.item(), global_step)
                    logger.add_scalar("lr", scheduler.get_last_lr()[0], global_step)

        if rank == 0:
            torch.save({"epoch": epoch, "state_dict": system.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, os.path.join(ckpt_dir, f"epoch={epoch}.ckpt"))
            print(f"epoch {epoch}: step {global_step}", flush=True)
        dist.barrier()

    if rank == 0:
        logger.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
