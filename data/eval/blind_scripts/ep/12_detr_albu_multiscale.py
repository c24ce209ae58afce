"""
DETR on a COCO-format retail-shelf dataset with heavier augmentation
(albumentations: random crops + multi-scale resize).

torchrun --nproc_per_node=4 12_detr_albu_multiscale.py --data_root /data/sku --output_dir out/sku_detr
"""
import argparse
import json
import os
import random
import time
from pathlib import Path

import albumentations as A
import cv2
import numpy as np
import torch
import torch.distributed as dist
from pycocotools.coco import COCO
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import util.misc as utils
from datasets.coco_eval import CocoEvaluator
from main import get_args_parser
from models import build_model

SCALES = [480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800]
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def build_aug(train):
    bbox_params = A.BboxParams(format="coco", label_fields=["labels"], min_visibility=0.3, min_area=16)
    if train:
        return A.Compose([
            A.HorizontalFlip(p=0.5),
            A.RandomSizedCrop(min_max_height=(384, 600), height=600, width=600, w2h_ratio=1.0, p=0.5),
            A.OneOf([A.SmallestMaxSize(max_size=s) for s in SCALES], p=1.0),
            A.LongestMaxSize(max_size=1333),
            A.ColorJitter(0.2, 0.2, 0.2, 0.0, p=0.3),
        ], bbox_params=bbox_params)
    return A.Compose([A.SmallestMaxSize(max_size=800), A.LongestMaxSize(max_size=1333)], bbox_params=bbox_params)


class ShelfDataset(Dataset):
    def __init__(self, root, split, train):
        self.root = Path(root)
        self.coco = COCO(str(self.root / "annotations" / f"{split}.json"))
        self.ids = sorted(self.coco.getImgIds())
        self.img_dir = self.root / split
        self.aug = build_aug(train)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, idx):
        image_id = self.ids[idx]
        info = self.coco.loadImgs(image_id)[0]
        img = cv2.cvtColor(cv2.imread(str(self.img_dir / info["file_name"])), cv2.COLOR_BGR2RGB)
        h, w = img.shape[:2]
        anns = [a for a in self.coco.loadAnns(self.coco.getAnnIds(imgIds=image_id)) if not a.get("iscrowd", 0)]
        bboxes = []
        for a in anns:
            x, y, bw, bh = a["bbox"]
            x, y = max(0.0, x), max(0.0, y)
            bw, bh = min(bw, w - x), min(bh, h - y)
            if bw > 1 and bh > 1:
                bboxes.append(([x, y, bw, bh], a["category_id"]))
        out = self.aug(image=img, bboxes=[b for b, _ in bboxes], labels=[l for _, l in bboxes])
        img = (out["image"].astype(np.float32) / 255.0 - MEAN) / STD
        H, W = img.shape[:2]
        boxes = torch.tensor(out["bboxes"], dtype=torch.float32).reshape(-1, 4)
        # xywh (abs) -> cxcywh (normalized), as the DETR criterion expects
        boxes = torch.stack([(boxes[:, 0] + boxes[:, 2] / 2) / W, (boxes[:, 1] + boxes[:, 3] / 2) / H,
                             boxes[:, 2] / W, boxes[:, 3] / H], dim=-1)
        target = {"boxes": boxes, "labels": torch.tensor(out["labels"], dtype=torch.int64),
                  "image_id": torch.tensor(image_id), "orig_size": torch.tensor([h, w]),
                  "size": torch.tensor([H, W])}
        return torch.from_numpy(img).permute(2, 0, 1).contiguous(), target


def train_one_epoch(model, criterion, loader, optimizer, device, epoch, max_norm):
    model.train()
    criterion.train()
    logger = utils.MetricLogger(delimiter="  ")
    logger.add_meter("lr", utils.SmoothedValue(window_size=1, fmt="{value:.6f}"))
    wd = criterion.weight_dict
    for samples, targets in logger.log_every(loader, 50, f"Epoch: [{epoch}]"):
        # a crop can remove every box of the batch; nothing to match against then
        if all(len(t["boxes"]) == 0 for t in targets):
            continue
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        outputs = model(samples)
        loss_dict = criterion(outputs, targets)
        losses = sum(loss_dict[k] * wd[k] for k in loss_dict if k in wd)
        optimizer.zero_grad()
        losses.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        reduced = utils.reduce_dict(loss_dict)
        logger.update(loss=sum(reduced[k] * wd[k] for k in reduced if k in wd).item(),
                      class_error=reduced["class_error"], lr=optimizer.param_groups[0]["lr"])
    logger.synchronize_between_processes()
    return {k: m.global_avg for k, m in logger.meters.items()}


@torch.no_grad()
def evaluate(model, postprocessors, loader, coco_gt, device):
    model.eval()
    evaluator = CocoEvaluator(coco_gt, ("bbox",))
    for samples, targets in loader:
        outputs = model(samples.to(device))
        orig = torch.stack([t["orig_size"] for t in targets]).to(device)
        results = postprocessors["bbox"](outputs, orig)
        evaluator.update({t["image_id"].item(): r for t, r in zip(targets, results)})
    evaluator.synchronize_between_processes()
    evaluator.accumulate()
    evaluator.summarize()
    return evaluator.coco_eval["bbox"].stats.tolist()


def main(args):
    utils.init_distributed_mode(args)
    device = torch.device(args.device)
    seed = args.seed + utils.get_rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    cv2.setNumThreads(0)

    ds_train = ShelfDataset(args.data_root, "train", train=True)
    ds_val = ShelfDataset(args.data_root, "val", train=False)
    args.num_classes = max(ds_train.coco.getCatIds()) + 1

    model, criterion, postprocessors = build_model(args)
    model.to(device)
    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module
    param_dicts = [
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" in n and p.requires_grad],
         "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)

    if args.distributed:
        sampler_train = DistributedSampler(ds_train)
        sampler_val = DistributedSampler(ds_val, shuffle=False)
    else:
        sampler_train = torch.utils.data.RandomSampler(ds_train)
        sampler_val = torch.utils.data.SequentialSampler(ds_val)
    loader_train = DataLoader(ds_train, batch_sampler=torch.utils.data.BatchSampler(sampler_train, args.batch_size,
                                                                                   drop_last=True),
                              collate_fn=utils.collate_fn, num_workers=args.num_workers, pin_memory=True)
    loader_val = DataLoader(ds_val, args.batch_size, sampler=sampler_val, drop_last=False,
                            collate_fn=utils.collate_fn, num_workers=args.num_workers)

    output_dir = Path(args.output_dir)
    for epoch in range(args.epochs):
        if args.distributed:
            sampler_train.set_epoch(epoch)
        t0 = time.time()
        train_stats = train_one_epoch(model, criterion, loader_train, optimizer, device, epoch, args.clip_max_norm)
        lr_scheduler.step()
        utils.save_on_master({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                              "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "args": args},
                             output_dir / "checkpoint.pth")
        stats = evaluate(model, postprocessors, loader_val, ds_val.coco, device)
        if utils.is_main_process():
            with open(output_dir / "log.txt", "a") as f:
                f.write(json.dumps({"epoch": epoch, "sec": time.time() - t0, "AP": stats[0], "AP50": stats[1],
                                    **{f"train_{k}": v for k, v in train_stats.items()}}) + "\n")
    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser("shelf DETR", parents=[get_args_parser()])
    parser.add_argument("--data_root", required=True)
    args = parser.parse_args()
    args.dataset_file = "shelf"
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    main(args)
