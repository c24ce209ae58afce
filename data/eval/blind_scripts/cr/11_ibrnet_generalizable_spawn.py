"""Generalisable image-based rendering (IBRNet-like) trained across many scenes.

Mixed training set: scenes with sensor depth (ScanNet-style) and scenes without it
(RealEstate10K-style). The depth head only gets a loss on batches that carry depth.

Single node, one process per GPU started with torch.multiprocessing:

    python train_ibr.py --data_root /data/ibr_mix --out /shared/ibr/run3 --gpus 8
"""
import argparse
import glob
import json
import os
import random
from collections import OrderedDict

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--num_src", type=int, default=8)
    ap.add_argument("--rays", type=int, default=512)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--depth_w", type=float, default=0.1)
    ap.add_argument("--resume", default="")
    return ap.parse_args()


class MultiSceneDataset(Dataset):
    """One item = one target view of one scene plus its nearest source views."""

    def __init__(self, root, split, num_src, rays):
        self.items = []
        for scene in sorted(glob.glob(os.path.join(root, split, "*"))):
            meta = json.load(open(os.path.join(scene, "cameras.json")))
            for t in range(len(meta["frames"])):
                self.items.append((scene, t))
        self.num_src, self.rays = num_src, rays
        self._meta = {}

    def __len__(self):
        return len(self.items)

    def meta(self, scene):
        if scene not in self._meta:
            self._meta[scene] = json.load(open(os.path.join(scene, "cameras.json")))
        return self._meta[scene]

    def __getitem__(self, idx):
        scene, t = self.items[idx]
        m = self.meta(scene)
        frames = m["frames"]
        c2w = np.array([f["c2w"] for f in frames], dtype=np.float32)
        dist_ = np.linalg.norm(c2w[:, :3, 3] - c2w[t, :3, 3], axis=-1)
        dist_[t] = np.inf
        src = np.argsort(dist_)[: self.num_src]
        load = lambda i: np.asarray(Image.open(os.path.join(scene, frames[i]["file"])), np.float32)[..., :3] / 255.0
        tgt = load(t)
        H, W = tgt.shape[:2]
        pix = np.random.randint(0, H * W, self.rays)
        out = {
            "tgt_rgb": torch.from_numpy(tgt.reshape(-1, 3)[pix]),
            "pix": torch.from_numpy(np.stack([pix % W, pix // W], -1).astype(np.float32)),
            "tgt_c2w": torch.from_numpy(c2w[t]),
            "src_rgb": torch.from_numpy(np.stack([load(i) for i in src])).permute(0, 3, 1, 2),
            "src_c2w": torch.from_numpy(c2w[src]),
            "K": torch.tensor(m["K"], dtype=torch.float32),
            "near_far": torch.tensor(m["near_far"], dtype=torch.float32),
            "has_depth": torch.tensor("depth" in frames[t]),
            "tgt_depth": torch.zeros(self.rays),
        }
        if "depth" in frames[t]:
            d = np.load(os.path.join(scene, frames[t]["depth"])).astype(np.float32)
            out["tgt_depth"] = torch.from_numpy(d.reshape(-1)[pix])
        return out


class FeatureNet(nn.Module):
    def __init__(self, c=32):
        super().__init__()
        def blk(i, o, s):
            return nn.Sequential(nn.Conv2d(i, o, 3, s, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True))
        self.net = nn.Sequential(blk(3, c, 2), blk(c, c, 1), blk(c, 2 * c, 2), blk(2 * c, 2 * c, 1),
                                 nn.Upsample(scale_factor=2, mode="bilinear"), blk(2 * c, c, 1))

    def forward(self, x):
        return self.net(x)


class IBRModel(nn.Module):
    def __init__(self, feat=32):
        super().__init__()
        self.features = FeatureNet(feat)
        d = feat + 3
        self.base = nn.Sequential(nn.Linear(2 * d + 4, 64), nn.ELU(), nn.Linear(64, 32), nn.ELU())
        self.vis = nn.Sequential(nn.Linear(32, 32), nn.ELU(), nn.Linear(32, 1), nn.Sigmoid())
        self.sigma = nn.Sequential(nn.Linear(64, 32), nn.ELU(), nn.Linear(32, 1), nn.ReLU())
        self.blend = nn.Sequential(nn.Linear(32 + 4, 16), nn.ELU(), nn.Linear(16, 1))
        self.depth_head = nn.Sequential(nn.Linear(2, 16), nn.ELU(), nn.Linear(16, 1))

    def forward(self, b, n_samples, perturb=True):
        B, V, _, H, W = b["src_rgb"].shape
        feats = self.features(b["src_rgb"].flatten(0, 1))
        feats = F.interpolate(feats, size=(H, W), mode="bilinear", align_corners=False)
        feats = torch.cat([feats, b["src_rgb"].flatten(0, 1)], 1).view(B, V, -1, H, W)
        K = b["K"]
        d = torch.stack([(b["pix"][..., 0] + 0.5 - K[:, None, 0, 2]) / K[:, None, 0, 0],
                         (b["pix"][..., 1] + 0.5 - K[:, None, 1, 2]) / K[:, None, 1, 1],
                         torch.ones_like(b["pix"][..., 0])], -1)
        rd = (b["tgt_c2w"][:, None, :3, :3] @ d[..., None]).squeeze(-1)
        ro = b["tgt_c2w"][:, None, :3, 3].expand_as(rd)
        near, far = b["near_far"][:, 0, None, None], b["near_far"][:, 1, None, None]
        u = torch.linspace(0, 1, n_samples, device=rd.device)
        z = (near + (far - near) * u).expand(B, rd.shape[1], n_samples)
        if perturb:
            z = z + torch.rand_like(z) * (far - near) / n_samples
        pts = ro[:, :, None] + rd[:, :, None] * z[..., None]                         # B,R,S,3
        w2c = torch.inverse(b["src_c2w"])                                             # B,V,4,4
        p = (w2c[:, :, None, None, :3, :3] @ pts[:, None, ..., None]).squeeze(-1) + w2c[:, :, None, None, :3, 3]
        uv = (K[:, None, None, None, :2, :2] @ (p[..., :2] / p[..., 2:].clamp_min(1e-3))[..., None]).squeeze(-1)
        uv = uv + K[:, None, None, None, :2, 2]
        grid = torch.stack([uv[..., 0] / W * 2 - 1, uv[..., 1] / H * 2 - 1], -1)    # B,V,R,S,2
        R_, S_ = grid.shape[2:4]
        f = F.grid_sample(feats.flatten(0, 1), grid.flatten(0, 1), align_corners=False)
        f = f.view(B, V, -1, R_, S_).permute(0, 3, 4, 1, 2)                          # B,R,S,V,C
        valid = ((grid.abs() <= 1).all(-1) & (p[..., 2] > 0)).permute(0, 2, 3, 1).float()[..., None]
        src_dirs = F.normalize(pts[:, None] - b["src_c2w"][:, :, None, None, :3, 3], dim=-1).permute(0, 2, 3, 1, 4)
        tgt_dirs = rd[:, :, None, None].expand_as(src_dirs)
        ddir = torch.cat([src_dirs - F.normalize(tgt_dirs, dim=-1), (src_dirs * F.normalize(tgt_dirs, dim=-1)).sum(-1, keepdim=True)], -1)
        wsum = valid.sum(3, keepdim=True).clamp_min(1)
        mean = (f * valid).sum(3, keepdim=True) / wsum
        var = ((f - mean) ** 2 * valid).sum(3, keepdim=True) / wsum
        h = self.base(torch.cat([mean.expand_as(f), var.expand_as(f), ddir], -1))   # B,R,S,V,32
        vis = self.vis(h) * valid
        hw = (h * vis).sum(3) / vis.sum(3).clamp_min(1e-6)
        hv = torch.cat([hw, ((h - hw[..., None, :]) ** 2 * vis).sum(3) / vis.sum(3).clamp_min(1e-6)], -1)
        sigma = self.sigma(hv)[..., 0]
        logits = self.blend(torch.cat([h, ddir], -1)).masked_fill(valid == 0, -1e9)
        rgb = (torch.softmax(logits, 3) * f[..., -3:]).sum(3)                         # B,R,S,3
        delta = torch.cat([z[..., 1:] - z[..., :-1], torch.full_like(z[..., :1], 1e10)], -1)
        a = 1 - torch.exp(-sigma * delta)
        wts = a * torch.cumprod(torch.cat([torch.ones_like(a[..., :1]), 1 - a + 1e-10], -1), -1)[..., :-1]
        out = {"rgb": (wts[..., None] * rgb).sum(2)}
        if bool(b["has_depth"].any()):
            exp_d = (wts * z).sum(-1)
            acc = wts.sum(-1)
            out["depth"] = exp_d + self.depth_head(torch.stack([exp_d, acc], -1))[..., 0]
        return out


def seed_worker(worker_id):
    np.random.seed((torch.initial_seed() + worker_id) % 2 ** 32)


def strip_module_prefix(sd):
    return OrderedDict((k[len("module."):] if k.startswith("module.") else k, v) for k, v in sd.items())


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(7)
    random.seed(7 + rank)
    np.random.seed(7 + rank)

    train_set = MultiSceneDataset(args.data_root, "train", args.num_src, args.rays)
    val_set = MultiSceneDataset(args.data_root, "val", args.num_src, 4096)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=1, sampler=train_sampler, num_workers=4,
                              pin_memory=True, persistent_workers=True, worker_init_fn=seed_worker)
    # validation: plain round-robin split (no padded duplicates), sums reduced below
    val_shard = Subset(val_set, list(range(rank, len(val_set), world_size)))
    val_loader = DataLoader(val_shard, batch_size=1, shuffle=False, num_workers=2, worker_init_fn=seed_worker)

    model = IBRModel().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # depth_head gets no gradient on batches without depth
    model = DDP(model, device_ids=[rank], find_unused_parameters=True)
    optim = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=10, gamma=0.5)
    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(strip_module_prefix(ck["model"]))
        optim.load_state_dict(ck["optim"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for it, b in enumerate(train_loader):
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            out = model(b, args.samples)
            loss = F.mse_loss(out["rgb"], b["tgt_rgb"])
            if "depth" in out:
                m = b["has_depth"][:, None].float()
                loss = loss + args.depth_w * ((out["depth"] - b["tgt_depth"]).abs() * m).mean()
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            tot += torch.stack([F.mse_loss(out["rgb"].detach(), b["tgt_rgb"]), torch.ones((), device=device)])
            if rank == 0 and it % 200 == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f}", flush=True)
        sched.step()

        model.eval()
        val = torch.zeros(2, device=device)
        with torch.no_grad():
            for b in val_loader:
                b = {k: v.to(device) for k, v in b.items()}
                out = model.module(b, args.samples, perturb=False)
                val += torch.stack([-10 * torch.log10(F.mse_loss(out["rgb"], b["tgt_rgb"])),
                                    torch.ones((), device=device)])
        dist.all_reduce(tot)
        dist.all_reduce(val)
        if rank == 0:
            print(f"epoch {epoch}: train psnr {-10 * torch.log10(tot[0] / tot[1]).item():.2f} "
                  f"val psnr {(val[0] / val[1]).item():.2f} ({int(val[1].item())} views)", flush=True)
            torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, os.path.join(args.out, "latest.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse()
    world_size = args.gpus
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)
