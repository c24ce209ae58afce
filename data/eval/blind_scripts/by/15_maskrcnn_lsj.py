"""Mask R-CNN R50-FPN v2 with Large Scale Jitter (1024x1024 crops, scale 0.1-2.0), SyncBN and AMP.

    torchrun --nproc_per_node=8 maskrcnn_lsj.py --coco-root /data/coco --epochs 100
"""
import argparse
import math
import os
import time
from itertools import chain

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from pycocotools import mask as mask_utils
from pycocotools.cocoeval import COCOeval
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.models.detection import maskrcnn_resnet50_fpn_v2
from torchvision.transforms import v2 as T

LSJ_SIZE = 1024


def build_dataset(root, split, train):
    if train:
        tf = T.Compose([
            T.ToImage(),
            T.RandomHorizontalFlip(),
            T.ScaleJitter(target_size=(LSJ_SIZE, LSJ_SIZE), scale_range=(0.1, 2.0), antialias=True),
            T.RandomCrop((LSJ_SIZE, LSJ_SIZE), pad_if_needed=True, fill=0),
            T.ClampBoundingBoxes(),
            T.SanitizeBoundingBoxes(min_size=1),
            T.ToDtype(torch.float32, scale=True),
        ])
    else:
        tf = T.Compose([T.ToImage(), T.ToDtype(torch.float32, scale=True)])
    ds = torchvision.datasets.CocoDetection(f"{root}/{split}2017", f"{root}/annotations/instances_{split}2017.json",
                                            transforms=tf)
    if train:
        ds.ids = [i for i in ds.ids if ds.coco.getAnnIds(imgIds=i, iscrowd=False)]
    keys = ("boxes", "labels", "masks", "image_id") if train else ("image_id",)
    return torchvision.datasets.wrap_dataset_for_transforms_v2(ds, target_keys=keys)


def collate(batch):
    return tuple(zip(*batch))


def cosine_lr(step, total, warmup, base):
    if step < warmup:
        return base * (0.001 + 0.999 * step / warmup)
    p = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1.0 + math.cos(math.pi * p))


@torch.no_grad()
def evaluate(model, loader, coco_gt, device):
    model.eval()
    out = {}
    for imgs, tgts in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            preds = model([im.to(device) for im in imgs])
        for t, p in zip(tgts, preds):
            iid = int(t["image_id"])
            boxes = p["boxes"].float().cpu()
            boxes[:, 2:] -= boxes[:, :2]
            masks = (p["masks"][:, 0] > 0.5).cpu().numpy().astype(np.uint8)
            rles = [mask_utils.encode(np.asfortranarray(m)) for m in masks]
            for r in rles:
                r["counts"] = r["counts"].decode("ascii")
            out[iid] = [{"image_id": iid, "category_id": int(c), "bbox": b, "score": float(s), "segmentation": r}
                        for b, s, c, r in zip(boxes.tolist(), p["scores"].tolist(), p["labels"].tolist(), rles)]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, out)
    if dist.get_rank() != 0:
        return {}
    merged = {}
    for p in parts:
        merged.update(p)
    dets = list(chain.from_iterable(merged.values()))
    stats = {}
    for iou_type in ("bbox", "segm"):
        E = COCOeval(coco_gt, coco_gt.loadRes(dets), iou_type)
        E.params.imgIds = sorted(merged)
        E.evaluate()
        E.accumulate()
        E.summarize()
        stats[iou_type] = E.stats[0]
    return stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coco-root", default="/data/coco")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=8, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1, help="for a global batch of 64")
    ap.add_argument("--warmup-iters", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--out", default="runs/mrcnn_lsj")
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = build_dataset(args.coco_root, "train", True)
    val_ds = build_dataset(args.coco_root, "val", False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8, collate_fn=collate,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=2, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=4,
                        collate_fn=collate)

    model = maskrcnn_resnet50_fpn_v2(weights=None, weights_backbone="IMAGENET1K_V1", num_classes=91,
                                     trainable_backbone_layers=5, min_size=LSJ_SIZE, max_size=LSJ_SIZE)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

    base_lr = args.lr * args.batch_size * world / 64
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 4e-5}, {"params": no_decay, "weight_decay": 0.0}],
                          lr=base_lr, momentum=0.9)
    scaler = torch.cuda.amp.GradScaler()
    total_steps = args.epochs * len(train_dl)

    start_epoch, step = 0, 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, step = ck["epoch"] + 1, ck["step"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        for i, (imgs, tgts) in enumerate(train_dl):
            if any(len(t["boxes"]) == 0 for t in tgts):
                continue  # the crop can remove every instance of an image
            lr = cosine_lr(step, total_steps, args.warmup_iters, base_lr)
            for g in opt.param_groups:
                g["lr"] = lr
            imgs = [im.to(device, non_blocking=True) for im in imgs]
            tgts = [{"boxes": t["boxes"].to(device), "labels": t["labels"].to(device),
                     "masks": t["masks"].to(device)} for t in tgts]
            with torch.autocast("cuda", dtype=torch.float16):
                loss_dict = ddp(imgs, tgts)
                loss = sum(loss_dict.values())
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 10.0)
            scaler.step(opt)
            scaler.update()
            step += 1
            if i % 50 == 0:
                logged = torch.stack([v.detach().float() for v in loss_dict.values()])
                dist.all_reduce(logged, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} [{i}/{len(train_dl)}] lr {lr:.4f} loss {logged.sum().item():.3f} "
                          + " ".join(f"{k}={v:.3f}" for k, v in zip(loss_dict, logged.tolist()))
                          + f" {time.time() - t0:.0f}s", flush=True)

        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": epoch, "step": step}, os.path.join(args.out, "last.pth"))
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            stats = evaluate(model, val_dl, val_ds.coco, device)
            if rank == 0:
                print(f"epoch {epoch}: box AP {stats['bbox']:.4f} mask AP {stats['segm']:.4f}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
