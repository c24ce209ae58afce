"""ImageNet ViT-B/16 training with torch.compile + DDP.

    torchrun --nproc_per_node=8 vit_compile_ddp.py --data /datasets/imagenet --output /shared/runs/vitb16
    (re-run the same command to resume from <output>/last.pth)
"""
import argparse
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args():
    parser = argparse.ArgumentParser("vit-compile")
    parser.add_argument("--data", type=str, required=True)
    parser.add_argument("--output", type=str, required=True)
    parser.add_argument("--model", type=str, default="vit_base_patch16_224")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=128, help="per GPU")
    parser.add_argument("--base-lr", type=float, default=5e-4, help="for a global batch of 512")
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--warmup-epochs", type=int, default=5)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--compile-mode", type=str, default="max-autotune-no-cudagraphs")
    return parser.parse_args()


def build_loaders(args, rank, world_size):
    normalize = transforms.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(),
        transforms.ToTensor(),
        normalize,
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        normalize,
    ])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)
    # drop_last keeps the batch shape fixed so the compiled graph never sees a ragged batch
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    for images, target in loader:
        images = images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(images)
        correct += (logits.argmax(dim=1) == target).sum()
        count += target.numel()
    dist.all_reduce(correct)
    dist.all_reduce(count)
    model.train()
    return (correct / count).item() * 100.0


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    is_main = rank == 0
    if is_main:
        os.makedirs(args.output, exist_ok=True)

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True

    train_loader, val_loader, train_sampler = build_loaders(args, rank, world_size)

    model = timm.create_model(args.model, pretrained=False, num_classes=1000, drop_path_rate=0.1)
    model = model.to(device, memory_format=torch.channels_last)

    global_batch = args.batch_size * world_size
    lr = args.base_lr * global_batch / 512
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or name.endswith(".bias") or "pos_embed" in name or "cls_token" in name else decay).append(p)
    optimizer = torch.optim.AdamW([
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ], lr=lr, betas=(0.9, 0.999), fused=True)

    steps_per_epoch = len(train_loader)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1e-3, total_iters=args.warmup_epochs * steps_per_epoch)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=(args.epochs - args.warmup_epochs) * steps_per_epoch, eta_min=1e-6)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[args.warmup_epochs * steps_per_epoch])

    start_epoch, best_acc = 0, 0.0
    ckpt_path = os.path.join(args.output, "last.pth")
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]
        if is_main:
            print(f"resumed from epoch {ckpt['epoch']} (best {best_acc:.2f})")
        del ckpt

    # compile the plain module first, then hand the compiled module to DDP
    model = torch.compile(model, mode=args.compile_mode)
    model = DDP(model, device_ids=[local_rank])

    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for it, (images, target) in enumerate(train_loader):
            images = images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(images), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            running[0] += loss.detach()
            running[1] += 1
            if is_main and it % 100 == 0:
                print(f"ep {epoch} it {it}/{steps_per_epoch} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

        dist.all_reduce(running)
        acc = evaluate(model, val_loader, device)
        if is_main:
            imgs_per_s = steps_per_epoch * global_batch / (time.time() - t0)
            print(f"epoch {epoch}: train loss {(running[0] / running[1]).item():.4f} "
                  f"val acc {acc:.2f} ({imgs_per_s:.0f} img/s)", flush=True)
            best_acc = max(best_acc, acc)
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "best_acc": best_acc,
                "args": vars(args),
            }
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if acc >= best_acc:
                torch.save(state["model"], os.path.join(args.output, "best_model.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
