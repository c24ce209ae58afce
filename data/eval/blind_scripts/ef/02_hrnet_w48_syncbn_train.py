"""HRNet-W48 384x288 trainer with OHKM and AMP.

Heavier model for the offline analytics jobs (tracking + biomechanics export).
Reads COCO-format keypoint json; our court-side datasets are exported in the
same format by the labelling tool.

    torchrun --nproc_per_node=8 hrnet_w48_train.py --cfg configs/w48_384x288.yaml
"""
import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from sportpose.data import TopDownCocoDataset
from sportpose.transforms import affine_transform, flip_back, get_affine_transform

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]


@dataclass
class Config:
    data_root: str = "/mnt/datasets/coco"
    train_ann: str = "annotations/person_keypoints_train2017.json"
    val_ann: str = "annotations/person_keypoints_val2017.json"
    out_dir: str = "runs/w48_384x288"
    image_size: list = field(default_factory=lambda: [288, 384])
    sigma: float = 3.0
    batch_size: int = 24
    workers: int = 8
    epochs: int = 210
    base_lr: float = 5e-4
    base_batch: int = 192
    warmup_iters: int = 500
    ohkm_topk: int = 8
    resume: str = ""


def load_config():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", default="")
    parser.add_argument("--resume", default="")
    a = parser.parse_args()
    cfg = Config()
    if a.cfg:
        with open(a.cfg) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, v)
    if a.resume:
        cfg.resume = a.resume
    return cfg


class HRNetW48(nn.Module):
    def __init__(self, num_joints=17):
        super().__init__()
        self.backbone = timm.create_model("hrnet_w48", pretrained=True, features_only=True,
                                          feature_location="", out_indices=(1,))
        self.final_layer = nn.Conv2d(self.backbone.feature_info.channels()[0], num_joints, 1)

    def forward(self, x):
        return self.final_layer(self.backbone(x)[0])


def ohkm_mse(output, target, weight, topk):
    b, k = output.shape[:2]
    per_joint = 0.5 * F.mse_loss(output.reshape(b, k, -1) * weight, target.reshape(b, k, -1) * weight,
                                 reduction="none").mean(dim=2)
    hard, _ = per_joint.topk(topk, dim=1)
    return hard.mean()


def decode(heatmaps, center, scale):
    b, k, h, w = heatmaps.shape
    flat = heatmaps.reshape(b, k, -1)
    idx = flat.argmax(2)
    maxvals = flat.max(2)[..., None]
    coords = np.stack([idx % w, idx // w], -1).astype(np.float32)
    for n in range(b):
        for j in range(k):
            px, py = int(coords[n, j, 0] + 0.5), int(coords[n, j, 1] + 0.5)
            if 1 < px < w - 1 and 1 < py < h - 1:
                hm = heatmaps[n, j]
                coords[n, j] += 0.25 * np.sign([hm[py, px + 1] - hm[py, px - 1], hm[py + 1, px] - hm[py - 1, px]])
        trans = get_affine_transform(center[n], scale[n], 0, [w, h], inv=1)
        for j in range(k):
            coords[n, j] = affine_transform(coords[n, j], trans)
    return coords, maxvals


def lr_at(step, total, cfg, peak):
    if step < cfg.warmup_iters:
        return peak * (0.001 + 0.999 * step / cfg.warmup_iters)
    t = (step - cfg.warmup_iters) / max(1, total - cfg.warmup_iters)
    return peak * 0.5 * (1 + math.cos(math.pi * t))


@torch.no_grad()
def evaluate(model, loader, coco_gt, device, out_dir):
    model.eval()
    local = []
    for images, _, _, meta in loader:
        images = images.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            hm = model(images)
            hm_flip = model(images.flip(3))
        hm_flip = torch.from_numpy(flip_back(hm_flip.float().cpu().numpy(), FLIP_PAIRS).copy()).to(device)
        hm_flip[..., 1:] = hm_flip.clone()[..., :-1]
        heat = ((hm.float() + hm_flip) / 2).cpu().numpy()
        coords, maxvals = decode(heat, meta["center"].numpy(), meta["scale"].numpy())
        for n in range(len(heat)):
            mask = maxvals[n, :, 0] > 0.2
            local.append({"index": int(meta["index"][n]), "image_id": int(meta["image_id"][n]), "category_id": 1,
                          "keypoints": np.concatenate([coords[n], maxvals[n]], 1).reshape(-1).tolist(),
                          "score": float(maxvals[n, mask, 0].mean()) if mask.any() else 0.0})

    # per-rank lists have different lengths; all_gather_object pickles them
    world = [None for _ in range(dist.get_world_size())]
    dist.all_gather_object(world, local)
    ap = torch.zeros(1, device=device)
    if dist.get_rank() == 0:
        uniq = {}
        for part in world:
            for r in part:
                uniq[r.pop("index")] = r
        path = os.path.join(out_dir, "val_keypoints.json")
        with open(path, "w") as f:
            json.dump(list(uniq.values()), f)
        E = COCOeval(coco_gt, coco_gt.loadRes(path), "keypoints")
        E.params.useSegm = None
        E.evaluate()
        E.accumulate()
        E.summarize()
        ap[0] = E.stats[0]
    dist.broadcast(ap, src=0)
    return ap.item()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    is_main = rank == 0
    if is_main:
        os.makedirs(cfg.out_dir, exist_ok=True)
        print(cfg)

    train_ds = TopDownCocoDataset(cfg.data_root, cfg.train_ann, "train2017", image_size=cfg.image_size,
                                  sigma=cfg.sigma, flip_pairs=FLIP_PAIRS, train=True)
    val_ds = TopDownCocoDataset(cfg.data_root, cfg.val_ann, "val2017", image_size=cfg.image_size,
                                sigma=cfg.sigma, flip_pairs=FLIP_PAIRS, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    train_dl = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler, num_workers=cfg.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=32, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=cfg.workers, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(HRNetW48()).cuda()
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.base_lr, weight_decay=1e-4)
    scaler = torch.cuda.amp.GradScaler()

    # linear scaling from the 192-image reference batch
    global_batch = cfg.batch_size * world_size
    peak_lr = cfg.base_lr * global_batch / cfg.base_batch
    total_steps = cfg.epochs * len(train_dl)

    start_epoch, best = 0, 0.0
    if cfg.resume:
        ckpt = torch.load(cfg.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt.get("best", 0.0)

    step = start_epoch * len(train_dl)
    for epoch in range(start_epoch, cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for images, target, weight, _ in train_dl:
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step, total_steps, cfg, peak_lr)
            images, target, weight = images.cuda(non_blocking=True), target.cuda(non_blocking=True), weight.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(images)
            loss = ohkm_mse(out.float(), target, weight, cfg.ohkm_topk)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            step += 1
        dist.all_reduce(running)
        if is_main:
            print(f"epoch {epoch} loss {(running[0] / running[1]).item():.6f} time {time.time() - t0:.0f}s", flush=True)

        if epoch % 10 == 9 or epoch == cfg.epochs - 1:
            ap = evaluate(model, val_dl, val_ds.coco, device, cfg.out_dir)
            if is_main:
                print(f"epoch {epoch} AP {ap:.4f}", flush=True)
            if ap > best:
                best = ap
                if is_main:
                    torch.save(model.module.state_dict(), os.path.join(cfg.out_dir, "best.pth"))
        if is_main:
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "best": best}, os.path.join(cfg.out_dir, "last.pth"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
