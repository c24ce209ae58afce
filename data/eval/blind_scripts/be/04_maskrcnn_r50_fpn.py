r"""Mask R-CNN R50-FPN on COCO, adapted from the torchvision detection references.

    torchrun --nproc_per_node=8 04_maskrcnn_r50_fpn.py --data-path /data/coco --epochs 26 \
        --lr-steps 16 22 --aspect-ratio-group-factor 3 --amp --output-dir ckpt/maskrcnn
"""
import argparse
import datetime
import math
import os
import time

import torch
import torch.distributed as dist
import torch.utils.data
import torchvision
from torchvision.models.detection import maskrcnn_resnet50_fpn
from torchvision.models import ResNet50_Weights

import presets
import utils
from coco_utils import get_coco, get_coco_api_from_dataset
from coco_eval import CocoEvaluator
from group_by_aspect_ratio import GroupedBatchSampler, create_aspect_ratio_groups


def get_args():
    parser = argparse.ArgumentParser(description="Mask R-CNN training")
    parser.add_argument("--data-path", default="/datasets01/COCO/022719/", type=str)
    parser.add_argument("-b", "--batch-size", default=2, type=int, help="images per gpu")
    parser.add_argument("--epochs", default=26, type=int)
    parser.add_argument("-j", "--workers", default=4, type=int)
    parser.add_argument("--lr", default=0.02, type=float, help="0.02 is the default for 8 gpus x 2 images")
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
    parser.add_argument("--lr-steps", default=[16, 22], nargs="+", type=int)
    parser.add_argument("--lr-gamma", default=0.1, type=float)
    parser.add_argument("--print-freq", default=20, type=int)
    parser.add_argument("--output-dir", default=".", type=str)
    parser.add_argument("--resume", default="", type=str)
    parser.add_argument("--start-epoch", default=0, type=int)
    parser.add_argument("--aspect-ratio-group-factor", default=3, type=int)
    parser.add_argument("--trainable-backbone-layers", default=3, type=int)
    parser.add_argument("--amp", action="store_true")
    return parser.parse_args()


def warmup_lr_scheduler(optimizer, warmup_iters, warmup_factor):
    def f(x):
        if x >= warmup_iters:
            return 1
        alpha = float(x) / warmup_iters
        return warmup_factor * (1 - alpha) + alpha

    return torch.optim.lr_scheduler.LambdaLR(optimizer, f)


def train_one_epoch(model, optimizer, data_loader, device, epoch, print_freq, scaler):
    model.train()
    metric_logger = utils.MetricLogger(delimiter="  ")
    metric_logger.add_meter("lr", utils.SmoothedValue(window_size=1, fmt="{value:.6f}"))
    header = f"Epoch: [{epoch}]"

    lr_scheduler = None
    if epoch == 0:
        warmup_iters = min(1000, len(data_loader) - 1)
        lr_scheduler = warmup_lr_scheduler(optimizer, warmup_iters, 1.0 / 1000)

    for images, targets in metric_logger.log_every(data_loader, print_freq, header):
        images = [img.to(device, non_blocking=True) for img in images]
        targets = [{k: v.to(device, non_blocking=True) for k, v in t.items()} for t in targets]
        with torch.cuda.amp.autocast(enabled=scaler is not None):
            loss_dict = model(images, targets)
            losses = sum(loss for loss in loss_dict.values())

        # reduce losses over all GPUs for logging purposes
        loss_dict_reduced = utils.reduce_dict(loss_dict)
        losses_reduced = sum(loss for loss in loss_dict_reduced.values())
        loss_value = losses_reduced.item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training\n{loss_dict_reduced}")
            raise SystemExit(1)

        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(losses).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            losses.backward()
            optimizer.step()
        if lr_scheduler is not None:
            lr_scheduler.step()

        metric_logger.update(loss=losses_reduced, **loss_dict_reduced)
        metric_logger.update(lr=optimizer.param_groups[0]["lr"])
    return metric_logger


@torch.no_grad()
def evaluate(model, data_loader, device):
    cpu_device = torch.device("cpu")
    model.eval()
    coco = get_coco_api_from_dataset(data_loader.dataset)
    coco_evaluator = CocoEvaluator(coco, ["bbox", "segm"])
    metric_logger = utils.MetricLogger(delimiter="  ")
    for images, targets in metric_logger.log_every(data_loader, 100, "Test:"):
        images = [img.to(device, non_blocking=True) for img in images]
        torch.cuda.synchronize()
        model_time = time.time()
        outputs = model(images)
        outputs = [{k: v.to(cpu_device) for k, v in t.items()} for t in outputs]
        model_time = time.time() - model_time
        res = {target["image_id"]: output for target, output in zip(targets, outputs)}
        evaluator_time = time.time()
        coco_evaluator.update(res)
        metric_logger.update(model_time=model_time, evaluator_time=time.time() - evaluator_time)

    # gather the stats from all processes
    metric_logger.synchronize_between_processes()
    coco_evaluator.synchronize_between_processes()  # all_gather of img_ids / eval_imgs
    coco_evaluator.accumulate()
    coco_evaluator.summarize()
    return coco_evaluator.coco_eval["bbox"].stats[0], coco_evaluator.coco_eval["segm"].stats[0]


def main():
    args = get_args()
    utils.init_distributed_mode(args)  # reads RANK / WORLD_SIZE / LOCAL_RANK, sets device, init_process_group
    device = torch.device("cuda")
    if args.output_dir and utils.is_main_process():
        utils.mkdir(args.output_dir)

    print("Loading data")
    dataset = get_coco(args.data_path, "train", transforms=presets.DetectionPresetTrain(data_augmentation="hflip"))
    dataset_test = get_coco(args.data_path, "val", transforms=presets.DetectionPresetEval())

    print("Creating data loaders")
    train_sampler = torch.utils.data.RandomSampler(dataset)
    test_sampler = torch.utils.data.distributed.DistributedSampler(dataset_test, shuffle=False)

    if args.aspect_ratio_group_factor >= 0:
        group_ids = create_aspect_ratio_groups(dataset, k=args.aspect_ratio_group_factor)
        train_batch_sampler = GroupedBatchSampler(train_sampler, group_ids, args.batch_size)
    else:
        train_batch_sampler = torch.utils.data.BatchSampler(train_sampler, args.batch_size, drop_last=True)

    data_loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=train_batch_sampler, num_workers=args.workers, collate_fn=utils.collate_fn
    )
    data_loader_test = torch.utils.data.DataLoader(
        dataset_test, batch_size=1, sampler=test_sampler, num_workers=args.workers, collate_fn=utils.collate_fn
    )

    print("Creating model")
    model = maskrcnn_resnet50_fpn(weights=None, weights_backbone=ResNet50_Weights.IMAGENET1K_V1,
                                  num_classes=91, trainable_backbone_layers=args.trainable_backbone_layers)
    model.to(device)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
    model_without_ddp = model.module

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler() if args.amp else None
    lr_scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.lr_steps, gamma=args.lr_gamma)

    best_segm_ap = 0.0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
        args.start_epoch = checkpoint["epoch"] + 1
        best_segm_ap = checkpoint.get("best_segm_ap", 0.0)
        if args.amp and "scaler" in checkpoint:
            scaler.load_state_dict(checkpoint["scaler"])

    print("Start training")
    start_time = time.time()
    for epoch in range(args.start_epoch, args.epochs):
        train_one_epoch(model, optimizer, data_loader, device, epoch, args.print_freq, scaler)
        lr_scheduler.step()

        bbox_ap, segm_ap = evaluate(model_without_ddp, data_loader_test, device=device)
        checkpoint = {
            "model": model_without_ddp.state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": lr_scheduler.state_dict(),
            "args": args,
            "epoch": epoch,
            "best_segm_ap": max(best_segm_ap, segm_ap),
        }
        if args.amp:
            checkpoint["scaler"] = scaler.state_dict()
        utils.save_on_master(checkpoint, os.path.join(args.output_dir, f"model_{epoch}.pth"))
        utils.save_on_master(checkpoint, os.path.join(args.output_dir, "checkpoint.pth"))
        if segm_ap > best_segm_ap:
            best_segm_ap = segm_ap
            utils.save_on_master(checkpoint, os.path.join(args.output_dir, "model_best.pth"))
        if utils.is_main_process():
            print(f"epoch {epoch}: bbox AP {bbox_ap:.4f} segm AP {segm_ap:.4f} (best segm {best_segm_ap:.4f})")

    total_time = time.time() - start_time
    print(f"Training time {datetime.timedelta(seconds=int(total_time))}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
