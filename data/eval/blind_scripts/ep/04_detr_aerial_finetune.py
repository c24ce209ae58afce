"""
Fine-tune DETR (COCO-pretrained) on the aerial-vehicles dataset.

The dataset ships as one COCO-style json with no official split, so we carve
out a validation split here.  Model / criterion / transforms come from the
DETR repo (PYTHONPATH=third_party/detr).
"""
import argparse
import copy
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from pycocotools.coco import COCO
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import datasets.transforms as T
import util.misc as utils
from datasets.coco import ConvertCocoPolysToMask
from datasets.coco_eval import CocoEvaluator
from models import build_model
from main import get_args_parser as detr_args_parser

CLASSES = ["car", "truck", "bus", "van", "trailer", "motorcycle"]


def make_transforms(train):
    normalize = T.Compose([T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    scales = [480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800]
    if train:
        return T.Compose([
            T.RandomHorizontalFlip(),
            T.RandomSelect(
                T.RandomResize(scales, max_size=1333),
                T.Compose([T.RandomResize([400, 500, 600]),
                           T.RandomSizeCrop(384, 600),
                           T.RandomResize(scales, max_size=1333)])),
            normalize,
        ])
    return T.Compose([T.RandomResize([800], max_size=1333), normalize])


class AerialDataset(Dataset):
    def __init__(self, img_dir, coco, image_ids, transforms):
        self.img_dir = Path(img_dir)
        self.coco = coco
        self.ids = list(image_ids)
        self._transforms = transforms
        self.prepare = ConvertCocoPolysToMask(return_masks=False)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, idx):
        image_id = self.ids[idx]
        info = self.coco.loadImgs(image_id)[0]
        img = Image.open(self.img_dir / info["file_name"]).convert("RGB")
        anns = self.coco.loadAnns(self.coco.getAnnIds(imgIds=image_id))
        # remap category ids to contiguous 0..K-1
        anns = [dict(a, category_id=self.coco.cat_to_label[a["category_id"]]) for a in anns]
        img, target = self.prepare(img, {"image_id": image_id, "annotations": anns})
        img, target = self._transforms(img, target)
        return img, target


def subset_coco(coco, image_ids):
    """COCO api object restricted to `image_ids` (for CocoEvaluator), labels remapped."""
    ids = set(image_ids)
    d = copy.deepcopy(coco.dataset)
    d["images"] = [im for im in d["images"] if im["id"] in ids]
    d["annotations"] = [dict(a, category_id=coco.cat_to_label[a["category_id"]])
                        for a in d["annotations"] if a["image_id"] in ids]
    d["categories"] = [dict(c, id=coco.cat_to_label[c["id"]]) for c in d["categories"]]
    sub = COCO()
    sub.dataset = d
    sub.createIndex()
    return sub


def build_splits(args):
    coco = COCO(args.ann_file)
    cat_ids = sorted(coco.getCatIds())
    coco.cat_to_label = {c: i for i, c in enumerate(cat_ids)}
    img_ids = sorted(coco.getImgIds())
    random.shuffle(img_ids)
    n_val = int(len(img_ids) * args.val_fraction)
    val_ids, train_ids = img_ids[:n_val], img_ids[n_val:]
    train_set = AerialDataset(args.img_dir, coco, train_ids, make_transforms(train=True))
    val_set = AerialDataset(args.img_dir, coco, val_ids, make_transforms(train=False))
    return train_set, val_set, subset_coco(coco, val_ids)


def train_one_epoch(model, criterion, loader, optimizer, device, epoch, max_norm):
    model.train()
    criterion.train()
    logger = utils.MetricLogger(delimiter="  ")
    for samples, targets in logger.log_every(loader, 50, f"Epoch [{epoch}]"):
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        outputs = model(samples)
        loss_dict = criterion(outputs, targets)
        wd = criterion.weight_dict
        loss = sum(loss_dict[k] * wd[k] for k in loss_dict if k in wd)
        optimizer.zero_grad()
        loss.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        reduced = utils.reduce_dict(loss_dict)
        logger.update(loss=sum(reduced[k] * wd[k] for k in reduced if k in wd).item(),
                      class_error=reduced["class_error"].item())
    logger.synchronize_between_processes()
    return {k: m.global_avg for k, m in logger.meters.items()}


@torch.no_grad()
def evaluate(model, postprocessors, loader, coco_val, device):
    model.eval()
    evaluator = CocoEvaluator(coco_val, ("bbox",))
    for samples, targets in loader:
        outputs = model(samples.to(device))
        orig_sizes = torch.stack([t["orig_size"] for t in targets]).to(device)
        results = postprocessors["bbox"](outputs, orig_sizes)
        evaluator.update({t["image_id"].item(): r for t, r in zip(targets, results)})
    evaluator.synchronize_between_processes()
    evaluator.accumulate()
    evaluator.summarize()
    return evaluator.coco_eval["bbox"].stats.tolist()


def main():
    parser = argparse.ArgumentParser("aerial finetune", parents=[detr_args_parser()])
    parser.add_argument("--img_dir", default="/data/aerial/images")
    parser.add_argument("--ann_file", default="/data/aerial/annotations.json")
    parser.add_argument("--val_fraction", type=float, default=0.1)
    parser.add_argument("--pretrained", default="checkpoints/detr-r50-e632da11.pth")
    args = parser.parse_args()
    args.num_classes = len(CLASSES)
    args.dataset_file = "aerial"

    utils.init_distributed_mode(args)
    device = torch.device(args.device)
    seed = args.seed + utils.get_rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    model, criterion, postprocessors = build_model(args)
    ckpt = torch.load(args.pretrained, map_location="cpu")["model"]
    for k in ["class_embed.weight", "class_embed.bias"]:
        ckpt.pop(k)
    missing, unexpected = model.load_state_dict(ckpt, strict=False)
    print("missing:", missing, "unexpected:", unexpected)
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

    train_set, val_set, coco_val = build_splits(args)
    if args.distributed:
        sampler_train = DistributedSampler(train_set)
        sampler_val = DistributedSampler(val_set, shuffle=False)
    else:
        sampler_train = torch.utils.data.RandomSampler(train_set)
        sampler_val = torch.utils.data.SequentialSampler(val_set)
    loader_train = DataLoader(train_set, batch_sampler=torch.utils.data.BatchSampler(sampler_train, args.batch_size,
                                                                                     drop_last=True),
                              collate_fn=utils.collate_fn, num_workers=args.num_workers)
    loader_val = DataLoader(val_set, args.batch_size, sampler=sampler_val, collate_fn=utils.collate_fn,
                            num_workers=args.num_workers)

    output_dir = Path(args.output_dir)
    if utils.is_main_process():
        output_dir.mkdir(parents=True, exist_ok=True)
    best_map = 0.0
    for epoch in range(args.epochs):
        if args.distributed:
            sampler_train.set_epoch(epoch)
        t0 = time.time()
        train_stats = train_one_epoch(model, criterion, loader_train, optimizer, device, epoch, args.clip_max_norm)
        lr_scheduler.step()
        stats = evaluate(model, postprocessors, loader_val, coco_val, device)
        state = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                 "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "classes": CLASSES}
        utils.save_on_master(state, output_dir / "checkpoint.pth")
        if stats[0] > best_map:
            best_map = stats[0]
            utils.save_on_master(state, output_dir / "best.pth")
        if utils.is_main_process():
            with open(output_dir / "log.txt", "a") as f:
                f.write(json.dumps({"epoch": epoch, "time": time.time() - t0, "mAP": stats[0], "AP50": stats[1],
                                    **{f"train_{k}": v for k, v in train_stats.items()}}) + "\n")

    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
