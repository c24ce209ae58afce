"""NeuS (SDF-based volume rendering) on DTU, distributed over shuffled ray batches.

    torchrun --nproc_per_node=4 neus_ddp.py --case dtu_scan24 --data_dir public_data --exp_dir exp
"""
import argparse
import logging
import math
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
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--data_dir", default="public_data")
    ap.add_argument("--exp_dir", default="exp")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch_size", type=int, default=512, help="rays per GPU")
    ap.add_argument("--n_samples", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup_epochs", type=int, default=1)
    ap.add_argument("--igr_weight", type=float, default=0.1)
    ap.add_argument("--mask_weight", type=float, default=0.1)
    ap.add_argument("--mesh_res", type=int, default=512)
    return ap.parse_args()


def load_K_Rt_from_P(P):
    K, R, t = cv2.decomposeProjectionMatrix(P)[:3]
    K = K / K[2, 2]
    pose = np.eye(4, dtype=np.float32)
    pose[:3, :3] = R.transpose()
    pose[:3, 3] = (t[:3] / t[3])[:, 0]
    return K.astype(np.float32), pose


def build_rays(case_dir, downscale=2):
    cams = np.load(os.path.join(case_dir, "cameras_sphere.npz"))
    img_files = sorted(os.listdir(os.path.join(case_dir, "image")))
    all_rays = []
    for i, name in enumerate(img_files):
        img = cv2.imread(os.path.join(case_dir, "image", name))[..., ::-1].astype(np.float32) / 255.0
        mask = cv2.imread(os.path.join(case_dir, "mask", name))[..., :1].astype(np.float32) / 255.0
        img = cv2.resize(img, None, fx=1 / downscale, fy=1 / downscale, interpolation=cv2.INTER_AREA)
        mask = cv2.resize(mask, None, fx=1 / downscale, fy=1 / downscale, interpolation=cv2.INTER_NEAREST)[..., None]
        K, pose = load_K_Rt_from_P((cams[f"world_mat_{i}"] @ cams[f"scale_mat_{i}"])[:3, :4])
        K[:2] /= downscale
        H, W = img.shape[:2]
        xs, ys = np.meshgrid(np.arange(W, dtype=np.float32), np.arange(H, dtype=np.float32), indexing="xy")
        d = np.stack([(xs - K[0, 2]) / K[0, 0], (ys - K[1, 2]) / K[1, 1], np.ones_like(xs)], -1) @ pose[:3, :3].T
        d = d / np.linalg.norm(d, axis=-1, keepdims=True)
        o = np.broadcast_to(pose[:3, 3], d.shape)
        all_rays.append(np.concatenate([o, d, img, mask], -1).reshape(-1, 10))
    return torch.from_numpy(np.concatenate(all_rays).astype(np.float32))


class Embedder(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n
        self.out_dim = 3 + 6 * n

    def forward(self, x):
        return torch.cat([x] + [f(x * 2 ** k) for k in range(self.n) for f in (torch.sin, torch.cos)], -1)


class SDFNet(nn.Module):
    def __init__(self, d_hidden=256, n_layers=8, skip=4, bias=0.5):
        super().__init__()
        self.embed = Embedder(6)
        self.skip = skip
        dims = [self.embed.out_dim] + [d_hidden] * n_layers + [1 + d_hidden]
        self.lins = nn.ModuleList()
        for l in range(len(dims) - 1):
            out = dims[l + 1] - (self.embed.out_dim if l + 1 == skip else 0)
            lin = nn.Linear(dims[l], out)
            # geometric initialisation (sphere of radius `bias`)
            if l == len(dims) - 2:
                nn.init.normal_(lin.weight, mean=math.sqrt(math.pi) / math.sqrt(dims[l]), std=1e-4)
                nn.init.constant_(lin.bias, -bias)
            elif l == 0:
                nn.init.constant_(lin.bias, 0.0)
                nn.init.constant_(lin.weight[:, 3:], 0.0)
                nn.init.normal_(lin.weight[:, :3], 0.0, math.sqrt(2) / math.sqrt(out))
            else:
                nn.init.constant_(lin.bias, 0.0)
                nn.init.normal_(lin.weight, 0.0, math.sqrt(2) / math.sqrt(out))
            self.lins.append(nn.utils.weight_norm(lin))
        self.act = nn.Softplus(beta=100)

    def forward(self, x):
        e = self.embed(x)
        h = e
        for l, lin in enumerate(self.lins):
            if l == self.skip:
                h = torch.cat([h, e], -1) / math.sqrt(2)
            h = lin(h)
            if l < len(self.lins) - 1:
                h = self.act(h)
        return h[..., :1], h[..., 1:]


class NeuS(nn.Module):
    def __init__(self):
        super().__init__()
        self.sdf = SDFNet()
        self.variance = nn.Parameter(torch.tensor(0.3))
        self.embed_dir = Embedder(4)
        self.color = nn.Sequential(nn.Linear(3 + 27 + 3 + 256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                   nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 3), nn.Sigmoid())

    def forward(self, ro, rd, n_samples, cos_anneal=1.0, perturb=True):
        b = (ro * rd).sum(-1, keepdim=True)
        mid = -b
        near, far = mid - 1.0, mid + 1.0
        z = near + (far - near) * torch.linspace(0, 1, n_samples, device=ro.device)
        if perturb:
            z = z + (torch.rand_like(z[:, :1]) - 0.5) * (far - near) / n_samples
        dists = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 2.0 / n_samples)], -1)
        mid_z = z + dists / 2
        pts = (ro[:, None] + rd[:, None] * mid_z[..., None]).reshape(-1, 3)
        dirs = rd[:, None].expand(-1, n_samples, -1).reshape(-1, 3)
        with torch.enable_grad():
            pts.requires_grad_(True)
            sdf, feat = self.sdf(pts)
            grad = torch.autograd.grad(sdf, pts, torch.ones_like(sdf), create_graph=True)[0]
        rgb = self.color(torch.cat([pts, self.embed_dir(dirs), grad, feat], -1)).view(-1, n_samples, 3)
        inv_s = torch.exp(self.variance * 10.0).clamp(1e-6, 1e6)
        true_cos = (dirs * grad).sum(-1, keepdim=True)
        iter_cos = -(F.relu(-true_cos * 0.5 + 0.5) * (1 - cos_anneal) + F.relu(-true_cos) * cos_anneal)
        d = dists.reshape(-1, 1)
        prev_cdf = torch.sigmoid((sdf - iter_cos * d * 0.5) * inv_s)
        next_cdf = torch.sigmoid((sdf + iter_cos * d * 0.5) * inv_s)
        alpha = ((prev_cdf - next_cdf + 1e-5) / (prev_cdf + 1e-5)).clamp(0, 1).view(-1, n_samples)
        w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-7], -1), -1)[:, :-1]
        color = (w[..., None] * rgb).sum(1)
        eik = ((grad.norm(dim=-1) - 1) ** 2).mean()
        return color, w.sum(-1, keepdim=True), eik


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s %(message)s")
    torch.manual_seed(0)

    case_dir = os.path.join(args.data_dir, args.case)
    rays = build_rays(case_dir)
    ds = TensorDataset(rays)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    model = DDP(NeuS().to(device), device_ids=[local_rank])
    # batch_size is per GPU: scale the base lr with the number of GPUs, after a warmup
    base_lr = args.lr * math.sqrt(world)
    opt = torch.optim.Adam(model.parameters(), lr=base_lr)
    total = args.epochs * len(loader)
    warm = args.warmup_epochs * len(loader)

    def lr_at(step):
        if step < warm:
            return base_lr * step / warm
        prog = (step - warm) / max(1, total - warm)
        return base_lr * ((math.cos(math.pi * prog) + 1) * 0.5 * 0.95 + 0.05)

    out_dir = os.path.join(args.exp_dir, args.case)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        agg = torch.zeros(3, device=device)
        for (batch,) in loader:
            batch = batch.to(device, non_blocking=True)
            ro, rd, rgb, mask = batch[:, :3], batch[:, 3:6], batch[:, 6:9], batch[:, 9:10]
            cos_anneal = min(1.0, step / (5 * len(loader)))
            color, acc, eik = model(ro, rd, args.n_samples, cos_anneal)
            color_loss = (F.l1_loss(color, rgb, reduction="none") * mask).sum() / mask.sum().clamp_min(1e-5)
            mask_loss = F.binary_cross_entropy(acc.clamp(1e-3, 1 - 1e-3), mask)
            loss = color_loss + args.igr_weight * eik + args.mask_weight * mask_loss
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            agg += torch.stack([color_loss.detach(), eik.detach(), torch.ones((), device=device)])
        dist.all_reduce(agg)
        s_val = torch.exp(model.module.variance * 10).item()
        logging.info("epoch %d  color %.4f  eikonal %.4f  s=%.1f  lr=%.2e", epoch,
                     (agg[0] / agg[2]).item(), (agg[1] / agg[2]).item(), s_val, lr_at(step))

        if rank == 0 and ((epoch + 1) % 10 == 0 or epoch == args.epochs - 1):
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(out_dir, f"ckpt_{epoch:03d}.pth"))
            sdf_net = model.module.sdf
            R = args.mesh_res
            lin = torch.linspace(-1.0, 1.0, R)
            vol = np.zeros((R, R, R), np.float32)
            with torch.no_grad():
                for i in range(R):
                    yy, zz = torch.meshgrid(lin, lin, indexing="ij")
                    p = torch.stack([torch.full_like(yy, float(lin[i])), yy, zz], -1).view(-1, 3).to(device)
                    vol[i] = sdf_net(p)[0].view(R, R).cpu().numpy()
            v, f = mcubes.marching_cubes(-vol, 0.0)
            v = v / (R - 1) * 2 - 1
            trimesh.Trimesh(v, f).export(os.path.join(out_dir, f"mesh_{epoch:03d}.ply"))
            logging.info("saved mesh with %d vertices", v.shape[0])
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
