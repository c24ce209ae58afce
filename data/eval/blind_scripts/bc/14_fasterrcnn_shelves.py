"""Faster R-CNN (ResNet-50-FPN v2) for retail shelf product detection.

    torchrun --nnodes=1 --nproc-per-node=8 --max-restarts=2 train_det.py \
        --data /datasets/shelves/coco --output /shared/det/shelves_frcnn --epochs 26
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torchvision
import wandb
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.detection import fasterrcnn_resnet50_fpn_v2
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor

from shelves.data import CocoDetection, get_transform


def get_args():
    parser = argparse.ArgumentParser(description="shelf detector training")
    parser.add_argument("--data", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--epochs", type=int, default=26)
    parser.add_argument("--batch-size", type=int, default=4, help="images per GPU")
    parser.add_argument("--lr", type=float, default=0.02, help="for 16 images / iteration")
    parser.add_argument("--lr-steps", type=int, nargs="+", default=[16, 22])
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--wandb-project", default="shelf-detection")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def collate(batch):
    return tuple(zip(*batch))


def build_model(num_classes):
    model = fasterrcnn_resnet50_fpn_v2(weights="DEFAULT", trainable_backbone_layers=3)
    in_features = model.roi_heads.box_predictor.cls_score.in_features
    model.roi_heads.box_predictor = FastRCNNPredictor(in_features, num_classes)
    return model


@torch.no_grad()
def evaluate(model, loader, coco_gt, device, rank, world):
    model.eval()
    results = []
    for images, targets in loader:
        images = [im.to(device) for im in images]
        outputs = model(images)
        for out, tgt in zip(outputs, targets):
            boxes = out["boxes"].cpu()
            boxes[:, 2:] -= boxes[:, :2]  # xyxy -> xywh
            for b, s, l in zip(boxes.tolist(), out["scores"].tolist(), out["labels"].tolist()):
                results.append({"image_id": int(tgt["image_id"]), "category_id": int(l),
                                "bbox": [round(v, 2) for v in b], "score": round(s, 4)})
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    model.train()
    if rank != 0:
        return None
    dets = [r for part in gathered for r in part]
    if not dets:
        return 0.0
    coco_dt = coco_gt.loadRes(dets)
    ev = COCOeval(coco_gt, coco_dt, "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return float(ev.stats[0])


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    train_ds = CocoDetection(os.path.join(args.data, "train"), os.path.join(args.data, "train.json"),
                             get_transform(train=True))
    val_ds = CocoDetection(os.path.join(args.data, "val"), os.path.join(args.data, "val.json"),
                           get_transform(train=False))
    coco_gt = COCO(os.path.join(args.data, "val.json")) if rank == 0 else None
    num_classes = len(train_ds.coco.getCatIds()) + 1

    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, collate_fn=collate, pin_memory=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=2,
                            num_workers=args.workers, collate_fn=collate)

    model = build_model(num_classes)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[args.local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    lr = args.lr * args.batch_size * world / 16
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.lr_steps, gamma=0.1)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    warmup_iters = min(1000, len(train_loader) - 1)

    start_epoch, best_map = 0, 0.0
    ckpt_path = os.path.join(args.output, "checkpoint.pth")
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["lr_scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_map = ckpt["epoch"] + 1, ckpt["best_map"]

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        wandb.init(project=args.wandb_project, config=vars(args), resume="allow",
                   id=os.environ.get("WANDB_RUN_ID"))

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (images, targets) in enumerate(train_loader):
            if epoch == 0 and it <= warmup_iters:
                f = 0.001 + (1 - 0.001) * it / warmup_iters
                for g in optimizer.param_groups:
                    g["lr"] = lr * f
            images = [im.to(device, non_blocking=True) for im in images]
            targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
            with torch.autocast("cuda", enabled=args.amp):
                loss_dict = model(images, targets)
                loss = sum(loss_dict.values())
            if not math.isfinite(loss.item()):
                raise RuntimeError(f"non-finite loss {loss_dict}")
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

            if it % 50 == 0:
                stats = torch.stack([loss.detach()] + [v.detach() for v in loss_dict.values()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    names = ["loss"] + list(loss_dict.keys())
                    wandb.log({f"train/{n}": v for n, v in zip(names, stats.tolist())}
                              | {"lr": optimizer.param_groups[0]["lr"]},
                              step=epoch * len(train_loader) + it)
        scheduler.step()

        bbox_map = evaluate(model.module, val_loader, coco_gt, device, rank, world)
        if rank == 0:
            wandb.log({"val/bbox_mAP": bbox_map, "epoch": epoch, "epoch_min": (time.time() - t0) / 60})
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "lr_scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "best_map": max(best_map, bbox_map)}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if bbox_map > best_map:
                best_map = bbox_map
                torch.save(model.module.state_dict(), os.path.join(args.output, "model_best.pth"))
            with open(os.path.join(args.output, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "bbox_mAP": bbox_map}) + "\n")
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
