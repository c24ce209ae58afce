"""ViT-B/16 fine-tuning on a folder dataset (timm), torchrun + DDP.

Formerly used apex.parallel.DistributedDataParallel(delay_allreduce=True) and
apex FusedAdam; both replaced with the native versions.
"""
import argparse
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timm.data import create_transform, resolve_data_config
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.datasets import ImageFolder


def is_dist():
    return dist.is_available() and dist.is_initialized()


def get_rank():
    return dist.get_rank() if is_dist() else 0


def get_world_size():
    return dist.get_world_size() if is_dist() else 1


def is_main_process():
    return get_rank() == 0


def reduce_mean(t):
    if not is_dist():
        return t
    t = t.clone()
    dist.all_reduce(t)
    return t / get_world_size()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="vit_base_patch16_224.augreg_in21k")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-4, help="per 512 images")
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--layer-decay", type=float, default=0.75)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--output", default="output/vit_ft")
    return p.parse_args()


def param_groups_lrd(model, weight_decay, layer_decay):
    num_layers = len(model.blocks) + 1
    scales = [layer_decay ** (num_layers - i) for i in range(num_layers + 1)]
    groups = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if n.startswith(("cls_token", "pos_embed", "patch_embed")):
            layer_id = 0
        elif n.startswith("blocks."):
            layer_id = int(n.split(".")[1]) + 1
        else:
            layer_id = num_layers
        decay = "no_decay" if p.ndim == 1 or n in ("cls_token", "pos_embed") else "decay"
        key = f"layer_{layer_id}_{decay}"
        if key not in groups:
            groups[key] = {"params": [], "weight_decay": weight_decay if decay == "decay" else 0.0,
                           "lr_scale": scales[layer_id]}
        groups[key]["params"].append(p)
    return list(groups.values())


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(images)
        loss_sum += F.cross_entropy(logits.float(), target, reduction="sum")
        correct += (logits.argmax(-1) == target).sum()
        count += target.numel()
    loss = reduce_mean(loss_sum / count)
    acc = reduce_mean(correct / count)
    model.train()
    return loss.item(), acc.item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    world = get_world_size()

    model = timm.create_model(args.model, pretrained=True, num_classes=0)
    data_cfg = resolve_data_config({}, model=model)
    train_set = ImageFolder(os.path.join(args.data, "train"), create_transform(**data_cfg, is_training=True,
                                                                               auto_augment="rand-m9-mstd0.5"))
    val_set = ImageFolder(os.path.join(args.data, "val"), create_transform(**data_cfg))
    model.reset_classifier(len(train_set.classes))
    model.to(device)

    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=128, shuffle=False, num_workers=args.workers, pin_memory=True)

    lr = args.lr * args.batch_size * world / 512
    optimizer = torch.optim.AdamW(param_groups_lrd(model, args.wd, args.layer_decay), lr=lr, fused=True)
    steps_per_epoch = len(train_loader)
    warmup = args.warmup_epochs * steps_per_epoch
    total = args.epochs * steps_per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, [lambda s, g=g: g["lr_scale"] * min((s + 1) / warmup, max(0.0, (total - s) / (total - warmup)))
                    for g in optimizer.param_groups])

    model = DDP(model, device_ids=[local_rank])
    writer = SummaryWriter(args.output) if is_main_process() else None

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (images, target) in enumerate(train_loader):
            images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(images), target, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            if step % 50 == 0:
                avg = reduce_mean(loss.detach())
                if writer is not None:
                    gstep = epoch * steps_per_epoch + step
                    writer.add_scalar("train/loss", avg.item(), gstep)
                    writer.add_scalar("train/lr", optimizer.param_groups[-1]["lr"], gstep)

        if is_main_process():
            val_loss, val_acc = evaluate(model, val_loader, device)
            writer.add_scalar("val/loss", val_loss, epoch)
            writer.add_scalar("val/acc", val_acc, epoch)
            print(f"epoch {epoch}: val loss {val_loss:.4f} acc {100 * val_acc:.2f} ({time.time() - t0:.0f}s)")
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(model.module.state_dict(), os.path.join(args.output, "best.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
