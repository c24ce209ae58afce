"""Hash-grid NeRF (pure PyTorch hash encoding), multi-node via Slurm.

sbatch wrapper:
    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_PORT=29511
    srun --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=8 \
        python hashnerf_slurm.py --scene /datasets/nerf_synthetic/ship --ckpt_dir /checkpoint/$USER/hashnerf_ship
"""
import argparse
import json
import math
import os
import time

import imageio.v2 as imageio
import lpips
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scene", required=True)
    ap.add_argument("--ckpt_dir", required=True, help="must be on storage shared by all nodes")
    ap.add_argument("--steps", type=int, default=30000)
    ap.add_argument("--batch_rays", type=int, default=65536, help="rays per optimizer step, all ranks together")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--n_samples", type=int, default=192)
    ap.add_argument("--eval_every", type=int, default=10000)
    ap.add_argument("--ckpt_every", type=int, default=2500)
    return ap.parse_args()


def setup_slurm():
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    return rank, world_size, local_rank


class HashEncoding(nn.Module):
    PRIMES = (1, 2654435761, 805459861)

    def __init__(self, n_levels=16, feat_dim=2, log2_T=19, base_res=16, max_res=2048):
        super().__init__()
        self.n_levels, self.feat_dim, self.T = n_levels, feat_dim, 2 ** log2_T
        b = math.exp((math.log(max_res) - math.log(base_res)) / (n_levels - 1))
        self.register_buffer("res", torch.tensor([math.floor(base_res * b ** l) for l in range(n_levels)]),
                             persistent=False)
        self.table = nn.Parameter(torch.empty(n_levels, self.T, feat_dim).uniform_(-1e-4, 1e-4))
        corners = torch.tensor([[i, j, k] for i in (0, 1) for j in (0, 1) for k in (0, 1)])
        self.register_buffer("corners", corners, persistent=False)

    def forward(self, x):  # x in [0,1]^3, (N,3)
        xs = x[:, None, :] * self.res[None, :, None]              # N,L,3
        x0 = xs.floor().long()
        w = xs - x0                                               # N,L,3
        c = x0[:, :, None, :] + self.corners[None, None]          # N,L,8,3
        h = (c[..., 0] * self.PRIMES[0]) ^ (c[..., 1] * self.PRIMES[1]) ^ (c[..., 2] * self.PRIMES[2])
        h = h % self.T                                            # N,L,8
        lvl = torch.arange(self.n_levels, device=x.device)[None, :, None].expand_as(h)
        f = self.table[lvl, h]                                    # N,L,8,F
        cw = torch.where(self.corners[None, None].bool(), w[:, :, None, :], 1 - w[:, :, None, :]).prod(-1)
        return (f * cw[..., None]).sum(2).flatten(1)              # N, L*F


class HashNeRF(nn.Module):
    def __init__(self, bound=1.5):
        super().__init__()
        self.bound = bound
        self.enc = HashEncoding()
        self.density = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
        self.color = nn.Sequential(nn.Linear(15 + 9, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))

    @staticmethod
    def sh_deg2(d):
        x, y, z = d.unbind(-1)
        return torch.stack([torch.ones_like(x) * 0.282095, 0.488603 * y, 0.488603 * z, 0.488603 * x,
                            1.092548 * x * y, 1.092548 * y * z, 0.315392 * (3 * z * z - 1),
                            1.092548 * x * z, 0.546274 * (x * x - y * y)], -1)

    def forward(self, pts, dirs):
        xn = ((pts + self.bound) / (2 * self.bound)).clamp(0, 1 - 1e-6)
        h = self.density(self.enc(xn))
        sigma = F.softplus(h[:, 0] - 1.0)
        rgb = torch.sigmoid(self.color(torch.cat([h[:, 1:], self.sh_deg2(dirs)], -1)))
        return rgb, sigma


def render(model, ro, rd, n_samples, near=2.0, far=6.0, perturb=True, bg=1.0):
    t = torch.linspace(near, far, n_samples, device=ro.device).expand(ro.shape[0], -1)
    if perturb:
        t = t + torch.rand_like(t) * (far - near) / n_samples
    pts = (ro[:, None] + rd[:, None] * t[..., None]).reshape(-1, 3)
    dirs = F.normalize(rd, dim=-1)[:, None].expand(-1, n_samples, -1).reshape(-1, 3)
    rgb, sigma = model(pts, dirs)
    rgb, sigma = rgb.view(-1, n_samples, 3), sigma.view(-1, n_samples)
    delta = torch.cat([t[:, 1:] - t[:, :-1], torch.full_like(t[:, :1], 1e10)], -1)
    alpha = 1 - torch.exp(-sigma * delta)
    w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
    return (w[..., None] * rgb).sum(1) + bg * (1 - w.sum(-1, keepdim=True))


def build_cache(scene, split):
    """Pack images + poses into one .npz on the shared filesystem (written once, by global rank 0)."""
    path = os.path.join(scene, f"packed_{split}.npz")
    if dist.get_rank() == 0 and not os.path.exists(path):
        meta = json.load(open(os.path.join(scene, f"transforms_{split}.json")))
        imgs = np.stack([imageio.imread(os.path.join(scene, f["file_path"] + ".png")) for f in meta["frames"]])
        imgs = imgs.astype(np.float32) / 255.0
        imgs = imgs[..., :3] * imgs[..., 3:] + (1 - imgs[..., 3:])
        poses = np.stack([np.array(f["transform_matrix"], np.float32) for f in meta["frames"]])
        focal = 0.5 * imgs.shape[2] / math.tan(0.5 * meta["camera_angle_x"])
        tmp = path + ".tmp.npz"
        np.savez(tmp, imgs=imgs.astype(np.float16), poses=poses, focal=np.float32(focal))
        os.replace(tmp, path)
    dist.barrier()
    z = np.load(path)
    return torch.from_numpy(z["imgs"].astype(np.float32)), torch.from_numpy(z["poses"]), float(z["focal"])


def rays_for(poses, ys, xs, H, W, focal):
    d = torch.stack([(xs + 0.5 - W / 2) / focal, -(ys + 0.5 - H / 2) / focal, -torch.ones_like(xs)], -1)
    rd = (poses[:, :3, :3] @ d[..., None]).squeeze(-1)
    return poses[:, :3, 3], rd


def main():
    args = parse_args()
    rank, world, local_rank = setup_slurm()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)
    gen = torch.Generator(device=device).manual_seed(1234 + rank)

    imgs, poses, focal = build_cache(args.scene, "train")
    test_imgs, test_poses, _ = build_cache(args.scene, "test")
    N, H, W = imgs.shape[:3]
    imgs, poses = imgs.to(device), poses.to(device)

    model = DDP(HashNeRF().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.99), eps=1e-15)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1 ** min(s / args.steps, 1.0))

    start = 0
    last = os.path.join(args.ckpt_dir, "last.pt")
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["step"]
        if rank == 0:
            print(f"resumed from step {start}", flush=True)

    if local_rank == 0:
        lpips.LPIPS(net="vgg", verbose=False)  # fetch backbone weights once per node
    dist.barrier()
    lpips_fn = lpips.LPIPS(net="vgg", verbose=False).to(device).eval()

    n_rays = args.batch_rays // (world * args.accum)
    t0 = time.time()
    for step in range(start + 1, args.steps + 1):
        for micro in range(args.accum):
            i = torch.randint(0, N, (n_rays,), device=device, generator=gen)
            ys = torch.randint(0, H, (n_rays,), device=device, generator=gen)
            xs = torch.randint(0, W, (n_rays,), device=device, generator=gen)
            ro, rd = rays_for(poses[i], ys.float(), xs.float(), H, W, focal)
            target = imgs[i, ys, xs]
            if micro < args.accum - 1:
                with model.no_sync():
                    loss = F.mse_loss(render(model, ro, rd, args.n_samples), target) / args.accum
                    loss.backward()
            else:
                loss = F.mse_loss(render(model, ro, rd, args.n_samples), target) / args.accum
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()

        if step % 200 == 0:
            l = loss.detach() * args.accum
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} mse {l.item():.5f} psnr {-10 * math.log10(l.item()):.2f} "
                      f"({(time.time() - t0) / (step - start):.3f}s/step)", flush=True)

        if step % args.ckpt_every == 0 and rank == 0:
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "step": step}, last + ".tmp")
            os.replace(last + ".tmp", last)

        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            m = torch.zeros(3, device=device)  # psnr sum, lpips sum, views
            with torch.no_grad():
                for k in range(rank, test_imgs.shape[0], world):
                    c2w = test_poses[k].to(device)
                    yy, xx = torch.meshgrid(torch.arange(H, device=device), torch.arange(W, device=device), indexing="ij")
                    ro, rd = rays_for(c2w[None].expand(H * W, 4, 4), yy.reshape(-1).float(), xx.reshape(-1).float(), H, W, focal)
                    pred = torch.cat([render(model.module, ro[s:s + 16384], rd[s:s + 16384], args.n_samples, perturb=False)
                                      for s in range(0, H * W, 16384)]).view(H, W, 3)
                    gt = test_imgs[k].to(device)
                    m[0] += -10 * torch.log10(F.mse_loss(pred, gt))
                    m[1] += lpips_fn(pred.permute(2, 0, 1)[None] * 2 - 1, gt.permute(2, 0, 1)[None] * 2 - 1).squeeze()
                    m[2] += 1
            dist.all_reduce(m)
            if rank == 0:
                print(f"[eval {step}] PSNR {m[0].item() / m[2].item():.2f}  LPIPS {m[1].item() / m[2].item():.4f} "
                      f"over {int(m[2].item())} views", flush=True)
            model.train()

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
