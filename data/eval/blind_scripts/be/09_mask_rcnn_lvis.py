"""Partially-supervised Mask R-CNN: boxes for all classes, masks only where the annotation has them
(COCO masks + Objects365 boxes merged into one json, `has_mask` flag per instance).

torchrun --nproc_per_node=8 09_mask_rcnn_lvis.py --train-json data/coco_o365_merged.json \
    --val-json data/coco/annotations/instances_val2017.json --epochs 12
"""
import argparse
import os
import time

import numpy as np
import pycocotools.mask as mask_util
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pycocotools.cocoeval import COCOeval
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.detection import fasterrcnn_resnet50_fpn
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.ops import MultiScaleRoIAlign, roi_align

from data import MergedDetectionDataset, collate_fn, build_transforms


class PartialMaskRCNN(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.detector = fasterrcnn_resnet50_fpn(weights=None, weights_backbone="DEFAULT", num_classes=num_classes)
        self.mask_pool = MultiScaleRoIAlign(["0", "1", "2", "3"], output_size=14, sampling_ratio=2)
        self.mask_head = MaskRCNNHeads(256, (256, 256, 256, 256), 1)
        self.mask_predictor = MaskRCNNPredictor(256, 256, num_classes)

    def mask_logits(self, features, boxes, image_sizes, labels):
        x = self.mask_predictor(self.mask_head(self.mask_pool(features, boxes, image_sizes)))
        labels = torch.cat(labels)
        return x[torch.arange(labels.numel(), device=labels.device), labels]

    def forward(self, images, targets=None):
        original_sizes = [img.shape[-2:] for img in images]
        images, targets = self.detector.transform(images, targets)
        features = self.detector.backbone(images.tensors)
        proposals, rpn_losses = self.detector.rpn(images, features, targets)
        detections, det_losses = self.detector.roi_heads(features, proposals, images.image_sizes, targets)

        if not self.training:
            boxes = [d["boxes"] for d in detections]
            if sum(b.shape[0] for b in boxes):
                probs = self.mask_logits(features, boxes, images.image_sizes, [d["labels"] for d in detections])
                probs = probs.sigmoid().split([b.shape[0] for b in boxes])
            else:
                probs = [torch.zeros(0, 28, 28, device=images.tensors.device) for _ in boxes]
            for d, p in zip(detections, probs):
                d["masks"] = p[:, None]
            return self.detector.transform.postprocess(detections, images.image_sizes, original_sizes)

        # mask branch is supervised on GT boxes of the instances that carry a mask
        gt_boxes, gt_labels, gt_masks = [], [], []
        for t in targets:
            keep = t["has_mask"]
            gt_boxes.append(t["boxes"][keep])
            gt_labels.append(t["labels"][keep])
            gt_masks.append(t["masks"][keep])
        num_mask_inst = sum(b.shape[0] for b in gt_boxes)
        if num_mask_inst > 0:
            logits = self.mask_logits(features, gt_boxes, images.image_sizes, gt_labels)
            rois = torch.cat([torch.cat([torch.full_like(b[:, :1], i), b], 1) for i, b in enumerate(gt_boxes)])
            mask_targets = roi_align(torch.cat(gt_masks)[:, None].float(), rois, (28, 28), 1.0, aligned=True)[:, 0]
            loss_mask = F.binary_cross_entropy_with_logits(logits, (mask_targets >= 0.5).float())
        else:
            loss_mask = torch.zeros((), device=images.tensors.device)

        losses = dict(rpn_losses)
        losses.update(det_losses)
        losses["loss_mask"] = loss_mask
        return losses


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-json", required=True)
    p.add_argument("--val-json", required=True)
    p.add_argument("--train-img-dir", default="data/images")
    p.add_argument("--val-img-dir", default="data/coco/val2017")
    p.add_argument("--num-classes", type=int, default=366)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--lr-steps", type=int, nargs="+", default=[8, 11])
    p.add_argument("--imgs-per-gpu", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--out", default="work_dirs/partial_mrcnn")
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, coco_gt, device):
    model.eval()
    results = []
    for images, targets in loader:
        outputs = model([im.to(device) for im in images])
        for t, o in zip(targets, outputs):
            boxes = o["boxes"].cpu().numpy()
            boxes[:, 2:] -= boxes[:, :2]
            masks = (o["masks"][:, 0] > 0.5).cpu().numpy().astype(np.uint8)
            for b, s, l, m in zip(boxes, o["scores"].tolist(), o["labels"].tolist(), masks):
                rle = mask_util.encode(np.asfortranarray(m))
                rle["counts"] = rle["counts"].decode("ascii")
                results.append({"image_id": int(t["image_id"]), "category_id": int(l), "bbox": b.tolist(),
                                "score": s, "segmentation": rle})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    model.train()
    if dist.get_rank() != 0:
        return None
    results = [r for part in gathered for r in part]
    stats = {}
    for iou_type in ("bbox", "segm"):
        ev = COCOeval(coco_gt, coco_gt.loadRes(results), iou_type)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
        stats[iou_type] = ev.stats[0]
    return stats


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.out, exist_ok=True)

    train_set = MergedDetectionDataset(args.train_img_dir, args.train_json, build_transforms(train=True))
    val_set = MergedDetectionDataset(args.val_img_dir, args.val_json, build_transforms(train=False))
    train_sampler = DistributedSampler(train_set, shuffle=True)
    # contiguous shards without padding so every val image is counted once
    val_indices = np.array_split(np.arange(len(val_set)), world_size)[rank].tolist()
    train_loader = DataLoader(train_set, batch_size=args.imgs_per_gpu, sampler=train_sampler, num_workers=4,
                              collate_fn=collate_fn, drop_last=True, pin_memory=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, val_indices), batch_size=1, num_workers=4,
                            collate_fn=collate_fn)

    model = PartialMaskRCNN(args.num_classes).to(device)  # backbone uses FrozenBatchNorm2d
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, args.lr_steps, gamma=0.1)

    best_segm = 0.0
    global_step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for step, (images, targets) in enumerate(train_loader):
            images = [im.to(device, non_blocking=True) for im in images]
            targets = [{k: v.to(device, non_blocking=True) for k, v in t.items()} for t in targets]
            if global_step < args.warmup:
                warm = 0.001 + (1 - 0.001) * global_step / args.warmup
                for g in optimizer.param_groups:
                    g["lr"] = args.lr * warm * (0.1 ** sum(epoch >= s for s in args.lr_steps))

            loss_dict = model(images, targets)
            loss = sum(loss_dict.values())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            global_step += 1

            if step % 50 == 0:
                logged = torch.stack([v.detach() for v in loss_dict.values()])
                dist.all_reduce(logged)
                logged /= world_size
                if rank == 0:
                    parts = " ".join(f"{k} {v:.3f}" for k, v in zip(loss_dict.keys(), logged.tolist()))
                    print(f"[{epoch}][{step}/{len(train_loader)}] {parts} lr {optimizer.param_groups[0]['lr']:.4f} "
                          f"{(time.time() - tic) / (step + 1):.2f}s/it", flush=True)
        scheduler.step()

        stats = evaluate(model.module, val_loader, val_set.coco, device)
        if rank == 0:
            print(f"epoch {epoch}: bbox AP {stats['bbox']:.4f}  segm AP {stats['segm']:.4f}")
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch}
            torch.save(ckpt, os.path.join(args.out, "last.pth"))
            if stats["segm"] > best_segm:
                best_segm = stats["segm"]
                torch.save(ckpt, os.path.join(args.out, "best_segm.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
