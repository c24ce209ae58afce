"""
Deformable DETR (+ box refinement) on VisDrone-DET in COCO format.
Small objects dominate, so we train at a larger scale and report AP_small
alongside AP; best checkpoint is picked on AP.

  torchrun --nproc_per_node=8 14_deformable_detr_visdrone.py --data_root /data/visdrone_coco \
      --with_box_refine --output_dir exps/visdrone_refine
"""
import argparse
import contextlib
import io
import json
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.utils.data import DataLoader, DistributedSampler

import datasets.transforms as T
import util.misc as utils
from datasets.coco import CocoDetection
from main import get_args_parser
from models import build_model

VISDRONE_SCALES = [800, 864, 928, 992, 1056, 1120, 1184, 1248]


def make_transforms(train):
    normalize = T.Compose([T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    if train:
        return T.Compose([
            T.RandomHorizontalFlip(),
            T.RandomSelect(
                T.RandomResize(VISDRONE_SCALES, max_size=2000),
                T.Compose([T.RandomResize([600, 800, 1000]), T.RandomSizeCrop(600, 1000),
                           T.RandomResize(VISDRONE_SCALES, max_size=2000)])),
            normalize])
    return T.Compose([T.RandomResize([1248], max_size=2000), normalize])


def build(split, args):
    root = Path(args.data_root)
    return CocoDetection(root / f"VisDrone2019-DET-{split}" / "images",
                         root / "annotations" / f"instances_{split}.json",
                         transforms=make_transforms(split == "train"), return_masks=False)


def train_one_epoch(model, criterion, loader, optimizer, device, epoch, max_norm):
    model.train()
    criterion.train()
    wd = criterion.weight_dict
    logger = utils.MetricLogger(delimiter="  ")
    for samples, targets in logger.log_every(loader, 50, f"Epoch: [{epoch}]"):
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        loss_dict = criterion(model(samples), targets)
        losses = sum(loss_dict[k] * wd[k] for k in loss_dict if k in wd)
        optimizer.zero_grad()
        losses.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        reduced = utils.reduce_dict(loss_dict)
        logger.update(loss=sum(reduced[k] * wd[k] for k in reduced if k in wd).item(),
                      lr=optimizer.param_groups[0]["lr"])
    logger.synchronize_between_processes()
    return {k: m.global_avg for k, m in logger.meters.items()}


@torch.no_grad()
def evaluate(model, postprocessors, loader, coco_gt, device):
    model.eval()
    dets, img_ids = [], set()
    for samples, targets in loader:
        outputs = model(samples.to(device))
        orig = torch.stack([t["orig_size"] for t in targets]).to(device)
        results = postprocessors["bbox"](outputs, orig)
        for t, r in zip(targets, results):
            image_id = t["image_id"].item()
            img_ids.add(image_id)
            boxes = r["boxes"].clone()
            boxes[:, 2:] -= boxes[:, :2]
            for b, s, l in zip(boxes.tolist(), r["scores"].tolist(), r["labels"].tolist()):
                dets.append({"image_id": image_id, "category_id": l, "bbox": b, "score": s})
    with contextlib.redirect_stdout(io.StringIO()):
        coco_dt = coco_gt.loadRes(dets) if dets else COCO()
        E = COCOeval(coco_gt, coco_dt, "bbox")
        E.params.imgIds = sorted(img_ids)
        E.params.maxDets = [1, 100, 500]
        E.evaluate()
        E.accumulate()
    E.summarize()
    return E.stats.tolist()


def main(args):
    utils.init_distributed_mode(args)
    device = torch.device(args.device)
    seed = args.seed + utils.get_rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    args.num_classes = 11  # VisDrone ids 1..10
    model, criterion, postprocessors = build_model(args)
    model.to(device)
    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    def match(n, keys):
        return any(k in n for k in keys)

    param_dicts = [
        {"params": [p for n, p in model_without_ddp.named_parameters()
                    if not match(n, args.lr_backbone_names) and not match(n, args.lr_linear_proj_names)
                    and p.requires_grad], "lr": args.lr},
        {"params": [p for n, p in model_without_ddp.named_parameters()
                    if match(n, args.lr_backbone_names) and p.requires_grad], "lr": args.lr_backbone},
        {"params": [p for n, p in model_without_ddp.named_parameters()
                    if match(n, args.lr_linear_proj_names) and p.requires_grad],
         "lr": args.lr * args.lr_linear_proj_mult},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)

    dataset_train, dataset_val = build("train", args), build("val", args)
    if args.distributed:
        sampler_train = DistributedSampler(dataset_train)
        sampler_val = DistributedSampler(dataset_val, shuffle=False)
    else:
        sampler_train = torch.utils.data.RandomSampler(dataset_train)
        sampler_val = torch.utils.data.SequentialSampler(dataset_val)
    loader_train = DataLoader(dataset_train,
                              batch_sampler=torch.utils.data.BatchSampler(sampler_train, args.batch_size, drop_last=True),
                              collate_fn=utils.collate_fn, num_workers=args.num_workers, pin_memory=True)
    loader_val = DataLoader(dataset_val, 1, sampler=sampler_val, drop_last=False,
                            collate_fn=utils.collate_fn, num_workers=args.num_workers, pin_memory=True)

    output_dir = Path(args.output_dir)
    best_ap = 0.0
    for epoch in range(args.epochs):
        if args.distributed:
            sampler_train.set_epoch(epoch)
        t0 = time.time()
        train_stats = train_one_epoch(model, criterion, loader_train, optimizer, device, epoch, args.clip_max_norm)
        lr_scheduler.step()
        stats = evaluate(model, postprocessors, loader_val, dataset_val.coco, device)
        ckpt = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "args": args}
        utils.save_on_master(ckpt, output_dir / "checkpoint.pth")
        if utils.is_main_process():
            if stats[0] > best_ap:
                best_ap = stats[0]
                torch.save(ckpt, output_dir / "best.pth")
            with open(output_dir / "log.txt", "a") as f:
                f.write(json.dumps({"epoch": epoch, "AP": stats[0], "AP50": stats[1], "AP_small": stats[3],
                                    "best_AP": best_ap, "time": time.time() - t0,
                                    **{f"train_{k}": v for k, v in train_stats.items()}}) + "\n")

    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser("VisDrone Deformable DETR", parents=[get_args_parser()])
    parser.add_argument("--data_root", required=True)
    args = parser.parse_args()
    args.dataset_file = "visdrone"
    Path(args.output_dir or "exps/visdrone").mkdir(parents=True, exist_ok=True)
    main(args)
