"""ConvNeXt-T on ImageNet-1k: DDP, fp16 AMP, gradient accumulation, auto-resume.

The job runs under a preemptible queue, so it always resumes from <output>/checkpoint-last.pth
when that file exists.

    torchrun --nproc_per_node=8 10_ddp_convnext_resume.py --data_path /data/imagenet --output_dir /nfs/runs/convnext_t
"""
import argparse
import contextlib
import json
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args():
    p = argparse.ArgumentParser("ConvNeXt training")
    p.add_argument("--data_path", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--model", default="convnext_tiny")
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--update_freq", type=int, default=4, help="gradient accumulation steps")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--warmup_epochs", type=int, default=20)
    p.add_argument("--blr", type=float, default=4e-3, help="lr for total batch 4096")
    p.add_argument("--weight_decay", type=float, default=0.05)
    p.add_argument("--drop_path", type=float, default=0.1)
    p.add_argument("--clip_grad", type=float, default=None)
    p.add_argument("--num_workers", type=int, default=10)
    p.add_argument("--save_freq", type=int, default=1)
    return p.parse_args()


def cosine_lr(it, total, warmup, base):
    if it < warmup:
        return base * it / warmup
    return 0.5 * base * (1 + math.cos(math.pi * (it - warmup) / (total - warmup)))


def auto_resume(args, model_without_ddp, optimizer, scaler):
    ckpt_path = os.path.join(args.output_dir, "checkpoint-last.pth")
    if not os.path.exists(ckpt_path):
        return 0, 0.0
    checkpoint = torch.load(ckpt_path)
    model_without_ddp.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scaler.load_state_dict(checkpoint["scaler"])
    print(f"Resumed from {ckpt_path} (epoch {checkpoint['epoch']})", flush=True)
    return checkpoint["epoch"] + 1, checkpoint.get("max_accuracy", 0.0)


def save_on_master(state, path):
    if dist.get_rank() == 0:
        torch.save(state, path + ".partial")
        os.replace(path + ".partial", path)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    crit = nn.CrossEntropyLoss(reduction="sum")
    m = torch.zeros(3, device=device)
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(images)
            loss = crit(output, target)
        m += torch.stack([loss.float(), (output.argmax(-1) == target).sum().float(),
                          torch.tensor(float(target.numel()), device=device)])
    dist.all_reduce(m)
    return m[0].item() / m[2].item(), 100.0 * m[1].item() / m[2].item()


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda")
    torch.manual_seed(0 + rank)
    torch.backends.cudnn.benchmark = True

    train_tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = transforms.Compose([
        transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224), transforms.ToTensor(),
        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    train_set = datasets.ImageFolder(os.path.join(args.data_path, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data_path, "val"), val_tf)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, sampler=sampler, batch_size=args.batch_size,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=256,
                            num_workers=args.num_workers, pin_memory=True)

    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=args.drop_path).to(device)
    model = DDP(model, device_ids=[local_rank])
    model_without_ddp = model.module

    total_batch = args.batch_size * args.update_freq * world
    lr = args.blr * total_batch / 4096
    optimizer = torch.optim.AdamW(model_without_ddp.parameters(), lr=lr, weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler()
    criterion = SoftTargetCrossEntropy()

    start_epoch, max_acc = auto_resume(args, model_without_ddp, optimizer, scaler)
    iters_per_epoch = len(train_loader) // args.update_freq
    total_iters, warmup_iters = args.epochs * iters_per_epoch, args.warmup_epochs * iters_per_epoch
    if rank == 0:
        print(f"total batch {total_batch}, lr {lr:.2e}, {iters_per_epoch} updates/epoch", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        optimizer.zero_grad(set_to_none=True)
        for step, (samples, targets) in enumerate(train_loader):
            if step >= iters_per_epoch * args.update_freq:
                break
            it = epoch * iters_per_epoch + step // args.update_freq
            if step % args.update_freq == 0:
                for g in optimizer.param_groups:
                    g["lr"] = cosine_lr(it, total_iters, warmup_iters, lr)
            samples, targets = samples.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            samples, targets = mixup(samples, targets)
            update = (step + 1) % args.update_freq == 0
            with contextlib.nullcontext() if update else model.no_sync():
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = criterion(model(samples), targets)
                scaler.scale(loss / args.update_freq).backward()
            if update:
                if args.clip_grad:
                    scaler.unscale_(optimizer)
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 200 == 0:
                print(f"Epoch [{epoch}] [{step}/{len(train_loader)}] loss {loss.item():.4f} "
                      f"lr {optimizer.param_groups[0]['lr']:.2e} {time.time() - t0:.0f}s", flush=True)

        val_loss, acc1 = evaluate(model_without_ddp, val_loader, device)
        if rank == 0:
            print(f"Epoch {epoch}: val loss {val_loss:.4f}, acc@1 {acc1:.2f}", flush=True)
        max_acc = max(max_acc, acc1)
        if (epoch + 1) % args.save_freq == 0 or epoch + 1 == args.epochs:
            state = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch, "max_accuracy": max_acc}
            save_on_master(state, os.path.join(args.output_dir, "checkpoint-last.pth"))
            if acc1 >= max_acc:
                save_on_master(model_without_ddp.state_dict(), os.path.join(args.output_dir, "checkpoint-best.pth"))
        if rank == 0:
            with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "val_loss": val_loss, "acc1": acc1}) + "\n")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    a = get_args()
    os.makedirs(a.output_dir, exist_ok=True)
    main(a)
