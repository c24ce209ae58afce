"""NeuS-style neural SDF reconstruction on DTU, data parallel over GPUs.

Every rank keeps all images of the scene and draws its own random rays; the
SDF / color networks are synchronised by DDP. Mesh extraction runs on rank 0.
"""
import argparse
import datetime
import glob
import os

import cv2
import mcubes
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import trimesh
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scan_dir", required=True, help="e.g. /data/DTU/scan24")
    ap.add_argument("--exp_dir", default="exp/neus")
    ap.add_argument("--iters", type=int, default=300000)
    ap.add_argument("--batch_rays", type=int, default=2048, help="rays per iteration, all GPUs together")
    ap.add_argument("--n_samples", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=5000)
    ap.add_argument("--anneal_end", type=int, default=50000)
    ap.add_argument("--eik_weight", type=float, default=0.1)
    ap.add_argument("--mesh_every", type=int, default=50000)
    ap.add_argument("--save_every", type=int, default=10000)
    ap.add_argument("--resume", default="")
    return ap.parse_args()


def load_dtu(scan_dir):
    cams = np.load(os.path.join(scan_dir, "cameras_sphere.npz"))
    files = sorted(glob.glob(os.path.join(scan_dir, "image", "*.png")))
    images, intrinsics, poses = [], [], []
    for i, f in enumerate(files):
        images.append(cv2.imread(f)[..., ::-1].astype(np.float32) / 255.0)
        P = (cams[f"world_mat_{i}"] @ cams[f"scale_mat_{i}"])[:3, :4]
        K, R, t = cv2.decomposeProjectionMatrix(P)[:3]
        K = K / K[2, 2]
        c2w = np.eye(4, dtype=np.float32)
        c2w[:3, :3] = R.T
        c2w[:3, 3] = (t[:3] / t[3])[:, 0]
        intrinsics.append(K.astype(np.float32))
        poses.append(c2w)
    return (torch.from_numpy(np.stack(images)), torch.from_numpy(np.stack(intrinsics)),
            torch.from_numpy(np.stack(poses)))


class Embed(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        out = [x]
        for k in range(self.n):
            out += [torch.sin(2.0 ** k * x), torch.cos(2.0 ** k * x)]
        return torch.cat(out, -1)


class SDFNet(nn.Module):
    def __init__(self, d_hidden=256, n_layers=8, skip=4, d_feat=256):
        super().__init__()
        self.embed = Embed(6)
        d_in = 3 + 36
        self.skip = skip
        self.layers = nn.ModuleList()
        for l in range(n_layers):
            din = d_in if l == 0 else d_hidden
            if l == skip:
                din = d_hidden + d_in
            dout = d_feat + 1 if l == n_layers - 1 else d_hidden
            lin = nn.Linear(din, dout)
            if l == n_layers - 1:  # geometric init: sphere of radius 0.5
                nn.init.normal_(lin.weight, mean=np.sqrt(np.pi) / np.sqrt(din), std=1e-4)
                nn.init.constant_(lin.bias, -0.5)
            self.layers.append(nn.utils.parametrizations.weight_norm(lin))
        self.act = nn.Softplus(beta=100)

    def forward(self, x):
        e = self.embed(x)
        h = e
        for l, lin in enumerate(self.layers):
            if l == self.skip:
                h = torch.cat([h, e], -1) / np.sqrt(2)
            h = lin(h)
            if l < len(self.layers) - 1:
                h = self.act(h)
        return h[..., :1], h[..., 1:]


class NeuS(nn.Module):
    def __init__(self):
        super().__init__()
        self.sdf_net = SDFNet()
        self.embed_d = Embed(4)
        self.color_net = nn.Sequential(
            nn.Linear(3 + 3 + 27 + 3 + 256, 256), nn.ReLU(True),
            nn.Linear(256, 256), nn.ReLU(True),
            nn.Linear(256, 256), nn.ReLU(True),
            nn.Linear(256, 3), nn.Sigmoid())
        self.variance = nn.Parameter(torch.tensor(0.3))

    def forward(self, rays_o, rays_d, n_samples, cos_anneal):
        # near/far from the unit sphere
        b = (rays_o * rays_d).sum(-1, keepdim=True)
        mid = -b
        near, far = (mid - 1.0).clamp_min(0.05), mid + 1.0
        t = torch.linspace(0, 1, n_samples, device=rays_o.device)
        z = near + (far - near) * t
        if self.training:
            z = z + (far - near) / n_samples * (torch.rand_like(z) - 0.5)
        dists = torch.cat([z[:, 1:] - z[:, :-1], (far - near) / n_samples], -1)
        mid_z = z + dists * 0.5
        pts = (rays_o[:, None] + rays_d[:, None] * mid_z[..., None]).requires_grad_(True)
        dirs = rays_d[:, None].expand_as(pts)

        sdf, feat = self.sdf_net(pts)
        grad = torch.autograd.grad(sdf, pts, torch.ones_like(sdf), create_graph=True)[0]
        normal = F.normalize(grad, dim=-1)
        rgb = self.color_net(torch.cat([pts, self.embed_d(dirs), normal, feat], -1))

        inv_s = torch.exp(self.variance * 10.0).clamp(1e-6, 1e6)
        true_cos = (dirs * grad).sum(-1, keepdim=True)
        iter_cos = -(F.relu(-true_cos * 0.5 + 0.5) * (1.0 - cos_anneal) + F.relu(-true_cos) * cos_anneal)
        sdf_next = sdf + iter_cos * dists[..., None] * 0.5
        sdf_prev = sdf - iter_cos * dists[..., None] * 0.5
        prev_cdf, next_cdf = torch.sigmoid(sdf_prev * inv_s), torch.sigmoid(sdf_next * inv_s)
        alpha = ((prev_cdf - next_cdf + 1e-5) / (prev_cdf + 1e-5)).clamp(0.0, 1.0).squeeze(-1)
        trans = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1.0 - alpha + 1e-7], -1), -1)[:, :-1]
        w = alpha * trans
        color = (w[..., None] * rgb).sum(1)
        eikonal = ((grad.norm(dim=-1) - 1.0) ** 2).mean()
        return color, eikonal, inv_s.detach()


def sample_rays(images, K, poses, n, device):
    N, H, W = images.shape[:3]
    v = torch.randint(0, N, (n,), device=device)
    x = torch.randint(0, W, (n,), device=device).float()
    y = torch.randint(0, H, (n,), device=device).float()
    Kv, c2w = K[v], poses[v]
    d = torch.stack([(x - Kv[:, 0, 2]) / Kv[:, 0, 0], (y - Kv[:, 1, 2]) / Kv[:, 1, 1], torch.ones_like(x)], -1)
    d = F.normalize((c2w[:, :3, :3] @ d[..., None]).squeeze(-1), dim=-1)
    return c2w[:, :3, 3], d, images[v, y.long(), x.long()]


@torch.no_grad()
def extract_mesh(sdf_net, path, res=512, bound=1.0, chunk=128 ** 3):
    xs = torch.linspace(-bound, bound, res, device="cuda")
    grid = torch.stack(torch.meshgrid(xs, xs, xs, indexing="ij"), -1).reshape(-1, 3)
    sdf = torch.cat([sdf_net(grid[s:s + chunk])[0] for s in range(0, grid.shape[0], chunk)])
    sdf = sdf.reshape(res, res, res).cpu().numpy()
    verts, faces = mcubes.marching_cubes(-sdf, 0.0)
    verts = verts / (res - 1) * 2 * bound - bound
    trimesh.Trimesh(verts, faces).export(path)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # rank 0 runs marching cubes at 512^3 while the others wait in a barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=1))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(1234 + rank)  # different rays on every rank; DDP syncs the initial weights

    images, K, poses = (t.to(device) for t in load_dtu(args.scan_dir))
    model = NeuS().to(device)
    optim = torch.optim.Adam(model.parameters(), lr=args.lr)
    start = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        start = ckpt["iter"]
    model = DDP(model, device_ids=[local_rank])

    def lr_factor(it):
        if it < args.warmup:
            return it / args.warmup
        prog = (it - args.warmup) / (args.iters - args.warmup)
        return (np.cos(np.pi * prog) + 1.0) * 0.5 * 0.95 + 0.05

    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_factor, last_epoch=start - 1 if start else -1)
    per_rank = args.batch_rays // world
    writer = None
    if rank == 0:
        os.makedirs(os.path.join(args.exp_dir, "meshes"), exist_ok=True)
        writer = SummaryWriter(args.exp_dir)

    for it in range(start, args.iters):
        rays_o, rays_d, gt = sample_rays(images, K, poses, per_rank, device)
        cos_anneal = min(1.0, it / args.anneal_end)
        color, eik, inv_s = model(rays_o, rays_d, args.n_samples, cos_anneal)
        l1 = F.l1_loss(color, gt)
        loss = l1 + args.eik_weight * eik
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        sched.step()

        if it % 100 == 0:
            logs = torch.stack([l1.detach(), eik.detach(), F.mse_loss(color.detach(), gt)])
            dist.all_reduce(logs)
            logs /= world
            if rank == 0:
                psnr = -10 * torch.log10(logs[2]).item()
                writer.add_scalar("loss/color", logs[0].item(), it)
                writer.add_scalar("loss/eikonal", logs[1].item(), it)
                writer.add_scalar("train/psnr", psnr, it)
                writer.add_scalar("train/inv_s", inv_s.item(), it)
                print(f"it {it} l1 {logs[0].item():.4f} psnr {psnr:.2f} s {inv_s.item():.1f}", flush=True)

        if (it + 1) % args.save_every == 0:
            if rank == 0:
                torch.save({"iter": it + 1, "model": model.module.state_dict(), "optim": optim.state_dict()},
                           os.path.join(args.exp_dir, "latest.pth"))
            dist.barrier()

        if (it + 1) % args.mesh_every == 0:
            if rank == 0:
                model.module.eval()
                extract_mesh(model.module.sdf_net, os.path.join(args.exp_dir, "meshes", f"{it + 1:07d}.ply"))
                model.module.train()
            dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
