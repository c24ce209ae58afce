"""
DETR R101 (aux losses, 100 queries) on COCO.  Keeps `last.pth` for resuming and
`best.pth` (by val AP) for the export step of the pipeline.

    torchrun --nproc_per_node=8 18_detr_r101.py --coco_path /data/coco --out runs/detr_r101
    torchrun --nproc_per_node=8 18_detr_r101.py --coco_path /data/coco --out runs/detr_r101 --resume runs/detr_r101/last.pth
"""
import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

import util.misc as utils
from datasets import build_dataset, get_coco_api_from_dataset
from datasets.coco_eval import CocoEvaluator
from main import get_args_parser
from models import build_model


def save_checkpoint(path, model, optimizer, lr_scheduler, epoch, best_ap, args):
    if dist.get_rank() != 0:
        return
    tmp = str(path) + ".tmp"
    torch.save({"model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "lr_scheduler": lr_scheduler.state_dict(),
                "epoch": epoch,
                "best_ap": best_ap,
                "args": vars(args)}, tmp)
    os.replace(tmp, path)


def train_one_epoch(model, criterion, loader, optimizer, device, epoch, max_norm):
    model.train()
    criterion.train()
    wd = criterion.weight_dict
    logger = utils.MetricLogger(delimiter="  ")
    logger.add_meter("lr", utils.SmoothedValue(window_size=1, fmt="{value:.6f}"))
    for samples, targets in logger.log_every(loader, 100, f"Epoch: [{epoch}]"):
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        loss_dict = criterion(model(samples), targets)
        losses = sum(loss_dict[k] * wd[k] for k in loss_dict if k in wd)
        reduced = utils.reduce_dict(loss_dict)
        loss_value = sum(reduced[k] * wd[k] for k in reduced if k in wd).item()
        if not math.isfinite(loss_value):
            raise RuntimeError(f"non-finite loss {loss_value}: {reduced}")
        optimizer.zero_grad()
        losses.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        logger.update(loss=loss_value, class_error=reduced["class_error"], lr=optimizer.param_groups[0]["lr"])
    logger.synchronize_between_processes()
    return {k: m.global_avg for k, m in logger.meters.items()}


@torch.no_grad()
def evaluate(model, postprocessors, loader, base_ds, device):
    model.eval()
    evaluator = CocoEvaluator(base_ds, ("bbox",))
    for samples, targets in loader:
        outputs = model(samples.to(device))
        orig = torch.stack([t["orig_size"] for t in targets]).to(device)
        res = postprocessors["bbox"](outputs, orig)
        evaluator.update({t["image_id"].item(): r for t, r in zip(targets, res)})
    evaluator.synchronize_between_processes()
    evaluator.accumulate()
    evaluator.summarize()
    return evaluator.coco_eval["bbox"].stats.tolist()


def main():
    parser = argparse.ArgumentParser("DETR R101", parents=[get_args_parser()])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.backbone = "resnet101"

    utils.init_distributed_mode(args)
    assert args.distributed, "launch with torchrun"
    device = torch.device(args.device)
    seed = args.seed + utils.get_rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    model, criterion, postprocessors = build_model(args)
    model.to(device)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start_epoch, best_ap, ckpt = 0, 0.0, None
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start_epoch, best_ap = ckpt["epoch"] + 1, ckpt["best_ap"]

    model = DDP(model, device_ids=[args.gpu])
    param_dicts = [
        {"params": [p for n, p in model.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model.named_parameters() if "backbone" in n and p.requires_grad],
         "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        del ckpt

    dataset_train = build_dataset(image_set="train", args=args)
    dataset_val = build_dataset(image_set="val", args=args)
    sampler_train = DistributedSampler(dataset_train)
    sampler_val = DistributedSampler(dataset_val, shuffle=False)
    loader_train = DataLoader(dataset_train, batch_sampler=BatchSampler(sampler_train, args.batch_size, drop_last=True),
                              collate_fn=utils.collate_fn, num_workers=args.num_workers, pin_memory=True)
    loader_val = DataLoader(dataset_val, args.batch_size, sampler=sampler_val, drop_last=False,
                            collate_fn=utils.collate_fn, num_workers=args.num_workers)
    base_ds = get_coco_api_from_dataset(dataset_val)

    for epoch in range(start_epoch, args.epochs):
        sampler_train.set_epoch(epoch)
        t0 = time.time()
        train_stats = train_one_epoch(model, criterion, loader_train, optimizer, device, epoch, args.clip_max_norm)
        lr_scheduler.step()
        stats = evaluate(model, postprocessors, loader_val, base_ds, device)
        if stats[0] > best_ap:
            best_ap = stats[0]
            save_checkpoint(out / "best.pth", model, optimizer, lr_scheduler, epoch, best_ap, args)
        save_checkpoint(out / "last.pth", model, optimizer, lr_scheduler, epoch, best_ap, args)
        if utils.is_main_process():
            with open(out / "log.txt", "a") as f:
                f.write(json.dumps({"epoch": epoch, "AP": stats[0], "AP50": stats[1], "best_AP": best_ap,
                                    "time": time.time() - t0,
                                    **{f"train_{k}": v for k, v in train_stats.items()}}) + "\n")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
