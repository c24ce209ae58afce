"""Cross-View Transformer (CVT-lite) for map-view vehicle segmentation on nuScenes.

BEV grid queries cross-attend to all camera features; keys carry a camera-aware
positional embedding (unprojected pixel ray directions minus camera centre).

    torchrun --nproc_per_node=8 17_cvt_cross_view_bevseg.py --config configs/cvt_nusc_vehicle.yaml
"""
import argparse
import math
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import wandb
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULT_CFG = {
    "data": {"root": "/datasets/nuscenes", "labels": "/datasets/cvt_labels_nuscenes", "img_h": 224, "img_w": 480},
    "model": {"dim": 128, "bev_h": 25, "bev_w": 25, "heads": 4},
    "train": {"epochs": 30, "batch_size": 4, "lr": 4e-3, "weight_decay": 1e-7, "workers": 8, "ckpt_dir": "ckpts/cvt"},
    "wandb": {"project": "cvt-nuscenes", "entity": "perception-team"},
}


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--name", default="cvt_vehicle")
    a = ap.parse_args()
    cfg = DEFAULT_CFG
    if a.config:
        with open(a.config) as f:
            user = yaml.safe_load(f)
        for k, v in user.items():
            cfg[k].update(v)
    cfg["name"] = a.name
    return cfg


class CVTData(Dataset):
    def __init__(self, cfg, split):
        d = cfg["data"]
        with open(os.path.join(d["labels"], f"{split}.pkl"), "rb") as f:
            self.samples = pickle.load(f)
        self.root, self.labels = d["root"], d["labels"]
        self.h, self.w = d["img_h"], d["img_w"]
        self.norm = torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        s = self.samples[i]
        imgs, I_inv, E_inv = [], [], []
        for cam in s["cameras"]:
            im = Image.open(os.path.join(self.root, cam["image"])).convert("RGB")
            K = np.asarray(cam["intrinsics"], dtype=np.float32).copy()
            K[0] *= self.w / im.width
            K[1] *= self.h / im.height
            im = torchvision.transforms.functional.to_tensor(im.resize((self.w, self.h), Image.BILINEAR))
            imgs.append(self.norm(im))
            I_inv.append(torch.from_numpy(np.linalg.inv(K)))
            E_inv.append(torch.from_numpy(np.asarray(cam["cam2ego"], dtype=np.float32)))
        bev = np.load(os.path.join(self.labels, s["bev"]))  # (200, 200) uint8 vehicle mask
        return torch.stack(imgs), torch.stack(I_inv), torch.stack(E_inv), torch.from_numpy(bev > 0).float()[None]


class CrossViewAttention(nn.Module):
    def __init__(self, dim, heads, feat_dim, h, w):
        super().__init__()
        self.heads = heads
        self.feat_proj = nn.Sequential(nn.BatchNorm2d(feat_dim), nn.ReLU(), nn.Conv2d(feat_dim, dim, 1, bias=False))
        self.img_embed = nn.Conv2d(4, dim, 1, bias=False)
        self.cam_embed = nn.Conv2d(4, dim, 1, bias=False)
        self.bev_embed = nn.Conv2d(2, dim, 1)
        self.q = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim))
        self.k = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim))
        self.v = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim))
        self.out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        ys, xs = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
        self.register_buffer("pix", torch.stack([xs, ys, torch.ones_like(xs)], 0), persistent=False)

    def forward(self, bev_q, bev_grid, feats, I_inv, E_inv, img_hw):
        B, N, C, h, w = feats.shape
        H, W = bev_q.shape[-2:]
        pix = self.pix * self.pix.new_tensor([img_hw[1], img_hw[0], 1.0]).view(3, 1, 1)
        rays = torch.einsum("bnij,jhw->bnihw", I_inv, pix)                      # camera frame
        rays = torch.cat([rays, torch.ones_like(rays[:, :, :1])], 2)
        world = torch.einsum("bnij,bnjhw->bnihw", E_inv, rays)                 # ego frame, homogeneous
        cam_c = E_inv[..., :, 3, None, None]                                   # (B, N, 4, 1, 1)
        img_pe = self.img_embed((world - cam_c).flatten(0, 1))
        img_pe = img_pe / (img_pe.norm(dim=1, keepdim=True) + 1e-7)
        c_pe = self.cam_embed(cam_c.flatten(0, 1)).view(B, N, -1, 1, 1)
        bev_pe = self.bev_embed(bev_grid[None]).unsqueeze(1) - c_pe           # (B, N, d, H, W)
        bev_pe = bev_pe / (bev_pe.norm(dim=2, keepdim=True) + 1e-7)
        feat = self.feat_proj(feats.flatten(0, 1))
        key = (img_pe + feat).view(B, N, -1, h * w).transpose(2, 3)            # (B, N, hw, d)
        val = feat.view(B, N, -1, h * w).transpose(2, 3)
        query = (bev_pe + bev_q[:, None]).flatten(3).transpose(2, 3)             # (B, N, HW, d)
        d = query.shape[-1]
        m, dh = self.heads, d // self.heads
        q = self.q(query).view(B, N, H * W, m, dh).permute(0, 3, 1, 2, 4)       # (B, m, N, HW, dh)
        k = self.k(key).view(B, N, h * w, m, dh).permute(0, 3, 1, 2, 4)
        v = self.v(val).view(B, N, h * w, m, dh).permute(0, 3, 1, 2, 4).reshape(B, m, N * h * w, dh)
        # per-camera dot products, softmax jointly over the keys of all cameras
        dot = torch.einsum("bmnqd,bmnkd->bmqnk", q, k).flatten(3) / math.sqrt(dh)
        att = torch.einsum("bmqk,bmkd->bmqd", dot.softmax(-1), v)
        att = att.permute(0, 2, 1, 3).reshape(B, H * W, d)
        x = bev_q.flatten(2).transpose(1, 2) + self.out(att)
        x = x + self.mlp(x)
        return x.transpose(1, 2).reshape(B, d, H, W)


class CVTLite(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        m, d = cfg["model"], cfg["data"]
        eff = torchvision.models.efficientnet_b4(weights="IMAGENET1K_V1").features
        self.backbone = eff[:6]  # stride 16, 160 channels
        self.img_hw = (d["img_h"], d["img_w"])
        self.bev_q = nn.Parameter(0.1 * torch.rand(m["dim"], m["bev_h"], m["bev_w"]))
        ys, xs = torch.meshgrid(torch.linspace(50, -50, m["bev_h"]), torch.linspace(50, -50, m["bev_w"]), indexing="ij")
        self.register_buffer("bev_grid", torch.stack([ys, xs], 0), persistent=False)
        self.cva = CrossViewAttention(m["dim"], m["heads"], 160, d["img_h"] // 16, d["img_w"] // 16)
        self.decoder = nn.Sequential(
            nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
            nn.Conv2d(m["dim"], 128, 3, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU(True),
            nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
            nn.Conv2d(128, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(True),
            nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
            nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(True),
            nn.Conv2d(64, 1, 1))

    def forward(self, imgs, I_inv, E_inv):
        B, N = imgs.shape[:2]
        f = self.backbone(imgs.flatten(0, 1))
        f = f.view(B, N, *f.shape[1:])
        bev = self.cva(self.bev_q.expand(B, -1, -1, -1), self.bev_grid, f, I_inv, E_inv, self.img_hw)
        out = self.decoder(bev)
        return F.interpolate(out, size=(200, 200), mode="bilinear", align_corners=False)


def sigmoid_focal(logits, target, alpha=0.25, gamma=2.0):
    p = logits.sigmoid()
    ce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    pt = p * target + (1 - p) * (1 - target)
    w = alpha * target + (1 - alpha) * (1 - target)
    return (w * ce * (1 - pt) ** gamma).mean()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    tc = cfg["train"]

    run = wandb.init(project=cfg["wandb"]["project"], entity=cfg["wandb"]["entity"], name=cfg["name"], config=cfg)

    train_ds, val_ds = CVTData(cfg, "train"), CVTData(cfg, "val")
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, tc["batch_size"], sampler=sampler, num_workers=tc["workers"],
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), tc["batch_size"],
                        num_workers=tc["workers"], pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(CVTLite(cfg)).to(dev)
    ddp = DDP(model, device_ids=[local_rank])
    lr = tc["lr"] * tc["batch_size"] * world / 32
    opt = torch.optim.AdamW(ddp.parameters(), lr=lr, weight_decay=tc["weight_decay"])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=tc["epochs"] * len(train_dl),
                                                pct_start=0.3, div_factor=10, final_div_factor=10)
    if rank == 0:
        os.makedirs(tc["ckpt_dir"], exist_ok=True)

    step = 0
    for epoch in range(tc["epochs"]):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        for imgs, I_inv, E_inv, bev in train_dl:
            imgs, I_inv, E_inv, bev = imgs.to(dev), I_inv.to(dev), E_inv.to(dev), bev.to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(imgs, I_inv, E_inv)
            loss = sigmoid_focal(logits.float(), bev)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(ddp.parameters(), 5.0)
            opt.step()
            sched.step()
            step += 1
            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                run.log({"train/loss": l.item(), "train/lr": sched.get_last_lr()[0]}, step=step)

        model.eval()
        iu = torch.zeros(2, device=dev)
        with torch.no_grad():
            for imgs, I_inv, E_inv, bev in val_dl:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model(imgs.to(dev), I_inv.to(dev), E_inv.to(dev)).float().sigmoid() > 0.4
                gt = bev.to(dev) > 0.5
                iu += torch.stack([(pred & gt).sum(), (pred | gt).sum()]).float()
        dist.all_reduce(iu)
        iou = (iu[0] / iu[1].clamp(min=1)).item()
        run.log({"val/iou": iou, "epoch": epoch, "epoch_time": time.time() - t0}, step=step)
        if rank == 0:
            print(f"epoch {epoch} IoU {iou:.4f}", flush=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "cfg": cfg},
                       os.path.join(tc["ckpt_dir"], f"epoch{epoch:02d}.pt"))
        dist.barrier()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
