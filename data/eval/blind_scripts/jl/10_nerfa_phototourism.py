"""NeRF-A (NeRF with per-image appearance codes) on Phototourism, multi-GPU, logged to W&B.

    torchrun --nproc_per_node=8 10_nerfa_phototourism.py --scene data/phototourism/trevi_fountain \
        --wandb_project nerf-wild --run_name trevi-nerfa-8gpu
"""
import argparse
import math
import os
import time

import imageio.v2 as imageio
import lpips
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scene", required=True)
    ap.add_argument("--wandb_project", default="nerf-wild")
    ap.add_argument("--run_name", default=None)
    ap.add_argument("--ckpt_dir", default="checkpoints")
    ap.add_argument("--downscale", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--global_batch", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--n_coarse", type=int, default=64)
    ap.add_argument("--n_fine", type=int, default=64)
    ap.add_argument("--a_dim", type=int, default=48)
    ap.add_argument("--num_workers", type=int, default=4)
    ap.add_argument("--log_every", type=int, default=50)
    return ap.parse_args()


def load_cameras(scene, downscale):
    """Cameras exported from COLMAP as npz (K, c2w, near/far per image) + the official tsv split."""
    tsv = pd.read_csv(os.path.join(scene, os.path.basename(scene.rstrip("/")) + ".tsv"), sep="\t").dropna()
    cams = np.load(os.path.join(scene, "cameras.npz"), allow_pickle=True)
    frames = []
    for _, row in tsv.iterrows():
        name = row["filename"]
        K, c2w, bounds = cams[name + "/K"].copy(), cams[name + "/c2w"], cams[name + "/bounds"]
        img = imageio.imread(os.path.join(scene, "dense/images", name))[..., :3].astype(np.float32) / 255.0
        img = img[::downscale, ::downscale]
        K[:2] /= downscale
        frames.append(dict(name=name, split=row["split"], img=img, K=K, c2w=c2w.astype(np.float32), bounds=bounds))
    return frames


def pixel_rays(K, c2w, h, w):
    x, y = np.meshgrid(np.arange(w) + 0.5, np.arange(h) + 0.5)
    d = np.stack([(x - K[0, 2]) / K[0, 0], (y - K[1, 2]) / K[1, 1], np.ones_like(x)], -1) @ c2w[:3, :3].T
    d /= np.linalg.norm(d, axis=-1, keepdims=True)
    return np.broadcast_to(c2w[:3, 3], d.shape), d


class RayBank(Dataset):
    def __init__(self, frames):
        chunks = []
        for i, fr in enumerate(frames):
            h, w = fr["img"].shape[:2]
            o, d = pixel_rays(fr["K"], fr["c2w"], h, w)
            nf = np.broadcast_to(np.asarray(fr["bounds"], np.float32), (h, w, 2))
            idx = np.full((h, w, 1), i, np.float32)
            chunks.append(np.concatenate([o, d, nf, fr["img"], idx], -1).reshape(-1, 12).astype(np.float32))
        self.data = torch.from_numpy(np.concatenate(chunks))

    def __len__(self):
        return self.data.shape[0]

    def __getitem__(self, i):
        return self.data[i]


class NeRFA(nn.Module):
    def __init__(self, n_images, a_dim, width=256):
        super().__init__()
        self.appearance = nn.Embedding(n_images, a_dim)
        nn.init.normal_(self.appearance.weight, std=0.01)

        def trunk():
            layers = [nn.Linear(63, width), nn.ReLU()]
            for _ in range(7):
                layers += [nn.Linear(width, width), nn.ReLU()]
            return nn.Sequential(*layers)

        self.trunks = nn.ModuleList([trunk(), trunk()])
        self.sigma = nn.ModuleList([nn.Linear(width, 1), nn.Linear(width, 1)])
        self.heads = nn.ModuleList([nn.Sequential(nn.Linear(width + 27 + a_dim, width // 2), nn.ReLU(),
                                                  nn.Linear(width // 2, 3), nn.Sigmoid()) for _ in range(2)])

    @staticmethod
    def pe(x, n):
        return torch.cat([x] + [f(x * 2.0 ** k) for k in range(n) for f in (torch.sin, torch.cos)], -1)

    def level(self, lvl, o, d, z, a):
        pts = o[:, None] + d[:, None] * z[..., None]
        h = self.trunks[lvl](self.pe(pts, 10))
        sigma = F.softplus(self.sigma[lvl](h)).squeeze(-1)
        n_s = z.shape[1]
        rgb = self.heads[lvl](torch.cat([h, self.pe(d, 4)[:, None].expand(-1, n_s, -1), a[:, None].expand(-1, n_s, -1)], -1))
        delta = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e2)], -1)
        alpha = 1 - torch.exp(-sigma * delta)
        w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
        return (w[..., None] * rgb).sum(1), w

    def forward(self, batch, n_coarse, n_fine, perturb=True, a=None):
        o, d, near, far = batch[:, 0:3], batch[:, 3:6], batch[:, 6:7], batch[:, 7:8]
        if a is None:
            a = self.appearance(batch[:, 11].long())
        t = torch.linspace(0, 1, n_coarse, device=o.device)
        z = near + (far - near) * t
        if perturb:
            z = z + torch.rand_like(z) * (far - near) / n_coarse
        rgb_c, w = self.level(0, o, d, z, a)
        with torch.no_grad():
            cdf = F.pad(torch.cumsum((w[:, :-1] + 1e-5) / (w[:, :-1] + 1e-5).sum(-1, keepdim=True), -1), (1, 0))
            u = torch.rand(o.shape[0], n_fine, device=o.device) if perturb else torch.linspace(0, 1, n_fine, device=o.device).repeat(o.shape[0], 1)
            j = torch.searchsorted(cdf, u.contiguous(), right=True).clamp(1, n_coarse - 1)
            c0, c1, z0, z1 = cdf.gather(1, j - 1), cdf.gather(1, j), z.gather(1, j - 1), z.gather(1, j)
            z_f, _ = torch.sort(torch.cat([z, z0 + (u - c0) / (c1 - c0).clamp_min(1e-5) * (z1 - z0)], -1), -1)
        rgb_f, _ = self.level(1, o, d, z_f, a)
        return rgb_c, rgb_f


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    run = wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    frames = load_cameras(args.scene, args.downscale)
    train_frames = [f for f in frames if f["split"] == "train"]
    test_frames = [f for f in frames if f["split"] == "test"]
    train_set = RayBank(train_frames)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.global_batch // world, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=True, drop_last=True)

    model = DDP(NeRFA(len(train_frames), args.a_dim).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader), eta_min=args.lr / 100)
    lpips_net = lpips.LPIPS(net="alex").to(device)
    os.makedirs(args.ckpt_dir, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for batch in loader:
            batch = batch.to(device, non_blocking=True)
            rgb_c, rgb_f = model(batch, args.n_coarse, args.n_fine)
            target = batch[:, 8:11]
            loss = F.mse_loss(rgb_c, target) + F.mse_loss(rgb_f, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % args.log_every == 0:
                stats = torch.stack([F.mse_loss(rgb_f.detach(), target), loss.detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                wandb.log({"train/psnr": -10 * math.log10(stats[0].item()), "train/loss": stats[1].item(),
                           "lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)

        # evaluate with the mean appearance code on held-out views (split across ranks)
        net = model.module
        a_mean = net.appearance.weight.detach().mean(0, keepdim=True)
        res = torch.zeros(3, device=device)
        with torch.no_grad():
            for fr in test_frames[rank::world]:
                h, w = fr["img"].shape[:2]
                o, d = pixel_rays(fr["K"], fr["c2w"], h, w)
                b = torch.from_numpy(np.concatenate([o, d, np.broadcast_to(np.asarray(fr["bounds"], np.float32), (h, w, 2))],
                                                    -1).reshape(-1, 8).astype(np.float32)).to(device)
                b = F.pad(b, (0, 4))
                pred = torch.cat([net(b[s:s + 8192], args.n_coarse, args.n_fine, perturb=False,
                                      a=a_mean.expand(b[s:s + 8192].shape[0], -1))[1]
                                  for s in range(0, b.shape[0], 8192)]).view(h, w, 3)
                gt = torch.from_numpy(fr["img"]).to(device)
                res[0] += -10 * torch.log10(F.mse_loss(pred, gt))
                res[1] += lpips_net(pred.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None], normalize=True).item()
                res[2] += 1
        dist.all_reduce(res)
        wandb.log({"test/psnr": (res[0] / res[2]).item(), "test/lpips": (res[1] / res[2]).item(),
                   "epoch_time_s": time.time() - t0}, step=step)
        if rank == 0:
            print(f"epoch {epoch} test psnr {(res[0] / res[2]).item():.2f} lpips {(res[1] / res[2]).item():.4f}", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.ckpt_dir, f"nerfa_{epoch:02d}.pt"))
        dist.barrier()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
