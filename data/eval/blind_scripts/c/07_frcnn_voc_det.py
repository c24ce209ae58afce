# -*- coding: utf-8 -*-
"""
Faster R-CNN (MobileNetV3-FPN) 在 VOC07+12 上训练, VOC07 test 上评估 mAP@0.5
torchrun --nproc_per_node=4 train_voc.py --data /data/VOCdevkit
"""
import os
import time
import argparse
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, ConcatDataset
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
import torchvision
from torchvision.datasets import VOCDetection
from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn
import torchvision.transforms.functional as TF

VOC_CLASSES = ["aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
               "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa",
               "train", "tvmonitor"]


def parse_args():
    p = argparse.ArgumentParser(description="VOC 检测训练")
    p.add_argument("--data", default="/data/VOCdevkit")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.02, help="总 batch 16 时的 lr")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--save-dir", default="./checkpoints/frcnn_voc")
    return p.parse_args()


class VOCDet(VOCDetection):
    def __init__(self, root, year, image_set, train):
        super().__init__(root, year=year, image_set=image_set, download=False)
        self.train = train

    def __getitem__(self, idx):
        img, target = super().__getitem__(idx)
        objs = target["annotation"]["object"]
        objs = objs if isinstance(objs, list) else [objs]
        boxes, labels, difficult = [], [], []
        for o in objs:
            bb = o["bndbox"]
            boxes.append([float(bb["xmin"]) - 1, float(bb["ymin"]) - 1, float(bb["xmax"]) - 1, float(bb["ymax"]) - 1])
            labels.append(VOC_CLASSES.index(o["name"]) + 1)
            difficult.append(int(o.get("difficult", 0)))
        img = TF.to_tensor(img)
        boxes = torch.tensor(boxes, dtype=torch.float32)
        if self.train and random.random() < 0.5:
            img = img.flip(-1)
            boxes[:, [0, 2]] = img.shape[-1] - boxes[:, [2, 0]]
        return img, {"boxes": boxes, "labels": torch.tensor(labels), "difficult": torch.tensor(difficult),
                     "image_id": torch.tensor([idx])}


def collate_fn(batch):
    return tuple(zip(*batch))


def voc_ap(rec, prec):
    ap = 0.0
    for t in np.arange(0.0, 1.1, 0.1):
        p = np.max(prec[rec >= t]) if np.sum(rec >= t) > 0 else 0
        ap += p / 11.0
    return ap


def compute_map(dets, gts, iou_thr=0.5):
    """dets: [N, 7] (img_id, cls, score, x1, y1, x2, y2); gts: {img_id: (boxes, labels, difficult)}"""
    aps = []
    for c in range(1, len(VOC_CLASSES) + 1):
        cls_dets = dets[dets[:, 1] == c]
        cls_dets = cls_dets[np.argsort(-cls_dets[:, 2])]
        npos, used = 0, {}
        for img_id, (b, l, d) in gts.items():
            m = l == c
            npos += int((m & (d == 0)).sum())
            used[img_id] = np.zeros(int(m.sum()), dtype=bool)
        tp, fp = np.zeros(len(cls_dets)), np.zeros(len(cls_dets))
        for i, det in enumerate(cls_dets):
            b, l, d = gts[int(det[0])]
            gb, gd = b[l == c], d[l == c]
            if len(gb) == 0:
                fp[i] = 1
                continue
            ix1, iy1 = np.maximum(gb[:, 0], det[3]), np.maximum(gb[:, 1], det[4])
            ix2, iy2 = np.minimum(gb[:, 2], det[5]), np.minimum(gb[:, 3], det[6])
            inter = np.clip(ix2 - ix1 + 1, 0, None) * np.clip(iy2 - iy1 + 1, 0, None)
            area = (det[5] - det[3] + 1) * (det[6] - det[4] + 1) + \
                (gb[:, 2] - gb[:, 0] + 1) * (gb[:, 3] - gb[:, 1] + 1) - inter
            ious = inter / area
            j = ious.argmax()
            if ious[j] > iou_thr:
                if gd[j]:
                    continue
                if not used[int(det[0])][j]:
                    tp[i], used[int(det[0])][j] = 1, True
                else:
                    fp[i] = 1
            else:
                fp[i] = 1
        tp, fp = np.cumsum(tp), np.cumsum(fp)
        rec = tp / max(npos, 1)
        prec = tp / np.maximum(tp + fp, np.finfo(np.float64).eps)
        aps.append(voc_ap(rec, prec))
    return float(np.mean(aps))


@torch.no_grad()
def evaluate(model, loader, test_set, device, world_size, rank):
    model.eval()
    local_dets = []
    for imgs, targets in loader:
        outputs = model.module([im.to(device) for im in imgs])
        for out, tgt in zip(outputs, targets):
            n = out["boxes"].shape[0]
            img_id = torch.full((n, 1), float(tgt["image_id"].item()), device=device)
            local_dets.append(torch.cat([img_id, out["labels"].float()[:, None],
                                         out["scores"][:, None], out["boxes"]], dim=1))
    local_dets = torch.cat(local_dets) if local_dets else torch.zeros(0, 7, device=device)
    # 把所有卡的检测结果拼起来
    gathered = [torch.zeros_like(local_dets) for _ in range(world_size)]
    dist.all_gather(gathered, local_dets)
    model.train()
    if rank != 0:
        return 0.0
    dets = torch.cat(gathered).cpu().numpy()
    gts = {}
    for i in range(len(test_set)):
        _, t = test_set[i]
        gts[i] = (t["boxes"].numpy(), t["labels"].numpy(), t["difficult"].numpy())
    # 去掉 DistributedSampler 补齐的重复图片
    _, keep = np.unique(dets[:, [0, 2, 3, 4]], axis=0, return_index=True)
    return compute_map(dets[np.sort(keep)], gts)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42 + rank)
    random.seed(42 + rank)

    train_set = ConcatDataset([VOCDet(args.data, "2007", "trainval", True),
                               VOCDet(args.data, "2012", "trainval", True)])
    test_set = VOCDet(args.data, "2007", "test", False)
    train_sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, collate_fn=collate_fn, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=4, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=args.workers, collate_fn=collate_fn)

    model = fasterrcnn_mobilenet_v3_large_fpn(weights_backbone="IMAGENET1K_V1", num_classes=len(VOC_CLASSES) + 1)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world_size / 16
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                lr=lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[14, 18], gamma=0.1)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (imgs, targets) in enumerate(train_loader):
            imgs = [im.to(device, non_blocking=True) for im in imgs]
            targets = [{"boxes": t["boxes"].to(device), "labels": t["labels"].to(device)} for t in targets]
            losses = model(imgs, targets)
            loss = sum(losses.values())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 0 and it % 100 == 0:
                print("[epoch %d][%d/%d] loss %.4f (%s) lr %.4f %.1fs" % (
                    epoch, it, len(train_loader), loss.item(),
                    ", ".join("%s=%.3f" % (k, v.item()) for k, v in losses.items()),
                    optimizer.param_groups[0]["lr"], time.time() - tic))
        scheduler.step()

        mAP = evaluate(model, test_loader, test_set, device, world_size, rank)
        if rank == 0:
            print("epoch %d VOC07 mAP@0.5 = %.4f" % (epoch, mAP))
            torch.save(model.module.state_dict(), os.path.join(args.save_dir, "last.pth"))
            if mAP > best:
                best = mAP
                torch.save(model.module.state_dict(), os.path.join(args.save_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
