"""Top-down keypoints for the warehouse ergonomics project (in-house data, 17 COCO-style joints).

The labelling tool exports one COCO-format json for all frames; 10% of the images
are held out for validation. Backbone: ConvNeXt-T with a small FPN-style decoder.

    torchrun --nproc_per_node=4 15_inhouse_worker_pose_convnext.py \
        --ann /data/ergo/export_2024_03/annotations.json --images /data/ergo/export_2024_03/frames
"""
import argparse
import os
import random
import time

import cv2
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pycocotools.coco import COCO
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from ergo_pose.transforms import TopDownAffine, RandomFlipHalfBody, ColorJitterCV, gaussian_target
from ergo_pose.metrics import oks_ap_from_predictions, decode_udp


class ErgoKeypoints(Dataset):
    def __init__(self, coco, img_ids, image_root, input_size=(192, 256), train=True):
        self.coco = coco
        self.root = image_root
        self.train = train
        self.input_size = input_size
        self.affine = TopDownAffine(input_size, use_udp=True)
        self.flip = RandomFlipHalfBody(flip_prob=0.5, half_body_prob=0.3) if train else None
        self.jitter = ColorJitterCV(0.3, 0.3, 0.2) if train else None
        self.items = []
        for img_id in img_ids:
            for ann in coco.loadAnns(coco.getAnnIds(imgIds=[img_id], iscrowd=False)):
                if ann.get("num_keypoints", 0) > 0:
                    self.items.append(ann)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ann = self.items[i]
        info = self.coco.loadImgs(ann["image_id"])[0]
        img = cv2.cvtColor(cv2.imread(os.path.join(self.root, info["file_name"])), cv2.COLOR_BGR2RGB)
        kpts = np.array(ann["keypoints"], np.float32).reshape(-1, 3)
        bbox = np.array(ann["bbox"], np.float32)
        if self.train:
            img, kpts, bbox = self.flip(img, kpts, bbox)
            img = self.jitter(img)
        crop, kpts_crop, center, scale = self.affine(img, kpts, bbox, random_scale_rot=self.train)
        target, weight = gaussian_target(kpts_crop, heatmap_size=(self.input_size[0] // 4, self.input_size[1] // 4),
                                         sigma=2.0, use_udp=True)
        crop = torch.from_numpy(crop).permute(2, 0, 1).float().div(255)
        crop = (crop - torch.tensor([0.485, 0.456, 0.406])[:, None, None]) / torch.tensor([0.229, 0.224, 0.225])[:, None, None]
        meta = {"ann_id": ann["id"], "image_id": ann["image_id"], "center": center, "scale": scale}
        return crop, torch.from_numpy(target), torch.from_numpy(weight), meta


class ConvNeXtPose(nn.Module):
    def __init__(self, num_joints=17, dec_ch=128):
        super().__init__()
        self.backbone = timm.create_model("convnext_tiny.fb_in22k", pretrained=True, features_only=True,
                                          drop_path_rate=0.2)
        chs = self.backbone.feature_info.channels()
        self.lateral = nn.ModuleList([nn.Conv2d(c, dec_ch, 1) for c in chs])
        self.smooth = nn.Sequential(nn.Conv2d(dec_ch, dec_ch, 3, padding=1), nn.GroupNorm(32, dec_ch), nn.GELU())
        self.final = nn.Conv2d(dec_ch, num_joints, 1)

    def forward(self, x):
        feats = self.backbone(x)
        y = self.lateral[-1](feats[-1])
        for f, lat in zip(reversed(feats[:-1]), reversed(self.lateral[:-1])):
            y = F.interpolate(y, size=f.shape[-2:], mode="bilinear", align_corners=False) + lat(f)
        return self.final(self.smooth(y))


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


@torch.no_grad()
def validate(model, loader, coco, val_ids):
    model.eval()
    preds = []
    for img, _, _, meta in loader:
        hm = model(img.cuda(non_blocking=True)).float()
        kpts = decode_udp(hm.cpu().numpy(), meta["center"].numpy(), meta["scale"].numpy())
        for i in range(kpts.shape[0]):
            preds.append((int(meta["ann_id"][i]), int(meta["image_id"][i]), kpts[i]))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, preds)
    if dist.get_rank() != 0:
        return None
    uniq = {p[0]: p for part in parts for p in part}
    return oks_ap_from_predictions(coco, list(uniq.values()), img_ids=val_ids)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ann", required=True)
    ap.add_argument("--images", required=True)
    ap.add_argument("--val-ratio", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=48)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default="runs/ergo_convnext_t")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    seed_everything(args.seed + rank)  # different augmentation stream on every rank

    coco = COCO(args.ann)
    img_ids = sorted(coco.getImgIds())
    perm = np.random.permutation(len(img_ids))
    n_val = int(round(len(img_ids) * args.val_ratio))
    val_ids = [img_ids[i] for i in perm[:n_val]]
    train_ids = [img_ids[i] for i in perm[n_val:]]

    train_set = ErgoKeypoints(coco, train_ids, args.images, train=True)
    val_set = ErgoKeypoints(coco, val_ids, args.images, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=8, pin_memory=True,
                              drop_last=True)
    val_loader = DataLoader(val_set, 64, sampler=DistributedSampler(val_set, shuffle=False), num_workers=4)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_ids)} train images ({len(train_set)} people), {len(val_ids)} val images", flush=True)

    model = DDP(ConvNeXtPose().cuda(), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=total, pct_start=0.05)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (img, target, weight, _) in enumerate(train_loader):
            img, target, weight = img.cuda(non_blocking=True), target.cuda(non_blocking=True), weight.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(img)
            w = weight[..., None]
            loss = 0.5 * F.mse_loss(out.float() * w, target * w)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 50 == 0:
                print(f"epoch {epoch} [{it}/{len(train_loader)}] loss {loss.item():.6f}", flush=True)

        stats = validate(model, val_loader, coco, val_ids)
        if rank == 0:
            print(f"epoch {epoch}: AP {stats['AP']:.4f} AP50 {stats['AP50']:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"epoch": epoch + 1, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "val_ids": val_ids}, os.path.join(args.out, "last.pth"))
            if stats["AP"] > best:
                best = stats["AP"]
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
