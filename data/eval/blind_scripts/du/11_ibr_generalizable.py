"""Generalizable image-based NeRF (IBRNet-like) trained on many LLFF-style scenes.

For each target view we take the K nearest source views; 2D features of the
source views are sampled at the projections of the ray samples and aggregated.
The source-view neighbour table is computed once and cached in the data root.

    torchrun --nproc_per_node=8 11_ibr_generalizable.py --root /data/ibr_scenes --out runs/ibr
"""
import argparse
import json
import math
import os
import random

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def read_scene(path):
    pb = np.load(os.path.join(path, "poses_bounds.npy"))
    poses = pb[:, :15].reshape(-1, 3, 5)
    c2w = np.concatenate([poses[:, :, 1:2], -poses[:, :, 0:1], poses[:, :, 2:4]], 2)
    hwf = poses[0, :, 4]
    files = sorted(os.listdir(os.path.join(path, "images_4")))
    return c2w.astype(np.float32), pb[:, 15:].astype(np.float32), hwf / np.array([4, 4, 4]), files


def build_neighbour_table(root, scenes, k):
    table = {}
    for s in scenes:
        c2w, _, _, _ = read_scene(os.path.join(root, s))
        centers, fwd = c2w[:, :, 3], -c2w[:, :, 2]
        dist_m = np.linalg.norm(centers[:, None] - centers[None], axis=-1) + (1 - fwd @ fwd.T)
        np.fill_diagonal(dist_m, np.inf)
        table[s] = np.argsort(dist_m, axis=1)[:, :k].tolist()
    return table


class IBRViews(Dataset):
    def __init__(self, root, scenes, table, rays, n_src, train=True):
        self.root, self.table, self.rays, self.n_src, self.train = root, table, rays, n_src, train
        self.items = []
        self.meta = {}
        for s in scenes:
            c2w, bds, hwf, files = read_scene(os.path.join(root, s))
            self.meta[s] = (c2w, bds, hwf, files)
            self.items += [(s, i) for i in range(len(files))]

    def __len__(self):
        return len(self.items)

    def _img(self, s, i):
        f = os.path.join(self.root, s, "images_4", self.meta[s][3][i])
        return torch.from_numpy(imageio.imread(f)[..., :3].astype(np.float32) / 255.0)

    def __getitem__(self, k):
        s, t = self.items[k]
        c2w, bds, hwf, _ = self.meta[s]
        nbrs = self.table[s][t]
        src = random.sample(nbrs, self.n_src) if self.train else nbrs[: self.n_src]
        tgt = self._img(s, t)
        H, W = tgt.shape[:2]
        if self.train:
            pix = torch.randint(0, H * W, (self.rays,))
        else:
            pix = torch.arange(H * W)
        y, x = (pix // W).float(), (pix % W).float()
        focal = float(hwf[2])
        d = torch.stack([(x + 0.5 - W / 2) / focal, -(y + 0.5 - H / 2) / focal, -torch.ones_like(x)], -1)
        R = torch.from_numpy(c2w[t, :3, :3])
        return {
            "rays_o": torch.from_numpy(c2w[t, :3, 3]).expand(len(pix), 3),
            "rays_d": d @ R.T,
            "rgb": tgt.reshape(-1, 3)[pix],
            "src_imgs": torch.stack([self._img(s, j) for j in src]).permute(0, 3, 1, 2),
            "src_c2w": torch.from_numpy(c2w[src]),
            "focal": torch.tensor(focal),
            "near_far": torch.tensor([bds[:, 0].min() * 0.9, bds[:, 1].max() * 1.1]),
            "hw": torch.tensor([H, W]),
        }


class FeatureNet(nn.Module):
    def __init__(self, c=32):
        super().__init__()

        def block(i, o, s):
            return nn.Sequential(nn.Conv2d(i, o, 3, s, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(True))

        self.net = nn.Sequential(block(3, c, 1), block(c, c, 1), block(c, 2 * c, 2), block(2 * c, 2 * c, 1),
                                 block(2 * c, 4 * c, 2), block(4 * c, 4 * c, 1))
        self.up = nn.Conv2d(4 * c, c, 1)

    def forward(self, x):
        f = self.up(self.net(x))
        return F.interpolate(f, size=x.shape[-2:], mode="bilinear", align_corners=False)


class IBRNet(nn.Module):
    def __init__(self, c=32, n_samples=64):
        super().__init__()
        self.n_samples = n_samples
        self.features = FeatureNet(c)
        self.agg = nn.Sequential(nn.Linear(2 * (c + 3), 128), nn.ELU(), nn.Linear(128, 64), nn.ELU())
        self.sigma = nn.Sequential(nn.Linear(64, 32), nn.ELU(), nn.Linear(32, 1))
        self.blend = nn.Sequential(nn.Linear(c + 3 + 64 + 4, 64), nn.ELU(), nn.Linear(64, 1))

    def forward(self, rays_o, rays_d, src_imgs, src_c2w, focal, near_far, perturb=True):
        # rays_o [R,3]; src_imgs [V,3,H,W]; src_c2w [V,3,4]
        V, _, H, W = src_imgs.shape
        feats = torch.cat([self.features(src_imgs), src_imgs], 1)  # [V, c+3, H, W]
        near, far = near_far[0], near_far[1]
        t = torch.linspace(0, 1, self.n_samples, device=rays_o.device)
        z = near + (far - near) * t.expand(rays_o.shape[0], -1)
        if perturb:
            z = z + (far - near) / self.n_samples * torch.rand_like(z)
        pts = rays_o[:, None] + rays_d[:, None] * z[..., None]  # [R,S,3]
        R_, T_ = src_c2w[:, :3, :3], src_c2w[:, :3, 3]
        cam = torch.einsum("vji,rsvj->rsvi", R_, pts[:, :, None] - T_)  # world -> camera
        uv = torch.stack([-cam[..., 0] / cam[..., 2] * focal / (W / 2), cam[..., 1] / cam[..., 2] * focal / (H / 2)], -1)
        valid = ((uv.abs() <= 1).all(-1) & (cam[..., 2] < 0)).float()  # [R,S,V]
        samp = F.grid_sample(feats, uv.permute(2, 0, 1, 3), align_corners=False)  # [V,C,R,S]
        samp = samp.permute(2, 3, 0, 1)  # [R,S,V,C]
        wsum = valid.sum(-1, keepdim=True).clamp_min(1)
        mean = (samp * valid[..., None]).sum(2) / wsum
        var = ((samp - mean[:, :, None]) ** 2 * valid[..., None]).sum(2) / wsum
        g = self.agg(torch.cat([mean, var], -1))
        sigma = F.relu(self.sigma(g).squeeze(-1))
        ray_dir_src = F.normalize(pts[:, :, None] - T_, dim=-1)
        cos = (ray_dir_src * F.normalize(rays_d, dim=-1)[:, None, None]).sum(-1, keepdim=True)
        bl_in = torch.cat([samp, g[:, :, None].expand(-1, -1, V, -1), ray_dir_src, cos], -1)
        logits = self.blend(bl_in).squeeze(-1).masked_fill(valid == 0, -1e4)
        rgb = (torch.softmax(logits, -1)[..., None] * samp[..., -3:]).sum(2)
        delta = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e10)], -1)
        alpha = 1 - torch.exp(-sigma * delta)
        w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
        return (w[..., None] * rgb).sum(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n_src", type=int, default=8)
    ap.add_argument("--rays", type=int, default=4096, help="rays per step, all GPUs together (one target view each)")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    with open(os.path.join(args.root, "splits.json")) as f:
        splits = json.load(f)
    table_path = os.path.join(args.root, f"neighbours_k{2 * args.n_src}.json")
    if rank == 0 and not os.path.exists(table_path):
        table = build_neighbour_table(args.root, splits["train"] + splits["val"], 2 * args.n_src)
        with open(table_path + ".tmp", "w") as f:
            json.dump(table, f)
        os.replace(table_path + ".tmp", table_path)
    dist.barrier()
    with open(table_path) as f:
        table = json.load(f)

    train_set = IBRViews(args.root, splits["train"], table, args.rays // world, args.n_src, train=True)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=1, sampler=sampler, num_workers=6, pin_memory=True)

    model = IBRNet()
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        state = {k[len("module."):] if k.startswith("module.") else k: v for k, v in ckpt["model"].items()}
        model.load_state_dict(state)
        start_epoch = ckpt["epoch"] + 1
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(dev)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.resume:
        optim.load_state_dict(ckpt["optim"])
    writer = SummaryWriter(args.out) if rank == 0 else None

    step = start_epoch * len(loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for b in loader:
            b = {k: v[0].to(dev, non_blocking=True) for k, v in b.items()}
            pred = model(b["rays_o"], b["rays_d"], b["src_imgs"], b["src_c2w"], b["focal"], b["near_far"])
            loss = F.mse_loss(pred, b["rgb"])
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            step += 1
            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("train/psnr", -10 * math.log10(l.item()), step)

        # validation on unseen scenes: whole images, views divided between ranks
        val_set = IBRViews(args.root, splits["val"], table, 0, args.n_src, train=False)
        net = model.module.eval()
        acc = torch.zeros(2, device=dev)
        with torch.no_grad():
            for k in range(rank, min(len(val_set), 32), world):
                b = {kk: v.to(dev) for kk, v in val_set[k].items()}
                pred = torch.cat([net(b["rays_o"][s:s + 2048], b["rays_d"][s:s + 2048], b["src_imgs"], b["src_c2w"],
                                      b["focal"], b["near_far"], perturb=False) for s in range(0, b["rgb"].shape[0], 2048)])
                acc[0] += -10 * torch.log10(F.mse_loss(pred, b["rgb"]))
                acc[1] += 1
        dist.all_reduce(acc)
        if rank == 0:
            writer.add_scalar("val/psnr", (acc[0] / acc[1]).item(), epoch)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optim": optim.state_dict()},
                       os.path.join(args.out, "latest.pt"))
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
