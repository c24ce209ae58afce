"""
DETR R50 sweep runner (eos_coef / num_queries / lr) for the 50-epoch schedule.
Each sweep point is one torchrun job:

    torchrun --nproc_per_node=8 13_detr_r50_sweep.py --coco_path /data/coco \
        --num_queries 200 --eos_coef 0.05 --run_name q200_eos005
"""
import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

import util.misc as utils
from datasets import build_dataset, get_coco_api_from_dataset
from datasets.coco_eval import CocoEvaluator
from main import get_args_parser
from models import build_model


def train_one_epoch(model, criterion, loader, optimizer, lr_sched, device, epoch, max_norm, global_step):
    model.train()
    criterion.train()
    wd = criterion.weight_dict
    meter = utils.MetricLogger(delimiter="  ")
    for samples, targets in meter.log_every(loader, 100, f"Epoch: [{epoch}]"):
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        outputs = model(samples)
        loss_dict = criterion(outputs, targets)
        losses = sum(loss_dict[k] * wd[k] for k in loss_dict if k in wd)

        reduced = utils.reduce_dict(loss_dict)
        reduced_scaled = {k: v * wd[k] for k, v in reduced.items() if k in wd}
        loss_value = sum(reduced_scaled.values()).item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training")
            sys.exit(1)

        optimizer.zero_grad()
        losses.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        global_step += 1

        meter.update(loss=loss_value, class_error=reduced["class_error"])
        if global_step % 20 == 0:
            wandb.log({"train/loss": loss_value,
                       "train/loss_ce": reduced_scaled["loss_ce"].item(),
                       "train/loss_bbox": reduced_scaled["loss_bbox"].item(),
                       "train/loss_giou": reduced_scaled["loss_giou"].item(),
                       "train/class_error": reduced["class_error"].item(),
                       "train/grad_norm": grad_norm.item(),
                       "lr": optimizer.param_groups[0]["lr"]}, step=global_step)
    meter.synchronize_between_processes()
    return {k: m.global_avg for k, m in meter.meters.items()}, global_step


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


def main(args):
    utils.init_distributed_mode(args)
    device = torch.device(args.device)
    seed = args.seed + utils.get_rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    wandb.init(project="detr-sweeps", name=args.run_name, config=vars(args), dir=args.output_dir)

    model, criterion, postprocessors = build_model(args)
    model.to(device)
    model_without_ddp = model
    if args.distributed:
        model = DDP(model, device_ids=[args.gpu])
        model_without_ddp = model.module
    n_params = sum(p.numel() for p in model_without_ddp.parameters() if p.requires_grad)

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
    loader_train = DataLoader(dataset_train, batch_sampler=BatchSampler(sampler_train, args.batch_size, drop_last=True),
                              collate_fn=utils.collate_fn, num_workers=args.num_workers)
    loader_val = DataLoader(dataset_val, args.batch_size, sampler=sampler_val, drop_last=False,
                            collate_fn=utils.collate_fn, num_workers=args.num_workers)
    base_ds = get_coco_api_from_dataset(dataset_val)

    output_dir = Path(args.output_dir)
    global_step, best_ap = 0, 0.0
    for epoch in range(args.epochs):
        if args.distributed:
            sampler_train.set_epoch(epoch)
        t0 = time.time()
        train_stats, global_step = train_one_epoch(model, criterion, loader_train, optimizer, lr_scheduler, device,
                                                   epoch, args.clip_max_norm, global_step)
        lr_scheduler.step()
        stats = evaluate(model, postprocessors, loader_val, base_ds, device)
        wandb.log({"val/AP": stats[0], "val/AP50": stats[1], "val/AP75": stats[2], "val/APs": stats[3],
                   "val/APm": stats[4], "val/APl": stats[5], "epoch": epoch}, step=global_step)
        ckpt = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "args": args}
        utils.save_on_master(ckpt, output_dir / "checkpoint.pth")
        if stats[0] > best_ap:
            best_ap = stats[0]
            utils.save_on_master(ckpt, output_dir / "best.pth")
        if utils.is_main_process():
            with (output_dir / "log.txt").open("a") as f:
                f.write(json.dumps({"epoch": epoch, "AP": stats[0], "n_parameters": n_params,
                                    "epoch_time": time.time() - t0,
                                    **{f"train_{k}": v for k, v in train_stats.items()}}) + "\n")

    wandb.summary["best_AP"] = best_ap
    wandb.finish()
    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser("DETR sweep", parents=[get_args_parser()])
    parser.add_argument("--run_name", default=None)
    args = parser.parse_args()
    args.epochs, args.lr_drop = 50, 33
    if not args.output_dir:
        args.output_dir = f"sweeps/{args.run_name or 'default'}"
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    main(args)
