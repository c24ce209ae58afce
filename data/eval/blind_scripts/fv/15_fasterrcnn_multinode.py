"""Faster R-CNN (ResNet-50 FPN v2) fine-tuning on a COCO-format dataset.

The launch wrapper and the distributed init came from our old
torch.distributed.launch / mp.spawn tooling; training runs on 2 nodes x 8 GPUs.
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.detection import MeanAveragePrecision
from torchvision.datasets import CocoDetection
from torchvision.models.detection import fasterrcnn_resnet50_fpn_v2, FasterRCNN_ResNet50_FPN_V2_Weights
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
import torchvision.transforms.v2 as T
from torchvision import tv_tensors
from torchvision.datasets import wrap_dataset_for_transforms_v2


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-path", default="/shared/datasets/parts_coco")
    p.add_argument("--num-classes", type=int, default=21, help="including background")
    p.add_argument("--batch-size", type=int, default=4, help="images per GPU")
    p.add_argument("--epochs", type=int, default=26)
    p.add_argument("--lr", type=float, default=0.02, help="for 16 images")
    p.add_argument("--lr-steps", nargs="+", type=int, default=[16, 22])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--output-dir", default="/shared/experiments/frcnn_parts")
    p.add_argument("--resume", default="")
    return p.parse_args()


def init_distributed_mode(args):
    args.local_rank = int(os.environ["LOCAL_RANK"])
    args.world_size = torch.cuda.device_count()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://",
                            world_size=args.world_size, rank=args.local_rank)
    args.rank = dist.get_rank()
    dist.barrier()


def get_dataset(root, split, train):
    if train:
        tf = T.Compose([T.ToImage(), T.RandomPhotometricDistort(), T.RandomZoomOut(fill={tv_tensors.Image: (123, 117, 104), "others": 0}),
                        T.RandomIoUCrop(), T.RandomHorizontalFlip(), T.SanitizeBoundingBoxes(),
                        T.ToDtype(torch.float, scale=True)])
    else:
        tf = T.Compose([T.ToImage(), T.ToDtype(torch.float, scale=True)])
    ds = CocoDetection(os.path.join(root, split), os.path.join(root, "annotations", f"{split}.json"), transforms=tf)
    return wrap_dataset_for_transforms_v2(ds, target_keys=("boxes", "labels", "image_id"))


def collate_fn(batch):
    return tuple(zip(*batch))


def train_one_epoch(model, optimizer, loader, device, epoch, scaler, args, warmup=None):
    model.train()
    t0 = time.time()
    for i, (images, targets) in enumerate(loader):
        images = [img.to(device, non_blocking=True) for img in images]
        targets = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in t.items()} for t in targets]
        with torch.autocast("cuda", dtype=torch.float16):
            loss_dict = model(images, targets)
            losses = sum(loss_dict.values())
        reduced = {k: v.detach().clone() for k, v in loss_dict.items()}
        for v in reduced.values():
            dist.all_reduce(v)
        loss_value = sum(v.item() for v in reduced.values()) / args.world_size
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training", reduced)
            sys.exit(1)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(losses).backward()
        scaler.step(optimizer)
        scaler.update()
        if warmup is not None:
            warmup.step()
        if i % 20 == 0 and args.rank == 0:
            print(f"epoch {epoch} [{i}/{len(loader)}] loss {loss_value:.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.5f} {time.time() - t0:.0f}s")


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    metric = MeanAveragePrecision(iou_type="bbox").to(device)
    for images, targets in loader:
        images = [img.to(device, non_blocking=True) for img in images]
        outputs = model.module(images)
        metric.update(outputs, [{"boxes": t["boxes"].to(device), "labels": t["labels"].to(device)} for t in targets])
    res = metric.compute()   # torchmetrics gathers the states of all processes
    model.train()
    return res["map"].item(), res["map_50"].item()


def main():
    args = parse_args()
    init_distributed_mode(args)
    device = torch.device("cuda", args.local_rank)

    train_set = get_dataset(args.data_path, "train", train=True)
    val_set = get_dataset(args.data_path, "val", train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, drop_last=True,
                              num_workers=args.workers, collate_fn=collate_fn, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler, num_workers=args.workers,
                            collate_fn=collate_fn)

    model = fasterrcnn_resnet50_fpn_v2(weights=FasterRCNN_ResNet50_FPN_V2_Weights.COCO_V1)
    in_features = model.roi_heads.box_predictor.cls_score.in_features
    model.roi_heads.box_predictor = FastRCNNPredictor(in_features, args.num_classes)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[args.local_rank])

    params = [p for p in model.parameters() if p.requires_grad]
    lr = args.lr * args.batch_size * args.world_size / 16
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    lr_scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.lr_steps, gamma=0.1)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1

    if args.rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        warmup = None
        if epoch == 0:
            warmup_iters = min(1000, len(train_loader) - 1)
            warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1e-3, total_iters=warmup_iters)
        train_one_epoch(model, optimizer, train_loader, device, epoch, scaler, args, warmup)
        lr_scheduler.step()
        mAP, mAP50 = evaluate(model, val_loader, device)
        if args.rank == 0:
            print(f"epoch {epoch}: mAP {mAP:.4f} mAP@0.5 {mAP50:.4f}")
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "lr_scheduler": lr_scheduler.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": epoch}, os.path.join(args.output_dir, f"model_{epoch}.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
