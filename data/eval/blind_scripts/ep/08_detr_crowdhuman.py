"""
Deformable DETR on CrowdHuman (full-body boxes).

CrowdHuman ships .odgt annotation files; we convert them to COCO format once
and keep the json next to the odgt so CocoDetection / CocoEvaluator can be
reused unchanged.
"""
import argparse
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torchvision
from PIL import Image
from torch.utils.data import DataLoader, DistributedSampler

import datasets.transforms as T
import util.misc as utils
from datasets.coco import ConvertCocoPolysToMask
from datasets.coco_eval import CocoEvaluator
from models import build_model
from main import get_args_parser


def odgt_to_coco(odgt_file, img_dir, box_key="fbox"):
    images, annotations = [], []
    ann_id = 1
    with open(odgt_file) as f:
        records = [json.loads(line) for line in f]
    for img_id, rec in enumerate(records, start=1):
        file_name = rec["ID"] + ".jpg"
        w, h = Image.open(os.path.join(img_dir, file_name)).size
        images.append({"id": img_id, "file_name": file_name, "width": w, "height": h})
        for gt in rec["gtboxes"]:
            if gt["tag"] != "person":
                continue
            x, y, bw, bh = gt[box_key]
            ignore = gt.get("extra", {}).get("ignore", 0)
            annotations.append({"id": ann_id, "image_id": img_id, "category_id": 1, "bbox": [x, y, bw, bh],
                                "area": bw * bh, "iscrowd": int(ignore)})
            ann_id += 1
    return {"images": images, "annotations": annotations, "categories": [{"id": 1, "name": "person"}]}


def coco_json_for(split, root):
    odgt = Path(root) / f"annotation_{split}.odgt"
    cache = Path(root) / f"annotation_{split}_coco.json"
    if not cache.exists():
        print(f"Converting {odgt} to COCO format ...")
        coco = odgt_to_coco(odgt, Path(root) / "Images")
        with open(cache, "w") as f:
            json.dump(coco, f)
    return cache


class CrowdHuman(torchvision.datasets.CocoDetection):
    def __init__(self, img_folder, ann_file, transforms):
        super().__init__(img_folder, ann_file)
        self._transforms = transforms
        self.prepare = ConvertCocoPolysToMask(return_masks=False)

    def __getitem__(self, idx):
        img, target = super().__getitem__(idx)
        target = {"image_id": self.ids[idx], "annotations": target}
        img, target = self.prepare(img, target)
        return self._transforms(img, target)


def make_transforms(train):
    normalize = T.Compose([T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    scales = [480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800]
    if train:
        return T.Compose([T.RandomHorizontalFlip(), T.RandomResize(scales, max_size=1400), normalize])
    return T.Compose([T.RandomResize([800], max_size=1400), normalize])


def build_crowdhuman(split, args):
    ann = coco_json_for(split, args.data_root)
    return CrowdHuman(Path(args.data_root) / "Images", ann, make_transforms(split == "train"))


def train_one_epoch(model, criterion, loader, optimizer, device, epoch, max_norm):
    model.train()
    criterion.train()
    logger = utils.MetricLogger(delimiter="  ")
    for samples, targets in logger.log_every(loader, 50, f"Epoch [{epoch}]"):
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        loss_dict = criterion(model(samples), targets)
        wd = criterion.weight_dict
        loss = sum(loss_dict[k] * wd[k] for k in loss_dict if k in wd)
        optimizer.zero_grad()
        loss.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        reduced = utils.reduce_dict(loss_dict)
        logger.update(loss=sum(reduced[k] * wd[k] for k in reduced if k in wd).item(),
                      lr=optimizer.param_groups[0]["lr"])
    logger.synchronize_between_processes()
    return {k: m.global_avg for k, m in logger.meters.items()}


@torch.no_grad()
def evaluate(model, postprocessors, loader, base_ds, device):
    model.eval()
    evaluator = CocoEvaluator(base_ds, ("bbox",))
    evaluator.coco_eval["bbox"].params.maxDets = [1, 100, 300]
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

    args.num_classes = 2  # person + (unused) background index
    model, criterion, postprocessors = build_model(args)
    model.to(device)
    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    param_dicts = [
        {"params": [p for n, p in model_without_ddp.named_parameters()
                    if "backbone.0" not in n and "reference_points" not in n and "sampling_offsets" not in n
                    and p.requires_grad], "lr": args.lr},
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone.0" in n and p.requires_grad],
         "lr": args.lr_backbone},
        {"params": [p for n, p in model_without_ddp.named_parameters()
                    if ("reference_points" in n or "sampling_offsets" in n) and p.requires_grad],
         "lr": args.lr * args.lr_linear_proj_mult},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)

    dataset_train = build_crowdhuman("train", args)
    dataset_val = build_crowdhuman("val", args)
    if args.distributed:
        sampler_train = DistributedSampler(dataset_train)
        sampler_val = DistributedSampler(dataset_val, shuffle=False)
    else:
        sampler_train = torch.utils.data.RandomSampler(dataset_train)
        sampler_val = torch.utils.data.SequentialSampler(dataset_val)
    loader_train = DataLoader(dataset_train,
                              batch_sampler=torch.utils.data.BatchSampler(sampler_train, args.batch_size, drop_last=True),
                              collate_fn=utils.collate_fn, num_workers=args.num_workers, pin_memory=True)
    loader_val = DataLoader(dataset_val, args.batch_size, sampler=sampler_val, drop_last=False,
                            collate_fn=utils.collate_fn, num_workers=args.num_workers, pin_memory=True)

    output_dir = Path(args.output_dir)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        start_epoch = ckpt["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        if args.distributed:
            sampler_train.set_epoch(epoch)
        t0 = time.time()
        train_stats = train_one_epoch(model, criterion, loader_train, optimizer, device, epoch, args.clip_max_norm)
        lr_scheduler.step()
        utils.save_on_master({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                              "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "args": args},
                             output_dir / "checkpoint.pth")
        stats = evaluate(model, postprocessors, loader_val, dataset_val.coco, device)
        if utils.is_main_process():
            with open(output_dir / "log.txt", "a") as f:
                f.write(json.dumps({"epoch": epoch, "time": time.time() - t0, "AP": stats[0], "AP50": stats[1],
                                    "AR300": stats[8], **{f"train_{k}": v for k, v in train_stats.items()}}) + "\n")

    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser("CrowdHuman Deformable DETR", parents=[get_args_parser()])
    parser.add_argument("--data_root", default="/data/CrowdHuman")
    args = parser.parse_args()
    args.dataset_file = "crowdhuman"
    args.num_queries = 500
    if args.output_dir:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    main(args)
