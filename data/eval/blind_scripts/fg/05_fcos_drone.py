r"""FCOS on the drone-survey annotations (one COCO json, we carve out a fixed val split).

Based on torchvision/references/detection. Large images -> small per-GPU batch, so we
accumulate gradients over --accum-steps iterations.

    torchrun --nproc_per_node=8 train_fcos.py --data-path /shared/drone_survey \
        -b 2 --accum-steps 4 --epochs 36 --lr-steps 24 32 --amp --output-dir /shared/runs/fcos_drone
"""
import argparse
import contextlib
import datetime
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.utils.data
import torchvision
from torchvision.transforms import v2

import utils
from coco_eval import CocoEvaluator


def get_transform(train):
    ops = [v2.ToImage()]
    if train:
        ops += [v2.RandomHorizontalFlip(0.5), v2.RandomVerticalFlip(0.5), v2.RandomPhotometricDistort(p=0.5)]
    ops += [v2.ToDtype(torch.float, scale=True), v2.SanitizeBoundingBoxes(), v2.ToPureTensor()]
    return v2.Compose(ops)


def make_split(n, val_fraction, seed):
    # same generator seed on every rank -> identical split everywhere
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g).tolist()
    n_val = int(round(n * val_fraction))
    return sorted(perm[n_val:]), sorted(perm[:n_val])


def train_one_epoch(model, optimizer, data_loader, device, epoch, args, scaler=None, warmup=None):
    model.train()
    metric_logger = utils.MetricLogger(delimiter="  ")
    metric_logger.add_meter("lr", utils.SmoothedValue(window_size=1, fmt="{value:.6f}"))
    header = f"Epoch: [{epoch}]"
    num_iters = len(data_loader)

    optimizer.zero_grad()
    for i, (images, targets) in enumerate(metric_logger.log_every(data_loader, args.print_freq, header)):
        images = list(image.to(device) for image in images)
        targets = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in t.items()} for t in targets]
        do_step = (i + 1) % args.accum_steps == 0 or (i + 1) == num_iters

        # skip the gradient all-reduce on accumulation-only iterations
        sync_ctx = model.no_sync() if (args.distributed and not do_step) else contextlib.nullcontext()
        with sync_ctx:
            with torch.autocast("cuda", enabled=scaler is not None):
                loss_dict = model(images, targets)
                losses = sum(loss for loss in loss_dict.values())
            if scaler is not None:
                scaler.scale(losses / args.accum_steps).backward()
            else:
                (losses / args.accum_steps).backward()

        loss_dict_reduced = utils.reduce_dict(loss_dict)
        losses_reduced = sum(loss for loss in loss_dict_reduced.values())
        loss_value = losses_reduced.item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training")
            print(loss_dict_reduced)
            sys.exit(1)

        if do_step:
            if scaler is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
                scaler.step(optimizer)
                scaler.update()
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
                optimizer.step()
            optimizer.zero_grad()
            if warmup is not None and epoch == 0:
                warmup.step()

        metric_logger.update(loss=losses_reduced, **loss_dict_reduced)
        metric_logger.update(lr=optimizer.param_groups[0]["lr"])
    return metric_logger


@torch.inference_mode()
def evaluate(model, data_loader, coco_gt, device):
    cpu_device = torch.device("cpu")
    model.eval()
    metric_logger = utils.MetricLogger(delimiter="  ")
    coco_evaluator = CocoEvaluator(coco_gt, ["bbox"])
    for images, targets in metric_logger.log_every(data_loader, 100, "Test:"):
        images = list(img.to(device) for img in images)
        outputs = model(images)
        outputs = [{k: v.to(cpu_device) for k, v in t.items()} for t in outputs]
        coco_evaluator.update({t["image_id"]: o for t, o in zip(targets, outputs)})
    metric_logger.synchronize_between_processes()
    coco_evaluator.synchronize_between_processes()
    coco_evaluator.accumulate()
    coco_evaluator.summarize()
    return coco_evaluator.coco_eval["bbox"].stats[0]


def main(args):
    if args.output_dir:
        utils.mkdir(args.output_dir)
    utils.init_distributed_mode(args)
    print(args)
    device = torch.device(args.device)

    img_root = os.path.join(args.data_path, "images")
    ann_file = os.path.join(args.data_path, "annotations.json")
    full_train = torchvision.datasets.wrap_dataset_for_transforms_v2(
        torchvision.datasets.CocoDetection(img_root, ann_file, transforms=get_transform(True)),
        target_keys={"boxes", "labels", "image_id"},
    )
    full_val = torchvision.datasets.wrap_dataset_for_transforms_v2(
        torchvision.datasets.CocoDetection(img_root, ann_file, transforms=get_transform(False)),
        target_keys={"boxes", "labels", "image_id"},
    )
    coco_gt = full_val.coco if hasattr(full_val, "coco") else full_val._dataset.coco
    num_classes = max(coco_gt.getCatIds()) + 1

    train_idx, val_idx = make_split(len(full_train), args.val_fraction, args.split_seed)
    dataset = torch.utils.data.Subset(full_train, train_idx)
    dataset_test = torch.utils.data.Subset(full_val, val_idx)
    if utils.is_main_process() and args.output_dir:
        with open(os.path.join(args.output_dir, "split.json"), "w") as f:
            json.dump({"train": train_idx, "val": val_idx}, f)
    if args.distributed:
        dist.barrier()

    if args.distributed:
        train_sampler = torch.utils.data.distributed.DistributedSampler(dataset)
        test_sampler = torch.utils.data.distributed.DistributedSampler(dataset_test, shuffle=False)
    else:
        train_sampler = torch.utils.data.RandomSampler(dataset)
        test_sampler = torch.utils.data.SequentialSampler(dataset_test)
    train_batch_sampler = torch.utils.data.BatchSampler(train_sampler, args.batch_size, drop_last=True)

    data_loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=train_batch_sampler, num_workers=args.workers, collate_fn=utils.collate_fn
    )
    data_loader_test = torch.utils.data.DataLoader(
        dataset_test, batch_size=1, sampler=test_sampler, num_workers=args.workers, collate_fn=utils.collate_fn
    )

    model = torchvision.models.detection.fcos_resnet50_fpn(
        weights=None, weights_backbone="IMAGENET1K_V1", num_classes=num_classes,
        trainable_backbone_layers=args.trainable_backbone_layers, min_size=1024, max_size=1536,
    )
    model.to(device)

    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler() if args.amp else None
    steps_per_epoch = math.ceil(len(data_loader) / args.accum_steps)
    warmup = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=0.001, total_iters=max(1, min(500, steps_per_epoch - 1))
    )
    lr_scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.lr_steps, gamma=0.1)

    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu", weights_only=False)
        model_without_ddp.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
        args.start_epoch = checkpoint["epoch"] + 1
        if scaler is not None:
            scaler.load_state_dict(checkpoint["scaler"])

    # more boxes per image for AP on these dense scenes
    model_without_ddp.detections_per_img = args.detections_per_img

    if args.test_only:
        evaluate(model, data_loader_test, coco_gt, device)
        return

    start_time = time.time()
    for epoch in range(args.start_epoch, args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        train_one_epoch(model, optimizer, data_loader, device, epoch, args, scaler, warmup)
        lr_scheduler.step()
        if args.output_dir:
            checkpoint = {
                "model": model_without_ddp.state_dict(),
                "optimizer": optimizer.state_dict(),
                "lr_scheduler": lr_scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "epoch": epoch,
                "args": args,
            }
            utils.save_on_master(checkpoint, os.path.join(args.output_dir, f"model_{epoch}.pth"))
            utils.save_on_master(checkpoint, os.path.join(args.output_dir, "checkpoint.pth"))
        ap = evaluate(model, data_loader_test, coco_gt, device)
        print(f"epoch {epoch}: bbox AP {ap:.4f}")

    print(f"Training time {datetime.timedelta(seconds=int(time.time() - start_time))}")


def get_args_parser():
    parser = argparse.ArgumentParser(description="FCOS drone-survey training")
    parser.add_argument("--data-path", default="/shared/drone_survey", type=str)
    parser.add_argument("--device", default="cuda", type=str)
    parser.add_argument("-b", "--batch-size", default=2, type=int, help="images per gpu")
    parser.add_argument("--accum-steps", default=4, type=int)
    parser.add_argument("--epochs", default=36, type=int)
    parser.add_argument("-j", "--workers", default=6, type=int)
    parser.add_argument("--lr", default=0.01, type=float)
    parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
    parser.add_argument("--lr-steps", default=[24, 32], nargs="+", type=int)
    parser.add_argument("--clip-grad-norm", default=10.0, type=float)
    parser.add_argument("--trainable-backbone-layers", default=3, type=int)
    parser.add_argument("--detections-per-img", default=300, type=int)
    parser.add_argument("--val-fraction", default=0.1, type=float)
    parser.add_argument("--split-seed", default=1234, type=int)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--print-freq", default=20, type=int)
    parser.add_argument("--output-dir", default="/shared/runs/fcos_drone", type=str)
    parser.add_argument("--resume", default="", type=str)
    parser.add_argument("--start-epoch", default=0, type=int)
    parser.add_argument("--test-only", action="store_true")
    parser.add_argument("--world-size", default=1, type=int)
    parser.add_argument("--dist-url", default="env://", type=str)
    return parser


if __name__ == "__main__":
    args = get_args_parser().parse_args()
    main(args)
    if args.distributed:
        dist.destroy_process_group()
