#!/usr/bin/env python
# DETR long-schedule training on the preemptible queue.
# The job is requeued after preemption, so it always resumes from
# <output_dir>/checkpoint.pth when present.
#
#   torchrun --nproc_per_node=8 11_detr_auto_resume.py --coco_path /datasets/coco \
#       --output_dir /shared/exp/detr_r50_500e
import argparse
import datetime
import json
import math
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

import util.misc as utils
from datasets import build_dataset, get_coco_api_from_dataset
from datasets.coco_eval import CocoEvaluator
from main import get_args_parser
from models import build_model

STOP_REQUESTED = False


def _handle_sigterm(signum, frame):
    global STOP_REQUESTED
    STOP_REQUESTED = True


def train_one_epoch(model, criterion, data_loader, optimizer, device, epoch, max_norm):
    model.train()
    criterion.train()
    metric_logger = utils.MetricLogger(delimiter="  ")
    metric_logger.add_meter("lr", utils.SmoothedValue(window_size=1, fmt="{value:.6f}"))
    for samples, targets in metric_logger.log_every(data_loader, 100, f"Epoch: [{epoch}]"):
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        outputs = model(samples)
        loss_dict = criterion(outputs, targets)
        weight_dict = criterion.weight_dict
        losses = sum(loss_dict[k] * weight_dict[k] for k in loss_dict.keys() if k in weight_dict)

        loss_dict_reduced = utils.reduce_dict(loss_dict)
        loss_value = sum(loss_dict_reduced[k] * weight_dict[k]
                         for k in loss_dict_reduced.keys() if k in weight_dict).item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training")
            sys.exit(1)

        optimizer.zero_grad()
        losses.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        metric_logger.update(loss=loss_value, class_error=loss_dict_reduced["class_error"])
        metric_logger.update(lr=optimizer.param_groups[0]["lr"])
    metric_logger.synchronize_between_processes()
    return {k: meter.global_avg for k, meter in metric_logger.meters.items()}


@torch.no_grad()
def evaluate(model, postprocessors, data_loader, base_ds, device):
    model.eval()
    coco_evaluator = CocoEvaluator(base_ds, ("bbox",))
    for samples, targets in data_loader:
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        outputs = model(samples)
        orig_target_sizes = torch.stack([t["orig_size"] for t in targets], dim=0)
        results = postprocessors["bbox"](outputs, orig_target_sizes)
        coco_evaluator.update({t["image_id"].item(): r for t, r in zip(targets, results)})
    coco_evaluator.synchronize_between_processes()
    coco_evaluator.accumulate()
    coco_evaluator.summarize()
    return coco_evaluator.coco_eval["bbox"].stats.tolist()


def find_resume_checkpoint(output_dir):
    ckpt = Path(output_dir) / "checkpoint.pth"
    return ckpt if ckpt.exists() else None


def main(args):
    utils.init_distributed_mode(args)
    signal.signal(signal.SIGTERM, _handle_sigterm)
    device = torch.device(args.device)
    seed = args.seed + utils.get_rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

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

    dataset_train = build_dataset(image_set="train", args=args)
    dataset_val = build_dataset(image_set="val", args=args)
    if args.distributed:
        sampler_train = DistributedSampler(dataset_train)
        sampler_val = DistributedSampler(dataset_val, shuffle=False)
    else:
        sampler_train = torch.utils.data.RandomSampler(dataset_train)
        sampler_val = torch.utils.data.SequentialSampler(dataset_val)
    data_loader_train = DataLoader(dataset_train, batch_sampler=BatchSampler(sampler_train, args.batch_size,
                                                                             drop_last=True),
                                   collate_fn=utils.collate_fn, num_workers=args.num_workers)
    data_loader_val = DataLoader(dataset_val, args.batch_size, sampler=sampler_val, drop_last=False,
                                 collate_fn=utils.collate_fn, num_workers=args.num_workers)
    base_ds = get_coco_api_from_dataset(dataset_val)

    output_dir = Path(args.output_dir)
    resume_from = args.resume or find_resume_checkpoint(output_dir)
    if resume_from:
        checkpoint = torch.load(resume_from)
        model_without_ddp.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
        args.start_epoch = checkpoint["epoch"] + 1
        print(f"Resumed from {resume_from} at epoch {args.start_epoch}")

    print("Start training")
    start_time = time.time()
    for epoch in range(args.start_epoch, args.epochs):
        if args.distributed:
            sampler_train.set_epoch(epoch)
        train_stats = train_one_epoch(model, criterion, data_loader_train, optimizer, device, epoch,
                                      args.clip_max_norm)
        lr_scheduler.step()

        checkpoint_paths = [output_dir / "checkpoint.pth"]
        if (epoch + 1) % 100 == 0:
            checkpoint_paths.append(output_dir / f"checkpoint{epoch:04}.pth")
        for path in checkpoint_paths:
            utils.save_on_master({"model": model_without_ddp.state_dict(),
                                  "optimizer": optimizer.state_dict(),
                                  "lr_scheduler": lr_scheduler.state_dict(),
                                  "epoch": epoch,
                                  "args": args}, path)

        log_stats = {"epoch": epoch, **{f"train_{k}": v for k, v in train_stats.items()}}
        if (epoch + 1) % 10 == 0:
            log_stats["coco_eval_bbox"] = evaluate(model, postprocessors, data_loader_val, base_ds, device)
        if utils.is_main_process():
            with (output_dir / "log.txt").open("a") as f:
                f.write(json.dumps(log_stats) + "\n")

        # the scheduler sends SIGTERM to every task before preemption
        stop = torch.tensor([int(STOP_REQUESTED)], device=device)
        if args.distributed:
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            print("Preemption signal received, exiting after checkpoint")
            break

    total_time = time.time() - start_time
    print(f"Training time {datetime.timedelta(seconds=int(total_time))}")
    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser("DETR auto-resume", parents=[get_args_parser()])
    args = parser.parse_args()
    if args.output_dir:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    main(args)
