#!/usr/bin/env python
# Top-down human pose estimation on COCO (SimpleBaseline-style ResNet + deconv head).
# Training with DDP, evaluation with flip test and COCO keypoint AP (OKS).
#
#   torchrun --nproc_per_node=8 02_pose_res50_coco.py --coco /datasets/coco --out work_dirs/res50_256x192
import argparse
import json
import math
import os
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coco", required=True)
    ap.add_argument("--out", default="work_dirs/pose_res50")
    ap.add_argument("--input-size", type=int, nargs=2, default=[192, 256])  # w h
    ap.add_argument("--sigma", type=float, default=2.0)
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=140)
    ap.add_argument("--milestones", type=int, nargs="+", default=[90, 120])
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


def _third(a, b):
    d = a - b
    return b + np.array([-d[1], d[0]], np.float32)


def affine_transform_matrix(center, scale, rot, out_size, inv=False):
    src_w = scale[0] * 200.0
    dst_w, dst_h = out_size
    rad = np.pi * rot / 180.0
    sn, cs = np.sin(rad), np.cos(rad)
    src_dir = np.array([-src_w * 0.5 * sn, src_w * -0.5 * cs], np.float32)
    src = np.zeros((3, 2), np.float32)
    dst = np.zeros((3, 2), np.float32)
    src[0], src[1] = center, center + src_dir
    dst[0] = [dst_w * 0.5, dst_h * 0.5]
    dst[1] = dst[0] + np.array([0, dst_w * -0.5], np.float32)
    src[2], dst[2] = _third(src[0], src[1]), _third(dst[0], dst[1])
    return cv2.getAffineTransform(dst, src) if inv else cv2.getAffineTransform(src, dst)


class CocoTopDown(Dataset):
    def __init__(self, root, split, input_size, sigma, train):
        self.root, self.split, self.train = root, split, train
        self.coco = COCO(os.path.join(root, "annotations", f"person_keypoints_{split}.json"))
        self.w, self.h = input_size
        self.hm_w, self.hm_h = self.w // 4, self.h // 4
        self.sigma = sigma
        self.items = []
        for img_id in sorted(self.coco.getImgIds()):
            info = self.coco.loadImgs(img_id)[0]
            for ann in self.coco.loadAnns(self.coco.getAnnIds(imgIds=img_id, iscrowd=False)):
                if ann["num_keypoints"] == 0 or ann["area"] <= 0:
                    continue
                x, y, bw, bh = ann["bbox"]
                c, s = self._box_to_cs(x, y, bw, bh)
                kps = np.array(ann["keypoints"], np.float32).reshape(-1, 3)
                self.items.append(dict(file=info["file_name"], image_id=img_id, center=c, scale=s, kps=kps))

    def _box_to_cs(self, x, y, w, h):
        c = np.array([x + w * 0.5, y + h * 0.5], np.float32)
        ar = self.w / self.h
        if w > ar * h:
            h = w / ar
        else:
            w = h * ar
        return c, np.array([w / 200.0, h / 200.0], np.float32) * 1.25

    def __len__(self):
        return len(self.items)

    def _render(self, joints, vis):
        tmp = int(self.sigma * 3)
        size = 2 * tmp + 1
        xs = np.arange(size, dtype=np.float32)
        g = np.exp(-((xs - tmp) ** 2 + (xs[:, None] - tmp) ** 2) / (2 * self.sigma ** 2))
        target = np.zeros((len(joints), self.hm_h, self.hm_w), np.float32)
        weight = (vis > 0).astype(np.float32)[:, None]
        for j, (x, y) in enumerate(joints):
            mx, my = int(x / 4 + 0.5), int(y / 4 + 0.5)
            ul, br = (mx - tmp, my - tmp), (mx + tmp + 1, my + tmp + 1)
            if ul[0] >= self.hm_w or ul[1] >= self.hm_h or br[0] < 0 or br[1] < 0:
                weight[j] = 0
                continue
            if weight[j] > 0:
                gx = max(0, -ul[0]), min(br[0], self.hm_w) - ul[0]
                gy = max(0, -ul[1]), min(br[1], self.hm_h) - ul[1]
                ix = max(0, ul[0]), min(br[0], self.hm_w)
                iy = max(0, ul[1]), min(br[1], self.hm_h)
                target[j, iy[0]:iy[1], ix[0]:ix[1]] = g[gy[0]:gy[1], gx[0]:gx[1]]
        return target, weight

    def __getitem__(self, idx):
        it = self.items[idx]
        img = cv2.cvtColor(cv2.imread(os.path.join(self.root, self.split, it["file"])), cv2.COLOR_BGR2RGB)
        c, s, kps = it["center"].copy(), it["scale"].copy(), it["kps"].copy()
        rot = 0.0
        if self.train:
            s = s * np.clip(np.random.randn() * 0.35 + 1, 0.65, 1.35)
            rot = np.clip(np.random.randn() * 45, -90, 90) if np.random.rand() < 0.6 else 0.0
            if np.random.rand() < 0.5:
                img = img[:, ::-1]
                kps[:, 0] = img.shape[1] - kps[:, 0] - 1
                for a, b in FLIP_PAIRS:
                    kps[[a, b]] = kps[[b, a]]
                c[0] = img.shape[1] - c[0] - 1
        trans = affine_transform_matrix(c, s, rot, (self.w, self.h))
        inp = cv2.warpAffine(np.ascontiguousarray(img), trans, (self.w, self.h), flags=cv2.INTER_LINEAR)
        inp = ((inp.astype(np.float32) / 255.0 - MEAN) / STD).transpose(2, 0, 1)
        pts = np.concatenate([kps[:, :2], np.ones((len(kps), 1), np.float32)], 1) @ trans.T
        target, weight = self._render(pts, kps[:, 2])
        meta = dict(center=c, scale=s, image_id=it["image_id"], index=idx)
        return torch.from_numpy(inp), torch.from_numpy(target), torch.from_numpy(weight), meta


class PoseResNet(nn.Module):
    def __init__(self, num_joints=17, deconv_ch=256):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        layers, in_ch = [], 2048
        for _ in range(3):
            layers += [nn.ConvTranspose2d(in_ch, deconv_ch, 4, 2, 1, bias=False),
                       nn.BatchNorm2d(deconv_ch), nn.ReLU(inplace=True)]
            in_ch = deconv_ch
        self.deconv = nn.Sequential(*layers)
        self.final_layer = nn.Conv2d(deconv_ch, num_joints, 1)

    def forward(self, x):
        return self.final_layer(self.deconv(self.backbone(x)))

    @torch.no_grad()
    def predict_with_flip(self, x, flip_pairs):
        hm = self(x)
        hm_f = self(x.flip(3)).flip(3)
        for a, b in flip_pairs:
            hm_f[:, [a, b]] = hm_f[:, [b, a]]
        hm_f[:, :, :, 1:] = hm_f.clone()[:, :, :, :-1]  # align flipped heatmaps
        return (hm + hm_f) * 0.5


def decode_heatmaps(hm, centers, scales, in_size):
    n, k, h, w = hm.shape
    flat = hm.reshape(n, k, -1)
    idx, maxv = flat.argmax(2), flat.max(2)
    coords = np.stack([idx % w, idx // w], -1).astype(np.float32)
    for i in range(n):
        for j in range(k):
            px, py = int(coords[i, j, 0]), int(coords[i, j, 1])
            if 1 < px < w - 1 and 1 < py < h - 1:
                d = np.array([hm[i, j, py, px + 1] - hm[i, j, py, px - 1],
                              hm[i, j, py + 1, px] - hm[i, j, py - 1, px]])
                coords[i, j] += np.sign(d) * 0.25
        t = affine_transform_matrix(centers[i], scales[i], 0, (w, h), inv=True)
        coords[i] = np.concatenate([coords[i], np.ones((k, 1), np.float32)], 1) @ t.T
    return coords, maxv


@torch.no_grad()
def validate(model, loader, dataset, args, rank, world_size):
    model.eval()
    results = []
    for img, _, _, meta in loader:
        hm = model.predict_with_flip(img.cuda(non_blocking=True), FLIP_PAIRS)
        coords, maxv = decode_heatmaps(hm.float().cpu().numpy(), meta["center"].numpy(),
                                       meta["scale"].numpy(), args.input_size)
        for i in range(len(coords)):
            kps = np.concatenate([coords[i], maxv[i][:, None]], 1)
            score = float(maxv[i][maxv[i] > 0.2].mean()) if (maxv[i] > 0.2).any() else 0.0
            results.append(dict(index=int(meta["index"][i]), image_id=int(meta["image_id"][i]),
                                category_id=1, keypoints=kps.reshape(-1).tolist(), score=score))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    ap = 0.0
    if rank == 0:
        merged = {r["index"]: r for part in gathered for r in part}  # drop sampler padding
        dets = [dict(r) for _, r in sorted(merged.items())]
        for d in dets:
            d.pop("index")
        res_file = os.path.join(args.out, "keypoints_val2017_results.json")
        with open(res_file, "w") as f:
            json.dump(dets, f)
        coco_eval = COCOeval(dataset.coco, dataset.coco.loadRes(res_file), "keypoints")
        coco_eval.params.useSegm = None
        coco_eval.evaluate()
        coco_eval.accumulate()
        coco_eval.summarize()
        ap = float(coco_eval.stats[0])
    return ap


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    train_set = CocoTopDown(args.coco, "train2017", args.input_size, args.sigma, train=True)
    val_set = CocoTopDown(args.coco, "val2017", args.input_size, args.sigma, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, args.batch_size * 2, sampler=val_sampler, num_workers=args.workers,
                            pin_memory=True)

    model = PoseResNet().cuda()
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, args.milestones, gamma=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_ap = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for i, (img, target, weight, _) in enumerate(train_loader):
            img, target, weight = img.cuda(non_blocking=True), target.cuda(non_blocking=True), weight.cuda(non_blocking=True)
            out = model(img)
            loss = 0.5 * (((out - target) ** 2).mean(dim=(2, 3)) * weight.squeeze(-1)).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 0 and i % 100 == 0:
                print(f"[{epoch}][{i}/{len(train_loader)}] loss {loss.item():.6f} "
                      f"lr {optimizer.param_groups[0]['lr']:.2e} {time.time() - tic:.1f}s", flush=True)
        scheduler.step()

        if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
            ap = validate(model, val_loader, val_set, args, rank, world_size)
            if rank == 0:
                ckpt = dict(epoch=epoch + 1, state_dict=model.module.state_dict(),
                            optimizer=optimizer.state_dict(), ap=ap)
                torch.save(ckpt, os.path.join(args.out, "latest.pth"))
                if ap > best_ap:
                    best_ap = ap
                    torch.save(ckpt, os.path.join(args.out, "best.pth"))
                print(f"epoch {epoch + 1}: AP {ap:.4f} (best {best_ap:.4f})", flush=True)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
