"""
DETR R50 with an EMA copy of the weights (evaluated instead of the raw model).

    torchrun --nproc_per_node=8 17_detr_ema.py --coco_path /data/coco --output_dir runs/detr_ema
"""
import argparse
import copy
import json
import math
import random
import sys
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


class ModelEMA:
    def __init__(self, model, decay=0.9997, warmup=2000):
        self.ema = copy.deepcopy(model).eval()
        self.decay, self.warmup, self.updates = decay, warmup, 0
        for p in self.ema.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        self.updates += 1
        d = self.decay * (1 - math.exp(-self.updates / self.warmup))
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(d).add_(msd[k].detach(), alpha=1 - d)


def train_one_epoch(model, criterion, loader, optimizer, ema, model_without_ddp, device, epoch, max_norm):
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
            print(f"Loss is {loss_value}, stopping training")
            sys.exit(1)
        optimizer.zero_grad()
        losses.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        ema.update(model_without_ddp)
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


def main(args):
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    args.distributed = True
    rank, world_size = dist.get_rank(), dist.get_world_size()
    utils.setup_for_distributed(rank == 0)
    device = torch.device("cuda", args.local_rank)
    print(f"rank {rank}/{world_size} on {device}")

    seed = args.seed + rank
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    model, criterion, postprocessors = build_model(args)
    model.to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    model_without_ddp = model.module
    ema = ModelEMA(model_without_ddp)  # after DDP so every rank starts from rank 0's weights

    param_dicts = [
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" in n and p.requires_grad],
         "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)

    dataset_train = build_dataset(image_set="train", args=args)
    dataset_val = build_dataset(image_set="val", args=args)
    sampler_train = DistributedSampler(dataset_train, shuffle=True)
    sampler_val = DistributedSampler(dataset_val, shuffle=False)
    loader_train = DataLoader(dataset_train, batch_sampler=BatchSampler(sampler_train, args.batch_size, drop_last=True),
                              collate_fn=utils.collate_fn, num_workers=args.num_workers, pin_memory=True)
    loader_val = DataLoader(dataset_val, args.batch_size, sampler=sampler_val, drop_last=False,
                            collate_fn=utils.collate_fn, num_workers=args.num_workers)
    base_ds = get_coco_api_from_dataset(dataset_val)

    output_dir = Path(args.output_dir)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        ema.ema.load_state_dict(ckpt["ema"])
        ema.updates = ckpt["ema_updates"]
        optimizer.load_state_dict(ckpt["optimizer"])
        lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        start_epoch = ckpt["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        sampler_train.set_epoch(epoch)
        t0 = time.time()
        train_stats = train_one_epoch(model, criterion, loader_train, optimizer, ema, model_without_ddp, device,
                                      epoch, args.clip_max_norm)
        lr_scheduler.step()
        utils.save_on_master({"model": model_without_ddp.state_dict(), "ema": ema.ema.state_dict(),
                              "ema_updates": ema.updates, "optimizer": optimizer.state_dict(),
                              "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "args": args},
                             output_dir / "checkpoint.pth")
        ema_stats = evaluate(ema.ema, postprocessors, loader_val, base_ds, device)
        if utils.is_main_process():
            with open(output_dir / "log.txt", "a") as f:
                f.write(json.dumps({"epoch": epoch, "ema_AP": ema_stats[0], "ema_AP50": ema_stats[1],
                                    "time": time.time() - t0,
                                    **{f"train_{k}": v for k, v in train_stats.items()}}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser("DETR + EMA", parents=[get_args_parser()])
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    Path(args.output_dir or "runs/detr_ema").mkdir(parents=True, exist_ok=True)
    args.output_dir = args.output_dir or "runs/detr_ema"
    main(args)
