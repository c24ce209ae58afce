#!/usr/bin/env python
"""Top-down HRNet-W32 on COCO keypoints (256x192), multi-GPU with torchrun.

    torchrun --nproc_per_node=8 01_hrnet_w32_coco_topdown.py --cfg experiments/coco/w32_256x192.yaml
"""
import argparse
import copy
import json
import logging
import os
import random
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms as T
import yaml
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from lib.core.inference import get_final_preds
from lib.models.pose_hrnet import get_pose_net
from lib.utils.transforms import affine_transform, flip_back, fliplr_joints, get_affine_transform

logger = logging.getLogger("hrnet")

NUM_JOINTS = 17
FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]


class COCOKeypoints(Dataset):
    def __init__(self, root, split, image_size, heatmap_size, sigma=2, is_train=True):
        self.root = root
        self.split = split
        self.is_train = is_train
        self.image_size = np.array(image_size)  # (w, h)
        self.heatmap_size = np.array(heatmap_size)
        self.sigma = sigma
        self.aspect_ratio = image_size[0] / image_size[1]
        self.scale_factor, self.rot_factor = 0.35, 45
        self.coco = COCO(os.path.join(root, "annotations", f"person_keypoints_{split}.json"))
        self.transform = T.Compose([T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        self.db = self._load_db()

    def _box2cs(self, x, y, w, h):
        center = np.array([x + w * 0.5, y + h * 0.5], dtype=np.float32)
        if w > self.aspect_ratio * h:
            h = w / self.aspect_ratio
        else:
            w = h * self.aspect_ratio
        scale = np.array([w / 200.0, h / 200.0], dtype=np.float32) * 1.25
        return center, scale

    def _load_db(self):
        db = []
        for img_id in self.coco.getImgIds():
            info = self.coco.loadImgs(img_id)[0]
            anns = self.coco.loadAnns(self.coco.getAnnIds(imgIds=img_id, iscrowd=False))
            for ann in anns:
                if ann["category_id"] != 1 or max(ann["keypoints"]) == 0:
                    continue
                x, y, w, h = ann["bbox"]
                if w < 1 or h < 1:
                    continue
                kps = np.array(ann["keypoints"], dtype=np.float32).reshape(-1, 3)
                joints = np.zeros((NUM_JOINTS, 3), dtype=np.float32)
                vis = np.zeros((NUM_JOINTS, 3), dtype=np.float32)
                joints[:, :2] = kps[:, :2]
                vis[:, :2] = np.minimum(1, kps[:, 2:3])
                c, s = self._box2cs(x, y, w, h)
                db.append(dict(image=os.path.join(self.root, "images", self.split, info["file_name"]),
                               image_id=img_id, center=c, scale=s, joints=joints, vis=vis, score=1.0))
        return db

    def __len__(self):
        return len(self.db)

    def _target(self, joints, vis):
        w, h = self.heatmap_size
        target = np.zeros((NUM_JOINTS, h, w), dtype=np.float32)
        weight = vis[:, 0:1].copy()
        stride = self.image_size / self.heatmap_size
        size = 6 * self.sigma + 1
        xs = np.arange(size, dtype=np.float32)
        g = np.exp(-((xs[None, :] - size // 2) ** 2 + (xs[:, None] - size // 2) ** 2) / (2 * self.sigma ** 2))
        for j in range(NUM_JOINTS):
            mu_x = int(joints[j, 0] / stride[0] + 0.5)
            mu_y = int(joints[j, 1] / stride[1] + 0.5)
            ul = [mu_x - 3 * self.sigma, mu_y - 3 * self.sigma]
            br = [mu_x + 3 * self.sigma + 1, mu_y + 3 * self.sigma + 1]
            if ul[0] >= w or ul[1] >= h or br[0] < 0 or br[1] < 0:
                weight[j] = 0
                continue
            if weight[j] > 0:
                gx = max(0, -ul[0]), min(br[0], w) - ul[0]
                gy = max(0, -ul[1]), min(br[1], h) - ul[1]
                ix = max(0, ul[0]), min(br[0], w)
                iy = max(0, ul[1]), min(br[1], h)
                target[j, iy[0]:iy[1], ix[0]:ix[1]] = g[gy[0]:gy[1], gx[0]:gx[1]]
        return target, weight

    def __getitem__(self, idx):
        rec = copy.deepcopy(self.db[idx])
        img = cv2.imread(rec["image"], cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        joints, vis, c, s = rec["joints"], rec["vis"], rec["center"], rec["scale"]
        r = 0.0
        if self.is_train:
            s = s * np.clip(np.random.randn() * self.scale_factor + 1, 1 - self.scale_factor, 1 + self.scale_factor)
            if random.random() <= 0.6:
                r = np.clip(np.random.randn() * self.rot_factor, -2 * self.rot_factor, 2 * self.rot_factor)
            if random.random() <= 0.5:
                img = img[:, ::-1, :]
                joints, vis = fliplr_joints(joints, vis, img.shape[1], FLIP_PAIRS)
                c[0] = img.shape[1] - c[0] - 1
        trans = get_affine_transform(c, s, r, self.image_size)
        crop = cv2.warpAffine(img, trans, (int(self.image_size[0]), int(self.image_size[1])), flags=cv2.INTER_LINEAR)
        for j in range(NUM_JOINTS):
            if vis[j, 0] > 0:
                joints[j, 0:2] = affine_transform(joints[j, 0:2], trans)
        target, weight = self._target(joints, vis)
        meta = dict(image_id=rec["image_id"], center=c, scale=s, score=rec["score"])
        return self.transform(crop), torch.from_numpy(target), torch.from_numpy(weight), meta


class JointsMSELoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.mse = nn.MSELoss(reduction="mean")

    def forward(self, output, target, weight):
        b, k = output.shape[:2]
        pred = output.reshape(b, k, -1)
        gt = target.reshape(b, k, -1)
        return 0.5 * self.mse(pred * weight, gt * weight)


def train_one_epoch(model, loader, criterion, optimizer, scaler, epoch, rank, print_freq=100):
    model.train()
    t0 = time.time()
    for i, (img, target, weight, _) in enumerate(loader):
        img = img.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        weight = weight.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(img)
        loss = criterion(out.float(), target, weight)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if rank == 0 and i % print_freq == 0:
            logger.info("epoch %d [%d/%d] loss %.6f (%.1fs)", epoch, i, len(loader), loss.item(), time.time() - t0)


@torch.no_grad()
def validate(model, loader, coco, out_dir, epoch, rank, flip_test=True):
    model.eval()
    results = []
    for img, _, _, meta in loader:
        img = img.cuda(non_blocking=True)
        out = model(img)
        if flip_test:
            out_flip = model(img.flip(3)).cpu().numpy()
            out_flip = torch.from_numpy(flip_back(out_flip, FLIP_PAIRS).copy()).cuda()
            out_flip[:, :, :, 1:] = out_flip.clone()[:, :, :, 0:-1]
            out = (out + out_flip) * 0.5
        preds, maxvals = get_final_preds(out.cpu().numpy(), meta["center"].numpy(), meta["scale"].numpy())
        for i in range(preds.shape[0]):
            kpt_score = float(maxvals[i][maxvals[i] > 0.2].mean()) if (maxvals[i] > 0.2).any() else 0.0
            kpts = np.concatenate([preds[i], maxvals[i]], axis=1)
            results.append(dict(image_id=int(meta["image_id"][i]), category_id=1,
                                keypoints=kpts.reshape(-1).round(3).tolist(),
                                score=float(meta["score"][i]) * kpt_score))

    res_file = os.path.join(out_dir, f"keypoints_val_ep{epoch}_rank{rank}.json")
    with open(res_file, "w") as f:
        json.dump(results, f)
    coco_dt = coco.loadRes(res_file)
    coco_eval = COCOeval(coco, coco_dt, "keypoints")
    coco_eval.params.useSegm = None
    coco_eval.params.imgIds = sorted({r["image_id"] for r in results})
    coco_eval.evaluate()
    coco_eval.accumulate()
    coco_eval.summarize()
    return float(coco_eval.stats[0])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", required=True)
    parser.add_argument("--data-root", default="data/coco")
    parser.add_argument("--output", default="output/coco_w32_256x192")
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    os.makedirs(args.output, exist_ok=True)
    torch.manual_seed(cfg.get("seed", 42) + rank)
    np.random.seed(cfg.get("seed", 42) + rank)

    image_size, heatmap_size = cfg["image_size"], cfg["heatmap_size"]
    train_set = COCOKeypoints(args.data_root, "train2017", image_size, heatmap_size, cfg["sigma"], True)
    val_set = COCOKeypoints(args.data_root, "val2017", image_size, heatmap_size, cfg["sigma"], False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_per_gpu"], sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=cfg["test_batch_per_gpu"], sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = get_pose_net(cfg["model"], is_train=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    criterion = JointsMSELoss().cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg["lr_steps"], 0.1)
    scaler = torch.cuda.amp.GradScaler()

    best_ap = 0.0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        train_one_epoch(model, train_loader, criterion, optimizer, scaler, epoch, rank)
        scheduler.step()
        if (epoch + 1) % cfg.get("val_interval", 10) == 0 or epoch + 1 == cfg["epochs"]:
            ap = validate(model, val_loader, val_set.coco, args.output, epoch, rank)
            if rank == 0:
                logger.info("epoch %d  AP %.4f  (best %.4f)", epoch, ap, best_ap)
                if ap > best_ap:
                    best_ap = ap
                    torch.save(model.module.state_dict(), os.path.join(args.output, "model_best.pth"))
        if rank == 0:
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                        "best_ap": best_ap}, os.path.join(args.output, "checkpoint.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
