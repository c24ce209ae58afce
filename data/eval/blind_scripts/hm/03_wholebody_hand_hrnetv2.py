# Hand keypoint estimation on COCO-WholeBody hands (21 kpts), HRNetV2-W18 top-down.
# Launch: torchrun --nproc_per_node=4 03_wholebody_hand_hrnetv2.py --work-dir work_dirs/hand_hrnetv2_w18
import argparse
import json
import os
import os.path as osp
import random
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from models.hrnet import HRNet
from core.transforms import get_affine_transform, warp_points

CFG = dict(
    data_root="data/coco",
    ann_train="annotations/coco_wholebody_train_v1.0.json",
    ann_val="annotations/coco_wholebody_val_v1.0.json",
    input_size=(256, 256),
    heatmap_size=(64, 64),
    sigma=2,
    num_joints=21,
    extra=dict(stage1=dict(num_modules=1, num_branches=1, block="BOTTLENECK", num_blocks=(4,), num_channels=(64,)),
               stage2=dict(num_modules=1, num_branches=2, block="BASIC", num_blocks=(4, 4), num_channels=(18, 36)),
               stage3=dict(num_modules=4, num_branches=3, block="BASIC", num_blocks=(4, 4, 4), num_channels=(18, 36, 72)),
               stage4=dict(num_modules=3, num_branches=4, block="BASIC", num_blocks=(4, 4, 4, 4),
                           num_channels=(18, 36, 72, 144), multiscale_output=True)),
    pretrained="checkpoints/hrnetv2_w18_imagenet.pth",
    samples_per_gpu=32,
    lr=5e-4,
    epochs=210,
    lr_steps=(170, 200),
    warmup_iters=500,
)


class WholeBodyHands(Dataset):
    """Left and right hand boxes of COCO-WholeBody, one sample per valid hand box."""

    def __init__(self, root, ann, split, cfg, train):
        self.img_dir = osp.join(root, split)
        self.train = train
        self.in_w, self.in_h = cfg["input_size"]
        self.hm_w, self.hm_h = cfg["heatmap_size"]
        self.sigma = cfg["sigma"]
        data = json.load(open(osp.join(root, ann)))
        images = {im["id"]: im["file_name"] for im in data["images"]}
        self.items = []
        for a in data["annotations"]:
            for side in ("lefthand", "righthand"):
                if not a[f"{side}_valid"]:
                    continue
                kpts = np.array(a[f"{side}_kpts"], np.float32).reshape(21, 3)
                self.items.append(dict(file=images[a["image_id"]], box=a[f"{side}_box"], kpts=kpts,
                                       image_id=a["image_id"]))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        img = cv2.imread(osp.join(self.img_dir, it["file"]), cv2.IMREAD_COLOR)
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        x, y, w, h = it["box"]
        center = np.array([x + w / 2, y + h / 2], np.float32)
        size = max(w, h) * 1.25
        kpts = it["kpts"].copy()
        rot = 0.0
        if self.train:
            size *= random.uniform(0.75, 1.25)
            rot = random.uniform(-90, 90) if random.random() < 0.6 else 0.0
            center += np.random.uniform(-0.05, 0.05, 2).astype(np.float32) * size
        trans = get_affine_transform(center, np.array([size, size]) / 200.0, rot, (self.in_w, self.in_h))
        crop = cv2.warpAffine(img, trans, (self.in_w, self.in_h), flags=cv2.INTER_LINEAR)
        kpts[:, :2] = warp_points(kpts[:, :2], trans)
        if self.train:
            crop = crop.astype(np.float32)
            crop *= random.uniform(0.8, 1.2)
            crop = np.clip(crop, 0, 255)
        target, weight = self.heatmaps(kpts)
        crop = (crop.astype(np.float32) / 255.0 - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
        crop = torch.from_numpy(crop.transpose(2, 0, 1).astype(np.float32))
        box_size = torch.tensor(size, dtype=torch.float32)
        return crop, torch.from_numpy(target), torch.from_numpy(weight), torch.from_numpy(kpts), box_size

    def heatmaps(self, kpts):
        feat_stride = self.in_w / self.hm_w
        target = np.zeros((21, self.hm_h, self.hm_w), np.float32)
        weight = (kpts[:, 2] > 0).astype(np.float32)[:, None]
        xs = np.arange(self.hm_w, dtype=np.float32)[None, :]
        ys = np.arange(self.hm_h, dtype=np.float32)[:, None]
        for j in range(21):
            if weight[j] == 0:
                continue
            mx, my = kpts[j, 0] / feat_stride, kpts[j, 1] / feat_stride
            if mx < -3 * self.sigma or my < -3 * self.sigma or mx >= self.hm_w + 3 * self.sigma or my >= self.hm_h + 3 * self.sigma:
                weight[j] = 0
                continue
            target[j] = np.exp(-((xs - mx) ** 2 + (ys - my) ** 2) / (2 * self.sigma ** 2))
        return target, weight


class HandPoseNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.backbone = HRNet(cfg["extra"])
        ch = sum(cfg["extra"]["stage4"]["num_channels"])
        self.head = nn.Sequential(nn.Conv2d(ch, ch, 1), nn.BatchNorm2d(ch), nn.ReLU(inplace=True),
                                  nn.Conv2d(ch, cfg["num_joints"], 1))

    def forward(self, x):
        feats = self.backbone(x)
        size = feats[0].shape[-2:]
        x = torch.cat([feats[0]] + [F.interpolate(f, size=size, mode="bilinear", align_corners=False) for f in feats[1:]], 1)
        return self.head(x)


def keypoint_mse(pred, target, weight):
    w = weight.unsqueeze(-1)
    return 0.5 * F.mse_loss(pred.flatten(2) * w, target.flatten(2) * w)


@torch.no_grad()
def evaluate(model, loader, device, stride=4.0):
    model.eval()
    correct = torch.zeros(2, device=device)  # pck hits, visible joints
    epe_sum = torch.zeros(1, device=device)
    for img, _, _, kpts, box_size in loader:
        img, kpts, box_size = img.to(device), kpts.to(device), box_size.to(device)
        hm = model(img)
        b, k, h, w = hm.shape
        idx = hm.flatten(2).argmax(-1)
        pred = torch.stack([(idx % w).float(), (idx // w).float()], -1) * stride
        vis = kpts[..., 2] > 0
        dist_px = (pred - kpts[..., :2]).norm(dim=-1)
        # PCK@0.2 of the crop size (crop is square, input_size = 256)
        correct[0] += ((dist_px < 0.2 * 256) & vis).sum()
        correct[1] += vis.sum()
        epe_sum += (dist_px * vis).sum()
    dist.all_reduce(correct)
    dist.all_reduce(epe_sum)
    return (correct[0] / correct[1].clamp(min=1)).item(), (epe_sum / correct[1].clamp(min=1)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work-dir", default="work_dirs/hand_hrnetv2_w18")
    ap.add_argument("--resume", default="")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    cfg = CFG

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_set = WholeBodyHands(cfg["data_root"], cfg["ann_train"], "train2017", cfg, train=True)
    val_set = WholeBodyHands(cfg["data_root"], cfg["ann_val"], "val2017", cfg, train=False)
    train_sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, cfg["samples_per_gpu"], sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    world = dist.get_world_size()
    # every hand exactly once across ranks (no sampler padding), summed with all_reduce
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), 64, shuffle=False, num_workers=4)

    model = HandPoseNet(cfg)
    state = torch.load(cfg["pretrained"], map_location="cpu")
    missing, _ = model.backbone.load_state_dict(state, strict=False)
    if rank == 0:
        print(f"loaded ImageNet weights, {len(missing)} missing keys")
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg["lr_steps"], gamma=0.1)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"]

    os.makedirs(args.work_dir, exist_ok=True)
    it = start_epoch * len(train_loader)
    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for img, target, weight, _, _ in train_loader:
            if weight.sum() == 0:
                continue  # no labelled joint in this batch
            img = img.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            weight = weight.to(device, non_blocking=True)
            if it < cfg["warmup_iters"]:
                for g in optimizer.param_groups:
                    g["lr"] = cfg["lr"] * (0.001 + 0.999 * it / cfg["warmup_iters"])
            loss = keypoint_mse(model(img), target, weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            it += 1
            if rank == 0 and it % 50 == 0:
                print(f"[{epoch}] it {it} loss {loss.item():.6f} lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)
        sched.step()

        if (epoch + 1) % 10 == 0:
            pck, epe = evaluate(model.module, val_loader, device)
            if rank == 0:
                print(f"epoch {epoch + 1}: PCK@0.2 {pck:.4f}  EPE {epe:.2f}px  ({time.time() - t0:.0f}s)", flush=True)
        if rank == 0:
            torch.save(dict(epoch=epoch + 1, model=model.module.state_dict(), optimizer=optimizer.state_dict(),
                            scheduler=sched.state_dict()), osp.join(args.work_dir, "latest.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
