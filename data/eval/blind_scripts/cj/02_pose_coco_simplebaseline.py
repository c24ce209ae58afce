"""SimpleBaseline (ResNet-50 + deconv head) top-down pose estimation on COCO keypoints.

torchrun --nproc_per_node=8 02_pose_coco_simplebaseline.py --data-root /datasets/coco
"""
import argparse
import json
import os
import pickle
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
    ap.add_argument("--data-root", default="/datasets/coco")
    ap.add_argument("--cache-dir", default="./cache")
    ap.add_argument("--work-dir", default="./work_dirs/simplebaseline_r50_256x192")
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--epochs", type=int, default=140)
    ap.add_argument("--base-lr", type=float, default=1e-3, help="for 8 GPUs x 32")
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--sigma", type=float, default=2.0)
    return ap.parse_args()


def box_to_center_scale(box, aspect_ratio=192 / 256, padding=1.25):
    x, y, w, h = box
    center = np.array([x + 0.5 * w, y + 0.5 * h], np.float32)
    if w > aspect_ratio * h:
        h = w / aspect_ratio
    else:
        w = h * aspect_ratio
    return center, np.array([w, h], np.float32) * padding


def affine_matrix(center, scale, rot, out_size, inv=False):
    w, h = out_size
    rad = np.deg2rad(rot)
    cs, sn = np.cos(rad), np.sin(rad)
    src_dir = np.array([-0.5 * scale[0] * sn, -0.5 * scale[0] * cs], np.float32)
    src = np.stack([center, center + src_dir, center + np.array([-src_dir[1], src_dir[0]])]).astype(np.float32)
    dst_c = np.array([0.5 * w, 0.5 * h], np.float32)
    dst_dir = np.array([0, -0.5 * w], np.float32)
    dst = np.stack([dst_c, dst_c + dst_dir, dst_c + np.array([-dst_dir[1], dst_dir[0]])]).astype(np.float32)
    return cv2.getAffineTransform(dst, src) if inv else cv2.getAffineTransform(src, dst)


class CocoTopDown(Dataset):
    def __init__(self, root, split, cache_dir, train, image_size=(192, 256), heatmap_size=(48, 64), sigma=2.0):
        self.img_dir = os.path.join(root, f"{split}2017")
        self.ann_file = os.path.join(root, "annotations", f"person_keypoints_{split}2017.json")
        self.train, self.image_size, self.heatmap_size, self.sigma = train, image_size, heatmap_size, sigma
        cache_file = os.path.join(cache_dir, f"coco_{split}_db.pkl")
        if os.path.exists(cache_file):
            with open(cache_file, "rb") as f:
                self.db = pickle.load(f)
        else:
            self.db = self._build_db()
            os.makedirs(cache_dir, exist_ok=True)
            with open(cache_file, "wb") as f:
                pickle.dump(self.db, f)

    def _build_db(self):
        coco = COCO(self.ann_file)
        db = []
        for img_id in coco.getImgIds():
            info = coco.loadImgs(img_id)[0]
            for ann in coco.loadAnns(coco.getAnnIds(imgIds=img_id, iscrowd=False)):
                if ann["num_keypoints"] == 0 or ann["area"] <= 0:
                    continue
                x, y, w, h = ann["bbox"]
                x1, y1 = max(0, x), max(0, y)
                x2, y2 = min(info["width"] - 1, x1 + max(0, w - 1)), min(info["height"] - 1, y1 + max(0, h - 1))
                if x2 < x1 or y2 < y1:
                    continue
                center, scale = box_to_center_scale([x1, y1, x2 - x1, y2 - y1])
                kpts = np.array(ann["keypoints"], np.float32).reshape(-1, 3)
                db.append({"file": info["file_name"], "image_id": img_id, "center": center, "scale": scale,
                           "joints": kpts[:, :2], "vis": (kpts[:, 2] > 0).astype(np.float32)})
        return db

    def __len__(self):
        return len(self.db)

    def __getitem__(self, idx):
        rec = self.db[idx]
        img = cv2.cvtColor(cv2.imread(os.path.join(self.img_dir, rec["file"])), cv2.COLOR_BGR2RGB)
        joints, vis = rec["joints"].copy(), rec["vis"].copy()
        center, scale, rot = rec["center"].copy(), rec["scale"].copy(), 0.0
        if self.train:
            scale = scale * np.clip(np.random.randn() * 0.35 + 1, 0.65, 1.35)
            rot = np.clip(np.random.randn() * 45, -90, 90) if np.random.rand() < 0.6 else 0.0
            if np.random.rand() < 0.5:
                img = img[:, ::-1]
                joints[:, 0] = img.shape[1] - 1 - joints[:, 0]
                center[0] = img.shape[1] - 1 - center[0]
                for a, b in FLIP_PAIRS:
                    joints[[a, b]], vis[[a, b]] = joints[[b, a]], vis[[b, a]]
        trans = affine_matrix(center, scale, rot, self.image_size)
        patch = cv2.warpAffine(np.ascontiguousarray(img), trans, self.image_size, flags=cv2.INTER_LINEAR)
        joints = np.concatenate([joints, np.ones((len(joints), 1), np.float32)], 1) @ trans.T
        target, weight = self._heatmaps(joints, vis)
        patch = (patch.astype(np.float32) / 255.0 - MEAN) / STD
        meta = {"center": rec["center"], "scale": rec["scale"], "image_id": rec["image_id"], "index": idx}
        return torch.from_numpy(patch.transpose(2, 0, 1)), torch.from_numpy(target), torch.from_numpy(weight), meta

    def _heatmaps(self, joints, vis):
        hw, hh = self.heatmap_size
        stride = self.image_size[0] / hw
        xs, ys = np.arange(hw, dtype=np.float32), np.arange(hh, dtype=np.float32)[:, None]
        target = np.zeros((len(joints), hh, hw), np.float32)
        weight = vis.copy()
        for j, (x, y) in enumerate(joints):
            mx, my = int(x / stride + 0.5), int(y / stride + 0.5)
            if weight[j] == 0 or not (0 <= mx < hw and 0 <= my < hh):
                weight[j] = 0
                continue
            target[j] = np.exp(-((xs - mx) ** 2 + (ys - my) ** 2) / (2 * self.sigma ** 2))
        return target, weight[:, None]


class PoseResNet(nn.Module):
    def __init__(self, num_joints=17):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        layers, in_ch = [], 2048
        for _ in range(3):
            layers += [nn.ConvTranspose2d(in_ch, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True)]
            in_ch = 256
        self.deconv = nn.Sequential(*layers)
        self.final = nn.Conv2d(256, num_joints, 1)

    def forward(self, x):
        return self.final(self.deconv(self.backbone(x)))


def joints_mse(pred, target, weight):
    return 0.5 * (((pred - target) ** 2) * weight.unsqueeze(-1)).mean()


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    results = []
    for imgs, _, _, meta in loader:
        imgs = imgs.to(device, non_blocking=True)
        hm = model(imgs)
        hm_flip = model(imgs.flip(3)).flip(3)
        for a, b in FLIP_PAIRS:
            hm_flip[:, [a, b]] = hm_flip[:, [b, a]]
        hm = (hm + hm_flip) * 0.5
        n, j, h, w = hm.shape
        maxvals, idx = hm.reshape(n, j, -1).max(dim=2)
        coords = torch.stack([idx % w, idx // w], dim=2).float().cpu().numpy()
        maxvals = maxvals.cpu().numpy()
        for i in range(n):
            c, s = meta["center"][i].numpy(), meta["scale"][i].numpy()
            xy = coords[i] * (s / np.array([w, h])) + c - 0.5 * s
            kpts = np.concatenate([xy, maxvals[i][:, None]], 1)
            results.append({"index": int(meta["index"][i]), "image_id": int(meta["image_id"][i]),
                            "category_id": 1, "keypoints": kpts.reshape(-1).tolist(),
                            "score": float(maxvals[i].mean())})
    return results


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.backends.cudnn.benchmark = True

    train_set = CocoTopDown(args.data_root, "train", args.cache_dir, train=True, sigma=args.sigma)
    val_set = CocoTopDown(args.data_root, "val", args.cache_dir, train=False, sigma=args.sigma)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=64, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PoseResNet()).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    lr = args.base_lr * world * args.batch_size / 256
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [90, 120], 0.1)

    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        print(f"{len(train_set)} train instances, {len(val_set)} val instances, lr {lr:.2e}", flush=True)

    best_ap = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for step, (imgs, target, weight, _) in enumerate(train_loader):
            imgs = imgs.to(device, non_blocking=True)
            target, weight = target.to(device, non_blocking=True), weight.to(device, non_blocking=True)
            loss = joints_mse(model(imgs), target, weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step % 100 == 0:
                reduced = loss.detach().clone()
                dist.all_reduce(reduced, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} it {step}/{len(train_loader)} loss {reduced.item():.6f} "
                          f"{time.time() - tic:.0f}s", flush=True)
        scheduler.step()

        if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
            local = predict(model.module, val_loader, device)
            gathered = [None] * world
            dist.all_gather_object(gathered, local)
            ap = torch.zeros(1, device=device)
            if rank == 0:
                dedup = {r["index"]: r for part in gathered for r in part}
                res_file = os.path.join(args.work_dir, f"results_ep{epoch + 1}.json")
                with open(res_file, "w") as f:
                    json.dump([{k: v for k, v in r.items() if k != "index"} for r in dedup.values()], f)
                coco_gt = COCO(val_set.ann_file)
                coco_eval = COCOeval(coco_gt, coco_gt.loadRes(res_file), "keypoints")
                coco_eval.evaluate()
                coco_eval.accumulate()
                coco_eval.summarize()
                ap[0] = coco_eval.stats[0]
            dist.broadcast(ap, src=0)
            if rank == 0:
                ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch + 1, "ap": ap.item()}
                torch.save(ckpt, os.path.join(args.work_dir, "latest.pth"))
                if ap.item() > best_ap:
                    torch.save(ckpt, os.path.join(args.work_dir, "best.pth"))
            best_ap = max(best_ap, ap.item())

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
