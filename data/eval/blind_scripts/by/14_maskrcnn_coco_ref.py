r"""Mask R-CNN R50-FPN training on COCO, following the torchvision detection references.

    torchrun --nproc_per_node=8 maskrcnn_coco_ref.py --data-path /datasets/coco --epochs 26 \
        --lr-steps 16 22 --aspect-ratio-group-factor 3 --amp
"""
import argparse
import bisect
import datetime
import math
import os
import sys
import time
from collections import defaultdict
from itertools import chain, repeat

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.data
import torchvision
from pycocotools import mask as coco_mask
from pycocotools.cocoeval import COCOeval
from torch.utils.data.sampler import BatchSampler
from torchvision.models.detection import maskrcnn_resnet50_fpn
from torchvision.transforms import functional as F


def get_args_parser():
    p = argparse.ArgumentParser(description="Mask R-CNN training", add_help=True)
    p.add_argument("--data-path", default="/datasets/coco", type=str)
    p.add_argument("-b", "--batch-size", default=2, type=int, help="images per gpu")
    p.add_argument("--epochs", default=26, type=int)
    p.add_argument("-j", "--workers", default=4, type=int)
    p.add_argument("--lr", default=0.02, type=float, help="0.02 is the default for 8 gpus x 2 images")
    p.add_argument("--momentum", default=0.9, type=float)
    p.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
    p.add_argument("--lr-steps", default=[16, 22], nargs="+", type=int)
    p.add_argument("--lr-gamma", default=0.1, type=float)
    p.add_argument("--print-freq", default=20, type=int)
    p.add_argument("--output-dir", default="out/maskrcnn", type=str)
    p.add_argument("--resume", default="", type=str)
    p.add_argument("--aspect-ratio-group-factor", default=3, type=int)
    p.add_argument("--test-only", action="store_true")
    p.add_argument("--amp", action="store_true")
    return p


class GroupedBatchSampler(BatchSampler):
    def __init__(self, sampler, group_ids, batch_size):
        self.sampler, self.group_ids, self.batch_size = sampler, group_ids, batch_size

    def __iter__(self):
        buffer_per_group, samples_per_group = defaultdict(list), defaultdict(list)
        num_batches = 0
        for idx in self.sampler:
            g = self.group_ids[idx]
            buffer_per_group[g].append(idx)
            samples_per_group[g].append(idx)
            if len(buffer_per_group[g]) == self.batch_size:
                yield buffer_per_group[g]
                num_batches += 1
                del buffer_per_group[g]
        # top up partially filled groups so every rank yields exactly len(self) batches
        num_remaining = len(self) - num_batches
        if num_remaining > 0:
            for g, _ in sorted(buffer_per_group.items(), key=lambda x: len(x[1]), reverse=True):
                need = self.batch_size - len(buffer_per_group[g])
                pool = samples_per_group[g]
                extra = list(chain.from_iterable(repeat(pool, math.ceil(need / len(pool)))))
                buffer_per_group[g].extend(extra[:need])
                yield buffer_per_group[g]
                num_remaining -= 1
                if num_remaining == 0:
                    break

    def __len__(self):
        return len(self.sampler) // self.batch_size


def aspect_ratio_groups(dataset, k):
    ratios = [dataset.coco.imgs[i]["width"] / dataset.coco.imgs[i]["height"] for i in dataset.ids]
    bins = sorted((2 ** np.linspace(-1, 1, 2 * k + 1)).tolist()) if k > 0 else [1.0]
    return [bisect.bisect_right(bins, r) for r in ratios]


class CocoInstanceSeg(torchvision.datasets.CocoDetection):
    def __init__(self, img_folder, ann_file, train):
        super().__init__(img_folder, ann_file)
        self.train = train
        if train:
            def valid(i):
                anns = self.coco.loadAnns(self.coco.getAnnIds(imgIds=i, iscrowd=False))
                return any(a["bbox"][2] > 1 and a["bbox"][3] > 1 for a in anns)
            self.ids = [i for i in self.ids if valid(i)]

    def __getitem__(self, idx):
        img, anns = super().__getitem__(idx)
        w, h = img.size
        anns = [a for a in anns if a.get("iscrowd", 0) == 0]
        boxes = torch.as_tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes[:, 0::2].clamp_(0, w)
        boxes[:, 1::2].clamp_(0, h)
        classes = torch.tensor([a["category_id"] for a in anns], dtype=torch.int64)
        masks = []
        for a in anns:
            rles = coco_mask.frPyObjects(a["segmentation"], h, w)
            m = coco_mask.decode(rles)
            masks.append(torch.as_tensor(m.any(axis=2) if m.ndim == 3 else m, dtype=torch.uint8))
        masks = torch.stack(masks) if masks else torch.zeros((0, h, w), dtype=torch.uint8)
        keep = (boxes[:, 3] > boxes[:, 1]) & (boxes[:, 2] > boxes[:, 0])
        boxes, classes, masks = boxes[keep], classes[keep], masks[keep]
        img = F.to_tensor(img)
        if self.train and torch.rand(1) < 0.5:
            img, masks = img.flip(-1), masks.flip(-1)
            boxes = torch.stack([w - boxes[:, 2], boxes[:, 1], w - boxes[:, 0], boxes[:, 3]], 1)
        return img, {"boxes": boxes, "labels": classes, "masks": masks, "image_id": self.ids[idx]}


def collate_fn(batch):
    return tuple(zip(*batch))


def reduce_dict(d):
    names = sorted(d)
    values = torch.stack([d[k] for k in names])
    dist.all_reduce(values, op=dist.ReduceOp.AVG)
    return dict(zip(names, values))


def train_one_epoch(model, optimizer, loader, device, epoch, print_freq, scaler):
    model.train()
    warmup = None
    if epoch == 0:
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1e-3,
                                                   total_iters=min(1000, len(loader) - 1))
    t0 = time.time()
    for i, (images, targets) in enumerate(loader):
        images = [im.to(device, non_blocking=True) for im in images]
        targets = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in t.items()} for t in targets]
        with torch.autocast("cuda", enabled=scaler is not None):
            loss_dict = model(images, targets)
            losses = sum(loss_dict.values())
        reduced = reduce_dict({k: v.detach() for k, v in loss_dict.items()})
        loss_value = sum(reduced.values()).item()
        if not math.isfinite(loss_value):  # same value on every rank after the all-reduce
            print(f"Loss is {loss_value}, stopping training\n{reduced}")
            sys.exit(1)
        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(losses).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            losses.backward()
            optimizer.step()
        if warmup is not None:
            warmup.step()
        if i % print_freq == 0 and dist.get_rank() == 0:
            print(f"Epoch: [{epoch}] [{i}/{len(loader)}] lr {optimizer.param_groups[0]['lr']:.6f} "
                  f"loss {loss_value:.4f} " + " ".join(f"{k} {v:.4f}" for k, v in reduced.items())
                  + f" ({time.time() - t0:.0f}s)", flush=True)


@torch.no_grad()
def evaluate(model, loader, coco_gt, device):
    model.eval()
    local = {}
    for images, targets in loader:
        outputs = model([im.to(device) for im in images])
        for t, o in zip(targets, outputs):
            boxes = o["boxes"].cpu()
            boxes[:, 2:] -= boxes[:, :2]
            masks = (o["masks"] > 0.5).squeeze(1).cpu().numpy()
            dets = []
            for b, s, c, m in zip(boxes.tolist(), o["scores"].tolist(), o["labels"].tolist(), masks):
                rle = coco_mask.encode(np.asfortranarray(m, dtype=np.uint8))
                rle["counts"] = rle["counts"].decode("utf-8")
                dets.append({"image_id": t["image_id"], "category_id": c, "bbox": b, "score": s, "segmentation": rle})
            local[t["image_id"]] = dets
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    if dist.get_rank() != 0:
        return
    merged = {}
    for g in gathered:
        merged.update(g)
    dets = list(chain.from_iterable(merged.values()))
    for iou_type in ("bbox", "segm"):
        res = [{k: v for k, v in d.items() if iou_type == "segm" or k != "segmentation"} for d in dets]
        E = COCOeval(coco_gt, coco_gt.loadRes(res), iou_type)
        E.params.imgIds = sorted(merged)
        E.evaluate()
        E.accumulate()
        print(f"IoU metric: {iou_type}")
        E.summarize()


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda")
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(args)

    dataset = CocoInstanceSeg(os.path.join(args.data_path, "train2017"),
                              os.path.join(args.data_path, "annotations", "instances_train2017.json"), train=True)
    dataset_test = CocoInstanceSeg(os.path.join(args.data_path, "val2017"),
                                   os.path.join(args.data_path, "annotations", "instances_val2017.json"), train=False)
    train_sampler = torch.utils.data.distributed.DistributedSampler(dataset)
    test_sampler = torch.utils.data.distributed.DistributedSampler(dataset_test, shuffle=False)
    if args.aspect_ratio_group_factor >= 0:
        group_ids = aspect_ratio_groups(dataset, args.aspect_ratio_group_factor)
        train_batch_sampler = GroupedBatchSampler(train_sampler, group_ids, args.batch_size)
    else:
        train_batch_sampler = BatchSampler(train_sampler, args.batch_size, drop_last=True)
    data_loader = torch.utils.data.DataLoader(dataset, batch_sampler=train_batch_sampler, num_workers=args.workers,
                                              collate_fn=collate_fn)
    data_loader_test = torch.utils.data.DataLoader(dataset_test, batch_size=1, sampler=test_sampler,
                                                   num_workers=args.workers, collate_fn=collate_fn)

    model = maskrcnn_resnet50_fpn(weights=None, weights_backbone="IMAGENET1K_V1", num_classes=91)
    model.to(device)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    model_without_ddp = model.module

    params = [p for p in model.parameters() if p.requires_grad]
    lr = args.lr * args.batch_size * world_size / 16
    optimizer = torch.optim.SGD(params, lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler() if args.amp else None
    lr_scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.lr_steps, gamma=args.lr_gamma)

    start_epoch = 0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu", weights_only=True)
        model_without_ddp.load_state_dict(checkpoint["model"])
        if not args.test_only:
            optimizer.load_state_dict(checkpoint["optimizer"])
            lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
            start_epoch = checkpoint["epoch"] + 1
            if scaler is not None:
                scaler.load_state_dict(checkpoint["scaler"])

    if args.test_only:
        torch.backends.cudnn.deterministic = True
        evaluate(model_without_ddp, data_loader_test, dataset_test.coco, device)
        dist.destroy_process_group()
        return

    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train_one_epoch(model, optimizer, data_loader, device, epoch, args.print_freq, scaler)
        lr_scheduler.step()
        if rank == 0:
            checkpoint = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                          "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch}
            if scaler is not None:
                checkpoint["scaler"] = scaler.state_dict()
            torch.save(checkpoint, os.path.join(args.output_dir, f"model_{epoch}.pth"))
            torch.save(checkpoint, os.path.join(args.output_dir, "checkpoint.pth"))
        evaluate(model_without_ddp, data_loader_test, dataset_test.coco, device)

    if rank == 0:
        print(f"Training time {datetime.timedelta(seconds=int(time.time() - start_time))}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args_parser().parse_args())
