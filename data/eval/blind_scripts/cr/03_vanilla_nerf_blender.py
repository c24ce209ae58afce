import argparse
import json
import os
import time

import imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm


def config_parser():
    parser = argparse.ArgumentParser(description="NeRF (coarse + fine), distributed over rays")
    parser.add_argument("--datadir", type=str, default="./data/nerf_synthetic/lego")
    parser.add_argument("--basedir", type=str, default="./logs")
    parser.add_argument("--expname", type=str, default="lego_ddp")
    parser.add_argument("--half_res", action="store_true")
    parser.add_argument("--N_rand", type=int, default=4096, help="global batch of rays")
    parser.add_argument("--N_samples", type=int, default=64)
    parser.add_argument("--N_importance", type=int, default=128)
    parser.add_argument("--netdepth", type=int, default=8)
    parser.add_argument("--netwidth", type=int, default=256)
    parser.add_argument("--lrate", type=float, default=5e-4)
    parser.add_argument("--lrate_decay", type=int, default=500, help="in 1000 steps")
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--num_workers", type=int, default=4)
    parser.add_argument("--i_print", type=int, default=100)
    parser.add_argument("--i_testset", type=int, default=4)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


class Embedder(nn.Module):
    def __init__(self, n_freqs):
        super().__init__()
        self.register_buffer("freqs", 2.0 ** torch.arange(n_freqs), persistent=False)
        self.out_dim = 3 + 3 * 2 * n_freqs

    def forward(self, x):
        xb = x[..., None, :] * self.freqs[:, None]
        return torch.cat([x, torch.sin(xb).flatten(-2), torch.cos(xb).flatten(-2)], -1)


class NeRFMLP(nn.Module):
    def __init__(self, D=8, W=256, skips=(4,)):
        super().__init__()
        self.embed_xyz = Embedder(10)
        self.embed_dir = Embedder(4)
        self.skips = skips
        in_ch = self.embed_xyz.out_dim
        layers = [nn.Linear(in_ch, W)]
        for i in range(D - 1):
            layers.append(nn.Linear(W + in_ch if i in skips else W, W))
        self.pts_linears = nn.ModuleList(layers)
        self.sigma = nn.Linear(W, 1)
        self.feature = nn.Linear(W, W)
        self.views_linear = nn.Linear(W + self.embed_dir.out_dim, W // 2)
        self.rgb = nn.Linear(W // 2, 3)

    def forward(self, pts, viewdirs):
        x_in = self.embed_xyz(pts)
        h = x_in
        for i, layer in enumerate(self.pts_linears):
            h = F.relu(layer(h))
            if i in self.skips:
                h = torch.cat([x_in, h], -1)
        sigma = self.sigma(h).squeeze(-1)
        d = self.embed_dir(viewdirs)[..., None, :].expand(*h.shape[:-1], -1)
        h = F.relu(self.views_linear(torch.cat([self.feature(h), d], -1)))
        return torch.sigmoid(self.rgb(h)), sigma


class CoarseFine(nn.Module):
    def __init__(self, D, W):
        super().__init__()
        self.coarse = NeRFMLP(D, W)
        self.fine = NeRFMLP(D, W)

    def forward(self, rays_o, rays_d, near, far, n_coarse, n_fine, perturb=True):
        viewdirs = F.normalize(rays_d, dim=-1)
        t = torch.linspace(0.0, 1.0, n_coarse, device=rays_o.device)
        z = near * (1 - t) + far * t
        z = z.expand(rays_o.shape[0], n_coarse)
        if perturb:
            mids = 0.5 * (z[:, 1:] + z[:, :-1])
            upper = torch.cat([mids, z[:, -1:]], -1)
            lower = torch.cat([z[:, :1], mids], -1)
            z = lower + (upper - lower) * torch.rand_like(z)
        pts = rays_o[:, None] + rays_d[:, None] * z[..., None]
        rgb_c, w_c = volume_render(*self.coarse(pts, viewdirs), z, rays_d)

        z_mid = 0.5 * (z[:, 1:] + z[:, :-1])
        z_fine = sample_pdf(z_mid, w_c[:, 1:-1].detach(), n_fine, det=not perturb)
        z_all, _ = torch.sort(torch.cat([z, z_fine], -1), -1)
        pts = rays_o[:, None] + rays_d[:, None] * z_all[..., None]
        rgb_f, _ = volume_render(*self.fine(pts, viewdirs), z_all, rays_d)
        return rgb_c, rgb_f


def volume_render(rgb, sigma, z, rays_d, white_bkgd=True):
    dists = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e10)], -1)
    dists = dists * rays_d.norm(dim=-1, keepdim=True)
    alpha = 1.0 - torch.exp(-F.relu(sigma) * dists)
    trans = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1.0 - alpha + 1e-10], -1), -1)[:, :-1]
    weights = alpha * trans
    out = (weights[..., None] * rgb).sum(-2)
    if white_bkgd:
        out = out + (1.0 - weights.sum(-1, keepdim=True))
    return out, weights


def sample_pdf(bins, weights, n, det=False):
    weights = weights + 1e-5
    pdf = weights / weights.sum(-1, keepdim=True)
    cdf = torch.cat([torch.zeros_like(pdf[:, :1]), torch.cumsum(pdf, -1)], -1)
    if det:
        u = torch.linspace(0.0, 1.0, n, device=bins.device).expand(cdf.shape[0], n).contiguous()
    else:
        u = torch.rand(cdf.shape[0], n, device=bins.device)
    inds = torch.searchsorted(cdf, u, right=True)
    below = (inds - 1).clamp(min=0)
    above = inds.clamp(max=cdf.shape[-1] - 1)
    cdf_g = torch.stack([torch.gather(cdf, 1, below), torch.gather(cdf, 1, above)], -1)
    bins_g = torch.stack([torch.gather(bins, 1, below), torch.gather(bins, 1, above)], -1)
    denom = cdf_g[..., 1] - cdf_g[..., 0]
    denom = torch.where(denom < 1e-5, torch.ones_like(denom), denom)
    return bins_g[..., 0] + (u - cdf_g[..., 0]) / denom * (bins_g[..., 1] - bins_g[..., 0])


def load_blender(basedir, split, half_res):
    with open(os.path.join(basedir, f"transforms_{split}.json")) as fp:
        meta = json.load(fp)
    imgs = np.stack([imageio.imread(os.path.join(basedir, f["file_path"] + ".png")) for f in meta["frames"]])
    imgs = (imgs / 255.0).astype(np.float32)
    imgs = imgs[..., :3] * imgs[..., -1:] + (1.0 - imgs[..., -1:])
    poses = np.stack([np.array(f["transform_matrix"], dtype=np.float32) for f in meta["frames"]])
    H, W = imgs.shape[1:3]
    focal = 0.5 * W / np.tan(0.5 * float(meta["camera_angle_x"]))
    if half_res:
        imgs = F.interpolate(torch.from_numpy(imgs).permute(0, 3, 1, 2), scale_factor=0.5,
                             mode="area").permute(0, 2, 3, 1).numpy()
        H, W, focal = H // 2, W // 2, focal / 2.0
    return imgs, poses, H, W, focal


def get_rays_np(H, W, focal, c2w):
    i, j = np.meshgrid(np.arange(W, dtype=np.float32), np.arange(H, dtype=np.float32), indexing="xy")
    dirs = np.stack([(i - W * 0.5) / focal, -(j - H * 0.5) / focal, -np.ones_like(i)], -1)
    rays_d = np.sum(dirs[..., None, :] * c2w[:3, :3], -1)
    rays_o = np.broadcast_to(c2w[:3, -1], rays_d.shape)
    return rays_o, rays_d


class RayDataset(Dataset):
    def __init__(self, imgs, poses, H, W, focal):
        rays = [np.concatenate(get_rays_np(H, W, focal, p), -1) for p in poses]
        self.rays = torch.from_numpy(np.stack(rays).reshape(-1, 6).astype(np.float32))
        self.rgbs = torch.from_numpy(imgs.reshape(-1, 3))

    def __len__(self):
        return self.rays.shape[0]

    def __getitem__(self, idx):
        return self.rays[idx], self.rgbs[idx]


@torch.no_grad()
def render_image(net, H, W, focal, c2w, args, device, chunk=4096):
    ro, rd = get_rays_np(H, W, focal, c2w)
    ro = torch.from_numpy(np.ascontiguousarray(ro)).reshape(-1, 3).to(device)
    rd = torch.from_numpy(rd).reshape(-1, 3).to(device)
    out = []
    for s in range(0, ro.shape[0], chunk):
        _, rgb_f = net(ro[s:s + chunk], rd[s:s + chunk], 2.0, 6.0, args.N_samples, args.N_importance, perturb=False)
        out.append(rgb_f)
    return torch.cat(out).reshape(H, W, 3)


def train():
    args = config_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(0)

    imgs, poses, H, W, focal = load_blender(args.datadir, "train", args.half_res)
    test_imgs, test_poses, _, _, _ = load_blender(args.datadir, "test", args.half_res)
    dataset = RayDataset(imgs, poses, H, W, focal)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.N_rand // world_size, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=True, drop_last=True)

    model = CoarseFine(args.netdepth, args.netwidth).to(device)
    model = DDP(model, device_ids=[args.local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lrate, betas=(0.9, 0.999))
    decay_steps = args.lrate_decay * 1000

    logdir = os.path.join(args.basedir, args.expname)
    if rank == 0:
        os.makedirs(logdir, exist_ok=True)
        with open(os.path.join(logdir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    global_step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        pbar = tqdm(loader, disable=rank != 0, desc=f"epoch {epoch}")
        t0 = time.time()
        for rays, target in pbar:
            rays = rays.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            rgb_c, rgb_f = model(rays[:, :3], rays[:, 3:], 2.0, 6.0, args.N_samples, args.N_importance)
            loss = F.mse_loss(rgb_c, target) + F.mse_loss(rgb_f, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            global_step += 1
            new_lr = args.lrate * (0.1 ** (global_step / decay_steps))
            for g in optimizer.param_groups:
                g["lr"] = new_lr

            if global_step % args.i_print == 0:
                with torch.no_grad():
                    mse_f = F.mse_loss(rgb_f, target).detach()
                    dist.all_reduce(mse_f, op=dist.ReduceOp.AVG)
                if rank == 0:
                    psnr = -10.0 * torch.log10(mse_f).item()
                    pbar.set_postfix(loss=f"{loss.item():.4f}", psnr=f"{psnr:.2f}", lr=f"{new_lr:.2e}")

        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s")
            torch.save({"global_step": global_step,
                        "network_fn_state_dict": model.module.state_dict(),
                        "optimizer_state_dict": optimizer.state_dict()},
                       os.path.join(logdir, f"{global_step:06d}.tar"))

            if (epoch + 1) % args.i_testset == 0:
                model.eval()
                psnrs = []
                for k in range(0, len(test_poses), 50):
                    img = render_image(model.module, H, W, focal, test_poses[k], args, device)
                    gt = torch.from_numpy(test_imgs[k]).to(device)
                    psnrs.append(-10.0 * torch.log10(F.mse_loss(img, gt)).item())
                    imageio.imwrite(os.path.join(logdir, f"test_{epoch:03d}_{k:03d}.png"),
                                    (img.clamp(0, 1).cpu().numpy() * 255).astype(np.uint8))
                print(f"[test] epoch {epoch}: PSNR {np.mean(psnrs):.2f} on {len(psnrs)} views")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    train()
