"""DeiT-Tiny (distillation token) trained against our RegNetY-16GF teacher.

Hard-label distillation as in Touvron et al.: the class token learns from the
labels (with mixup / cutmix), the distillation token from teacher argmax.

    torchrun --nproc_per_node=8 07_deit_hard_distill.py \
        --data-path /data/imagenet --teacher-path ckpt/regnety_160_ours.pth
"""
import argparse
import datetime
import json
import os
import time
from pathlib import Path

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.scheduler import CosineLRScheduler
from timm.utils import NativeScaler
from torch.utils.data import DataLoader
from torchvision import datasets


def get_args_parser():
    parser = argparse.ArgumentParser("DeiT distillation", add_help=False)
    parser.add_argument("--data-path", required=True, type=str)
    parser.add_argument("--model", default="deit_tiny_distilled_patch16_224", type=str)
    parser.add_argument("--teacher-model", default="regnety_160", type=str)
    parser.add_argument("--teacher-path", required=True, type=str)
    parser.add_argument("--batch-size", default=128, type=int)
    parser.add_argument("--epochs", default=300, type=int)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--warmup-epochs", type=int, default=5)
    parser.add_argument("--min-lr", type=float, default=1e-5)
    parser.add_argument("--mixup", type=float, default=0.8)
    parser.add_argument("--cutmix", type=float, default=1.0)
    parser.add_argument("--smoothing", type=float, default=0.1)
    parser.add_argument("--drop-path", type=float, default=0.1)
    parser.add_argument("--num-workers", default=10, type=int)
    parser.add_argument("--output-dir", default="output/deit_tiny_distilled")
    parser.add_argument("--resume", default="")
    return parser


def build_datasets(args):
    train_tf = create_transform(224, is_training=True, color_jitter=0.3,
                                auto_augment="rand-m9-mstd0.5-inc1", interpolation="bicubic",
                                re_prob=0.25, re_mode="pixel", re_count=1)
    val_tf = create_transform(224, is_training=False, interpolation="bicubic", crop_pct=0.875)
    train = datasets.ImageFolder(os.path.join(args.data_path, "train"), transform=train_tf)
    val = datasets.ImageFolder(os.path.join(args.data_path, "val"), transform=val_tf)
    return train, val


class HardDistillationLoss(torch.nn.Module):
    def __init__(self, base_criterion, teacher):
        super().__init__()
        self.base_criterion = base_criterion
        self.teacher = teacher

    def forward(self, inputs, outputs, labels):
        cls_out, dist_out = outputs
        base_loss = self.base_criterion(cls_out, labels)
        with torch.no_grad():
            teacher_out = self.teacher(inputs)
        dist_loss = F.cross_entropy(dist_out, teacher_out.argmax(dim=1))
        return 0.5 * base_loss + 0.5 * dist_loss


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    meter = torch.zeros(3, device=device, dtype=torch.float64)
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
        top5 = output.topk(5, 1).indices
        meter[0] += (top5[:, 0] == target).sum()
        meter[1] += (top5 == target.unsqueeze(1)).any(1).sum()
        meter[2] += target.size(0)
    dist.all_reduce(meter)
    return {"acc1": (100 * meter[0] / meter[2]).item(), "acc5": (100 * meter[1] / meter[2]).item()}


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda")
    torch.manual_seed(0 + rank)
    torch.backends.cudnn.benchmark = True

    dataset_train, dataset_val = build_datasets(args)
    sampler_train = torch.utils.data.DistributedSampler(dataset_train, shuffle=True)
    sampler_val = torch.utils.data.SequentialSampler(
        torch.utils.data.Subset(dataset_val, range(rank, len(dataset_val), world_size)))
    data_loader_train = DataLoader(dataset_train, sampler=sampler_train, batch_size=args.batch_size,
                                   num_workers=args.num_workers, pin_memory=True, drop_last=True)
    data_loader_val = DataLoader(sampler_val.data_source, sampler=sampler_val,
                                 batch_size=int(1.5 * args.batch_size), num_workers=args.num_workers,
                                 pin_memory=True, drop_last=False)

    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                     num_classes=1000)

    model = timm.create_model(args.model, pretrained=False, num_classes=1000, drop_path_rate=args.drop_path)
    model.to(device)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    model_without_ddp = model.module
    n_parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)

    # linear scaling rule, as in DeiT
    linear_scaled_lr = args.lr * args.batch_size * world_size / 512.0
    optimizer = torch.optim.AdamW(model_without_ddp.parameters(), lr=linear_scaled_lr,
                                  weight_decay=args.weight_decay)
    loss_scaler = NativeScaler()
    lr_scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs, lr_min=args.min_lr,
                                     warmup_lr_init=1e-6, warmup_t=args.warmup_epochs)

    teacher_model = timm.create_model(args.teacher_model, pretrained=False, num_classes=1000,
                                      global_pool="avg")
    checkpoint = torch.load(args.teacher_path)
    teacher_model.load_state_dict(checkpoint["model"])
    teacher_model.to(device)
    teacher_model.eval()

    criterion = HardDistillationLoss(SoftTargetCrossEntropy(), teacher_model)

    output_dir = Path(args.output_dir)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        loss_scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1

    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        print(f"params: {n_parameters / 1e6:.2f}M  lr: {linear_scaled_lr:.2e}", flush=True)

    max_accuracy = 0.0
    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler_train.set_epoch(epoch)
        model.train()
        for it, (samples, targets) in enumerate(data_loader_train):
            samples = samples.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            samples, targets = mixup_fn(samples, targets)
            with torch.cuda.amp.autocast():
                outputs = model(samples)
                loss = criterion(samples, outputs, targets)
            optimizer.zero_grad()
            loss_scaler(loss, optimizer, clip_grad=None, parameters=model.parameters())
            if rank == 0 and it % 100 == 0:
                print(f"Epoch [{epoch}] [{it}/{len(data_loader_train)}] loss {loss.item():.4f} "
                      f"lr {optimizer.param_groups[0]['lr']:.6f}", flush=True)
        lr_scheduler.step(epoch + 1)

        test_stats = evaluate(model_without_ddp, data_loader_val, device)
        max_accuracy = max(max_accuracy, test_stats["acc1"])
        if rank == 0:
            torch.save({
                "model": model_without_ddp.state_dict(),
                "optimizer": optimizer.state_dict(),
                "lr_scheduler": lr_scheduler.state_dict(),
                "scaler": loss_scaler.state_dict(),
                "epoch": epoch,
                "args": vars(args),
            }, output_dir / "checkpoint.pth")
            log_stats = {"epoch": epoch, **{f"test_{k}": v for k, v in test_stats.items()},
                         "max_accuracy": max_accuracy, "n_parameters": n_parameters}
            with (output_dir / "log.txt").open("a") as f:
                f.write(json.dumps(log_stats) + "\n")
            print(f"Accuracy: {test_stats['acc1']:.2f}% (max {max_accuracy:.2f}%)", flush=True)
        dist.barrier()

    total_time = time.time() - start_time
    if rank == 0:
        print("Training time {}".format(str(datetime.timedelta(seconds=int(total_time)))))
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser("DeiT distillation", parents=[get_args_parser()])
    main(parser.parse_args())
