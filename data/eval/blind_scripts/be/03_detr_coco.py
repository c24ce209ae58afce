"""
DETR (ResNet-50) training on COCO 2017.

    torchrun --nproc_per_node=8 03_detr_coco.py --coco_path /data/coco --output_dir out/detr_r50
"""
import argparse
import datetime
import json
import math
import os
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
from datasets.coco import CocoDetection
from models.detr import build_detr, PostProcess
from util.misc import nested_tensor_from_tensor_list, SmoothedValue


def get_args_parser():
    parser = argparse.ArgumentParser("DETR", add_help=False)
    parser.add_argument("--lr", default=1e-4, type=float)
    parser.add_argument("--lr_backbone", default=1e-5, type=float)
    parser.add_argument("--batch_size", default=4, type=int)
    parser.add_argument("--weight_decay", default=1e-4, type=float)
    parser.add_argument("--epochs", default=300, type=int)
    parser.add_argument("--lr_drop", default=200, type=int)
    parser.add_argument("--clip_max_norm", default=0.1, type=float)
    parser.add_argument("--num_queries", default=100, type=int)
    parser.add_argument("--aux_loss", action="store_true", default=True)
    parser.add_argument("--set_cost_class", default=1, type=float)
    parser.add_argument("--set_cost_bbox", default=5, type=float)
    parser.add_argument("--set_cost_giou", default=2, type=float)
    parser.add_argument("--eos_coef", default=0.1, type=float)
    parser.add_argument("--coco_path", type=str, required=True)
    parser.add_argument("--output_dir", default="out")
    parser.add_argument("--seed", default=42, type=int)
    parser.add_argument("--resume", default="")
    parser.add_argument("--eval_every", default=5, type=int)
    parser.add_argument("--score_thresh", default=0.01, type=float)
    parser.add_argument("--num_workers", default=2, type=int)
    return parser


def collate_fn(batch):
    imgs, targets = list(zip(*batch))
    return nested_tensor_from_tensor_list(imgs), list(targets)


def make_transforms(image_set):
    normalize = T.Compose([T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    scales = [480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800]
    if image_set == "train":
        return T.Compose([
            T.RandomHorizontalFlip(),
            T.RandomSelect(
                T.RandomResize(scales, max_size=1333),
                T.Compose([T.RandomResize([400, 500, 600]), T.RandomSizeCrop(384, 600),
                           T.RandomResize(scales, max_size=1333)]),
            ),
            normalize,
        ])
    return T.Compose([T.RandomResize([800], max_size=1333), normalize])


def reduce_dict(d):
    world_size = dist.get_world_size()
    with torch.no_grad():
        names = sorted(d.keys())
        values = torch.stack([d[k] for k in names])
        dist.all_reduce(values)
        values /= world_size
    return {k: v for k, v in zip(names, values)}


def train_one_epoch(model, criterion, loader, optimizer, device, epoch, max_norm, rank):
    model.train()
    criterion.train()
    loss_meter = SmoothedValue(window_size=20)
    for it, (samples, targets) in enumerate(loader):
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        outputs = model(samples)
        loss_dict = criterion(outputs, targets)
        weight_dict = criterion.weight_dict
        losses = sum(loss_dict[k] * weight_dict[k] for k in loss_dict if k in weight_dict)

        reduced = reduce_dict(loss_dict)
        loss_value = sum(reduced[k] * weight_dict[k] for k in reduced if k in weight_dict).item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training", reduced)
            raise SystemExit(1)

        optimizer.zero_grad()
        losses.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        loss_meter.update(loss_value)
        if rank == 0 and it % 100 == 0:
            print(f"Epoch [{epoch}] it {it}/{len(loader)} loss {loss_meter.median:.4f} "
                  f"({loss_meter.global_avg:.4f}) lr {optimizer.param_groups[0]['lr']:.2e}")
    return loss_meter.global_avg


@torch.no_grad()
def evaluate(model, postprocessor, loader, coco_gt, device, output_dir, rank, score_thresh=0.01):
    model.eval()
    rows = []
    for samples, targets in loader:
        samples = samples.to(device)
        outputs = model(samples)
        orig_sizes = torch.stack([t["orig_size"] for t in targets]).to(device)
        results = postprocessor(outputs, orig_sizes)
        for t, r in zip(targets, results):
            keep = r["scores"] > score_thresh  # keeps the results json small
            boxes, scores, labels = r["boxes"][keep], r["scores"][keep], r["labels"][keep]
            boxes = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], dim=1)  # xyxy -> xywh
            img_id = torch.full_like(scores, float(t["image_id"].item()))
            rows.append(torch.cat([img_id[:, None], boxes, scores[:, None], labels[:, None].float()], 1))
    local = torch.cat(rows, 0) if rows else torch.zeros(0, 7, device=device)

    # collect detections of every rank on every rank
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    dets = torch.cat(gathered, 0).cpu().numpy()

    stats = torch.zeros(2, device=device)
    if rank == 0:
        json_dets = []
        seen = set()
        for row in dets:
            key = (int(row[0]), *np.round(row[1:], 3).tolist())
            if key in seen:  # DistributedSampler pads by repeating images
                continue
            seen.add(key)
            json_dets.append({"image_id": int(row[0]), "bbox": [float(x) for x in row[1:5]],
                              "score": float(row[5]), "category_id": int(row[6])})
        with open(os.path.join(output_dir, "bbox_results.json"), "w") as f:
            json.dump(json_dets, f)
        coco_dt = coco_gt.loadRes(json_dets) if json_dets else COCO()
        coco_eval = COCOeval(coco_gt, coco_dt, "bbox")
        coco_eval.evaluate()
        coco_eval.accumulate()
        coco_eval.summarize()
        stats[0], stats[1] = coco_eval.stats[0], coco_eval.stats[1]
    dist.broadcast(stats, src=0)
    return stats[0].item(), stats[1].item()


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    device = torch.device("cuda")

    seed = args.seed + rank
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    model, criterion = build_detr(num_classes=91, num_queries=args.num_queries, aux_loss=args.aux_loss,
                                  cost_class=args.set_cost_class, cost_bbox=args.set_cost_bbox,
                                  cost_giou=args.set_cost_giou, eos_coef=args.eos_coef)
    model.to(device)
    criterion.to(device)
    postprocessor = PostProcess()

    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    model_without_ddp = model.module
    param_dicts = [
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" in n and p.requires_grad],
         "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)

    root = Path(args.coco_path)
    ds_train = CocoDetection(root / "train2017", root / "annotations/instances_train2017.json",
                             transforms=make_transforms("train"))
    ds_val = CocoDetection(root / "val2017", root / "annotations/instances_val2017.json",
                           transforms=make_transforms("val"))
    sampler_train = DistributedSampler(ds_train)
    sampler_val = DistributedSampler(ds_val, shuffle=False)
    batch_sampler_train = torch.utils.data.BatchSampler(sampler_train, args.batch_size, drop_last=True)
    loader_train = DataLoader(ds_train, batch_sampler=batch_sampler_train, collate_fn=collate_fn,
                              num_workers=args.num_workers)
    loader_val = DataLoader(ds_val, args.batch_size, sampler=sampler_val, drop_last=False,
                            collate_fn=collate_fn, num_workers=args.num_workers)
    coco_gt = ds_val.coco

    output_dir = Path(args.output_dir)
    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)

    start_epoch, best_ap = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        start_epoch = ckpt["epoch"] + 1
        best_ap = ckpt.get("best_ap", 0.0)

    print("Start training")
    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler_train.set_epoch(epoch)
        train_loss = train_one_epoch(model, criterion, loader_train, optimizer, device, epoch,
                                     args.clip_max_norm, rank)
        lr_scheduler.step()

        ap, ap50 = -1.0, -1.0
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            ap, ap50 = evaluate(model_without_ddp, postprocessor, loader_val, coco_gt, device, output_dir, rank,
                               score_thresh=args.score_thresh)

        if rank == 0:
            ckpt = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                    "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "args": args,
                    "best_ap": max(best_ap, ap)}
            torch.save(ckpt, output_dir / "checkpoint.pth")
            if ap > best_ap:
                torch.save(ckpt, output_dir / "checkpoint_best.pth")
            with open(output_dir / "log.txt", "a") as f:
                f.write(json.dumps({"epoch": epoch, "train_loss": train_loss, "AP": ap, "AP50": ap50}) + "\n")
        best_ap = max(best_ap, ap)

    total_time = str(datetime.timedelta(seconds=int(time.time() - start_time)))
    if rank == 0:
        print(f"Training time {total_time}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser("DETR training and evaluation script", parents=[get_args_parser()])
    main(parser.parse_args())
