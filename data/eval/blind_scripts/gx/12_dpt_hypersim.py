"""DPT-Large metric depth on Hypersim (synthetic indoor), 8 GPUs.

    torchrun --nproc_per_node=8 12_dpt_hypersim.py --root /datasets/hypersim --csv splits/hypersim.csv \
        --backbone vit_large_patch16_384 --grad-checkpointing --bs 4
"""
import argparse
import csv
import math
import os
import time

import h5py
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import wandb


class Hypersim(Dataset):
    MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
    STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)

    def __init__(self, root, csv_file, split, size=384):
        self.root, self.size, self.train = root, size, split == "train"
        with open(csv_file) as f:
            rows = [r for r in csv.DictReader(f) if r["split_partition_name"] == split and r["included_in_public_release"] == "True"]
        self.items = [(r["scene_name"], r["camera_name"], int(r["frame_id"])) for r in rows]

    def __len__(self):
        return len(self.items)

    def _paths(self, scene, cam, frame):
        img_dir = os.path.join(self.root, scene, "images")
        rgb = os.path.join(img_dir, f"scene_{cam}_final_hdf5", f"frame.{frame:04d}.color.hdf5")
        dist_m = os.path.join(img_dir, f"scene_{cam}_geometry_hdf5", f"frame.{frame:04d}.depth_meters.hdf5")
        return rgb, dist_m

    def __getitem__(self, i):
        rgb_path, depth_path = self._paths(*self.items[i])
        with h5py.File(rgb_path, "r") as f:
            rgb = f["dataset"][:].astype(np.float32)
        with h5py.File(depth_path, "r") as f:
            distance = f["dataset"][:].astype(np.float32)
        # tone map as in the Hypersim reference code
        rgb = np.clip(rgb / max(np.percentile(rgb, 90), 1e-6) * 0.8, 0, 1) ** (1 / 2.2)
        # hypersim stores distance to the camera centre, convert to planar depth
        h, w = distance.shape
        focal = 886.81
        xs, ys = np.meshgrid(np.linspace(-w / 2 + 0.5, w / 2 - 0.5, w), np.linspace(-h / 2 + 0.5, h / 2 - 0.5, h))
        depth = distance / np.sqrt(xs ** 2 + ys ** 2 + focal ** 2) * focal
        valid = np.isfinite(depth) & (depth > 0)
        depth[~valid] = 0

        if self.train:
            if np.random.rand() < 0.5:
                rgb, depth, valid = rgb[:, ::-1], depth[:, ::-1], valid[:, ::-1]
            y0, x0 = np.random.randint(0, h - self.size + 1), np.random.randint(0, w - self.size + 1)
        else:
            y0, x0 = (h - self.size) // 2, (w - self.size) // 2
        sl = np.s_[y0:y0 + self.size, x0:x0 + self.size]
        rgb = (rgb[sl] - self.MEAN) / self.STD
        return (torch.from_numpy(np.ascontiguousarray(rgb.transpose(2, 0, 1))),
                torch.from_numpy(np.ascontiguousarray(depth[sl])),
                torch.from_numpy(np.ascontiguousarray(valid[sl])))


class Reassemble(nn.Module):
    def __init__(self, dim, out, factor):
        super().__init__()
        layers = [nn.Conv2d(dim, out, 1)]
        if factor > 1:
            layers.append(nn.ConvTranspose2d(out, out, factor, factor))
        elif factor < 1:
            layers.append(nn.Conv2d(out, out, 3, 2, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class Fusion(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.res = nn.Sequential(nn.ReLU(), nn.Conv2d(f, f, 3, 1, 1), nn.ReLU(), nn.Conv2d(f, f, 3, 1, 1))
        self.out = nn.Conv2d(f, f, 1)

    def forward(self, x, skip):
        x = x + skip
        x = x + self.res(x)
        return self.out(F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=True))


class DPT(nn.Module):
    def __init__(self, backbone="vit_large_patch16_384", features=256, max_depth=20.0, grad_checkpointing=False):
        super().__init__()
        self.encoder = timm.create_model(backbone, pretrained=True)
        self.grad_checkpointing = grad_checkpointing
        depth = len(self.encoder.blocks)
        self.hooks = [depth // 4 - 1, depth // 2 - 1, 3 * depth // 4 - 1, depth - 1]
        dim = self.encoder.embed_dim
        chans = [256, 512, 1024, 1024]
        self.reassemble = nn.ModuleList([Reassemble(dim, c, f) for c, f in zip(chans, [4, 2, 1, 0.5])])
        self.proj = nn.ModuleList([nn.Conv2d(c, features, 3, 1, 1, bias=False) for c in chans])
        self.fusion = nn.ModuleList([Fusion(features) for _ in range(4)])
        self.head = nn.Sequential(nn.Conv2d(features, 128, 3, 1, 1),
                                  nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True),
                                  nn.Conv2d(128, 32, 3, 1, 1), nn.ReLU(True), nn.Conv2d(32, 1, 1), nn.Sigmoid())
        self.max_depth = max_depth

    def forward(self, x):
        b, _, h, w = x.shape
        t = self.encoder._pos_embed(self.encoder.patch_embed(x))
        outs = []
        for i, blk in enumerate(self.encoder.blocks):
            if self.grad_checkpointing and self.training:
                t = torch.utils.checkpoint.checkpoint(blk, t)
            else:
                t = blk(t)
            if i in self.hooks:
                outs.append(t[:, 1:].transpose(1, 2).reshape(b, -1, h // 16, w // 16))
        feats = [p(r(o)) for o, r, p in zip(outs, self.reassemble, self.proj)]
        x = self.fusion[3](feats[3], torch.zeros_like(feats[3]))
        x = self.fusion[2](x, feats[2])
        x = self.fusion[1](x, feats[1])
        x = self.fusion[0](x, feats[0])
        return self.head(x).squeeze(1) * self.max_depth


def silog(pred, gt, mask, lam=0.85):
    d = torch.log(pred[mask].clamp(min=1e-3)) - torch.log(gt[mask])
    return torch.sqrt((d ** 2).mean() - lam * d.mean() ** 2 + 1e-8)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--csv", required=True)
    ap.add_argument("--backbone", default="vit_large_patch16_384")
    ap.add_argument("--grad-checkpointing", action="store_true")
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--max-depth", type=float, default=20.0)
    ap.add_argument("--out", default="ckpt/dpt_hypersim")
    ap.add_argument("--wandb-project", default="depth")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(1000 + rank)
    torch.manual_seed(1000)

    if rank == 0:
        wandb.init(project=args.wandb_project, config=vars(args), name=f"dpt-{args.backbone}-hypersim")
        os.makedirs(args.out, exist_ok=True)

    if local_rank != 0:
        dist.barrier()
    model = DPT(args.backbone, max_depth=args.max_depth, grad_checkpointing=args.grad_checkpointing)
    if local_rank == 0:
        dist.barrier()
    model = model.to(device)
    # timm's ViT keeps its classification head / final norm, which the decoder never uses
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    train_set = Hypersim(args.root, args.csv, "train")
    val_set = Hypersim(args.root, args.csv, "val")
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=args.bs, num_workers=4)

    enc = [p for n, p in model.module.named_parameters() if n.startswith("encoder.")]
    dec = [p for n, p in model.module.named_parameters() if not n.startswith("encoder.")]
    opt = torch.optim.AdamW([{"params": enc, "lr": args.lr}, {"params": dec, "lr": args.lr * 10}],
                            weight_decay=0.01)
    iters = args.epochs * len(train_loader)
    warmup = min(1000, iters // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (iters - warmup))))

    step = 0
    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for img, depth, valid in train_loader:
            img, depth, valid = img.to(device), depth.to(device), valid.to(device)
            mask = valid & (depth > 1e-3) & (depth < args.max_depth)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(img)
            loss = silog(pred.float(), depth, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/silog": l.item(), "lr": sched.get_last_lr()[0],
                               "sec_per_it": (time.time() - t0) / 50}, step=step)
                    t0 = time.time()

        # validation (each rank its own slice)
        model.eval()
        acc = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for img, depth, valid in val_loader:
                img, depth, valid = img.to(device), depth.to(device), valid.to(device)
                mask = valid & (depth > 1e-3) & (depth < args.max_depth)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model.module(img).float()
                absrel = (pred - depth).abs() / depth.clamp(min=1e-3)
                delta = torch.maximum(pred / depth.clamp(min=1e-3), depth / pred.clamp(min=1e-3))
                acc[0] += absrel[mask].sum()
                acc[1] += (delta[mask] < 1.25).sum()
                acc[2] += mask.sum()
        dist.all_reduce(acc)
        absrel, d1 = (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()
        if rank == 0:
            wandb.log({"val/absrel": absrel, "val/d1": d1, "epoch": epoch}, step=step)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pth"))
            if absrel < best:
                best = absrel
                torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "best.pth"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
