"""NeRF in the Wild (appearance + transient embeddings) on Phototourism, DDP over GPUs.

    torchrun --nnodes=1 --nproc_per_node=4 04_nerfw_appearance.py --root data/phototourism/brandenburg_gate \
        --run_dir runs/brandenburg_w
"""
import argparse
import json
import math
import os

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--run_dir", required=True)
    p.add_argument("--img_downscale", type=int, default=2)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch_rays", type=int, default=4096, help="rays per step over all GPUs")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--n_samples", type=int, default=64)
    p.add_argument("--n_a", type=int, default=48)
    p.add_argument("--n_tau", type=int, default=16)
    p.add_argument("--beta_min", type=float, default=0.1)
    p.add_argument("--lambda_u", type=float, default=0.01)
    p.add_argument("--transient_start", type=int, default=2000,
                   help="steps of static-only training before the transient head is switched on")
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


class PhotoTourismRays(Dataset):
    """All rays of the training images; every item is (origin, direction, near, far, rgb, image id)."""

    def __init__(self, root, split, downscale):
        with open(os.path.join(root, "transforms.json")) as f:
            meta = json.load(f)
        with open(os.path.join(root, "split.json")) as f:
            names = set(json.load(f)[split])
        self.frames = [fr for fr in meta["frames"] if os.path.basename(fr["file_path"]) in names]
        self.n_images = len(meta["frames"])
        self.id_of = {fr["file_path"]: i for i, fr in enumerate(meta["frames"])}
        rays, rgbs, ids = [], [], []
        self.images = []
        for fr in self.frames:
            img = imageio.imread(os.path.join(root, fr["file_path"]))[..., :3].astype(np.float32) / 255.0
            img = torch.from_numpy(img[::downscale, ::downscale].copy())
            h, w = img.shape[:2]
            fx, fy = fr["fl_x"] / downscale, fr["fl_y"] / downscale
            cx, cy = fr["cx"] / downscale, fr["cy"] / downscale
            c2w = torch.tensor(fr["transform_matrix"], dtype=torch.float32)
            x, y = torch.meshgrid(torch.arange(w) + 0.5, torch.arange(h) + 0.5, indexing="xy")
            d = torch.stack([(x - cx) / fx, -(y - cy) / fy, -torch.ones_like(x)], -1) @ c2w[:3, :3].T
            o = c2w[:3, 3].expand_as(d)
            nf = torch.tensor([fr["near"], fr["far"]]).expand(h, w, 2)
            if split == "train":
                rays.append(torch.cat([o, d, nf], -1).reshape(-1, 8))
                rgbs.append(img.reshape(-1, 3))
                ids.append(torch.full((h * w,), self.id_of[fr["file_path"]], dtype=torch.long))
            else:
                self.images.append((img, torch.cat([o, d, nf], -1).reshape(-1, 8), h, w))
        if split == "train":
            self.rays, self.rgbs, self.ids = torch.cat(rays), torch.cat(rgbs), torch.cat(ids)

    def __len__(self):
        return self.rays.shape[0]

    def __getitem__(self, i):
        return self.rays[i], self.rgbs[i], self.ids[i]


def pe(x, n):
    return torch.cat([x] + [f(2.0 ** k * x) for k in range(n) for f in (torch.sin, torch.cos)], -1)


class NeRFW(nn.Module):
    def __init__(self, n_images, n_a, n_tau, beta_min, width=256):
        super().__init__()
        self.beta_min = beta_min
        self.embed_a = nn.Embedding(n_images, n_a)
        self.embed_t = nn.Embedding(n_images, n_tau)
        self.xyz = nn.Sequential(nn.Linear(63, width), nn.ReLU(), *[m for _ in range(7) for m in (nn.Linear(width, width), nn.ReLU())])
        self.static_sigma = nn.Linear(width, 1)
        self.static_rgb = nn.Sequential(nn.Linear(width + 27 + n_a, width // 2), nn.ReLU(), nn.Linear(width // 2, 3), nn.Sigmoid())
        self.transient = nn.Sequential(nn.Linear(width + n_tau, width // 2), nn.ReLU(),
                                       nn.Linear(width // 2, width // 2), nn.ReLU())
        self.transient_sigma = nn.Linear(width // 2, 1)
        self.transient_rgb = nn.Linear(width // 2, 3)
        self.transient_beta = nn.Linear(width // 2, 1)

    def forward(self, rays, img_ids, n_samples, use_transient, perturb=True, appearance=None):
        o, d, near, far = rays[:, :3], rays[:, 3:6], rays[:, 6:7], rays[:, 7:8]
        t = torch.linspace(0, 1, n_samples, device=rays.device)
        z = near * (1 - t) + far * t
        if perturb:
            z = z + (torch.rand_like(z) - 0.5) * (far - near) / n_samples
        pts = o[:, None] + d[:, None] * z[..., None]
        h = self.xyz(pe(pts, 10))
        sigma_s = F.softplus(self.static_sigma(h)).squeeze(-1)
        a = self.embed_a(img_ids) if appearance is None else appearance.expand(rays.shape[0], -1)
        dirs = pe(F.normalize(d, dim=-1), 4)
        c_s = self.static_rgb(torch.cat([h, dirs[:, None].expand(-1, z.shape[1], -1), a[:, None].expand(-1, z.shape[1], -1)], -1))
        delta = torch.cat([z[:, 1:] - z[:, :-1], 1e2 * torch.ones_like(z[:, :1])], -1)
        if not use_transient:
            alpha = 1 - torch.exp(-sigma_s * delta)
            w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
            return {"rgb": (w[..., None] * c_s).sum(1)}
        ht = self.transient(torch.cat([h, self.embed_t(img_ids)[:, None].expand(-1, z.shape[1], -1)], -1))
        sigma_t = F.softplus(self.transient_sigma(ht)).squeeze(-1)
        c_t = torch.sigmoid(self.transient_rgb(ht))
        beta = F.softplus(self.transient_beta(ht)).squeeze(-1)
        a_s, a_t = 1 - torch.exp(-sigma_s * delta), 1 - torch.exp(-sigma_t * delta)
        T = torch.cumprod(torch.cat([torch.ones_like(a_s[:, :1]), 1 - (a_s + a_t - a_s * a_t) + 1e-10], -1), -1)[:, :-1]
        w_s, w_t = a_s * T, a_t * T
        rgb = (w_s[..., None] * c_s).sum(1) + (w_t[..., None] * c_t).sum(1)
        beta_ray = (w_t * beta).sum(1) + self.beta_min
        return {"rgb": rgb, "beta": beta_ray, "sigma_t": sigma_t}


def nerfw_loss(out, target, lambda_u):
    if "beta" not in out:
        return F.mse_loss(out["rgb"], target)
    beta = out["beta"]
    return (((out["rgb"] - target) ** 2).sum(-1) / (2 * beta ** 2)).mean() + 3 + torch.log(beta).mean() \
        + lambda_u * out["sigma_t"].mean()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    train_set = PhotoTourismRays(args.root, "train", args.img_downscale)
    test_set = PhotoTourismRays(args.root, "test", args.img_downscale)
    sampler = DistributedSampler(train_set, shuffle=True, seed=17)
    loader = DataLoader(train_set, batch_size=args.batch_rays // world, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    train_ids = torch.unique(train_set.ids).to(device)
    net = NeRFW(train_set.n_images, args.n_a, args.n_tau, args.beta_min).to(device)
    # the transient branch sits idle for the first transient_start steps
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    optim = torch.optim.Adam(model.parameters(), lr=args.lr)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, total, eta_min=args.lr * 0.01)

    writer = SummaryWriter(args.run_dir) if rank == 0 else None
    ckpt_file = os.path.join(args.run_dir, "ckpt.pt")
    start_epoch, step = 0, 0
    if os.path.isfile(ckpt_file):
        state = torch.load(ckpt_file, map_location="cpu")
        net.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        start_epoch, step = state["epoch"] + 1, state["step"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for rays, rgb, ids in loader:
            rays, rgb, ids = rays.to(device, non_blocking=True), rgb.to(device, non_blocking=True), ids.to(device)
            out = model(rays, ids, args.n_samples, use_transient=step >= args.transient_start)
            loss = nerfw_loss(out, rgb, args.lambda_u)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            step += 1
            if step % 200 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if writer:
                    writer.add_scalar("train/loss", l.item(), step)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

        # test-time appearance: mean of the learned training embeddings
        net.eval()
        a_mean = net.embed_a.weight.detach()[train_ids].mean(0, keepdim=True)
        metric = torch.zeros(2, device=device)
        with torch.no_grad():
            for k in range(rank, len(test_set.images), world):
                img, rays, h, w = test_set.images[k]
                rays = rays.to(device)
                pred = torch.cat([net(rays[s:s + 8192], None, args.n_samples, use_transient=False, perturb=False,
                                      appearance=a_mean)["rgb"] for s in range(0, rays.shape[0], 8192)])
                mse = F.mse_loss(pred.view(h, w, 3), img.to(device))
                metric += torch.stack([-10.0 * torch.log10(mse), torch.ones((), device=device)])
        dist.all_reduce(metric)
        if rank == 0:
            psnr = (metric[0] / metric[1]).item()
            writer.add_scalar("test/psnr", psnr, epoch)
            print(f"epoch {epoch}: test PSNR {psnr:.2f} ({int(metric[1])} views)", flush=True)
            torch.save({"model": net.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "step": step}, ckpt_file + ".part")
            os.replace(ckpt_file + ".part", ckpt_file)
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
