"""DeiT-S on ImageNet with bf16-compressed gradient all-reduce.

Compares default fp32 all-reduce, fp16_compress_hook and bf16_compress_hook
(--hook) at equal hyper-parameters; everything else follows the DeiT recipe.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        bf16_hook_vit.py --data /mnt/lustre/imagenet --out /mnt/lustre/runs/deit_s_bf16hook --hook bf16
"""
import argparse
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets

HOOKS = {
    "none": None,
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hook", choices=list(HOOKS), default="bf16")
    ap.add_argument("--model", default="deit_small_patch16_224")
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4, help="per 512 images")
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--workers", type=int, default=10)
    return ap.parse_args()


def save_checkpoint(path, model, optimizer, epoch, best):
    torch.save({
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "best": best,
    }, path)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    m = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        m[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        m[1] += (logits.argmax(-1) == y).sum()
        m[2] += y.numel()
    dist.all_reduce(m)
    return (m[0] / m[2]).item(), (100 * m[1] / m[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), create_transform(
        224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25, interpolation="bicubic"))
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), create_transform(224, is_training=False))
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=256, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, pin_memory=True)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=0.1).to(device)
    model = DDP(model, device_ids=[local_rank])
    if HOOKS[args.hook] is not None:
        model.register_comm_hook(state=None, hook=HOOKS[args.hook])

    lr = args.lr * args.batch_size * world / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.wd)
    steps_per_epoch = len(train_loader)
    warmup = args.warmup_epochs * steps_per_epoch
    total = args.epochs * steps_per_epoch

    os.makedirs(args.out, exist_ok=True)
    last_path = os.path.join(args.out, "checkpoint.pth")
    best_path = os.path.join(args.out, "best.pth")
    start_epoch, best = 0, 0.0
    if os.path.exists(last_path):
        ck = torch.load(last_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
    if is_main:
        print(f"hook={args.hook} world={world} lr={lr:.2e} start_epoch={start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            step = epoch * steps_per_epoch + it
            cur_lr = lr * step / warmup if step < warmup else \
                1e-6 + 0.5 * (lr - 1e-6) * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
            for g in optimizer.param_groups:
                g["lr"] = cur_lr
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y_soft = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y_soft)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            if is_main and it % 100 == 0:
                print(f"[{epoch}][{it}/{steps_per_epoch}] loss {loss.item():.4f} lr {cur_lr:.2e} "
                      f"{(time.time() - t0) / (it + 1):.3f}s/it", flush=True)

        val_loss, acc1 = evaluate(model, val_loader, device)
        if is_main:
            print(f"epoch {epoch}: val loss {val_loss:.4f} acc@1 {acc1:.2f} (best {max(best, acc1):.2f})",
                  flush=True)
        save_checkpoint(last_path, model, optimizer, epoch, max(best, acc1))
        if acc1 > best:
            best = acc1
            save_checkpoint(best_path, model, optimizer, epoch, best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
