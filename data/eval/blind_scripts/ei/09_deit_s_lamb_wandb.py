#!/usr/bin/env python3
"""DeiT-S / LAMB large-batch run with W&B tracking of loss, lr and throughput.

    torchrun --nproc_per_node=8 09_deit_s_lamb_wandb.py --data /datasets/imagenet \
        --wandb-project ls-vit --run-name deit_s_lamb_8k
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import timm
import wandb
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.optim import Lamb
from timm.utils import ModelEmaV2
from torchvision.datasets import ImageFolder


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="/datasets/imagenet")
    parser.add_argument("--model", default="deit_small_patch16_224")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=1024, help="per-GPU")
    parser.add_argument("--lr", type=float, default=5e-4, help="per 512 images")
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--warmup-epochs", type=int, default=5)
    parser.add_argument("--min-lr", type=float, default=1e-5)
    parser.add_argument("--drop-path", type=float, default=0.1)
    parser.add_argument("--clip-grad", type=float, default=1.0)
    parser.add_argument("--ema-decay", type=float, default=0.99996)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--out-dir", default="/checkpoints/deit_s")
    parser.add_argument("--wandb-project", default="ls-vit")
    parser.add_argument("--run-name", default=None)
    parser.add_argument("--log-every", type=int, default=20)
    return parser.parse_args()


def lr_schedule(it, total_it, warmup_it, base, floor):
    if it < warmup_it:
        return base * it / warmup_it
    return floor + 0.5 * (base - floor) * (1 + math.cos(math.pi * (it - warmup_it) / (total_it - warmup_it)))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    buf = torch.zeros(3, device=device)
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(images)
        top5 = logits.topk(5, -1).indices
        buf[0] += (top5[:, 0] == labels).sum()
        buf[1] += (top5 == labels.unsqueeze(1)).any(-1).sum()
        buf[2] += labels.numel()
    dist.all_reduce(buf)
    return (100 * buf[0] / buf[2]).item(), (100 * buf[1] / buf[2]).item()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    global_batch = args.batch_size * world_size
    lr = args.lr * global_batch / 512
    wandb.init(project=args.wandb_project, name=args.run_name,
               config={**vars(args), "world_size": world_size, "global_batch": global_batch,
                       "scaled_lr": lr})

    train_ds = ImageFolder(os.path.join(args.data, "train"),
                           create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                            re_prob=0.25, interpolation="bicubic"))
    val_ds = ImageFolder(os.path.join(args.data, "val"),
                         create_transform(224, is_training=False, interpolation="bicubic"))
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=args.drop_path)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])
    model_ema = ModelEmaV2(model.module, decay=args.ema_decay)

    skip = model.module.no_weight_decay()
    decay, no_decay = [], []
    for name, p in model.module.named_parameters():
        if p.ndim <= 1 or name.endswith(".bias") or name in skip:
            no_decay.append(p)
        else:
            decay.append(p)
    optimizer = Lamb([{"params": decay, "weight_decay": args.weight_decay},
                      {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    mixup_fn = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    iters_per_epoch = len(train_loader)
    total_iters = args.epochs * iters_per_epoch
    warmup_iters = args.warmup_epochs * iters_per_epoch
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)

    it = 0
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t_last = time.perf_counter()
        for step, (images, labels) in enumerate(train_loader):
            cur_lr = lr_schedule(it, total_iters, warmup_iters, lr, args.min_lr)
            for g in optimizer.param_groups:
                g["lr"] = cur_lr
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            images, labels = mixup_fn(images, labels)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()
            model_ema.update(model.module)
            it += 1

            if step % args.log_every == 0 and rank == 0:
                torch.cuda.synchronize()
                now = time.perf_counter()
                throughput = args.log_every * global_batch / (now - t_last) if step else 0.0
                t_last = now
                wandb.log({"train/loss": loss.item(), "train/lr": cur_lr,
                           "train/grad_norm": grad_norm.item(),
                           "perf/img_per_sec": throughput, "epoch": epoch}, step=it)

        top1, top5 = evaluate(model, val_loader, device)
        ema_top1, _ = evaluate(model_ema.module, val_loader, device)
        if rank == 0:
            wandb.log({"val/top1": top1, "val/top5": top5, "val/ema_top1": ema_top1}, step=it)
            print(f"epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f} ema {ema_top1:.2f}", flush=True)
            ckpt = {"epoch": epoch, "model": model.module.state_dict(),
                    "model_ema": model_ema.module.state_dict(),
                    "optimizer": optimizer.state_dict()}
            torch.save(ckpt, os.path.join(args.out_dir, "last.pth"))
            if ema_top1 > best:
                best = ema_top1
                torch.save(ckpt, os.path.join(args.out_dir, "best.pth"))

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
