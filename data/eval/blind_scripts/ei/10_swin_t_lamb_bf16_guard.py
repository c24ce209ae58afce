"""Swin-T / LAMB at 16k global batch, bf16 autocast.

At this batch size the first warmup epochs occasionally produce a non-finite
loss; the loop drops those batches instead of poisoning the LAMB moments.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        10_swin_t_lamb_bf16_guard.py --data /lustre/imagenet --out /lustre/ckpt/swin_t_16k
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
from torchvision.datasets import ImageFolder


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="swin_tiny_patch4_window7_224")
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=1024, help="per GPU")
    ap.add_argument("--base-lr", type=float, default=1e-3, help="for 1024 images")
    ap.add_argument("--lr-scale", choices=["linear", "sqrt"], default="sqrt")
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--warmup-epochs", type=int, default=40)
    ap.add_argument("--clip", type=float, default=5.0)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--print-every", type=int, default=10)
    return ap.parse_args()


def scaled_lr(args, global_batch):
    ratio = global_batch / 1024
    return args.base_lr * (ratio if args.lr_scale == "linear" else math.sqrt(ratio))


def lr_at(it, total, warmup, peak):
    if it < warmup:
        return peak * (it + 1) / warmup
    return peak * 0.5 * (1.0 + math.cos(math.pi * (it - warmup) / max(1, total - warmup)))


def build_data(args):
    t_train = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                               re_prob=0.25, interpolation="bicubic")
    t_val = create_transform(224, is_training=False, crop_pct=0.875, interpolation="bicubic")
    train = ImageFolder(os.path.join(args.data, "train"), t_train)
    val = ImageFolder(os.path.join(args.data, "val"), t_val)
    s_train = DistributedSampler(train, shuffle=True, drop_last=True)
    s_val = DistributedSampler(val, shuffle=False)
    dl_train = DataLoader(train, batch_size=args.batch_size, sampler=s_train, drop_last=True,
                          num_workers=args.workers, pin_memory=True, persistent_workers=True,
                          prefetch_factor=4)
    dl_val = DataLoader(val, batch_size=250, sampler=s_val, num_workers=args.workers,
                        pin_memory=True)
    return dl_train, dl_val, s_train


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            p = model(x).argmax(1)
        t[0] += (p == y).sum()
        t[1] += y.numel()
    dist.all_reduce(t)
    return float(100 * t[0] / t[1])


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    dl_train, dl_val, s_train = build_data(args)

    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=0.2)
    model.to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    global_batch = args.batch_size * world
    peak = scaled_lr(args, global_batch)
    no_wd = model.module.no_weight_decay_keywords()
    groups = [{"params": [], "weight_decay": args.weight_decay},
              {"params": [], "weight_decay": 0.0}]
    for n, p in model.module.named_parameters():
        skip = p.ndim == 1 or any(k in n for k in no_wd)
        groups[1 if skip else 0]["params"].append(p)
    optimizer = Lamb(groups, lr=peak, betas=(0.9, 0.999), eps=1e-6)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    iters = len(dl_train)
    total, warmup = args.epochs * iters, args.warmup_epochs * iters

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "latest.pt")
    if os.path.isfile(ckpt_path):
        state = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world} | global batch {global_batch} | peak lr {peak:.2e} ({args.lr_scale})",
              flush=True)

    skipped = 0
    for epoch in range(start_epoch, args.epochs):
        s_train.set_epoch(epoch)
        model.train()
        tic = time.perf_counter()
        for i, (x, y) in enumerate(dl_train):
            it = epoch * iters + i
            lr = lr_at(it, total, warmup, peak)
            for g in optimizer.param_groups:
                g["lr"] = lr
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)

            if not torch.isfinite(loss):
                skipped += 1
                print(f"[rank {rank}] non-finite loss at it {it}, skipping batch "
                      f"({skipped} so far)", flush=True)
                optimizer.zero_grad(set_to_none=True)
                continue

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()

            if rank == 0 and i % args.print_every == 0:
                torch.cuda.synchronize()
                el = time.perf_counter() - tic
                print(f"ep {epoch} [{i}/{iters}] loss {loss.item():.4f} gnorm {gnorm.item():.2f} "
                      f"lr {lr:.2e} {(i + 1) * global_batch / el:.0f} img/s", flush=True)

        acc = validate(model, dl_val, device)
        if rank == 0:
            print(f"epoch {epoch} top1 {acc:.2f} epoch time {time.perf_counter() - tic:.0f}s",
                  flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
