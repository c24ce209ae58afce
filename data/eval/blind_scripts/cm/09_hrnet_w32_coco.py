"""HRNet-W32 top-down pose estimation on COCO keypoints, 256x192, with flip test.

    torchrun --nproc_per_node=8 09_hrnet_w32_coco.py --data-root /data/coco --work-dir work_dirs/hrnet_w32_coco
    torchrun --nproc_per_node=8 09_hrnet_w32_coco.py --data-root /data/coco --work-dir work_dirs/hrnet_w32_coco --resume work_dirs/hrnet_w32_coco/latest.pth
"""
import argparse
import json
import os
import time
from dataclasses import dataclass

import cv2
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

FLIP_PAIRS = ((1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12), (13, 14), (15, 16))


@dataclass
class Cfg:
    image_size: tuple = (192, 256)
    heatmap_size: tuple = (48, 64)
    sigma: float = 2.0
    batch_per_gpu: int = 32
    base_lr: float = 5e-4          # for a total batch of 256
    epochs: int = 210
    warmup_iters: int = 500
    milestones: tuple = (170, 200)
    workers: int = 8


def box_to_center_scale(box, aspect):
    x, y, w, h = box
    c = np.array([x + 0.5 * w, y + 0.5 * h], np.float32)
    if w > aspect * h:
        h = w / aspect
    else:
        w = h * aspect
    return c, np.array([w, h], np.float32) * 1.25


def warp_matrix(c, s, rot, out_wh):
    """maps image coordinates of the box (center c, size s) to an out_wh patch"""
    sx, sy = out_wh[0] / s[0], out_wh[1] / s[1]
    M = cv2.getRotationMatrix2D((float(c[0]), float(c[1])), rot, 1.0)
    M[:, :2] *= np.array([[sx], [sy]], np.float32)
    M[:, 2] = M[:, 2] * np.array([sx, sy]) + np.array([out_wh[0] / 2 - sx * c[0], out_wh[1] / 2 - sy * c[1]])
    return M


class CocoKeypoints(Dataset):
    def __init__(self, root, split, cfg, train):
        self.root, self.split, self.cfg, self.train = root, split, cfg, train
        self.coco = COCO(f"{root}/annotations/person_keypoints_{split}.json")
        aspect = cfg.image_size[0] / cfg.image_size[1]
        self.samples = []
        for img_id in self.coco.getImgIds():
            fname = self.coco.imgs[img_id]["file_name"]
            for a in self.coco.loadAnns(self.coco.getAnnIds(imgIds=img_id, iscrowd=False)):
                if max(a["keypoints"][2::3]) == 0:
                    continue
                c, s = box_to_center_scale(a["bbox"], aspect)
                self.samples.append((fname, img_id, c, s, np.array(a["keypoints"], np.float32).reshape(17, 3)))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        fname, img_id, c, s, kps = self.samples[i]
        img = cv2.imread(f"{self.root}/{self.split}/{fname}", cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        c, s, kps = c.copy(), s.copy(), kps.copy()
        rot = 0.0
        if self.train:
            s *= np.clip(1 + 0.25 * np.random.randn(), 0.75, 1.25)
            if np.random.rand() < 0.6:
                rot = float(np.clip(40 * np.random.randn(), -80, 80))
            if np.random.rand() < 0.5:
                img = img[:, ::-1].copy()
                kps[:, 0] = img.shape[1] - 1 - kps[:, 0]
                c[0] = img.shape[1] - 1 - c[0]
                for a, b in FLIP_PAIRS:
                    kps[[a, b]] = kps[[b, a]]
        M = warp_matrix(c, s, rot, self.cfg.image_size)
        patch = cv2.warpAffine(img, M, tuple(self.cfg.image_size), flags=cv2.INTER_LINEAR)
        x = torch.from_numpy(patch).permute(2, 0, 1).float().div(255)
        x = (x - torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
        pts = np.c_[kps[:, :2], np.ones(17)] @ M.T
        hw, hh = self.cfg.heatmap_size
        stride = self.cfg.image_size[0] / hw
        gx, gy = np.arange(hw, dtype=np.float32), np.arange(hh, dtype=np.float32)[:, None]
        target = np.zeros((17, hh, hw), np.float32)
        weight = np.zeros((17, 1), np.float32)
        for j in range(17):
            mx, my = pts[j] / stride
            if kps[j, 2] > 0 and 0 <= mx < hw and 0 <= my < hh:
                target[j] = np.exp(-((gx - mx) ** 2 + (gy - my) ** 2) / (2 * self.cfg.sigma ** 2))
                weight[j] = 1.0
        return x, torch.from_numpy(target), torch.from_numpy(weight), i


class HRNetPose(nn.Module):
    def __init__(self, num_joints=17):
        super().__init__()
        self.backbone = timm.create_model("hrnet_w32", pretrained=True, features_only=True,
                                          feature_location="", out_indices=(1, 2, 3, 4))
        self.head = nn.Conv2d(sum(self.backbone.feature_info.channels()), num_joints, 1)

    def forward(self, x):
        feats = self.backbone(x)
        size = feats[0].shape[-2:]
        y = torch.cat([feats[0]] + [F.interpolate(f, size, mode="bilinear", align_corners=False) for f in feats[1:]], 1)
        return self.head(y)

    def flip_test(self, x):
        hm = self(x)
        hm_flip = self(x.flip(3)).flip(3)
        perm = list(range(hm.shape[1]))
        for a, b in FLIP_PAIRS:
            perm[a], perm[b] = b, a
        hm_flip = hm_flip[:, perm]
        hm_flip[..., 1:] = hm_flip[..., :-1].clone()
        return 0.5 * (hm + hm_flip)


def heatmaps_to_image(hm, c, s, cfg):
    k, h, w = hm.shape
    idx = hm.reshape(k, -1).argmax(1)
    conf = hm.reshape(k, -1).max(1)
    xy = np.stack([idx % w, idx // w], 1).astype(np.float32)
    for j in range(k):
        px, py = int(xy[j, 0]), int(xy[j, 1])
        if 0 < px < w - 1 and 0 < py < h - 1:
            xy[j] += 0.25 * np.sign([hm[j, py, px + 1] - hm[j, py, px - 1], hm[j, py + 1, px] - hm[j, py - 1, px]])
    stride = cfg.image_size[0] / w
    Minv = cv2.invertAffineTransform(warp_matrix(c, s, 0.0, cfg.image_size))
    img_xy = np.c_[xy * stride, np.ones(k)] @ Minv.T
    return np.c_[img_xy, conf]


@torch.no_grad()
def evaluate(net, loader, dataset, cfg, work_dir, rank, world_size):
    net.eval()
    local = []
    for x, _, _, idx in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            hm = net.flip_test(x.cuda(non_blocking=True))
        hm = hm.float().cpu().numpy()
        for b, i in enumerate(idx.tolist()):
            _, img_id, c, s, _ = dataset.samples[i]
            kp = heatmaps_to_image(hm[b], c, s, cfg)
            vis = kp[:, 2] > 0.2
            local.append({"idx": i, "image_id": img_id, "category_id": 1,
                          "keypoints": kp.reshape(-1).round(2).tolist(),
                          "score": float(kp[vis, 2].mean()) if vis.any() else 0.0})
    parts = [None] * world_size
    dist.all_gather_object(parts, local)
    ap = torch.zeros(1, device="cuda")
    if rank == 0:
        uniq = {r["idx"]: r for p in parts for r in p}      # padded samples appear twice
        dets = [{k: v for k, v in r.items() if k != "idx"} for r in uniq.values()]
        path = os.path.join(work_dir, "val_keypoints.json")
        with open(path, "w") as f:
            json.dump(dets, f)
        ev = COCOeval(dataset.coco, dataset.coco.loadRes(path), "keypoints")
        ev.evaluate(); ev.accumulate(); ev.summarize()
        ap[0] = ev.stats[0]
    dist.broadcast(ap, src=0)
    return ap.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", required=True)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    cfg = Cfg()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    train_set = CocoKeypoints(args.data_root, "train2017", cfg, train=True)
    val_set = CocoKeypoints(args.data_root, "val2017", cfg, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, cfg.batch_per_gpu, sampler=train_sampler, num_workers=cfg.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, 64, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=cfg.workers, pin_memory=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(HRNetPose()).cuda()
    model = DDP(net, device_ids=[local_rank])
    lr = cfg.base_lr * cfg.batch_per_gpu * world_size / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg.milestones, 0.1)
    scaler = torch.cuda.amp.GradScaler()
    start_epoch, best_ap = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_ap = ckpt["epoch"], ckpt["best_ap"]

    writer = None
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.work_dir, "tb"))
    it = start_epoch * len(train_loader)
    for epoch in range(start_epoch, cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, target, weight, _ in train_loader:
            if it < cfg.warmup_iters:
                for g in optimizer.param_groups:
                    g["lr"] = lr * (0.001 + 0.999 * it / cfg.warmup_iters)
            x, target, weight = x.cuda(non_blocking=True), target.cuda(non_blocking=True), weight.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(x)
            loss = (((out.float() - target) ** 2).mean((2, 3)) * weight[..., 0]).mean() * 0.5
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            it += 1
            if writer is not None and it % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), it)
        scheduler.step()
        if rank == 0:
            print(f"epoch {epoch + 1}/{cfg.epochs} {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % 10 == 0 or epoch + 1 == cfg.epochs:
            ap_val = evaluate(net, val_loader, val_set, cfg, args.work_dir, rank, world_size)
            best_ap = max(best_ap, ap_val)
            if rank == 0:
                writer.add_scalar("val/AP", ap_val, epoch + 1)
                state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                         "epoch": epoch + 1, "best_ap": best_ap}
                torch.save(state, os.path.join(args.work_dir, "latest.pth"))
                if ap_val >= best_ap:
                    torch.save(net.state_dict(), os.path.join(args.work_dir, "best_AP.pth"))
            dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
