"""Deformable DETR (single-scale / multi-scale, optional box refinement) on COCO.

torchrun --nproc_per_node=8 12_deformable_detr.py --coco_path /data/coco --with_box_refine \
    --output_dir exps/r50_deformable_detr_refine
"""
import argparse
import datetime
import json
import math
import os
import random
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from datasets import build_dataset
from models import build_model
from util.misc import collate_fn, MetricLogger, SmoothedValue


def get_args():
    p = argparse.ArgumentParser("Deformable DETR")
    p.add_argument("--lr", default=2e-4, type=float)
    p.add_argument("--lr_backbone", default=2e-5, type=float)
    p.add_argument("--lr_linear_proj_mult", default=0.1, type=float)
    p.add_argument("--batch_size", default=2, type=int)
    p.add_argument("--weight_decay", default=1e-4, type=float)
    p.add_argument("--epochs", default=50, type=int)
    p.add_argument("--lr_drop", default=40, type=int)
    p.add_argument("--clip_max_norm", default=0.1, type=float)
    p.add_argument("--num_queries", default=300, type=int)
    p.add_argument("--with_box_refine", action="store_true")
    p.add_argument("--two_stage", action="store_true")
    p.add_argument("--coco_path", required=True)
    p.add_argument("--output_dir", default="exps/deformable_detr")
    p.add_argument("--resume", default="")
    p.add_argument("--seed", default=42, type=int)
    p.add_argument("--num_workers", default=2, type=int)
    return p.parse_args()


def all_gather_varlen(t):
    """all_gather for tensors whose first dim differs between ranks: pad to the max, gather, trim."""
    world = dist.get_world_size()
    n = torch.tensor([t.shape[0]], device=t.device, dtype=torch.long)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    max_n = max(sizes)
    padded = t.new_zeros((max_n,) + tuple(t.shape[1:]))
    padded[: t.shape[0]] = t
    out = [t.new_zeros((max_n,) + tuple(t.shape[1:])) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[:s] for o, s in zip(out, sizes)], 0)


class ShardSampler(torch.utils.data.Sampler):
    def __init__(self, n, rank, world):
        self.idx = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


def train_one_epoch(model, criterion, loader, optimizer, device, epoch, max_norm, world):
    model.train()
    criterion.train()
    logger = MetricLogger(delimiter="  ")
    logger.add_meter("lr", SmoothedValue(window_size=1, fmt="{value:.6f}"))
    for samples, targets in logger.log_every(loader, 50, f"Epoch: [{epoch}]"):
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]

        # average number of target boxes across all nodes, for normalisation
        num_boxes = torch.as_tensor([sum(len(t["labels"]) for t in targets)], dtype=torch.float, device=device)
        dist.all_reduce(num_boxes)
        num_boxes = torch.clamp(num_boxes / world, min=1).item()

        outputs = model(samples)
        loss_dict = criterion(outputs, targets, num_boxes=num_boxes)
        wd = criterion.weight_dict
        losses = sum(loss_dict[k] * wd[k] for k in loss_dict if k in wd)

        with torch.no_grad():
            keys = sorted(k for k in loss_dict if k in wd)
            vals = torch.stack([loss_dict[k].detach() * wd[k] for k in keys])
            dist.all_reduce(vals)
            vals /= world
        loss_value = vals.sum().item()
        if not math.isfinite(loss_value):
            raise RuntimeError(f"Loss is {loss_value}: {dict(zip(keys, vals.tolist()))}")

        optimizer.zero_grad()
        losses.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        logger.update(loss=loss_value, grad_norm=grad_norm, lr=optimizer.param_groups[0]["lr"])
    logger.synchronize_between_processes()
    return {k: m.global_avg for k, m in logger.meters.items()}


@torch.no_grad()
def evaluate(model, postprocessors, loader, coco_gt, device, output_dir):
    model.eval()
    rows = []
    for samples, targets in loader:
        outputs = model(samples.to(device))
        orig_sizes = torch.stack([t["orig_size"] for t in targets]).to(device)
        for t, r in zip(targets, postprocessors["bbox"](outputs, orig_sizes)):
            b = r["boxes"]
            b = torch.cat([b[:, :2], b[:, 2:] - b[:, :2]], 1)
            iid = torch.full_like(r["scores"], float(t["image_id"]))
            rows.append(torch.cat([iid[:, None], b, r["scores"][:, None], r["labels"][:, None].float()], 1))
    local = torch.cat(rows) if rows else torch.zeros((0, 7), device=device)
    dets = all_gather_varlen(local).cpu().numpy()  # every rank has a different number of images

    stats = torch.zeros(12, device=device)
    if dist.get_rank() == 0:
        res = [{"image_id": int(d[0]), "bbox": d[1:5].tolist(), "score": float(d[5]), "category_id": int(d[6])}
               for d in dets]
        with open(output_dir / "eval_bbox.json", "w") as f:
            json.dump(res, f)
        ev = COCOeval(coco_gt, coco_gt.loadRes(res), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
        stats = torch.as_tensor(ev.stats, dtype=torch.float, device=device)
    dist.broadcast(stats, 0)
    return stats.tolist()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed = args.seed + rank
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    model, criterion, postprocessors = build_model(args)
    model.to(device)
    criterion.to(device)
    model_without_ddp = model

    def match(n, keys):
        return any(k in n for k in keys)

    param_dicts = [
        {"params": [p for n, p in model_without_ddp.named_parameters()
                    if not match(n, ["backbone.0"]) and not match(n, ["reference_points", "sampling_offsets"])
                    and p.requires_grad], "lr": args.lr},
        {"params": [p for n, p in model_without_ddp.named_parameters()
                    if match(n, ["backbone.0"]) and p.requires_grad], "lr": args.lr_backbone},
        {"params": [p for n, p in model_without_ddp.named_parameters()
                    if match(n, ["reference_points", "sampling_offsets"]) and p.requires_grad],
         "lr": args.lr * args.lr_linear_proj_mult},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)

    output_dir = Path(args.output_dir)
    start_epoch, best_ap = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        # accept checkpoints written both from the bare model and from the DDP wrapper
        state = OrderedDict((k[len("module."):] if k.startswith("module.") else k, v)
                            for k, v in ckpt["model"].items())
        missing, unexpected = model_without_ddp.load_state_dict(state, strict=False)
        if rank == 0 and (missing or unexpected):
            print(f"missing keys: {missing}\nunexpected keys: {unexpected}")
        if "optimizer" in ckpt and "epoch" in ckpt:
            optimizer.load_state_dict(ckpt["optimizer"])
            lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
            start_epoch = ckpt["epoch"] + 1
            best_ap = ckpt.get("best_ap", 0.0)

    model = DistributedDataParallel(model, device_ids=[local_rank])
    model_without_ddp = model.module

    ds_train = build_dataset("train", args)
    ds_val = build_dataset("val", args)
    sampler_train = DistributedSampler(ds_train)
    loader_train = DataLoader(ds_train, batch_sampler=torch.utils.data.BatchSampler(sampler_train, args.batch_size,
                                                                                    drop_last=True),
                              collate_fn=collate_fn, num_workers=args.num_workers, pin_memory=True)
    loader_val = DataLoader(ds_val, args.batch_size, sampler=ShardSampler(len(ds_val), rank, world),
                            collate_fn=collate_fn, num_workers=args.num_workers, pin_memory=True)

    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler_train.set_epoch(epoch)
        train_stats = train_one_epoch(model, criterion, loader_train, optimizer, device, epoch,
                                      args.clip_max_norm, world)
        lr_scheduler.step()
        coco_stats = evaluate(model_without_ddp, postprocessors, loader_val, ds_val.coco, device, output_dir)
        ap = coco_stats[0]
        is_best = ap > best_ap
        best_ap = max(best_ap, ap)
        if rank == 0:
            ckpt = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                    "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "args": args, "best_ap": best_ap}
            torch.save(ckpt, output_dir / "checkpoint.pth")
            if (epoch + 1) % 5 == 0:
                torch.save(ckpt, output_dir / f"checkpoint{epoch:04}.pth")
            if is_best:
                torch.save(ckpt, output_dir / "checkpoint_best.pth")
            log = {**{f"train_{k}": v for k, v in train_stats.items()}, "epoch": epoch, "AP": ap,
                   "AP50": coco_stats[1], "best_AP": best_ap}
            with (output_dir / "log.txt").open("a") as f:
                f.write(json.dumps(log) + "\n")
        dist.barrier()

    if rank == 0:
        print("Training time", str(datetime.timedelta(seconds=int(time.time() - t0))))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
