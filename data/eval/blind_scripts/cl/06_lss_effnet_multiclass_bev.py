"""Multi-class BEV semantic segmentation (vehicle, pedestrian, drivable) with an LSS view transform
and an EfficientNet-B0 image encoder (torchvision).

Run:  torchrun --nproc_per_node=8 06_lss_effnet_multiclass_bev.py --cfg cfgs/lss_effb0.json
"""
import argparse
import json
import os
import pickle
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

CFG = {
    "dataroot": "/datasets/nuscenes/v1.0-trainval",
    "infos": {"train": "infos/bevseg_train.pkl", "val": "infos/bevseg_val.pkl"},
    "save_dir": "checkpoints/lss_effb0",
    "classes": ["vehicle", "pedestrian", "drivable"],
    "img_size": [224, 480],
    "xbound": [-50.0, 50.0, 0.5], "ybound": [-50.0, 50.0, 0.5], "zbound": [-10.0, 10.0, 20.0],
    "dbound": [4.0, 45.0, 1.0],
    "feat_c": 64, "batch_size": 4, "epochs": 20, "lr": 3e-4, "wd": 1e-7, "workers": 8,
}


class BEVSegData(Dataset):
    def __init__(self, cfg, split):
        self.cfg = cfg
        self.split = split
        with open(os.path.join(cfg["dataroot"], cfg["infos"][split]), "rb") as f:
            self.infos = pickle.load(f)

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, idx):
        info = self.infos[idx]
        H, W = self.cfg["img_size"]
        imgs, intrins, extrins, post = [], [], [], []
        flip = self.split == "train" and random.random() < 0.5
        for cam in info["cams"]:
            img = Image.open(os.path.join(self.cfg["dataroot"], cam["filename"])).convert("RGB")
            sx, sy = W / img.width, H / img.height
            img = img.resize((W, H))
            P = np.eye(3, dtype=np.float32)
            P[0, 0], P[1, 1] = sx, sy
            if flip:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
                P = np.array([[-1, 0, W - 1], [0, 1, 0], [0, 0, 1]], dtype=np.float32) @ P
            arr = np.asarray(img, dtype=np.float32) / 255.0
            arr = (arr - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
            imgs.append(torch.from_numpy(arr.astype(np.float32)).permute(2, 0, 1))
            intrins.append(torch.tensor(cam["intrinsic"], dtype=torch.float32))
            extrins.append(torch.tensor(cam["cam2ego"], dtype=torch.float32))  # 4x4
            post.append(torch.from_numpy(P))
        seg = torch.from_numpy(np.load(os.path.join(self.cfg["dataroot"], info["bev_seg"]))).float()
        return torch.stack(imgs), torch.stack(intrins), torch.stack(extrins), torch.stack(post), seg


def make_grid(cfg):
    dx = torch.tensor([b[2] for b in (cfg["xbound"], cfg["ybound"], cfg["zbound"])])
    lo = torch.tensor([b[0] for b in (cfg["xbound"], cfg["ybound"], cfg["zbound"])])
    nx = [int(round((b[1] - b[0]) / b[2])) for b in (cfg["xbound"], cfg["ybound"], cfg["zbound"])]
    return dx, lo, nx


class LSSEffNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        dx, lo, self.nx = make_grid(cfg)
        self.register_buffer("dx", dx, persistent=False)
        self.register_buffer("lo", lo, persistent=False)
        self.depth_bins = torch.arange(*cfg["dbound"]).numel()
        self.C = cfg["feat_c"]
        effnet = torchvision.models.efficientnet_b0(weights="IMAGENET1K_V1").features
        self.enc16, self.enc32 = effnet[:6], effnet[6:8]  # stride 16 (112 ch), stride 32 (320 ch)
        self.fuse = nn.Sequential(nn.Conv2d(112 + 320, 512, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(512), nn.ReLU(inplace=True))
        self.depth_feat = nn.Conv2d(512, self.depth_bins + self.C, 1)
        H, W = cfg["img_size"]
        fH, fW = H // 16, W // 16
        d = torch.arange(*cfg["dbound"]).view(-1, 1, 1).expand(-1, fH, fW)
        u = torch.linspace(0, W - 1, fW).view(1, 1, fW).expand_as(d)
        v = torch.linspace(0, H - 1, fH).view(1, fH, 1).expand_as(d)
        self.register_buffer("frustum", torch.stack([u, v, d], -1), persistent=False)
        c_bev = self.C * self.nx[2]
        self.bev = nn.Sequential(
            nn.Conv2d(c_bev, 128, 3, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU(inplace=True),
            nn.Conv2d(128, 128, 3, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU(inplace=True),
            nn.Conv2d(128, 128, 3, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU(inplace=True),
            nn.Conv2d(128, len(cfg["classes"]), 1))

    def lift(self, imgs):
        f3 = self.enc16(imgs)
        f4 = self.enc32(f3)
        f4 = F.interpolate(f4, size=f3.shape[-2:], mode="bilinear", align_corners=False)
        x = self.depth_feat(self.fuse(torch.cat([f3, f4], 1)))
        depth = x[:, : self.depth_bins].softmax(1)
        return depth.unsqueeze(1) * x[:, self.depth_bins:].unsqueeze(2)  # (BN, C, D, h, w)

    def geometry(self, intrins, extrins, post):
        B, N = intrins.shape[:2]
        pts = self.frustum.view(1, 1, -1, 3)
        uv1 = torch.cat([pts[..., :2], torch.ones_like(pts[..., :1])], -1)
        uv1 = torch.einsum("bnij,bnpj->bnpi", torch.inverse(post), uv1.expand(B, N, -1, -1))
        cam = torch.einsum("bnij,bnpj->bnpi", torch.inverse(intrins), uv1) * pts[..., 2:3]
        ego = torch.einsum("bnij,bnpj->bnpi", extrins[..., :3, :3], cam) + extrins[..., None, :3, 3]
        return ego  # (B, N, D*h*w, 3)

    def splat(self, feats, geom, B):
        C = feats.shape[-1]
        idx = ((geom - self.lo) / self.dx).long()
        nx, ny, nz = self.nx
        b = torch.arange(B, device=feats.device).view(B, 1, 1).expand(idx.shape[:3])
        ok = (idx >= 0).all(-1) & (idx[..., 0] < nx) & (idx[..., 1] < ny) & (idx[..., 2] < nz)
        idx, b, feats = idx[ok], b[ok], feats[ok]
        flat = ((b * nz + idx[:, 2]) * nx + idx[:, 0]) * ny + idx[:, 1]
        grid = feats.new_zeros(B * nz * nx * ny, C).index_add_(0, flat, feats)
        return grid.view(B, nz, nx, ny, C).permute(0, 1, 4, 2, 3).flatten(1, 2)

    def forward(self, imgs, intrins, extrins, post):
        B, N = imgs.shape[:2]
        feats = self.lift(imgs.flatten(0, 1))
        feats = feats.view(B, N, self.C, -1).transpose(2, 3)  # (B, N, D*h*w, C)
        return self.bev(self.splat(feats, self.geometry(intrins, extrins, post), B))


def iou_stats(logits, seg):
    pred, gt = logits.sigmoid() > 0.4, seg > 0.5
    return torch.stack([(pred & gt).sum((0, 2, 3)), (pred | gt).sum((0, 2, 3))]).float()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cfg = dict(CFG)
    if args.cfg:
        cfg.update(json.load(open(args.cfg)))

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_ds, val_ds = BEVSegData(cfg, "train"), BEVSegData(cfg, "val")
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                          num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, list(range(rank, len(val_ds), world))),
                        batch_size=cfg["batch_size"], num_workers=cfg["workers"], pin_memory=True)

    model = LSSEffNet(cfg)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(dev)
    ddp = DDP(model, device_ids=[local_rank])
    base_lr = cfg["lr"] * world * cfg["batch_size"] / 32
    opt = torch.optim.AdamW(ddp.parameters(), lr=base_lr, weight_decay=cfg["wd"])
    iters = cfg["epochs"] * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=base_lr, total_steps=iters, pct_start=0.05)
    pos_w = torch.tensor([2.13, 4.0, 1.0], device=dev).view(1, -1, 1, 1)
    if rank == 0:
        os.makedirs(cfg["save_dir"], exist_ok=True)
        print(json.dumps(cfg, indent=1), flush=True)

    best = 0.0
    for epoch in range(cfg["epochs"]):
        ddp.train()
        tic = time.time()
        for it, (imgs, K, E, P, seg) in enumerate(train_dl):
            imgs, K, E, P, seg = (t.to(dev, non_blocking=True) for t in (imgs, K, E, P, seg))
            out = ddp(imgs, K, E, P)
            loss = F.binary_cross_entropy_with_logits(out, seg, pos_weight=pos_w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(ddp.parameters(), 5.0)
            opt.step()
            sched.step()
            if it % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"[{epoch}][{it}/{len(train_dl)}] loss={l.item():.4f} "
                          f"lr={sched.get_last_lr()[0]:.2e} t={time.time() - tic:.1f}s", flush=True)

        model.eval()
        stats = torch.zeros(2, len(cfg["classes"]), device=dev)
        with torch.no_grad():
            for imgs, K, E, P, seg in val_dl:
                out = model(imgs.to(dev), K.to(dev), E.to(dev), P.to(dev))
                stats += iou_stats(out, seg.to(dev))
        dist.all_reduce(stats)
        ious = (stats[0] / stats[1].clamp(min=1)).tolist()
        miou = sum(ious) / len(ious)
        if rank == 0:
            print(f"epoch {epoch} " + " ".join(f"{c}={v:.4f}" for c, v in zip(cfg["classes"], ious))
                  + f" mIoU={miou:.4f}", flush=True)
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "cfg": cfg}
            torch.save(state, os.path.join(cfg["save_dir"], "last.pt"))
            if miou > best:
                torch.save(state, os.path.join(cfg["save_dir"], "best.pt"))
        best = max(best, miou)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
