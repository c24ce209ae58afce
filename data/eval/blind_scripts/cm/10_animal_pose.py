"""
Animal keypoint detection (top-down, 17 keypoints) on an in-house COCO-format
annotation file that has no official train/val split.  A fixed fraction of the
images is held out for validation (PCK@0.05 of the bbox diagonal).

    torchrun --nproc_per_node=4 10_animal_pose.py \
        --ann /data/animals/annotations/keypoints_all.json --img-dir /data/animals/images
"""
import argparse
import os
import random
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from pycocotools.coco import COCO
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

IN_W, IN_H = 256, 256
HM_W, HM_H = 64, 64
FLIP_IDX = [1, 0, 2, 3, 4, 8, 9, 10, 5, 6, 7, 14, 15, 16, 11, 12, 13]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ann", required=True)
    p.add_argument("--img-dir", required=True)
    p.add_argument("--out", default="runs/animal_pose")
    p.add_argument("--val-ratio", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--sigma", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def split_images(coco, val_ratio):
    ids = sorted(coco.getImgIds())
    random.shuffle(ids)
    n_val = int(round(len(ids) * val_ratio))
    return ids[n_val:], ids[:n_val]


class AnimalPose(Dataset):
    def __init__(self, coco, img_ids, img_dir, sigma, train):
        self.coco, self.img_dir, self.sigma, self.train = coco, img_dir, sigma, train
        self.anns = []
        for img_id in img_ids:
            for a in coco.loadAnns(coco.getAnnIds(imgIds=img_id, iscrowd=False)):
                if a.get("num_keypoints", 0) > 0 and a["bbox"][2] > 4 and a["bbox"][3] > 4:
                    self.anns.append(a)

    def __len__(self):
        return len(self.anns)

    def __getitem__(self, i):
        a = self.anns[i]
        info = self.coco.loadImgs(a["image_id"])[0]
        img = cv2.cvtColor(cv2.imread(os.path.join(self.img_dir, info["file_name"])), cv2.COLOR_BGR2RGB)
        kps = np.array(a["keypoints"], np.float32).reshape(-1, 3)
        x, y, w, h = a["bbox"]
        cx, cy, side = x + w / 2, y + h / 2, max(w, h) * 1.25
        rot = 0.0
        if self.train:
            side *= random.uniform(0.75, 1.25)
            rot = random.uniform(-40, 40) if random.random() < 0.5 else 0.0
            if random.random() < 0.5:
                img = img[:, ::-1].copy()
                cx = img.shape[1] - 1 - cx
                kps[:, 0] = img.shape[1] - 1 - kps[:, 0]
                kps = kps[FLIP_IDX]
        M = cv2.getRotationMatrix2D((cx, cy), rot, IN_W / side)
        M[0, 2] += IN_W / 2 - cx
        M[1, 2] += IN_H / 2 - cy
        crop = cv2.warpAffine(img, M, (IN_W, IN_H))
        pts = np.c_[kps[:, :2], np.ones(len(kps))] @ M.T
        hm = np.zeros((len(kps), HM_H, HM_W), np.float32)
        vis = np.zeros(len(kps), np.float32)
        gx, gy = np.arange(HM_W), np.arange(HM_H)[:, None]
        for j, (px, py) in enumerate(pts / (IN_W / HM_W)):
            if kps[j, 2] > 0 and 0 <= px < HM_W and 0 <= py < HM_H:
                hm[j] = np.exp(-((gx - px) ** 2 + (gy - py) ** 2) / (2 * self.sigma ** 2))
                vis[j] = 1
        t = torch.from_numpy(crop).permute(2, 0, 1).float() / 255.0
        t = torchvision.transforms.functional.normalize(t, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        bbox_diag = np.hypot(w, h) * IN_W / side
        return t, torch.from_numpy(hm), torch.from_numpy(vis), torch.from_numpy(pts.astype(np.float32)), \
            torch.tensor(bbox_diag, dtype=torch.float32)


class EvalShard(Sampler):
    def __init__(self, n, rank, world):
        self.idx = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


def build_model(num_kpts=17):
    r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
    layers = list(r.children())[:-2]
    ch = 2048
    for _ in range(3):
        layers += [nn.ConvTranspose2d(ch, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True)]
        ch = 256
    layers.append(nn.Conv2d(256, num_kpts, 1))
    return nn.Sequential(*layers)


@torch.no_grad()
def pck(model, loader, thr=0.05):
    model.eval()
    acc = torch.zeros(2, device="cuda", dtype=torch.float64)
    for img, _, vis, pts, diag in loader:
        hm = model(img.cuda(non_blocking=True))
        n, k, h, w = hm.shape
        am = hm.flatten(2).argmax(-1)
        pred = torch.stack([am % w, am // w], -1).float() * (IN_W / HM_W)
        d = torch.linalg.norm(pred - pts.cuda()[..., :2], dim=-1)
        v = vis.cuda() > 0
        acc[0] += ((d < thr * diag.cuda()[:, None]) & v).sum()
        acc[1] += v.sum()
    dist.all_reduce(acc)
    return (acc[0] / acc[1].clamp(min=1)).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    seed_everything(args.seed + rank)  # a different augmentation stream on every process

    coco = COCO(args.ann)
    train_ids, val_ids = split_images(coco, args.val_ratio)
    train_set = AnimalPose(coco, train_ids, args.img_dir, args.sigma, train=True)
    val_set = AnimalPose(coco, val_ids, args.img_dir, args.sigma, train=False)
    if rank == 0:
        print(f"{len(train_set)} train instances / {len(val_set)} val instances", flush=True)

    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 64, sampler=EvalShard(len(val_set), rank, world), num_workers=4)

    net = build_model().cuda()
    model = DDP(net, device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.epochs, eta_min=1e-6)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (img, hm, vis, _, _) in enumerate(train_loader):
            img, hm, vis = img.cuda(non_blocking=True), hm.cuda(non_blocking=True), vis.cuda(non_blocking=True)
            out = model(img)
            loss = ((out - hm) ** 2).mean((2, 3)).mul(vis).sum() / vis.sum().clamp(min=1)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.5f}", flush=True)
        sched.step()

        acc = pck(net, val_loader)
        if rank == 0:
            print(f"epoch {epoch}: PCK@0.05 {acc:.4f}  ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "epoch": epoch, "pck": acc}, os.path.join(args.out, "last.pt"))
            if acc > best:
                best = acc
                torch.save({"model": net.state_dict(), "epoch": epoch, "pck": acc}, os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
