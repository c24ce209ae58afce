"""
Fine-tune a COCO DETR checkpoint on the PCB-defect data set.

The labelling tool exports one CSV (image,x1,y1,x2,y2,label); it is converted
once into COCO json files (train/val split) in --cache_dir, which lives on the
shared filesystem.

torchrun --nnodes 2 --nproc_per_node 4 --rdzv_backend c10d --rdzv_endpoint $MASTER:29400 \
    15_detr_finetune_pcb.py --csv /shared/pcb/labels.csv --images /shared/pcb/images \
    --cache_dir /shared/pcb/cache --output_dir /shared/runs/pcb_detr --pretrained /shared/ckpt/detr_r50.pth
"""
import argparse
import csv
import json
import os
import random
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

import util.misc as utils
from datasets.coco import CocoDetection, make_coco_transforms
from datasets.coco_eval import CocoEvaluator
from main import get_args_parser
from models import build_model


def csv_to_coco(csv_path, image_dir, cache_dir, val_fraction, split_seed):
    rows = defaultdict(list)
    with open(csv_path) as f:
        for r in csv.DictReader(f):
            rows[r["image"]].append(r)
    classes = sorted({r["label"] for rs in rows.values() for r in rs if r["label"]})
    cat_ids = {c: i + 1 for i, c in enumerate(classes)}
    names = sorted(rows)
    random.Random(split_seed).shuffle(names)
    n_val = int(len(names) * val_fraction)
    for split, subset in (("val", names[:n_val]), ("train", names[n_val:])):
        images, anns = [], []
        for img_id, name in enumerate(subset, start=1):
            w, h = Image.open(os.path.join(image_dir, name)).size
            images.append({"id": img_id, "file_name": name, "width": w, "height": h})
            for r in rows[name]:
                if not r["label"]:  # defect-free board, kept as a negative image
                    continue
                x1, y1, x2, y2 = (float(r[k]) for k in ("x1", "y1", "x2", "y2"))
                anns.append({"id": len(anns) + 1, "image_id": img_id, "category_id": cat_ids[r["label"]],
                             "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1), "iscrowd": 0})
        tmp = Path(cache_dir) / f".{split}.json.tmp"
        with open(tmp, "w") as f:
            json.dump({"images": images, "annotations": anns,
                       "categories": [{"id": i, "name": c} for c, i in cat_ids.items()]}, f)
        os.replace(tmp, Path(cache_dir) / f"{split}.json")


def prepare_annotations(args):
    cache = Path(args.cache_dir)
    if utils.is_main_process():
        cache.mkdir(parents=True, exist_ok=True)
        if not (cache / "train.json").exists() or not (cache / "val.json").exists():
            csv_to_coco(args.csv, args.images, cache, args.val_fraction, args.split_seed)
    if args.distributed:
        dist.barrier()
    return cache / "train.json", cache / "val.json"


def load_pretrained(model, path):
    sd = torch.load(path, map_location="cpu")
    sd = sd.get("model", sd)
    sd = {(k[7:] if k.startswith("module.") else k): v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if not k.startswith("class_embed.")}  # new label space
    missing, unexpected = model.load_state_dict(sd, strict=False)
    print(f"pretrained: missing={missing} unexpected={unexpected}")


def train_one_epoch(model, criterion, loader, optimizer, device, epoch, max_norm, run):
    model.train()
    criterion.train()
    wd = criterion.weight_dict
    logger = utils.MetricLogger(delimiter="  ")
    for it, (samples, targets) in enumerate(logger.log_every(loader, 20, f"Epoch: [{epoch}]")):
        n_boxes = torch.tensor([sum(len(t["boxes"]) for t in targets)], device=device)
        if utils.get_world_size() > 1:
            dist.all_reduce(n_boxes)
        if n_boxes.item() == 0:
            # all ranks drew defect-free boards only; every rank takes this branch together
            continue
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        loss_dict = criterion(model(samples), targets)
        losses = sum(loss_dict[k] * wd[k] for k in loss_dict if k in wd)
        optimizer.zero_grad()
        losses.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        reduced = utils.reduce_dict(loss_dict)
        loss_value = sum(reduced[k] * wd[k] for k in reduced if k in wd).item()
        logger.update(loss=loss_value)
        if run is not None and it % 20 == 0:
            run.log({"train/loss": loss_value, "epoch": epoch})
    logger.synchronize_between_processes()
    return {k: m.global_avg for k, m in logger.meters.items()}


@torch.no_grad()
def evaluate(model, postprocessors, loader, coco_gt, device):
    model.eval()
    evaluator = CocoEvaluator(coco_gt, ("bbox",))
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
    train_json, val_json = prepare_annotations(args)
    seed = args.seed + utils.get_rank()  # augmentation randomness differs per rank on purpose
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    with open(train_json) as f:
        args.num_classes = max(c["id"] for c in json.load(f)["categories"]) + 1
    model, criterion, postprocessors = build_model(args)
    if args.pretrained:
        load_pretrained(model, args.pretrained)
    model.to(device)
    model_without_ddp = model
    if args.distributed:
        model = DDP(model, device_ids=[args.gpu])
        model_without_ddp = model.module
    param_dicts = [
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" in n and p.requires_grad],
         "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)

    ds_train = CocoDetection(args.images, train_json, transforms=make_coco_transforms("train"), return_masks=False)
    ds_val = CocoDetection(args.images, val_json, transforms=make_coco_transforms("val"), return_masks=False)
    sampler_train = DistributedSampler(ds_train) if args.distributed else torch.utils.data.RandomSampler(ds_train)
    sampler_val = DistributedSampler(ds_val, shuffle=False) if args.distributed \
        else torch.utils.data.SequentialSampler(ds_val)
    loader_train = DataLoader(ds_train, batch_sampler=BatchSampler(sampler_train, args.batch_size, drop_last=True),
                              collate_fn=utils.collate_fn, num_workers=args.num_workers)
    loader_val = DataLoader(ds_val, args.batch_size, sampler=sampler_val, collate_fn=utils.collate_fn,
                            num_workers=args.num_workers)

    run = None
    if utils.is_main_process():
        run = wandb.init(project="pcb-detr", config=vars(args), name=Path(args.output_dir).name)
    output_dir = Path(args.output_dir)
    best = -1.0
    for epoch in range(args.epochs):
        if args.distributed:
            sampler_train.set_epoch(epoch)
        train_stats = train_one_epoch(model, criterion, loader_train, optimizer, device, epoch,
                                      args.clip_max_norm, run)
        lr_scheduler.step()
        stats = evaluate(model, postprocessors, loader_val, ds_val.coco, device)
        ckpt = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "args": args}
        utils.save_on_master(ckpt, output_dir / "checkpoint.pth")
        if stats[1] > best:  # every rank holds the same merged stats
            best = stats[1]
            utils.save_on_master(ckpt, output_dir / "best_ap50.pth")
        if run is not None:
            run.log({"val/AP": stats[0], "val/AP50": stats[1], "epoch": epoch, **train_stats})
    if run is not None:
        run.finish()
    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser("PCB fine-tune", parents=[get_args_parser()])
    parser.add_argument("--csv", required=True)
    parser.add_argument("--images", required=True)
    parser.add_argument("--cache_dir", required=True)
    parser.add_argument("--val_fraction", type=float, default=0.15)
    parser.add_argument("--split_seed", type=int, default=2024)
    parser.add_argument("--pretrained", default="")
    args = parser.parse_args()
    args.dataset_file = "pcb"
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    main(args)
