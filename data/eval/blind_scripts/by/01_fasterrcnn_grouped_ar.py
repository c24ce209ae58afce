#!/usr/bin/env python
"""Faster R-CNN R50-FPN on COCO with aspect-ratio grouped batches.

Adapted from the torchvision detection references.
"""
import argparse
import bisect
import copy
import datetime
import math
import os
import sys
import time
from collections import defaultdict
from itertools import chain, repeat

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.data
import torchvision
from torch.utils.data.sampler import BatchSampler
from torchvision.models.detection import fasterrcnn_resnet50_fpn
from torchvision.transforms import functional as F
from pycocotools.cocoeval import COCOeval


def get_args():
    parser = argparse.ArgumentParser(description="Faster R-CNN training")
    parser.add_argument("--data-path", default="/datasets/coco")
    parser.add_argument("--output-dir", default="./work_dirs/frcnn_r50_fpn")
    parser.add_argument("--epochs", type=int, default=26)
    parser.add_argument("--batch-size", type=int, default=2, help="images per gpu")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--lr-steps", nargs="+", type=int, default=[16, 22])
    parser.add_argument("--lr-gamma", type=float, default=0.1)
    parser.add_argument("--aspect-ratio-group-factor", type=int, default=3)
    parser.add_argument("--print-freq", type=int, default=20)
    parser.add_argument("--resume", default="")
    parser.add_argument("--amp", action="store_true")
    return parser.parse_args()


def _repeat_to_at_least(iterable, n):
    repeat_times = math.ceil(n / len(iterable))
    return list(chain.from_iterable(repeat(iterable, repeat_times)))


class GroupedBatchSampler(BatchSampler):
    """Yields mini-batches whose images all fall in the same aspect-ratio bin."""

    def __init__(self, sampler, group_ids, batch_size):
        self.sampler = sampler
        self.group_ids = group_ids
        self.batch_size = batch_size

    def __iter__(self):
        buffer_per_group = defaultdict(list)
        samples_per_group = defaultdict(list)
        num_batches = 0
        for idx in self.sampler:
            group_id = self.group_ids[idx]
            buffer_per_group[group_id].append(idx)
            samples_per_group[group_id].append(idx)
            if len(buffer_per_group[group_id]) == self.batch_size:
                yield buffer_per_group[group_id]
                num_batches += 1
                del buffer_per_group[group_id]
        num_remaining = len(self) - num_batches
        if num_remaining > 0:
            for group_id, _ in sorted(buffer_per_group.items(), key=lambda x: len(x[1]), reverse=True):
                remaining = self.batch_size - len(buffer_per_group[group_id])
                extra = _repeat_to_at_least(samples_per_group[group_id], remaining)
                buffer_per_group[group_id].extend(extra[:remaining])
                yield buffer_per_group[group_id]
                num_remaining -= 1
                if num_remaining == 0:
                    break

    def __len__(self):
        return len(self.sampler) // self.batch_size


def create_aspect_ratio_groups(dataset, k=3):
    ratios = [dataset.coco.imgs[i]["width"] / dataset.coco.imgs[i]["height"] for i in dataset.ids]
    bins = (2 ** np.linspace(-1, 1, 2 * k + 1)).tolist() if k > 0 else [1.0]
    bins = sorted(copy.copy(bins))
    groups = [bisect.bisect_right(bins, r) for r in ratios]
    counts = np.unique(groups, return_counts=True)[1]
    print(f"Using {bins} as bins for aspect ratio quantization, counts per bin: {counts.tolist()}")
    return groups


class CocoDetection(torchvision.datasets.CocoDetection):
    def __init__(self, img_folder, ann_file, train=False):
        super().__init__(img_folder, ann_file)
        self.train = train
        if train:
            self.ids = [i for i in self.ids if self._has_valid_annotation(i)]

    def _has_valid_annotation(self, img_id):
        anns = self.coco.loadAnns(self.coco.getAnnIds(imgIds=img_id, iscrowd=False))
        return any(a["bbox"][2] > 1 and a["bbox"][3] > 1 for a in anns)

    def __getitem__(self, idx):
        img, anns = super().__getitem__(idx)
        image_id = self.ids[idx]
        w, h = img.size
        anns = [a for a in anns if a.get("iscrowd", 0) == 0]
        boxes = torch.as_tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes[:, 0::2].clamp_(min=0, max=w)
        boxes[:, 1::2].clamp_(min=0, max=h)
        labels = torch.tensor([a["category_id"] for a in anns], dtype=torch.int64)
        keep = (boxes[:, 3] > boxes[:, 1]) & (boxes[:, 2] > boxes[:, 0])
        boxes, labels = boxes[keep], labels[keep]
        img = F.to_tensor(img)
        if self.train and torch.rand(1).item() < 0.5:
            img = img.flip(-1)
            boxes = torch.stack([w - boxes[:, 2], boxes[:, 1], w - boxes[:, 0], boxes[:, 3]], dim=1)
        return img, {"boxes": boxes, "labels": labels, "image_id": image_id}


def collate_fn(batch):
    return tuple(zip(*batch))


def reduce_dict(input_dict):
    world_size = dist.get_world_size()
    with torch.no_grad():
        names = sorted(input_dict.keys())
        values = torch.stack([input_dict[k] for k in names])
        dist.all_reduce(values)
        values /= world_size
    return dict(zip(names, values))


def train_one_epoch(model, optimizer, data_loader, device, epoch, args, scaler):
    model.train()
    warmup = None
    if epoch == 0:
        warmup_iters = min(1000, len(data_loader) - 1)
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0 / 1000, total_iters=warmup_iters)

    t0 = time.time()
    for i, (images, targets) in enumerate(data_loader):
        images = [img.to(device, non_blocking=True) for img in images]
        targets = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in t.items()} for t in targets]

        with torch.cuda.amp.autocast(enabled=scaler is not None):
            loss_dict = model(images, targets)
            losses = sum(loss for loss in loss_dict.values())

        loss_dict_reduced = reduce_dict(loss_dict)
        loss_value = sum(loss_dict_reduced.values()).item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training: {loss_dict_reduced}")
            sys.exit(1)

        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(losses).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            losses.backward()
            optimizer.step()
        if warmup is not None:
            warmup.step()

        if i % args.print_freq == 0 and dist.get_rank() == 0:
            parts = "  ".join(f"{k}: {v.item():.4f}" for k, v in loss_dict_reduced.items())
            print(f"Epoch [{epoch}] [{i}/{len(data_loader)}] lr: {optimizer.param_groups[0]['lr']:.5f} "
                  f"loss: {loss_value:.4f}  {parts}  ({time.time() - t0:.1f}s)")


@torch.no_grad()
def evaluate(model, data_loader, coco_gt, device):
    model.eval()
    predictions = {}
    for images, targets in data_loader:
        images = [img.to(device, non_blocking=True) for img in images]
        outputs = model(images)
        for target, output in zip(targets, outputs):
            boxes = output["boxes"].cpu()
            boxes[:, 2:] -= boxes[:, :2]
            predictions[target["image_id"]] = [
                {"image_id": target["image_id"], "category_id": int(l), "bbox": b, "score": float(s)}
                for b, s, l in zip(boxes.tolist(), output["scores"].tolist(), output["labels"].tolist())
            ]

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, predictions)
    if dist.get_rank() != 0:
        return None
    merged = {}
    for p in gathered:
        merged.update(p)
    results = list(chain.from_iterable(merged.values()))
    if len(results) == 0:
        return 0.0
    coco_dt = coco_gt.loadRes(results)
    coco_eval = COCOeval(coco_gt, coco_dt, iouType="bbox")
    coco_eval.params.imgIds = sorted(merged.keys())
    coco_eval.evaluate()
    coco_eval.accumulate()
    coco_eval.summarize()
    return coco_eval.stats[0]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    dataset = CocoDetection(os.path.join(args.data_path, "train2017"),
                            os.path.join(args.data_path, "annotations/instances_train2017.json"), train=True)
    dataset_test = CocoDetection(os.path.join(args.data_path, "val2017"),
                                 os.path.join(args.data_path, "annotations/instances_val2017.json"))

    train_sampler = torch.utils.data.RandomSampler(dataset)
    test_sampler = torch.utils.data.distributed.DistributedSampler(dataset_test, shuffle=False)

    group_ids = create_aspect_ratio_groups(dataset, k=args.aspect_ratio_group_factor)
    train_batch_sampler = GroupedBatchSampler(train_sampler, group_ids, args.batch_size)

    data_loader = torch.utils.data.DataLoader(dataset, batch_sampler=train_batch_sampler,
                                              num_workers=args.workers, collate_fn=collate_fn, pin_memory=True)
    data_loader_test = torch.utils.data.DataLoader(dataset_test, batch_size=1, sampler=test_sampler,
                                                   num_workers=args.workers, collate_fn=collate_fn)

    model = fasterrcnn_resnet50_fpn(weights=None, weights_backbone="IMAGENET1K_V1", num_classes=91)
    model.to(device)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    model_without_ddp = model.module

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.lr_steps, gamma=args.lr_gamma)
    scaler = torch.cuda.amp.GradScaler() if args.amp else None

    start_epoch = 0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
        if scaler is not None and "scaler" in checkpoint:
            scaler.load_state_dict(checkpoint["scaler"])
        start_epoch = checkpoint["epoch"] + 1

    print(f"[rank {rank}] start training, {len(data_loader)} iters per epoch")
    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        train_one_epoch(model, optimizer, data_loader, device, epoch, args, scaler)
        lr_scheduler.step()
        if rank == 0:
            checkpoint = {
                "model": model_without_ddp.state_dict(),
                "optimizer": optimizer.state_dict(),
                "lr_scheduler": lr_scheduler.state_dict(),
                "epoch": epoch,
                "args": vars(args),
            }
            if scaler is not None:
                checkpoint["scaler"] = scaler.state_dict()
            torch.save(checkpoint, os.path.join(args.output_dir, f"model_{epoch}.pth"))
            torch.save(checkpoint, os.path.join(args.output_dir, "checkpoint.pth"))
        evaluate(model_without_ddp, data_loader_test, dataset_test.coco, device)

    if rank == 0:
        total = str(datetime.timedelta(seconds=int(time.time() - start_time)))
        print(f"Training time {total}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
