"""RT-DETR (R50-vd backbone, hybrid encoder) training on COCO, 72-epoch schedule.

    torchrun --nproc_per_node=4 20_rtdetr_train.py -c configs/rtdetr_r50vd_6x_coco.yml --amp
"""
import argparse
import datetime
import json
import math
import os
import random
import time
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from rtdetr.data import CocoDetection, build_train_transforms, build_val_transforms
from rtdetr.nn import RTDETR, SetCriterion, HungarianMatcher, RTDETRPostProcessor


class ModelEMA:
    def __init__(self, model, decay=0.9999, warmups=2000):
        self.module = deepcopy(model.module if hasattr(model, "module") else model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.decay_fn = lambda x: decay * (1 - math.exp(-x / warmups))
        self.updates = 0

    @torch.no_grad()
    def update(self, model):
        msd = (model.module if hasattr(model, "module") else model).state_dict()
        self.updates += 1
        d = self.decay_fn(self.updates)
        for k, v in self.module.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(d).add_(msd[k].detach(), alpha=1 - d)


def multiscale_collate(scales, base=640):
    def collate(batch):
        images = torch.stack([b[0] for b in batch])
        targets = [b[1] for b in batch]
        size = random.choice(scales) if scales else base
        if size != images.shape[-1]:
            images = F.interpolate(images, size=size, mode="bilinear", align_corners=False)
        return images, targets  # boxes are normalised cxcywh, unaffected by the resize
    return collate


def val_collate(batch):
    return torch.stack([b[0] for b in batch]), [b[1] for b in batch]


@torch.no_grad()
def coco_evaluate(model, postprocessor, loader, coco_gt, device):
    model.eval()
    results = []
    for images, targets in loader:
        images = images.to(device)
        outputs = model(images)
        orig = torch.stack([t["orig_size"] for t in targets]).to(device)
        for t, r in zip(targets, postprocessor(outputs, orig)):
            boxes = r["boxes"].cpu()
            boxes[:, 2:] -= boxes[:, :2]
            for b, s, l in zip(boxes.tolist(), r["scores"].tolist(), r["labels"].tolist()):
                results.append({"image_id": int(t["image_id"]), "category_id": int(l), "bbox": b, "score": s})
    ev = COCOeval(coco_gt, coco_gt.loadRes(results), "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats.tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--use-ema", action="store_true")
    ap.add_argument("--resume", default="")
    ap.add_argument("--output-dir", default="output/rtdetr_r50vd")
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed = cfg.get("seed", 0) + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    train_ds = CocoDetection(cfg["train_img_dir"], cfg["train_ann"], build_train_transforms(cfg))
    val_ds = CocoDetection(cfg["val_img_dir"], cfg["val_ann"], build_val_transforms(cfg))
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"] // world, sampler=train_sampler,
                              num_workers=cfg.get("num_workers", 4), drop_last=True, pin_memory=True,
                              collate_fn=multiscale_collate(cfg.get("multi_scales", [480 + 32 * i for i in range(11)])))
    val_loader = DataLoader(val_ds, batch_size=8, shuffle=False, num_workers=4, collate_fn=val_collate)

    model = RTDETR(num_classes=cfg["num_classes"], backbone=cfg["backbone"], num_queries=300,
                   num_decoder_layers=6, eval_spatial_size=[640, 640])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    matcher = HungarianMatcher(cost_class=2, cost_bbox=5, cost_giou=2, alpha=0.25, gamma=2.0)
    criterion = SetCriterion(matcher, weight_dict={"loss_vfl": 1, "loss_bbox": 5, "loss_giou": 2},
                             losses=["vfl", "boxes"], num_classes=cfg["num_classes"]).to(device)
    postprocessor = RTDETRPostProcessor(num_classes=cfg["num_classes"], num_top_queries=300)

    backbone_params = [p for n, p in model.named_parameters() if n.startswith("backbone") and p.requires_grad]
    other_params = [p for n, p in model.named_parameters() if not n.startswith("backbone") and p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": backbone_params, "lr": cfg["lr"] * 0.1},
                                   {"params": other_params}], lr=cfg["lr"], weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[1000], gamma=0.1)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    start_epoch, best_ap = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_ap = ckpt["epoch"] + 1, ckpt.get("best_ap", 0.0)

    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    ema = ModelEMA(model) if args.use_ema else None
    os.makedirs(args.output_dir, exist_ok=True)

    warmup_iters = cfg.get("warmup_iters", 2000)
    global_step = start_epoch * len(train_loader)
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        if epoch == cfg["epochs"] - cfg.get("no_aug_epochs", 2):
            train_ds.set_stop_aug_epoch()  # drop mosaic / zoom-out for the last epochs
        model.train()
        criterion.train()
        t0 = time.time()
        for it, (images, targets) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            targets = [{k: v.to(device, non_blocking=True) for k, v in t.items()} for t in targets]
            if global_step < warmup_iters:
                f = min(1.0, (global_step + 1) / warmup_iters)
                for g, lr in zip(optimizer.param_groups, base_lrs):
                    g["lr"] = lr * f

            with torch.autocast(device_type="cuda", enabled=args.amp):
                outputs = model(images, targets=targets)
            with torch.autocast(device_type="cuda", enabled=False):
                loss_dict = criterion(outputs, targets)
            loss = sum(loss_dict.values())
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            scaler.step(optimizer)
            scaler.update()
            if ema:
                ema.update(model)
            global_step += 1

            if it % 100 == 0:
                vals = torch.stack([v.detach() for v in loss_dict.values()])
                dist.all_reduce(vals)
                vals /= world
                if rank == 0:
                    print(f"Epoch [{epoch}] [{it}/{len(train_loader)}] loss {vals.sum():.4f} "
                          f"lr {optimizer.param_groups[1]['lr']:.2e} {(time.time() - t0) / (it + 1):.3f}s/it",
                          flush=True)
        scheduler.step()

        if rank == 0:
            eval_model = ema.module if ema else model
            stats = coco_evaluate(eval_model, postprocessor, val_loader, val_ds.coco, device)
            ap = stats[0]
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch, "best_ap": max(best_ap, ap)}
            if ema:
                state["ema"] = ema.module.state_dict()
            torch.save(state, os.path.join(args.output_dir, "last.pth"))
            if ap > best_ap:
                best_ap = ap
                torch.save(state, os.path.join(args.output_dir, "best.pth"))
            with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "AP": ap, "AP50": stats[1]}) + "\n")
            print(f"epoch {epoch}: AP {ap:.4f} AP50 {stats[1]:.4f} best {best_ap:.4f}")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
