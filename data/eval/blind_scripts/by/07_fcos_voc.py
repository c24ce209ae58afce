#!/usr/bin/env python
"""FCOS R50-FPN on Pascal VOC 07+12 (COCO-format json), evaluated on VOC07 test with pycocotools.

torchrun --nproc_per_node=4 fcos_voc.py --ann-dir data/voc_coco --img-dir data/VOCdevkit
"""
import argparse
import json
import os
import random
import time
from datetime import datetime

import torch
import torch.distributed as dist
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.detection import fcos_resnet50_fpn
from torchvision.transforms import functional as TF

VOC_CLASSES = ("aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
               "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa",
               "train", "tvmonitor")


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--ann-dir", default="data/voc_coco")
    p.add_argument("--img-dir", default="data/VOCdevkit")
    p.add_argument("--work-dir", default="work_dirs/fcos_voc")
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--steps", type=int, nargs=2, default=[16, 22])
    p.add_argument("--imgs-per-gpu", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--warmup-iters", type=int, default=500)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    return p


class VOCCoco(Dataset):
    def __init__(self, ann_file, img_root, train):
        self.coco = COCO(ann_file)
        self.img_root = img_root
        self.train = train
        self.ids = sorted(self.coco.imgs.keys())

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, idx):
        img_id = self.ids[idx]
        info = self.coco.imgs[img_id]
        img = Image.open(os.path.join(self.img_root, info["file_name"])).convert("RGB")
        anns = [a for a in self.coco.loadAnns(self.coco.getAnnIds(imgIds=img_id)) if not a.get("iscrowd", 0)]
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        labels = torch.tensor([a["category_id"] for a in anns], dtype=torch.int64)
        img = TF.to_tensor(img)
        if self.train and random.random() < 0.5:
            img = img.flip(-1)
            W = img.shape[-1]
            boxes = torch.stack([W - boxes[:, 2], boxes[:, 1], W - boxes[:, 0], boxes[:, 3]], 1)
        return img, {"boxes": boxes, "labels": labels, "image_id": img_id}


def collate(batch):
    return tuple(zip(*batch))


def lr_factor(it, epoch, warmup_iters, steps):
    f = 0.1 ** sum(epoch >= s for s in steps)
    if it < warmup_iters:
        f *= 1.0 / 3 + (1 - 1.0 / 3) * it / warmup_iters
    return f


@torch.no_grad()
def evaluate(model, loader, coco_gt, device, log):
    model.eval()
    results = []
    for images, targets in loader:
        outputs = model([im.to(device, non_blocking=True) for im in images])
        for t, o in zip(targets, outputs):
            boxes = o["boxes"].float().cpu()
            boxes[:, 2:] -= boxes[:, :2]
            for b, s, c in zip(boxes.tolist(), o["scores"].tolist(), o["labels"].tolist()):
                results.append({"image_id": t["image_id"], "category_id": c, "bbox": b, "score": s})

    if dist.get_rank() == 0:
        if not results:
            return 0.0, 0.0
        coco_dt = coco_gt.loadRes(results)
        E = COCOeval(coco_gt, coco_dt, "bbox")
        E.evaluate()
        E.accumulate()
        E.summarize()
        log(f"bbox mAP {E.stats[0]:.4f}  mAP50 {E.stats[1]:.4f}")
        return E.stats[0], E.stats[1]
    return None, None


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    log_file = None
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        log_file = open(os.path.join(args.work_dir, f"{datetime.now():%Y%m%d_%H%M%S}.log"), "a")

    def log(msg):
        if rank == 0:
            line = f"{datetime.now():%H:%M:%S} {msg}"
            print(line, flush=True)
            log_file.write(line + "\n")
            log_file.flush()

    train_ds = VOCCoco(os.path.join(args.ann_dir, "voc0712_trainval.json"), args.img_dir, train=True)
    test_ds = VOCCoco(os.path.join(args.ann_dir, "voc07_test.json"), args.img_dir, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.imgs_per_gpu, sampler=train_sampler,
                              num_workers=args.workers, collate_fn=collate, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=4, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=args.workers, collate_fn=collate)

    # category ids in the json are 1..20, keep 0 for background.
    # min_size is a tuple -> GeneralizedRCNNTransform picks a random short side per image while training
    model = fcos_resnet50_fpn(weights=None, weights_backbone="IMAGENET1K_V1", num_classes=len(VOC_CLASSES) + 1,
                              min_size=(480, 512, 544, 576, 608, 640), max_size=1000)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim <= 1]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 1e-4}, {"params": no_decay, "weight_decay": 0}],
                                lr=args.lr, momentum=0.9)
    base_lrs = [g["lr"] for g in optimizer.param_groups]

    log(f"{len(train_ds)} train images, {len(test_ds)} test images, world size {world_size}")
    best_map, it = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for step, (images, targets) in enumerate(train_loader):
            f = lr_factor(it, epoch, args.warmup_iters, args.steps)
            for g, lr in zip(optimizer.param_groups, base_lrs):
                g["lr"] = lr * f
            images = [im.to(device, non_blocking=True) for im in images]
            targets = [{"boxes": t["boxes"].to(device), "labels": t["labels"].to(device)} for t in targets]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss_dict = model(images, targets)
            loss = sum(loss_dict.values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            optimizer.step()
            it += 1
            if step % 50 == 0:
                vals = torch.stack([v.detach().float() for v in loss_dict.values()])
                dist.all_reduce(vals, op=dist.ReduceOp.AVG)
                log(f"ep {epoch} {step}/{len(train_loader)} lr {optimizer.param_groups[0]['lr']:.5f} "
                    + " ".join(f"{k} {v:.3f}" for k, v in zip(loss_dict, vals.tolist()))
                    + f" {time.time() - tic:.0f}s")

        mAP, mAP50 = evaluate(model.module, test_loader, test_ds.coco, device, log)
        if rank == 0:
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch, "iter": it, "mAP": mAP}
            torch.save(ckpt, os.path.join(args.work_dir, "latest.pth"))
            if mAP > best_map:
                best_map = mAP
                torch.save(ckpt, os.path.join(args.work_dir, "best.pth"))
            with open(os.path.join(args.work_dir, "eval.jsonl"), "a") as fh:
                fh.write(json.dumps({"epoch": epoch, "mAP": mAP, "mAP50": mAP50}) + "\n")
        dist.barrier()

    log(f"done, best mAP {best_map:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
