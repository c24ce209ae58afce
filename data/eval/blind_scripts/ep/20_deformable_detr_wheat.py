"""
Fine-tune Deformable DETR (COCO weights, single-scale) on Global Wheat Head
Detection, converted to COCO json by tools/gwhd_to_coco.py.

Started from our single-GPU notebook; now runs on the 4-GPU box:

    torchrun --standalone --nproc_per_node=4 20_deformable_detr_wheat.py \
        --data_root /data/gwhd_2021 --pretrained weights/r50_deformable_detr_single_scale.pth
"""
import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import datasets.transforms as T
import util.misc as utils
from datasets.coco import CocoDetection
from datasets.coco_eval import CocoEvaluator
from main import get_args_parser
from models import build_model


def wheat_transforms(train):
    normalize = T.Compose([T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    scales = [640, 672, 704, 736, 768, 800, 832, 864, 896, 928, 960, 992, 1024]
    if train:
        return T.Compose([
            T.RandomHorizontalFlip(),
            T.RandomSelect(
                T.RandomResize(scales, max_size=1333),
                T.Compose([T.RandomResize([700, 800, 900]), T.RandomSizeCrop(600, 900),
                           T.RandomResize(scales, max_size=1333)])),
            normalize])
    return T.Compose([T.RandomResize([1024], max_size=1333), normalize])


def train_one_epoch(model, criterion, loader, optimizer, device, epoch, max_norm):
    model.train()
    criterion.train()
    wd = criterion.weight_dict
    logger = utils.MetricLogger(delimiter="  ")
    logger.add_meter("lr", utils.SmoothedValue(window_size=1, fmt="{value:.6f}"))
    for samples, targets in logger.log_every(loader, 20, f"Epoch: [{epoch}]"):
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        loss_dict = criterion(model(samples), targets)
        losses = sum(loss_dict[k] * wd[k] for k in loss_dict if k in wd)
        optimizer.zero_grad()
        losses.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        reduced = utils.reduce_dict(loss_dict)
        logger.update(loss=sum(reduced[k] * wd[k] for k in reduced if k in wd).item(),
                      lr=optimizer.param_groups[0]["lr"])
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


def load_pretrained(model, path):
    state = torch.load(path, map_location="cpu")["model"]
    # drop the 91-way COCO heads; box heads are kept
    state = {k: v for k, v in state.items() if "class_embed" not in k}
    missing, unexpected = model.load_state_dict(state, strict=False)
    print(f"loaded {path}: {len(missing)} missing, {len(unexpected)} unexpected")


def main(args):
    utils.init_distributed_mode(args)
    device = torch.device(args.device)
    seed = args.seed + utils.get_rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    args.num_classes = 2  # wheat head (id 1)
    model, criterion, postprocessors = build_model(args)
    if args.pretrained:
        load_pretrained(model, args.pretrained)
    model.to(device)
    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    def match(n, keys):
        return any(k in n for k in keys)

    param_dicts = [
        {"params": [p for n, p in model_without_ddp.named_parameters()
                    if not match(n, args.lr_backbone_names) and not match(n, args.lr_linear_proj_names)
                    and p.requires_grad], "lr": args.lr},
        {"params": [p for n, p in model_without_ddp.named_parameters()
                    if match(n, args.lr_backbone_names) and p.requires_grad], "lr": args.lr_backbone},
        {"params": [p for n, p in model_without_ddp.named_parameters()
                    if match(n, args.lr_linear_proj_names) and p.requires_grad],
         "lr": args.lr * args.lr_linear_proj_mult},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[args.lr_drop], gamma=0.1)

    root = Path(args.data_root)
    ds_train = CocoDetection(root / "images", root / "annotations" / "train.json",
                             transforms=wheat_transforms(True), return_masks=False)
    ds_val = CocoDetection(root / "images", root / "annotations" / "val.json",
                           transforms=wheat_transforms(False), return_masks=False)
    loader_train = DataLoader(ds_train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                              collate_fn=utils.collate_fn, num_workers=args.num_workers, pin_memory=True)
    loader_val = DataLoader(ds_val, batch_size=args.batch_size, shuffle=False,
                            collate_fn=utils.collate_fn, num_workers=args.num_workers, pin_memory=True)

    output_dir = Path(args.output_dir)
    best_ap50 = 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        train_stats = train_one_epoch(model, criterion, loader_train, optimizer, device, epoch, args.clip_max_norm)
        lr_scheduler.step()
        stats = evaluate(model, postprocessors, loader_val, ds_val.coco, device)
        ckpt = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "args": args}
        utils.save_on_master(ckpt, output_dir / "checkpoint.pth")
        if stats[1] > best_ap50:
            best_ap50 = stats[1]
            utils.save_on_master(ckpt, output_dir / "best.pth")
        if utils.is_main_process():
            with open(output_dir / "log.txt", "a") as f:
                f.write(json.dumps({"epoch": epoch, "AP": stats[0], "AP50": stats[1], "best_AP50": best_ap50,
                                    "time": time.time() - t0,
                                    **{f"train_{k}": v for k, v in train_stats.items()}}) + "\n")
    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser("GWHD Deformable DETR", parents=[get_args_parser()])
    parser.add_argument("--data_root", required=True)
    parser.add_argument("--pretrained", default="")
    args = parser.parse_args()
    args.dataset_file = "gwhd"
    args.epochs, args.lr_drop = 30, 20
    args.num_queries = 300
    args.output_dir = args.output_dir or "exps/gwhd_ddetr"
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    main(args)
