# Swin-T ImageNet-1k training, 300 epochs, following the Swin recipe:
# AdamW, cosine with 20 warmup epochs (per-iteration), grad clip 5.0,
# mixup 0.8 / cutmix 1.0, label smoothing 0.1, drop path 0.2, AMP.
import argparse
import datetime
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, SubsetRandomSampler
from torchvision import datasets, transforms

import timm
from timm.data import Mixup, create_transform
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.loss import SoftTargetCrossEntropy
from timm.scheduler.cosine_lr import CosineLRScheduler
from timm.utils import AverageMeter

CONFIG = {
    "MODEL": "swin_tiny_patch4_window7_224",
    "DROP_PATH": 0.2,
    "IMG_SIZE": 224,
    "BATCH_SIZE": 128,  # per GPU
    "EPOCHS": 300,
    "WARMUP_EPOCHS": 20,
    "BASE_LR": 5e-4,  # for a total batch of 512
    "WARMUP_LR": 5e-7,
    "MIN_LR": 5e-6,
    "WEIGHT_DECAY": 0.05,
    "CLIP_GRAD": 5.0,
    "MIXUP": 0.8,
    "CUTMIX": 1.0,
    "SMOOTHING": 0.1,
    "NUM_WORKERS": 8,
    "SAVE_FREQ": 10,
}


def parse_option():
    parser = argparse.ArgumentParser("Swin Transformer training")
    parser.add_argument("--data-path", type=str, default="/data/imagenet")
    parser.add_argument("--output", type=str, default="/nfs/swin_runs/swin_tiny")
    parser.add_argument("--batch-size", type=int, help="override per-GPU batch size")
    parser.add_argument("--resume", type=str, default="")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cfg = dict(CONFIG)
    if args.batch_size:
        cfg["BATCH_SIZE"] = args.batch_size
    return args, cfg


def build_loader(cfg, data_path, rank, world_size):
    t_train = create_transform(input_size=cfg["IMG_SIZE"], is_training=True, color_jitter=0.4,
                               auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25, re_mode="pixel",
                               re_count=1, interpolation="bicubic")
    t_val = transforms.Compose([
        transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(cfg["IMG_SIZE"]),
        transforms.ToTensor(),
        transforms.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD),
    ])
    dataset_train = datasets.ImageFolder(os.path.join(data_path, "train"), t_train)
    dataset_val = datasets.ImageFolder(os.path.join(data_path, "val"), t_val)

    sampler_train = DistributedSampler(dataset_train, num_replicas=world_size, rank=rank, shuffle=True)
    indices = np.arange(rank, len(dataset_val), world_size)
    sampler_val = SubsetRandomSampler(indices)

    data_loader_train = DataLoader(dataset_train, sampler=sampler_train, batch_size=cfg["BATCH_SIZE"],
                                   num_workers=cfg["NUM_WORKERS"], pin_memory=True, drop_last=True)
    data_loader_val = DataLoader(dataset_val, sampler=sampler_val, batch_size=cfg["BATCH_SIZE"],
                                 num_workers=cfg["NUM_WORKERS"], pin_memory=True, drop_last=False)
    mixup_fn = Mixup(mixup_alpha=cfg["MIXUP"], cutmix_alpha=cfg["CUTMIX"], label_smoothing=cfg["SMOOTHING"],
                     num_classes=1000)
    return dataset_train, dataset_val, data_loader_train, data_loader_val, mixup_fn


def set_weight_decay(model, skip_list=(), skip_keywords=()):
    has_decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if len(param.shape) == 1 or name.endswith(".bias") or name in skip_list or \
                any(k in name for k in skip_keywords):
            no_decay.append(param)
        else:
            has_decay.append(param)
    return [{"params": has_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train_one_epoch(cfg, model, criterion, data_loader, optimizer, epoch, mixup_fn, lr_scheduler,
                    scaler, rank):
    model.train()
    optimizer.zero_grad()
    num_steps = len(data_loader)
    loss_meter, norm_meter = AverageMeter(), AverageMeter()
    start = time.time()
    for idx, (samples, targets) in enumerate(data_loader):
        samples = samples.cuda(non_blocking=True)
        targets = targets.cuda(non_blocking=True)
        samples, targets = mixup_fn(samples, targets)
        with torch.cuda.amp.autocast():
            outputs = model(samples)
            loss = criterion(outputs, targets)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), cfg["CLIP_GRAD"])
        scaler.step(optimizer)
        scaler.update()
        lr_scheduler.step_update(epoch * num_steps + idx)
        torch.cuda.synchronize()
        loss_meter.update(loss.item(), targets.size(0))
        norm_meter.update(grad_norm.item())
        if rank == 0 and idx % 100 == 0:
            lr = optimizer.param_groups[0]["lr"]
            print(f"Train: [{epoch}/{cfg['EPOCHS']}][{idx}/{num_steps}] lr {lr:.6f} "
                  f"loss {loss_meter.val:.4f} ({loss_meter.avg:.4f}) grad_norm {norm_meter.val:.4f}")
    if rank == 0:
        print(f"EPOCH {epoch} training takes {datetime.timedelta(seconds=int(time.time() - start))}")


@torch.no_grad()
def validate(data_loader, model):
    model.eval()
    sums = torch.zeros(3, device="cuda")
    for images, target in data_loader:
        images = images.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
        top5 = output.topk(5, 1).indices
        sums[0] += (top5[:, 0] == target).sum()
        sums[1] += (top5 == target.unsqueeze(1)).any(1).sum()
        sums[2] += target.size(0)
    dist.all_reduce(sums)
    return (100.0 * sums[0] / sums[2]).item(), (100.0 * sums[1] / sums[2]).item()


def main():
    args, cfg = parse_option()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    dataset_train, dataset_val, data_loader_train, data_loader_val, mixup_fn = build_loader(
        cfg, args.data_path, rank, world_size)

    model = timm.create_model(cfg["MODEL"], num_classes=1000, drop_path_rate=cfg["DROP_PATH"]).cuda()
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank], broadcast_buffers=False)
    model_without_ddp = model.module

    # linear scale the learning rate according to the total batch size
    total_batch = cfg["BATCH_SIZE"] * world_size
    base_lr = cfg["BASE_LR"] * total_batch / 512.0
    warmup_lr = cfg["WARMUP_LR"] * total_batch / 512.0
    min_lr = cfg["MIN_LR"] * total_batch / 512.0

    skip = {"absolute_pos_embed"}
    skip_kw = {"relative_position_bias_table"}
    optimizer = torch.optim.AdamW(set_weight_decay(model_without_ddp, skip, skip_kw), lr=base_lr,
                                  betas=(0.9, 0.999), eps=1e-8, weight_decay=cfg["WEIGHT_DECAY"])
    n_iter_per_epoch = len(dataset_train) // cfg["BATCH_SIZE"]
    lr_scheduler = CosineLRScheduler(optimizer, t_initial=cfg["EPOCHS"] * n_iter_per_epoch, lr_min=min_lr,
                                     warmup_lr_init=warmup_lr, warmup_t=cfg["WARMUP_EPOCHS"] * n_iter_per_epoch,
                                     cycle_limit=1, t_in_epochs=False)
    scaler = torch.cuda.amp.GradScaler()
    criterion = SoftTargetCrossEntropy()

    start_epoch, max_accuracy = 0, 0.0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
        scaler.load_state_dict(checkpoint["scaler"])
        start_epoch = checkpoint["epoch"] + 1
        max_accuracy = checkpoint.get("max_accuracy", 0.0)

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"total batch {total_batch}, base lr {base_lr:.2e}")
    start_time = time.time()
    for epoch in range(start_epoch, cfg["EPOCHS"]):
        data_loader_train.sampler.set_epoch(epoch)
        train_one_epoch(cfg, model, criterion, data_loader_train, optimizer, epoch, mixup_fn,
                        lr_scheduler, scaler, rank)
        acc1, acc5 = validate(data_loader_val, model_without_ddp)
        max_accuracy = max(max_accuracy, acc1)
        if rank == 0:
            print(f"Accuracy of the network on the {len(dataset_val)} test images: {acc1:.1f}% "
                  f"(top5 {acc5:.1f}%), max {max_accuracy:.2f}%")
            if epoch % cfg["SAVE_FREQ"] == 0 or epoch == cfg["EPOCHS"] - 1:
                torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                            "lr_scheduler": lr_scheduler.state_dict(), "scaler": scaler.state_dict(),
                            "epoch": epoch, "max_accuracy": max_accuracy},
                           os.path.join(args.output, f"ckpt_epoch_{epoch}.pth"))
            with open(os.path.join(args.output, "log.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "acc1": acc1, "acc5": acc5}) + "\n")

    if rank == 0:
        print("Training time", datetime.timedelta(seconds=int(time.time() - start_time)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
