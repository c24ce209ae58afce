"""NeRF on LLFF with a cached ray bank, gradient accumulation and W&B logging, multi-GPU.

    torchrun --nproc_per_node=4 19_nerf_llff_accum.py --datadir data/nerf_llff_data/room --exp room_acc \
        --rays_per_gpu 2048 --accum 2
"""
import argparse
import contextlib
import glob
import math
import os

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

BASE_BATCH = 4096  # rays per optimizer step the base lr was tuned for


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--datadir", required=True)
    p.add_argument("--exp", required=True)
    p.add_argument("--logroot", default="logs")
    p.add_argument("--factor", type=int, default=8)
    p.add_argument("--hold", type=int, default=8)
    p.add_argument("--rays_per_gpu", type=int, default=2048)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--base_lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--n_samples", type=int, default=64)
    p.add_argument("--n_fine", type=int, default=64)
    p.add_argument("--no_wandb", action="store_true")
    return p.parse_args()


def load_llff(root, factor):
    pb = np.load(os.path.join(root, "poses_bounds.npy"))
    poses = pb[:, :15].reshape(-1, 3, 5)
    bds = pb[:, 15:]
    files = sorted(f for f in glob.glob(os.path.join(root, f"images_{factor}", "*")) if f.lower().endswith((".png", ".jpg")))
    imgs = np.stack([imageio.imread(f)[..., :3] for f in files]).astype(np.float32) / 255.0
    H, W = imgs.shape[1:3]
    focal = poses[0, 2, 4] * W / poses[0, 1, 4]
    poses = np.concatenate([poses[:, :, 1:2], -poses[:, :, 0:1], poses[:, :, 2:4]], 2).astype(np.float32)
    scale = 1.0 / (bds.min() * 0.75)
    poses[:, :3, 3] *= scale
    return imgs, poses, H, W, float(focal)


def rays_ndc(H, W, focal, c2w):
    x, y = np.meshgrid(np.arange(W, dtype=np.float32), np.arange(H, dtype=np.float32), indexing="xy")
    d = np.stack([(x - W * 0.5) / focal, -(y - H * 0.5) / focal, -np.ones_like(x)], -1) @ c2w[:3, :3].T
    o = np.broadcast_to(c2w[:3, 3], d.shape)
    t = -(1.0 + o[..., 2]) / d[..., 2]
    o = o + t[..., None] * d
    ax, ay = -2.0 * focal / W, -2.0 * focal / H
    o_n = np.stack([ax * o[..., 0] / o[..., 2], ay * o[..., 1] / o[..., 2], 1.0 + 2.0 / o[..., 2]], -1)
    d_n = np.stack([ax * (d[..., 0] / d[..., 2] - o[..., 0] / o[..., 2]),
                    ay * (d[..., 1] / d[..., 2] - o[..., 1] / o[..., 2]), -2.0 / o[..., 2]], -1)
    return np.concatenate([o_n, d_n], -1).astype(np.float32)


def ray_bank(args, imgs, poses, H, W, focal, train_ids, rank):
    """Rank 0 builds the bank and publishes it atomically; the others wait and read it."""
    path = os.path.join(args.datadir, f"raybank_f{args.factor}_h{args.hold}.npy")
    if rank == 0 and not os.path.exists(path):
        bank = np.concatenate([np.concatenate([rays_ndc(H, W, focal, poses[i]), imgs[i]], -1).reshape(-1, 9)
                               for i in train_ids])
        tmp = path + f".tmp{os.getpid()}.npy"
        np.save(tmp, bank)
        os.replace(tmp, path)
    dist.barrier()
    return np.load(path, mmap_mode="r")


class Bank(Dataset):
    def __init__(self, arr):
        self.arr = arr

    def __len__(self):
        return self.arr.shape[0]

    def __getitem__(self, i):
        return torch.from_numpy(np.array(self.arr[i]))


def pe(x, L):
    return torch.cat([x] + [torch.sin(x * 2.0 ** k) for k in range(L)] + [torch.cos(x * 2.0 ** k) for k in range(L)], -1)


class Net(nn.Module):
    def __init__(self, W=256):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(63, W), nn.ReLU(), nn.Linear(W, W), nn.ReLU(), nn.Linear(W, W), nn.ReLU(),
                               nn.Linear(W, W), nn.ReLU())
        self.b = nn.Sequential(nn.Linear(W + 63, W), nn.ReLU(), nn.Linear(W, W), nn.ReLU(), nn.Linear(W, W), nn.ReLU(),
                               nn.Linear(W, W + 1))
        self.c = nn.Sequential(nn.Linear(W + 27, W // 2), nn.ReLU(), nn.Linear(W // 2, 3))

    def forward(self, x, d):
        e = pe(x, 10)
        h = self.b(torch.cat([self.a(e), e], -1))
        return torch.sigmoid(self.c(torch.cat([h[..., 1:], pe(d, 4)], -1))), F.relu(h[..., 0])


class TwoLevel(nn.Module):
    def __init__(self, n_s, n_f):
        super().__init__()
        self.coarse, self.fine, self.n_s, self.n_f = Net(), Net(), n_s, n_f

    def _render(self, net, o, d, z):
        p = o[:, None] + d[:, None] * z[..., None]
        rgb, sig = net(p, F.normalize(d, dim=-1)[:, None].expand_as(p))
        dl = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e10)], -1) * d.norm(dim=-1, keepdim=True)
        a = 1 - torch.exp(-sig * dl)
        w = a * torch.cumprod(torch.cat([torch.ones_like(a[:, :1]), 1 - a + 1e-10], -1), -1)[:, :-1]
        return (w[..., None] * rgb).sum(1), w

    def forward(self, rays, train=True):
        o, d = rays[:, :3], rays[:, 3:6]
        z = torch.linspace(0, 1, self.n_s, device=o.device).expand(o.shape[0], -1)
        if train:
            z = (z + torch.rand_like(z) / self.n_s).clamp(max=1.0)
        c0, w = self._render(self.coarse, o, d, z)
        with torch.no_grad():
            cdf = F.pad(torch.cumsum((w[:, :-1] + 1e-5) / (w[:, :-1] + 1e-5).sum(-1, keepdim=True), -1), (1, 0))
            u = torch.rand(o.shape[0], self.n_f, device=o.device) if train else torch.linspace(0, 1, self.n_f, device=o.device).expand(o.shape[0], -1).contiguous()
            k = torch.searchsorted(cdf, u, right=True).clamp(1, self.n_s - 1)
            zl, zh, cl, ch = z.gather(1, k - 1), z.gather(1, k), cdf.gather(1, k - 1), cdf.gather(1, k)
            zf, _ = torch.sort(torch.cat([z, zl + (u - cl) / (ch - cl).clamp_min(1e-5) * (zh - zl)], -1), -1)
        c1, _ = self._render(self.fine, o, d, zf)
        return c0, c1


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    imgs, poses, H, W, focal = load_llff(args.datadir, args.factor)
    test_ids = list(range(0, len(imgs), args.hold))
    train_ids = [i for i in range(len(imgs)) if i % args.hold]
    bank = Bank(ray_bank(args, imgs, poses, H, W, focal, train_ids, rank))
    sampler = DistributedSampler(bank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(bank, batch_size=args.rays_per_gpu, sampler=sampler, num_workers=6, drop_last=True,
                        pin_memory=True, persistent_workers=True)

    # one optimizer step sees rays_per_gpu * accum * world rays: scale lr by sqrt of the batch ratio
    global_batch = args.rays_per_gpu * args.accum * world
    lr = args.base_lr * math.sqrt(global_batch / BASE_BATCH)
    steps_per_epoch = len(loader) // args.accum
    total_steps = args.epochs * steps_per_epoch
    model = DDP(TwoLevel(args.n_samples, args.n_fine).to(dev), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.1 ** (s / total_steps))

    run = None
    out_dir = os.path.join(args.logroot, args.exp)
    ckpt = os.path.join(out_dir, "last.pt")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        if not args.no_wandb:
            run = wandb.init(project="llff-nerf", name=args.exp,
                             config={**vars(args), "world_size": world, "global_batch": global_batch, "lr": lr})
    start_epoch = 0
    if os.path.exists(ckpt):
        st = torch.load(ckpt, map_location="cpu")
        model.module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        start_epoch = st["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        it = iter(loader)
        for step in range(steps_per_epoch):
            opt.zero_grad(set_to_none=True)
            mse_sum = torch.zeros((), device=dev)
            for micro in range(args.accum):
                batch = next(it).to(dev, non_blocking=True)
                sync = contextlib.nullcontext() if micro == args.accum - 1 else model.no_sync()
                with sync:
                    c0, c1 = model(batch[:, :6])
                    tgt = batch[:, 6:9]
                    loss = (F.mse_loss(c0, tgt) + F.mse_loss(c1, tgt)) / args.accum
                    loss.backward()
                mse_sum += F.mse_loss(c1.detach(), tgt) / args.accum
            opt.step()
            sched.step()
            if step % 200 == 0:
                dist.all_reduce(mse_sum, op=dist.ReduceOp.AVG)
                if run is not None:
                    run.log({"train/psnr": -10 * math.log10(mse_sum.item()), "lr": sched.get_last_lr()[0]},
                            step=epoch * steps_per_epoch + step)

        model.eval()
        acc = torch.zeros(2, device=dev)
        with torch.no_grad():
            for i in test_ids[rank::world]:
                r = torch.from_numpy(rays_ndc(H, W, focal, poses[i]).reshape(-1, 6)).to(dev)
                img = torch.cat([model.module(r[s:s + 8192], train=False)[1] for s in range(0, r.shape[0], 8192)]).view(H, W, 3)
                acc += torch.stack([-10 * torch.log10(F.mse_loss(img, torch.from_numpy(imgs[i]).to(dev))),
                                    torch.ones((), device=dev)])
        dist.all_reduce(acc)
        if rank == 0:
            psnr = (acc[0] / acc[1]).item()
            print(f"epoch {epoch}: test PSNR {psnr:.2f}", flush=True)
            if run is not None:
                run.log({"test/psnr": psnr, "epoch": epoch}, step=(epoch + 1) * steps_per_epoch)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
