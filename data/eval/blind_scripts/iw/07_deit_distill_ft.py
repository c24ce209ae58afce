#!/usr/bin/env python3
"""DeiT-B distilled (⚗): fine-tune at 384px on ImageNet-1k, optional RegNetY teacher.

Follows the DeiT recipe: the distilled model has a class token and a distillation
token; at train time both heads are returned and DistillationLoss combines them.
"""
import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision import datasets

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from timm.utils import NativeScaler, accuracy


def get_args():
    p = argparse.ArgumentParser("DeiT distilled fine-tuning")
    p.add_argument("--data-path", default="/datasets01/imagenet_full_size/061417")
    p.add_argument("--model", default="deit_base_distilled_patch16_224")
    p.add_argument("--finetune", default="", help="checkpoint trained at 224")
    p.add_argument("--input-size", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=5e-6, help="for a total batch of 512")
    p.add_argument("--min-lr", type=float, default=1e-6)
    p.add_argument("--weight-decay", type=float, default=1e-8)
    p.add_argument("--drop-path", type=float, default=0.1)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--teacher-model", default="regnety_160")
    p.add_argument("--teacher-path", default="")
    p.add_argument("--distillation-type", default="none", choices=["none", "soft", "hard"])
    p.add_argument("--distillation-alpha", type=float, default=0.5)
    p.add_argument("--distillation-tau", type=float, default=1.0)
    p.add_argument("--num-workers", type=int, default=10)
    p.add_argument("--output-dir", default="./deit_b_dist_384")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class DistillationLoss(nn.Module):
    def __init__(self, base_criterion, teacher, distillation_type, alpha, tau):
        super().__init__()
        self.base_criterion = base_criterion
        self.teacher = teacher
        self.distillation_type = distillation_type
        self.alpha = alpha
        self.tau = tau

    def forward(self, inputs, outputs, labels):
        outputs_kd = None
        if not isinstance(outputs, torch.Tensor):
            outputs, outputs_kd = outputs
        base_loss = self.base_criterion(outputs, labels)
        if self.distillation_type == "none":
            return base_loss

        with torch.no_grad():
            teacher_out = self.teacher(inputs)
        if self.distillation_type == "soft":
            T = self.tau
            kd = F.kl_div(F.log_softmax(outputs_kd / T, dim=1), F.log_softmax(teacher_out / T, dim=1),
                          reduction="sum", log_target=True) * (T * T) / outputs_kd.numel()
        else:
            kd = F.cross_entropy(outputs_kd, teacher_out.argmax(dim=1))
        return base_loss * (1 - self.alpha) + kd * self.alpha


def interpolate_pos_embed(model, state):
    pos = state["pos_embed"]
    n_extra = model.num_prefix_tokens
    extra, grid = pos[:, :n_extra], pos[:, n_extra:]
    old = int(grid.shape[1] ** 0.5)
    new = int((model.pos_embed.shape[1] - n_extra) ** 0.5)
    if old != new:
        dim = grid.shape[-1]
        grid = grid.reshape(1, old, old, dim).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(new, new), mode="bicubic", align_corners=False)
        grid = grid.permute(0, 2, 3, 1).reshape(1, new * new, dim)
        state["pos_embed"] = torch.cat([extra, grid], dim=1)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        s += torch.stack([acc1.double() * target.size(0) / 100, acc5.double() * target.size(0) / 100,
                          torch.tensor(float(target.size(0)), device=device, dtype=torch.float64)])
    dist.all_reduce(s)
    return {"acc1": (100 * s[0] / s[2]).item(), "acc5": (100 * s[1] / s[2]).item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    torch.backends.cudnn.benchmark = True

    t_train = create_transform(args.input_size, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                               re_prob=0.25, interpolation="bicubic")
    t_val = create_transform(args.input_size, is_training=False, crop_pct=1.0, interpolation="bicubic")
    ds_train = datasets.ImageFolder(os.path.join(args.data_path, "train"), t_train)
    ds_val = datasets.ImageFolder(os.path.join(args.data_path, "val"), t_val)
    sampler = torch.utils.data.DistributedSampler(ds_train, num_replicas=world_size, rank=rank, shuffle=True)
    ds_val_local = torch.utils.data.Subset(ds_val, range(rank, len(ds_val), world_size))
    dl_train = torch.utils.data.DataLoader(ds_train, sampler=sampler, batch_size=args.batch_size,
                                           num_workers=args.num_workers, pin_memory=True, drop_last=True)
    dl_val = torch.utils.data.DataLoader(ds_val_local, batch_size=int(1.5 * args.batch_size),
                                         num_workers=args.num_workers, pin_memory=True)

    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                     num_classes=1000)

    model = timm.create_model(args.model, pretrained=False, num_classes=1000, img_size=args.input_size,
                              drop_path_rate=args.drop_path)
    if args.finetune:
        ckpt = torch.load(args.finetune, map_location="cpu")
        state = ckpt.get("model", ckpt)
        interpolate_pos_embed(model, state)
        msg = model.load_state_dict(state, strict=False)
        if rank == 0:
            print(f"loaded {args.finetune}: {msg}")
    model.set_distilled_training(True)
    model.to(device)

    teacher = None
    if args.distillation_type != "none":
        teacher = timm.create_model(args.teacher_model, pretrained=False, num_classes=1000)
        teacher.load_state_dict(torch.load(args.teacher_path, map_location="cpu")["model"])
        teacher.to(device).eval()

    model = DDP(model, device_ids=[local_rank])
    model_without_ddp = model.module

    lr = args.lr * args.batch_size * world_size / 512.0
    optimizer = create_optimizer_v2(model_without_ddp, opt="adamw", lr=lr, weight_decay=args.weight_decay)
    loss_scaler = NativeScaler()
    n_iter = len(dl_train)
    scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * n_iter, lr_min=args.min_lr,
                                  warmup_t=0, t_in_epochs=False)
    criterion = DistillationLoss(SoftTargetCrossEntropy(), teacher, args.distillation_type,
                                 args.distillation_alpha, args.distillation_tau)

    out = Path(args.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (samples, targets) in enumerate(dl_train):
            samples = samples.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            samples, targets = mixup_fn(samples, targets)
            with torch.cuda.amp.autocast():
                outputs = model(samples)
                loss = criterion(samples, outputs, targets)
            optimizer.zero_grad()
            loss_scaler(loss, optimizer, parameters=model.parameters())
            scheduler.step_update(epoch * n_iter + i + 1)
            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} [{i}/{n_iter}] loss {loss.item():.4f} "
                      f"lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)

        stats = evaluate(model_without_ddp, dl_val, device)
        if rank == 0:
            best = max(best, stats["acc1"])
            print(f"epoch {epoch}: acc1 {stats['acc1']:.2f} acc5 {stats['acc5']:.2f} best {best:.2f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": loss_scaler.state_dict(), "epoch": epoch}, out / "checkpoint.pth")
            with open(out / "log.txt", "a") as f:
                f.write(json.dumps({"epoch": epoch, **stats}) + "\n")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
