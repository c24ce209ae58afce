"""Track R-CNN style MOTS on BDD100K seg_track_20: Mask R-CNN with an association
embedding head trained with a batch-hard triplet loss across two frames of a video.

The official val split is kept for the final report; model selection during training
uses a held-out 10% of the train videos.
"""
import argparse
import glob
import json
import os
import random
import time
from collections import defaultdict

import numpy as np
import pycocotools.mask as mask_utils
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.detection import maskrcnn_resnet50_fpn_v2
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.models.detection.mask_rcnn import MaskRCNNPredictor
from torchvision.ops import MultiScaleRoIAlign
from torchvision.transforms.functional import to_tensor

CLASSES = ["pedestrian", "rider", "car", "truck", "bus", "train", "motorcycle", "bicycle"]


def read_scalabel(label_dir):
    videos = defaultdict(list)
    for path in sorted(glob.glob(os.path.join(label_dir, "*.json"))):
        with open(path) as f:
            for fr in json.load(f):
                videos[fr["videoName"]].append(fr)
    for v in videos.values():
        v.sort(key=lambda fr: fr["frameIndex"])
    return videos


class FramePairs(Dataset):
    def __init__(self, img_root, videos, names, gap=3):
        self.img_root, self.videos, self.gap = img_root, videos, gap
        self.items = [(n, i) for n in names for i, fr in enumerate(videos[n]) if fr.get("labels")]

    def __len__(self):
        return len(self.items)

    def frame(self, name, i):
        fr = self.videos[name][i]
        img = to_tensor(Image.open(os.path.join(self.img_root, name, fr["name"])).convert("RGB"))
        boxes, labels, masks, ids = [], [], [], []
        for lab in fr.get("labels") or []:
            if lab["category"] not in CLASSES or lab.get("attributes", {}).get("ignored"):
                continue
            m = mask_utils.decode(lab["rle"])
            ys, xs = np.nonzero(m)
            if len(xs) < 16:
                continue
            boxes.append([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])
            labels.append(CLASSES.index(lab["category"]) + 1)
            masks.append(m)
            ids.append(int(lab["id"]))
        return img, {"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
                     "labels": torch.tensor(labels, dtype=torch.int64),
                     "masks": torch.from_numpy(np.stack(masks)) if masks else torch.zeros(0, *img.shape[-2:], dtype=torch.uint8),
                     "ids": torch.tensor(ids, dtype=torch.int64)}

    def __getitem__(self, k):
        name, i = self.items[k]
        j = min(max(i + random.randint(-self.gap, self.gap), 0), len(self.videos[name]) - 1)
        return self.frame(name, i), self.frame(name, j)


class TrackRCNN(nn.Module):
    def __init__(self, emb_dim=128):
        super().__init__()
        self.det = maskrcnn_resnet50_fpn_v2(weights="DEFAULT", min_size=720, max_size=1280)
        self.det.roi_heads.box_predictor = FastRCNNPredictor(1024, len(CLASSES) + 1)
        self.det.roi_heads.mask_predictor = MaskRCNNPredictor(256, 256, len(CLASSES) + 1)
        self.pool = MultiScaleRoIAlign(["0", "1", "2", "3"], 7, 2)
        self.assoc = nn.Sequential(nn.Flatten(), nn.Linear(256 * 49, 1024), nn.ReLU(inplace=True), nn.Linear(1024, emb_dim))

    def embed(self, feats, boxes, sizes):
        return self.assoc(self.pool(feats, boxes, sizes))

    def forward(self, imgs, tgts):
        images, targets = self.det.transform(imgs, tgts)
        feats = self.det.backbone(images.tensors)
        props, l_rpn = self.det.rpn(images, feats, targets)
        _, l_roi = self.det.roi_heads(feats, props, images.image_sizes, targets)
        emb = self.embed(feats, [t["boxes"] for t in targets], images.image_sizes)
        return {**l_rpn, **l_roi}, emb


def triplet(emb, ids, margin=0.2):
    if len(ids) < 2:
        return emb.sum() * 0
    d = torch.cdist(emb, emb)
    same = ids[:, None] == ids[None]
    eye = torch.eye(len(ids), dtype=torch.bool, device=ids.device)
    pos = (d * (same & ~eye)).max(1).values
    neg = d.masked_fill(same, 1e6).min(1).values
    valid = (same & ~eye).any(1) & (~same).any(1)
    return F.relu(pos - neg + margin)[valid].mean() if valid.any() else emb.sum() * 0


@torch.no_grad()
def val_mask_iou(model, dataset, rank, world):
    """Mean IoU between predicted and GT masks of matched instances, plus recall at IoU 0.5."""
    model.eval()
    stats = torch.zeros(3, device="cuda")  # sum iou, matched, gt
    for k in range(rank, len(dataset), world):
        (img, tgt), _ = dataset[k]
        out = model.det([img.cuda()])[0]
        gt = tgt["masks"].cuda().float().flatten(1)
        stats[2] += len(gt)
        if len(gt) == 0 or len(out["masks"]) == 0:
            continue
        pm = (out["masks"][:, 0] > 0.5).float().flatten(1)
        inter = pm @ gt.T
        iou = inter / (pm.sum(1)[:, None] + gt.sum(1)[None] - inter).clamp(min=1)
        best = iou.max(0).values
        stats[0] += best[best > 0.5].sum()
        stats[1] += (best > 0.5).sum()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1].clamp(min=1)).item(), (stats[1] / stats[2].clamp(min=1)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bdd-root", default="/data/bdd100k")
    ap.add_argument("--out", default="work/trackrcnn_bdd_mots")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--holdout", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=2023)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    # different augmentation streams per rank
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    img_root = os.path.join(args.bdd_root, "images", "seg_track_20", "train")
    videos = read_scalabel(os.path.join(args.bdd_root, "labels", "seg_track_20", "rles", "train"))
    names = sorted(videos)
    holdout = set(random.sample(names, int(len(names) * args.holdout)))
    train_set = FramePairs(img_root, videos, [n for n in names if n not in holdout])
    val_set = FramePairs(img_root, videos, sorted(holdout))

    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        collate_fn=lambda b: b, drop_last=True, pin_memory=True)

    model = DDP(TrackRCNN().cuda(), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [8 * len(loader), 11 * len(loader)], 0.1)
    best_iou = 0.0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, batch in enumerate(loader):
            imgs = [f[0].cuda(non_blocking=True) for pair in batch for f in pair]
            tgts = [{k: v.cuda() for k, v in f[1].items()} for pair in batch for f in pair]
            losses, emb = model(imgs, tgts)
            ids = torch.cat([t["ids"] for t in tgts])
            offsets = torch.repeat_interleave(torch.arange(len(batch), device=ids.device) * 10_000_000,
                                              torch.tensor([len(tgts[2 * b]["ids"]) + len(tgts[2 * b + 1]["ids"]) for b in range(len(batch))], device=ids.device))
            losses["loss_assoc"] = triplet(emb, ids + offsets)
            loss = sum(losses.values())
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            scheduler.step()
            if it % 50 == 0:
                vals = torch.stack([v.detach() for v in losses.values()])
                dist.all_reduce(vals, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"[{epoch}] {it}/{len(loader)} " + " ".join(f"{k}={v:.3f}" for k, v in zip(losses, vals.tolist())), flush=True)

        miou, recall = val_mask_iou(model.module, val_set, rank, world)
        if rank == 0:
            print(f"epoch {epoch}: held-out mask IoU {miou:.4f} recall@0.5 {recall:.4f} ({time.time() - t0:.0f}s)", flush=True)
            state = {"model": model.module.state_dict(), "epoch": epoch, "holdout": sorted(holdout)}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if miou > best_iou:
                best_iou = miou
                torch.save(state, os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
