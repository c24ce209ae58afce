"""
DETR R101-DC5 training with results dumping: every evaluation writes the
detections as a COCO results json next to the checkpoint so we can run
the TIDE error analysis offline.
"""
import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

import util.misc as utils
from datasets.coco import build as build_coco
from models.detr import build as build_detr


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--coco_path", required=True)
    p.add_argument("--output_dir", default="runs/detr_r101_dc5")
    p.add_argument("--backbone", default="resnet101")
    p.add_argument("--dilation", action="store_true", default=True)
    p.add_argument("--position_embedding", default="sine")
    p.add_argument("--hidden_dim", type=int, default=256)
    p.add_argument("--nheads", type=int, default=8)
    p.add_argument("--enc_layers", type=int, default=6)
    p.add_argument("--dec_layers", type=int, default=6)
    p.add_argument("--dim_feedforward", type=int, default=2048)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--num_queries", type=int, default=100)
    p.add_argument("--pre_norm", action="store_true")
    p.add_argument("--masks", action="store_true")
    p.add_argument("--aux_loss", type=int, default=1)
    p.add_argument("--set_cost_class", type=float, default=1)
    p.add_argument("--set_cost_bbox", type=float, default=5)
    p.add_argument("--set_cost_giou", type=float, default=2)
    p.add_argument("--bbox_loss_coef", type=float, default=5)
    p.add_argument("--giou_loss_coef", type=float, default=2)
    p.add_argument("--eos_coef", type=float, default=0.1)
    p.add_argument("--dataset_file", default="coco")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lr_backbone", type=float, default=1e-5)
    p.add_argument("--weight_decay", type=float, default=1e-4)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--lr_drop", type=int, default=400)
    p.add_argument("--clip_max_norm", type=float, default=0.1)
    p.add_argument("--eval_every", type=int, default=5)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--resume", default="")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dist_url", default="env://")
    return p.parse_args()


def train_one_epoch(model, criterion, loader, optimizer, device, epoch, max_norm):
    model.train()
    criterion.train()
    logger = utils.MetricLogger(delimiter="  ")
    logger.add_meter("lr", utils.SmoothedValue(window_size=1, fmt="{value:.6f}"))
    for samples, targets in logger.log_every(loader, 200, f"Epoch: [{epoch}]"):
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        outputs = model(samples)
        loss_dict = criterion(outputs, targets)
        wd = criterion.weight_dict
        losses = sum(loss_dict[k] * wd[k] for k in loss_dict if k in wd)

        reduced = utils.reduce_dict(loss_dict)
        loss_value = sum(reduced[k] * wd[k] for k in reduced if k in wd).item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training\n{reduced}")
            sys.exit(1)

        optimizer.zero_grad()
        losses.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        logger.update(loss=loss_value, class_error=reduced["class_error"])
        logger.update(lr=optimizer.param_groups[0]["lr"])
    logger.synchronize_between_processes()
    return {k: m.global_avg for k, m in logger.meters.items()}


def to_coco_results(targets, results):
    out = []
    for t, r in zip(targets, results):
        boxes = r["boxes"].clone()
        boxes[:, 2:] -= boxes[:, :2]
        for b, s, l in zip(boxes.tolist(), r["scores"].tolist(), r["labels"].tolist()):
            out.append({"image_id": int(t["image_id"]), "category_id": int(l), "bbox": [round(x, 2) for x in b],
                        "score": round(s, 4)})
    return out


@torch.no_grad()
def evaluate(model, postprocessors, loader, coco_gt, device, dump_path):
    model.eval()
    results = []
    for samples, targets in loader:
        outputs = model(samples.to(device))
        orig_sizes = torch.stack([t["orig_size"] for t in targets]).to(device)
        results.extend(to_coco_results(targets, postprocessors["bbox"](outputs, orig_sizes)))

    stats = None
    if utils.is_main_process():
        gathered = [None for _ in range(utils.get_world_size())]
        dist.gather_object(results, gathered, dst=0)
        # DistributedSampler repeats a few images to even out the shards
        seen, merged = set(), []
        for part in gathered:
            merged.extend(r for r in part if r["image_id"] not in seen)
            seen |= {r["image_id"] for r in part}
        with open(dump_path, "w") as f:
            json.dump(merged, f)
        E = COCOeval(coco_gt, coco_gt.loadRes(merged), "bbox")
        E.params.imgIds = sorted({r["image_id"] for r in merged})
        E.evaluate()
        E.accumulate()
        E.summarize()
        stats = E.stats.tolist()
    return stats


def main():
    args = parse_args()
    utils.init_distributed_mode(args)
    device = torch.device(args.device)
    seed = args.seed + utils.get_rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    model, criterion, postprocessors = build_detr(args)
    model.to(device)
    model_without_ddp = model
    if args.distributed:
        model = DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    param_dicts = [
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" in n and p.requires_grad],
         "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)

    dataset_train = build_coco(image_set="train", args=args)
    dataset_val = build_coco(image_set="val", args=args)
    sampler_train = DistributedSampler(dataset_train) if args.distributed else torch.utils.data.RandomSampler(dataset_train)
    sampler_val = DistributedSampler(dataset_val, shuffle=False) if args.distributed \
        else torch.utils.data.SequentialSampler(dataset_val)
    loader_train = DataLoader(dataset_train, batch_sampler=BatchSampler(sampler_train, args.batch_size, drop_last=True),
                              collate_fn=utils.collate_fn, num_workers=args.num_workers)
    loader_val = DataLoader(dataset_val, 2, sampler=sampler_val, drop_last=False,
                            collate_fn=utils.collate_fn, num_workers=args.num_workers)
    coco_gt = dataset_val.coco

    output_dir = Path(args.output_dir)
    if utils.is_main_process():
        output_dir.mkdir(parents=True, exist_ok=True)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        start_epoch = ckpt["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        if args.distributed:
            sampler_train.set_epoch(epoch)
        t0 = time.time()
        train_stats = train_one_epoch(model, criterion, loader_train, optimizer, device, epoch, args.clip_max_norm)
        lr_scheduler.step()
        utils.save_on_master({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                              "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "args": args},
                             output_dir / "checkpoint.pth")
        log = {"epoch": epoch, "epoch_time": time.time() - t0, **{f"train_{k}": v for k, v in train_stats.items()}}
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            stats = evaluate(model, postprocessors, loader_val, coco_gt, device,
                             output_dir / f"results_e{epoch:03d}.json")
            if stats is not None:
                log["coco_bbox"] = stats
        if utils.is_main_process():
            with open(output_dir / "log.txt", "a") as f:
                f.write(json.dumps(log) + "\n")

    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
