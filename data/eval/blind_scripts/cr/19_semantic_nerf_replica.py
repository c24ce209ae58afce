"""Semantic-NeRF on Replica sequences: joint radiance + semantic-label field, multi-GPU.

Sequence layout (Semantic-NeRF release): rgb/rgb_<i>.png, semantic_class/semantic_class_<i>.png,
traj_w_c.txt (one flattened 4x4 camera-to-world per line).

    torchrun --nproc_per_node=4 semantic_nerf_ddp.py --seq data/replica/room_0/Sequence_1 --out runs/room0
    # continue an interrupted run
    torchrun --nproc_per_node=4 semantic_nerf_ddp.py --seq data/replica/room_0/Sequence_1 --out runs/room0 --resume
"""
import argparse
import glob
import os
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--H", type=int, default=240)
    p.add_argument("--W", type=int, default=320)
    p.add_argument("--hfov", type=float, default=90.0)
    p.add_argument("--train_skip", type=int, default=5)
    p.add_argument("--iters", type=int, default=200000)
    p.add_argument("--rays", type=int, default=4096, help="total over GPUs")
    p.add_argument("--n_coarse", type=int, default=64)
    p.add_argument("--n_fine", type=int, default=128)
    p.add_argument("--near", type=float, default=0.1)
    p.add_argument("--far", type=float, default=10.0)
    p.add_argument("--sem_weight", type=float, default=0.04)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--save_every", type=int, default=10000)
    p.add_argument("--test_every", type=int, default=20000)
    return p.parse_args()


def load_replica(seq, H, W):
    rgb_files = sorted(glob.glob(os.path.join(seq, "rgb", "rgb_*.png")), key=lambda f: int(f.split("_")[-1][:-4]))
    sem_files = sorted(glob.glob(os.path.join(seq, "semantic_class", "semantic_class_*.png")),
                       key=lambda f: int(f.split("_")[-1][:-4]))
    poses = np.loadtxt(os.path.join(seq, "traj_w_c.txt"), dtype=np.float32).reshape(-1, 4, 4)
    rgbs = np.stack([cv2.resize(cv2.imread(f)[..., ::-1], (W, H), interpolation=cv2.INTER_AREA) for f in rgb_files])
    sems = np.stack([cv2.resize(cv2.imread(f, cv2.IMREAD_UNCHANGED), (W, H), interpolation=cv2.INTER_NEAREST)
                     for f in sem_files])
    # class ids of the whole sequence -> contiguous labels (same on every rank: sorted unique)
    classes = np.unique(sems)
    remap = np.zeros(classes.max() + 1, np.int64)
    remap[classes] = np.arange(len(classes))
    poses[:, :3, 1:3] *= -1  # OpenCV -> OpenGL camera axes
    return (torch.from_numpy(rgbs.astype(np.float32) / 255.0), torch.from_numpy(remap[sems]),
            torch.from_numpy(poses), classes)


class PosEnc(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.register_buffer("freq", 2.0 ** torch.arange(n), persistent=False)

    def forward(self, x):
        y = (x[..., None] * self.freq).flatten(-2)
        return torch.cat([x, y.sin(), y.cos()], -1)


class SemanticNeRF(nn.Module):
    def __init__(self, n_classes, W=256):
        super().__init__()
        self.pe, self.pe_d = PosEnc(10), PosEnc(4)
        self.trunk = nn.ModuleList([nn.Linear(63, W)] + [nn.Linear(W + (63 if i == 4 else 0), W) for i in range(1, 8)])
        self.sigma = nn.Linear(W, 1)
        self.sem = nn.Sequential(nn.Linear(W, W // 2), nn.ReLU(), nn.Linear(W // 2, n_classes))
        self.feat = nn.Linear(W, W)
        self.rgb = nn.Sequential(nn.Linear(W + 27, W // 2), nn.ReLU(), nn.Linear(W // 2, 3), nn.Sigmoid())

    def forward(self, x, d):
        e = self.pe(x)
        h = e
        for i, l in enumerate(self.trunk):
            if i == 4:
                h = torch.cat([h, e], -1)
            h = F.relu(l(h))
        dd = self.pe_d(d)[:, None].expand(-1, x.shape[1], -1)
        return self.rgb(torch.cat([self.feat(h), dd], -1)), F.relu(self.sigma(h)[..., 0]), self.sem(h)


class CoarseFine(nn.Module):
    def __init__(self, n_classes, n_c, n_f, near, far):
        super().__init__()
        self.coarse, self.fine = SemanticNeRF(n_classes), SemanticNeRF(n_classes)
        self.n_c, self.n_f, self.near, self.far = n_c, n_f, near, far

    @staticmethod
    def integrate(rgb, sigma, sem, z, rd):
        delta = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e10)], -1) * rd.norm(dim=-1, keepdim=True)
        a = 1 - torch.exp(-sigma * delta)
        w = a * torch.cumprod(torch.cat([torch.ones_like(a[:, :1]), 1 - a + 1e-10], -1), -1)[:, :-1]
        return (w[..., None] * rgb).sum(1), (w[..., None] * sem).sum(1), w

    def forward(self, ro, rd, perturb=True):
        u = torch.linspace(0, 1, self.n_c, device=ro.device)
        z = (self.near + (self.far - self.near) * u).expand(ro.shape[0], -1)
        if perturb:
            z = z + (torch.rand_like(z) - 0.5) * (self.far - self.near) / self.n_c
        vd = F.normalize(rd, dim=-1)
        rgb_c, sem_c, w = self.integrate(*self.coarse(ro[:, None] + rd[:, None] * z[..., None], vd), z, rd)
        with torch.no_grad():
            mid = 0.5 * (z[:, 1:] + z[:, :-1])
            pdf = w[:, 1:-1] + 1e-5
            cdf = F.pad(torch.cumsum(pdf / pdf.sum(-1, keepdim=True), -1), (1, 0))
            uu = torch.rand(ro.shape[0], self.n_f, device=ro.device)
            i = torch.searchsorted(cdf, uu, right=True).clamp(1, cdf.shape[1] - 1)
            c0, c1, b0, b1 = cdf.gather(1, i - 1), cdf.gather(1, i), mid.gather(1, i - 1), mid.gather(1, i)
            zf = torch.sort(torch.cat([z, b0 + (uu - c0) / (c1 - c0).clamp_min(1e-5) * (b1 - b0)], -1), -1).values
        rgb_f, sem_f, _ = self.integrate(*self.fine(ro[:, None] + rd[:, None] * zf[..., None], vd), zf, rd)
        return rgb_c, sem_c, rgb_f, sem_f


def camera_rays(c2w, xs, ys, H, W, focal):
    d = torch.stack([(xs - W / 2) / focal, -(ys - H / 2) / focal, -torch.ones_like(xs)], -1)
    return c2w[..., :3, 3].expand(*d.shape), (c2w[..., :3, :3] @ d[..., None]).squeeze(-1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    gen = torch.Generator(device=device).manual_seed(2021 + rank)

    rgbs, labels, poses, classes = load_replica(args.seq, args.H, args.W)
    H, W = args.H, args.W
    focal = W / 2.0 / np.tan(np.deg2rad(args.hfov / 2))
    train_ids = np.arange(0, len(rgbs), args.train_skip)
    test_ids = np.arange(args.train_skip // 2, len(rgbs), args.train_skip)
    tr_rgb, tr_lab, tr_pose = rgbs[train_ids].to(device), labels[train_ids].to(device), poses[train_ids].to(device)

    net = CoarseFine(len(classes), args.n_coarse, args.n_fine, args.near, args.far).to(device)
    optim = torch.optim.Adam(net.parameters(), lr=args.lr)
    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    start = 0
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        start = ckpt["iter"]
    model = DDP(net, device_ids=[local_rank])

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))
        np.save(os.path.join(args.out, "class_ids.npy"), classes)

    n = args.rays // world
    t0 = time.time()
    for it in range(start + 1, args.iters + 1):
        i = torch.randint(0, len(train_ids), (n,), device=device, generator=gen)
        x = torch.randint(0, W, (n,), device=device, generator=gen)
        y = torch.randint(0, H, (n,), device=device, generator=gen)
        ro, rd = camera_rays(tr_pose[i], x.float() + 0.5, y.float() + 0.5, H, W, focal)
        rgb_c, sem_c, rgb_f, sem_f = model(ro, rd)
        gt_rgb, gt_lab = tr_rgb[i, y, x], tr_lab[i, y, x]
        l_rgb = F.mse_loss(rgb_c, gt_rgb) + F.mse_loss(rgb_f, gt_rgb)
        l_sem = F.cross_entropy(sem_c, gt_lab) + F.cross_entropy(sem_f, gt_lab)
        loss = l_rgb + args.sem_weight * l_sem
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        for g in optim.param_groups:
            g["lr"] = args.lr * 0.1 ** (it / 250000)

        if it % 500 == 0:
            st = torch.stack([l_rgb.detach(), l_sem.detach()])
            dist.all_reduce(st, op=dist.ReduceOp.AVG)
            if writer:
                writer.add_scalar("train/rgb", st[0].item(), it)
                writer.add_scalar("train/sem", st[1].item(), it)
                print(f"it {it} rgb {st[0].item():.4f} sem {st[1].item():.4f} {time.time() - t0:.0f}s", flush=True)

        if it % args.save_every == 0 and rank == 0:
            torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "iter": it}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)

        if it % args.test_every == 0:
            # held-out frames split over ranks; per-class intersection/union summed for mIoU
            inter = torch.zeros(len(classes), device=device)
            union = torch.zeros(len(classes), device=device)
            psnr = torch.zeros(2, device=device)
            yy, xx = torch.meshgrid(torch.arange(H, device=device).float() + 0.5,
                                    torch.arange(W, device=device).float() + 0.5, indexing="ij")
            net.eval()
            with torch.no_grad():
                for k in test_ids[rank::world]:
                    ro, rd = camera_rays(poses[k].to(device).expand(H * W, 4, 4), xx.reshape(-1), yy.reshape(-1), H, W, focal)
                    outs = [net(ro[s:s + 4096], rd[s:s + 4096], perturb=False) for s in range(0, H * W, 4096)]
                    pred_rgb = torch.cat([o[2] for o in outs])
                    pred_lab = torch.cat([o[3] for o in outs]).argmax(-1)
                    gt = labels[k].to(device).view(-1)
                    psnr += torch.stack([-10 * torch.log10(F.mse_loss(pred_rgb, rgbs[k].to(device).view(-1, 3))),
                                         torch.ones((), device=device)])
                    inter += torch.bincount(gt[pred_lab == gt], minlength=len(classes)).float()
                    union += (torch.bincount(gt, minlength=len(classes)) +
                              torch.bincount(pred_lab, minlength=len(classes))).float()
            net.train()
            for t in (inter, union, psnr):
                dist.all_reduce(t)
            union = union - inter
            miou = (inter[union > 0] / union[union > 0]).mean().item()
            if writer:
                writer.add_scalar("test/psnr", (psnr[0] / psnr[1]).item(), it)
                writer.add_scalar("test/mIoU", miou, it)
                print(f"[test it {it}] PSNR {(psnr[0] / psnr[1]).item():.2f} mIoU {miou:.4f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
