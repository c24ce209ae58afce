#!/usr/bin/env python
"""HRNet-W32 top-down keypoint trainer (COCO-format annotations, 17 joints).

Used as the base model for the broadcast-footage pose pipeline; we pretrain on
COCO and later fine-tune on our own match annotations.

    torchrun --nproc_per_node=4 train_hrnet_w32.py --data-root /mnt/datasets/coco --out runs/hrnet_w32_256x192
"""
import argparse
import json
import logging
import os
import time

import cv2
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from sportpose.transforms import affine_transform, flip_back, fliplr_joints, get_affine_transform

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)

logger = logging.getLogger("hrnet")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/mnt/datasets/coco")
    p.add_argument("--out", default="runs/hrnet_w32")
    p.add_argument("--epochs", type=int, default=210)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--input-size", type=int, nargs=2, default=[192, 256], help="w h")
    p.add_argument("--sigma", type=float, default=2.0)
    p.add_argument("--resume", default="")
    p.add_argument("--eval-every", type=int, default=10)
    return p.parse_args()


class CocoKeypoints(Dataset):
    def __init__(self, root, split, image_size, sigma, train):
        self.coco = COCO(os.path.join(root, "annotations", f"person_keypoints_{split}.json"))
        self.img_dir = os.path.join(root, split)
        self.image_size = np.array(image_size)
        self.heatmap_size = self.image_size // 4
        self.sigma = sigma
        self.train = train
        self.num_joints = 17
        self.db = self._build_db()

    def _build_db(self):
        db = []
        aspect = self.image_size[0] / self.image_size[1]
        for img_id in self.coco.getImgIds():
            info = self.coco.loadImgs(img_id)[0]
            for ann in self.coco.loadAnns(self.coco.getAnnIds(imgIds=img_id, iscrowd=False)):
                x, y, w, h = ann["bbox"]
                if ann["num_keypoints"] == 0 or w < 1 or h < 1:
                    continue
                center = np.array([x + w * 0.5, y + h * 0.5], dtype=np.float32)
                if w > aspect * h:
                    h = w / aspect
                else:
                    w = h * aspect
                scale = np.array([w / 200.0, h / 200.0], dtype=np.float32) * 1.25
                kpts = np.array(ann["keypoints"], dtype=np.float32).reshape(-1, 3)
                db.append(dict(path=os.path.join(self.img_dir, info["file_name"]), center=center, scale=scale,
                               joints=kpts[:, :2], vis=(kpts[:, 2] > 0).astype(np.float32), image_id=img_id))
        return db

    def __len__(self):
        return len(self.db)

    def _heatmaps(self, joints, vis):
        hm_w, hm_h = int(self.heatmap_size[0]), int(self.heatmap_size[1])
        target = np.zeros((self.num_joints, hm_h, hm_w), dtype=np.float32)
        weight = vis.copy()
        stride = self.image_size / self.heatmap_size
        tmp = int(self.sigma * 3)
        xs = np.arange(0, 2 * tmp + 1, 1, np.float32)
        g = np.exp(-((xs - tmp) ** 2 + (xs[:, None] - tmp) ** 2) / (2 * self.sigma ** 2))
        for j in range(self.num_joints):
            mx = int(joints[j, 0] / stride[0] + 0.5)
            my = int(joints[j, 1] / stride[1] + 0.5)
            ul, br = (mx - tmp, my - tmp), (mx + tmp + 1, my + tmp + 1)
            if ul[0] >= hm_w or ul[1] >= hm_h or br[0] < 0 or br[1] < 0:
                weight[j] = 0
            if weight[j] == 0:
                continue
            gx = max(0, -ul[0]), min(br[0], hm_w) - ul[0]
            gy = max(0, -ul[1]), min(br[1], hm_h) - ul[1]
            ix = max(0, ul[0]), min(br[0], hm_w)
            iy = max(0, ul[1]), min(br[1], hm_h)
            target[j, iy[0]:iy[1], ix[0]:ix[1]] = g[gy[0]:gy[1], gx[0]:gx[1]]
        return target, weight

    def __getitem__(self, idx):
        rec = self.db[idx]
        img = cv2.cvtColor(cv2.imread(rec["path"], cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
        c, s, r = rec["center"].copy(), rec["scale"].copy(), 0.0
        joints, vis = rec["joints"].copy(), rec["vis"].copy()
        if self.train:
            s = s * np.clip(np.random.randn() * 0.35 + 1, 0.65, 1.35)
            if np.random.rand() <= 0.6:
                r = float(np.clip(np.random.randn() * 40, -80, 80))
            if np.random.rand() <= 0.5:
                img = img[:, ::-1, :]
                joints, vis = fliplr_joints(joints, vis, img.shape[1], FLIP_PAIRS)
                c[0] = img.shape[1] - c[0] - 1
        trans = get_affine_transform(c, s, r, self.image_size)
        inp = cv2.warpAffine(np.ascontiguousarray(img), trans, (int(self.image_size[0]), int(self.image_size[1])),
                             flags=cv2.INTER_LINEAR)
        for j in range(self.num_joints):
            if vis[j] > 0:
                joints[j] = affine_transform(joints[j], trans)
        target, weight = self._heatmaps(joints, vis)
        inp = ((inp.astype(np.float32) / 255.0 - MEAN) / STD).transpose(2, 0, 1)
        meta = dict(center=rec["center"], scale=rec["scale"], image_id=rec["image_id"], index=idx)
        return torch.from_numpy(inp), torch.from_numpy(target), torch.from_numpy(weight)[:, None], meta


class HRNetPose(nn.Module):
    def __init__(self, backbone="hrnet_w32", num_joints=17, pretrained=True):
        super().__init__()
        self.backbone = timm.create_model(backbone, pretrained=pretrained, features_only=True,
                                          feature_location="", out_indices=(1,))
        ch = self.backbone.feature_info.channels()[0]
        self.final_layer = nn.Conv2d(ch, num_joints, kernel_size=1)

    def forward(self, x):
        return self.final_layer(self.backbone(x)[0])


class JointsMSELoss(nn.Module):
    def forward(self, output, target, target_weight):
        b, k = output.shape[:2]
        pred = output.reshape(b, k, -1) * target_weight
        gt = target.reshape(b, k, -1) * target_weight
        return 0.5 * nn.functional.mse_loss(pred, gt)


def get_final_preds(heatmaps, center, scale):
    b, k, h, w = heatmaps.shape
    flat = heatmaps.reshape(b, k, -1)
    idx = np.argmax(flat, 2)
    maxvals = np.amax(flat, 2)[..., None]
    coords = np.stack([idx % w, idx // w], axis=-1).astype(np.float32) * (maxvals > 0)
    for n in range(b):
        for j in range(k):
            hm = heatmaps[n, j]
            px, py = int(coords[n, j, 0] + 0.5), int(coords[n, j, 1] + 0.5)
            if 1 < px < w - 1 and 1 < py < h - 1:
                diff = np.array([hm[py, px + 1] - hm[py, px - 1], hm[py + 1, px] - hm[py - 1, px]])
                coords[n, j] += np.sign(diff) * 0.25
    preds = np.zeros_like(coords)
    for n in range(b):
        trans = get_affine_transform(center[n], scale[n], 0, [w, h], inv=1)
        for j in range(k):
            preds[n, j] = affine_transform(coords[n, j], trans)
    return preds, maxvals


def train_one_epoch(model, loader, criterion, optimizer, device, epoch):
    model.train()
    stats = torch.zeros(2, device=device)
    end = time.time()
    for i, (inp, target, weight, _) in enumerate(loader):
        inp = inp.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        weight = weight.to(device, non_blocking=True)
        output = model(inp)
        loss = criterion(output, target, weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        stats[0] += loss.detach() * inp.size(0)
        stats[1] += inp.size(0)
        if i % 100 == 0:
            logger.info("epoch %d [%d/%d] loss %.6f  %.3fs/it", epoch, i, len(loader), loss.item(),
                        (time.time() - end) / (i + 1))
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


@torch.no_grad()
def validate(model, loader, coco_gt, device, out_dir):
    model.eval()
    results = []
    for inp, _, _, meta in loader:
        inp = inp.to(device, non_blocking=True)
        output = model(inp)
        flipped = flip_back(model(torch.flip(inp, [3])).cpu().numpy(), FLIP_PAIRS)
        flipped = torch.from_numpy(flipped.copy()).to(device)
        flipped[:, :, :, 1:] = flipped.clone()[:, :, :, 0:-1]
        heat = ((output + flipped) * 0.5).cpu().numpy()
        preds, maxvals = get_final_preds(heat, meta["center"].numpy(), meta["scale"].numpy())
        for n in range(heat.shape[0]):
            conf = maxvals[n, :, 0]
            score = float(conf[conf > 0.2].mean()) if (conf > 0.2).any() else 0.0
            kpts = np.concatenate([preds[n], maxvals[n]], axis=1)
            results.append(dict(index=int(meta["index"][n]), image_id=int(meta["image_id"][n]), category_id=1,
                                keypoints=kpts.reshape(-1).tolist(), score=score))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() != 0:
        return 0.0
    # DistributedSampler pads the last batch, drop the repeated samples
    merged = {r["index"]: r for part in gathered for r in part}
    res_file = os.path.join(out_dir, "keypoints_val2017_results.json")
    with open(res_file, "w") as f:
        json.dump([{k: v for k, v in r.items() if k != "index"} for r in merged.values()], f)
    coco_eval = COCOeval(coco_gt, coco_gt.loadRes(res_file), "keypoints")
    coco_eval.params.useSegm = None
    coco_eval.evaluate()
    coco_eval.accumulate()
    coco_eval.summarize()
    return float(coco_eval.stats[0])


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [rank%(process)d] %(message)s")
    torch.backends.cudnn.benchmark = True
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    train_set = CocoKeypoints(args.data_root, "train2017", args.input_size, args.sigma, train=True)
    val_set = CocoKeypoints(args.data_root, "val2017", args.input_size, args.sigma, train=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=DistributedSampler(train_set, shuffle=True),
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size * 2, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    model = HRNetPose("hrnet_w32")
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    criterion = JointsMSELoss()
    # 32 img/GPU x 4 GPUs, same as the reference w32_256x192_adam_lr1e-3 setup
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[170, 200], gamma=0.1)

    start_epoch, best_ap = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_ap = ckpt["epoch"] + 1, ckpt["best_ap"]
        logger.info("resumed from %s (epoch %d)", args.resume, start_epoch)

    for epoch in range(start_epoch, args.epochs):
        train_loss = train_one_epoch(model, train_loader, criterion, optimizer, device, epoch)
        scheduler.step()
        logger.info("epoch %d train loss %.6f lr %.2e", epoch, train_loss, scheduler.get_last_lr()[0])

        ap = 0.0
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            ap = validate(model, val_loader, val_set.coco, device, args.out)
            logger.info("epoch %d val AP %.4f", epoch, ap)

        if rank == 0:
            is_best = ap > best_ap
            best_ap = max(ap, best_ap)
            state = dict(epoch=epoch, model=model.module.state_dict(), optimizer=optimizer.state_dict(),
                         scheduler=scheduler.state_dict(), best_ap=best_ap)
            torch.save(state, os.path.join(args.out, "checkpoint.pth"))
            if is_best:
                torch.save(state["model"], os.path.join(args.out, "model_best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
