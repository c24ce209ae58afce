"""pixelNeRF-style image-conditioned NeRF on ShapeNet-SRN, multi-GPU.

A ResNet-34 encoder (ImageNet init, trained end to end) produces a feature
volume for each source view; query points are projected into the source view
and the sampled features condition the NeRF MLP.

Launch:  torchrun --standalone --nproc_per_node=8 03_pixelnerf_srn.py --cfg configs/srn_cars.yaml
"""
import argparse
import glob
import os

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class SRNObjects(Dataset):
    """One item = one object: all of its views, intrinsics and poses."""

    def __init__(self, root, split):
        self.objs = sorted(glob.glob(os.path.join(root, f"cars_{split}", "*")))

    def __len__(self):
        return len(self.objs)

    def __getitem__(self, i):
        d = self.objs[i]
        rgbs = sorted(glob.glob(os.path.join(d, "rgb", "*.png")))
        poses = sorted(glob.glob(os.path.join(d, "pose", "*.txt")))
        with open(os.path.join(d, "intrinsics.txt")) as f:
            focal = float(f.readline().split()[0])
        imgs = np.stack([imageio.imread(p)[..., :3] for p in rgbs]).astype(np.float32) / 255.0
        c2w = np.stack([np.loadtxt(p, dtype=np.float32).reshape(4, 4) for p in poses])
        c2w = c2w @ np.diag([1, -1, -1, 1]).astype(np.float32)  # OpenCV -> OpenGL
        return torch.from_numpy(imgs).permute(0, 3, 1, 2), torch.from_numpy(c2w), torch.tensor(focal)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet34(weights="IMAGENET1K_V1")
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu)
        self.pool = r.maxpool
        self.layers = nn.ModuleList([r.layer1, r.layer2, r.layer3])
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, x):
        x = (x - self.mean) / self.std
        x = self.stem(x)
        feats = [x]
        x = self.pool(x)
        for layer in self.layers:
            x = layer(x)
            feats.append(x)
        size = feats[0].shape[-2:]
        feats = [F.interpolate(f, size, mode="bilinear", align_corners=True) for f in feats]
        return torch.cat(feats, 1)  # 64 + 64 + 128 + 256 = 512


class PixelNeRF(nn.Module):
    def __init__(self, d_feat=512, hidden=512):
        super().__init__()
        self.encoder = Encoder()
        self.n_freq = 6
        d_in = 3 + 6 * self.n_freq + 3
        self.lin_in = nn.Linear(d_in, hidden)
        self.feat_proj = nn.ModuleList([nn.Linear(d_feat, hidden) for _ in range(3)])
        self.blocks = nn.ModuleList([nn.Sequential(nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                                   nn.Linear(hidden, hidden)) for _ in range(5)])
        self.out = nn.Linear(hidden, 4)

    def pe(self, x):
        f = 2.0 ** torch.arange(self.n_freq, device=x.device) * np.pi
        xf = (x[..., None] * f).flatten(-2)
        return torch.cat([x, torch.sin(xf), torch.cos(xf)], -1)

    def forward(self, src_img, src_c2w, focal, pts, dirs):
        # src_img [B,3,H,W], pts [B,R,S,3] in world space
        B, _, H, W = src_img.shape
        feat = self.encoder(src_img)
        w2c = torch.inverse(src_c2w)
        p = (w2c[:, None, None, :3, :3] @ pts[..., None]).squeeze(-1) + w2c[:, None, None, :3, 3]
        d = (w2c[:, None, None, :3, :3] @ dirs[..., None]).squeeze(-1)
        uv = torch.stack([-p[..., 0] / p[..., 2], p[..., 1] / p[..., 2]], -1) * focal[:, None, None, None]
        uv = uv / torch.tensor([W / 2, H / 2], device=uv.device)  # to [-1, 1]
        f = F.grid_sample(feat, uv.flatten(1, 2)[:, :, None], align_corners=True, padding_mode="border")
        f = f.squeeze(-1).transpose(1, 2).reshape(B, *pts.shape[1:3], -1)
        h = self.lin_in(torch.cat([self.pe(p), d], -1))
        for i, blk in enumerate(self.blocks):
            if i < len(self.feat_proj):
                h = h + self.feat_proj[i](f)
            h = h + blk(h)
        out = self.out(F.relu(h))
        return torch.sigmoid(out[..., :3]), F.relu(out[..., 3])


def make_rays(c2w, focal, H, W, xs, ys):
    d = torch.stack([(xs - W / 2) / focal[:, None], -(ys - H / 2) / focal[:, None], -torch.ones_like(xs)], -1)
    d = (c2w[:, None, :3, :3] @ d[..., None]).squeeze(-1)
    return c2w[:, None, :3, 3].expand_as(d), d


def volume_render(model, src, src_c2w, focal, rays_o, rays_d, near=0.8, far=1.8, n=64, perturb=True):
    t = torch.linspace(near, far, n, device=rays_o.device).expand(*rays_o.shape[:2], n)
    if perturb:
        t = t + (far - near) / n * torch.rand_like(t)
    pts = rays_o[..., None, :] + rays_d[..., None, :] * t[..., None]
    rgb, sigma = model(src, src_c2w, focal, pts, rays_d[..., None, :].expand_as(pts))
    delta = torch.cat([t[..., 1:] - t[..., :-1], torch.full_like(t[..., :1], 1e10)], -1)
    alpha = 1 - torch.exp(-sigma * delta)
    T = torch.cumprod(torch.cat([torch.ones_like(alpha[..., :1]), 1 - alpha + 1e-10], -1), -1)[..., :-1]
    w = alpha * T
    return (w[..., None] * rgb).sum(-2) + (1 - w.sum(-1, keepdim=True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--out", default="out/pixelnerf_cars")
    args = ap.parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = SRNObjects(cfg["data_root"], "train")
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=cfg["objects_per_batch"] // world, sampler=sampler,
                        num_workers=8, pin_memory=True, persistent_workers=True)

    model = PixelNeRF().to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    writer = SummaryWriter(args.out) if rank == 0 else None

    step = 0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for imgs, c2w, focal in loader:
            imgs, c2w, focal = imgs.to(device, non_blocking=True), c2w.to(device), focal.to(device)
            B, V, _, H, W = imgs.shape
            src_i = torch.randint(0, V, (B,), device=device)
            tgt_i = torch.randint(0, V, (B,), device=device)
            ar = torch.arange(B, device=device)
            src, src_pose = imgs[ar, src_i], c2w[ar, src_i]
            tgt, tgt_pose = imgs[ar, tgt_i], c2w[ar, tgt_i]
            R = cfg["rays_per_object"]
            xs = torch.randint(0, W, (B, R), device=device)
            ys = torch.randint(0, H, (B, R), device=device)
            rays_o, rays_d = make_rays(tgt_pose, focal, H, W, xs.float(), ys.float())
            gt = tgt[ar[:, None], :, ys, xs]

            pred = volume_render(model, src, src_pose, focal, rays_o, rays_d)
            loss = F.mse_loss(pred, gt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("train/loss", l.item(), step)
                    writer.add_scalar("train/psnr", -10 * torch.log10(l).item(), step)
            step += 1

        if rank == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.out, "last.pt"))
            print(f"epoch {epoch} done, step {step}", flush=True)
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
