#!/usr/bin/env python3
"""ViT-B/16 / LAMB at 16k global batch: torch.compile + bf16 + EMA, W&B on rank 0.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        17_vit_b_lamb_compile_wandb.py --data /lustre/imagenet --out /lustre/runs/vitb_lamb16k
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
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.optim import Lamb
from timm.utils import ModelEmaV2
from torchvision.datasets import ImageFolder


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256, help="per GPU micro-batch")
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-4, help="per 512 images (sqrt-scaled for LAMB)")
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--warmup-epochs", type=int, default=30)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--ema-decay", type=float, default=0.9999)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--wandb", action="store_true")
    p.add_argument("--workers", type=int, default=12)
    return p.parse_args()


def cosine(step, total, warmup, peak):
    if step < warmup:
        return peak * (step + 1) / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        acc[0] += (out.argmax(-1) == y).sum()
        acc[1] += y.numel()
    dist.all_reduce(acc)
    return float(100 * acc[0] / acc[1])


def main():
    args = get_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cuda.matmul.allow_tf32 = True

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    run = None
    if args.wandb and rank == 0:
        import wandb
        run = wandb.init(project="large-batch-vit", config=vars(args), dir=args.out,
                         resume="allow", id=os.environ.get("WANDB_RUN_ID"))

    train_ds = ImageFolder(os.path.join(args.data, "train"),
                           create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                            re_prob=0.25, interpolation="bicubic"))
    val_ds = ImageFolder(os.path.join(args.data, "val"),
                         create_transform(224, is_training=False, interpolation="bicubic"))
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=250, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=0.1)
    model.to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    ema = ModelEmaV2(model, decay=args.ema_decay)
    train_model = torch.compile(ddp_model) if args.compile else ddp_model

    eff_batch = args.batch_size * args.accum * world
    peak_lr = args.lr * math.sqrt(eff_batch / 512)
    nwd = model.no_weight_decay()
    optimizer = Lamb([
        {"params": [p for n, p in model.named_parameters() if p.ndim > 1 and n not in nwd],
         "weight_decay": args.wd},
        {"params": [p for n, p in model.named_parameters() if p.ndim <= 1 or n in nwd],
         "weight_decay": 0.0},
    ], lr=peak_lr, betas=(0.9, 0.999))
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    updates_per_epoch = len(train_loader) // args.accum
    total_updates = args.epochs * updates_per_epoch
    warmup_updates = args.warmup_epochs * updates_per_epoch

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        ema.module.load_state_dict(ckpt["ema"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1
    if rank == 0:
        print(f"eff batch {eff_batch} peak lr {peak_lr:.2e} start epoch {start_epoch}", flush=True)

    skipped = 0
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train_model.train()
        optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        for i, (x, y) in enumerate(train_loader):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(train_model(x), y) / args.accum
            loss.backward()
            if (i + 1) % args.accum:
                continue

            update = epoch * updates_per_epoch + i // args.accum
            lr = cosine(update, total_updates, warmup_updates, peak_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            # grads are already all-reduced here, so the norm (and the skip) is identical on all ranks
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            if torch.isfinite(gnorm):
                optimizer.step()
                ema.update(model)
            else:
                skipped += 1
            optimizer.zero_grad(set_to_none=True)

            if rank == 0 and (i // args.accum) % 50 == 0:
                torch.cuda.synchronize()
                ips = (i + 1) * args.batch_size * world / (time.perf_counter() - t0)
                print(f"ep {epoch} upd {update} loss {loss.item() * args.accum:.4f} "
                      f"gnorm {gnorm.item():.2f} lr {lr:.2e} {ips:.0f} img/s skipped {skipped}",
                      flush=True)
                if run is not None:
                    run.log({"loss": loss.item() * args.accum, "lr": lr, "grad_norm": gnorm.item(),
                             "img_per_sec": ips, "skipped_updates": skipped}, step=update)

        top1 = evaluate(ddp_model, val_loader, device)
        top1_ema = evaluate(ema.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} top1 {top1:.2f} ema {top1_ema:.2f}", flush=True)
            if run is not None:
                run.log({"val/top1": top1, "val/top1_ema": top1_ema, "epoch": epoch})
            torch.save({"epoch": epoch, "model": model.state_dict(), "ema": ema.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
