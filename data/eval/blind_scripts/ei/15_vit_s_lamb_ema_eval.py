"""ViT-S/16 / LAMB, 90-epoch 'budget' recipe (Beyer et al. style), EMA weights.

Global batch 8192 on 8 GPUs with bf16. Reports train throughput and top-1 of the
online and EMA weights.

    torchrun --nproc_per_node=8 15_vit_s_lamb_ema_eval.py --data /datasets/imagenet
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import timm
from timm.data import Mixup, create_transform
from timm.optim import Lamb
from timm.utils import ModelEmaV2
from torchvision.datasets import ImageFolder


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/imagenet")
    p.add_argument("--model", default="vit_small_patch16_224")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=1024, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3, help="per 1024")
    p.add_argument("--lr-sqrt-scaling", action="store_true", default=True)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=10000)
    p.add_argument("--ema-decay", type=float, default=0.9998)
    p.add_argument("--ema-eval-every", type=int, default=5)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--out", default="/checkpoints/vit_s_lamb_8k")
    return p.parse_args()


def lr_fn(step, total, warmup, peak):
    if step < warmup:
        return peak * step / warmup
    return 0.5 * peak * (1.0 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def build_loaders(args):
    train_tf = create_transform(224, is_training=True, auto_augment="rand-m10-mstd0.5",
                                re_prob=0.0, interpolation="bilinear", scale=(0.05, 1.0))
    val_tf = create_transform(224, is_training=False, crop_pct=0.875)
    train_ds = ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_ds = ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, 500, sampler=val_sampler, num_workers=args.workers,
                            pin_memory=True)
    return train_loader, val_loader, train_sampler


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros((), device=device)
    total = torch.zeros((), device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        correct += (logits.argmax(-1) == y).sum()
        total += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    return 100.0 * (correct / total).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_loader, val_loader, train_sampler = build_loaders(args)

    model = timm.create_model(args.model, num_classes=1000, class_token=False,
                              global_pool="avg", fc_norm=False)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])
    model_ema = ModelEmaV2(model.module, decay=args.ema_decay)

    global_batch = args.batch_size * world
    scale = math.sqrt(global_batch / 1024) if args.lr_sqrt_scaling else global_batch / 1024
    peak_lr = args.lr * scale
    skip = model.module.no_weight_decay()
    params = [
        {"params": [p for n, p in model.module.named_parameters()
                    if p.ndim > 1 and n not in skip], "weight_decay": args.wd},
        {"params": [p for n, p in model.module.named_parameters()
                    if p.ndim <= 1 or n in skip], "weight_decay": 0.0},
    ]
    optimizer = Lamb(params, lr=peak_lr, betas=(0.9, 0.999))
    mixup = Mixup(mixup_alpha=0.2, num_classes=1000)

    steps_per_epoch = len(train_loader)
    total_steps = steps_per_epoch * args.epochs
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world} global batch {global_batch} peak lr {peak_lr:.2e}", flush=True)

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t_start = time.perf_counter()
        for i, (x, y) in enumerate(train_loader):
            lr = lr_fn(step, total_steps, args.warmup_steps, peak_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
                loss = torch.sum(-y * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            model_ema.update(model.module)
            step += 1

            if rank == 0 and i % 100 == 0:
                torch.cuda.synchronize()
                elapsed = time.perf_counter() - t_start
                print(f"[{epoch}/{args.epochs}] {i}/{steps_per_epoch} loss {loss.item():.4f} "
                      f"lr {lr:.2e} {(i + 1) * global_batch / elapsed:.0f} img/s", flush=True)

        top1 = evaluate(model, val_loader, device)
        msg = f"epoch {epoch} top1 {top1:.2f}"
        if rank == 0 and (epoch + 1) % args.ema_eval_every == 0:
            ema_top1 = evaluate(model_ema.module, val_loader, device)
            msg += f" ema_top1 {ema_top1:.2f}"
        if rank == 0:
            print(msg, flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "ema": model_ema.module.state_dict(),
                        "optimizer": optimizer.state_dict()},
                       os.path.join(args.out, "checkpoint.pth"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
