"""ViT-S/16 fine-tuning on CIFAR-100, launched with torchrun.

Same recipe as the accelerate notebook version, but with explicit process-group handling so
the sweep scheduler can pass its own torchrun flags.

    torchrun --standalone --nproc_per_node=8 09_vit_cifar100_torchrun.py --data-dir /scratch/cifar
"""
import argparse
import math
import os
import time
from datetime import timedelta

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate.utils import set_seed
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

MEAN, STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="/scratch/cifar")
    ap.add_argument("--model", default="vit_small_patch16_224.augreg_in21k")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--bs", type=int, default=64, help="per process")
    ap.add_argument("--lr", type=float, default=5e-4, help="for global batch 512")
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--mixup", type=float, default=0.8)
    ap.add_argument("--cutmix", type=float, default=1.0)
    ap.add_argument("--ckpt-dir", default="ckpt/vit_c100")
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


def setup_distributed():
    dist.init_process_group(backend="nccl", timeout=timedelta(minutes=30))
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    return rank, world_size, local_rank


def cosine_lr(step, total, warmup, base_lr):
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    totals = torch.zeros(3, device=device)  # loss sum, correct, count
    crit = nn.CrossEntropyLoss(reduction="sum")
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            out = model(x)
        totals[0] += crit(out.float(), y)
        totals[1] += (out.argmax(-1) == y).sum()
        totals[2] += y.numel()
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    model.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def main():
    args = parse()
    rank, world_size, local_rank = setup_distributed()

    if rank == 0:
        # download once; the other ranks wait for the files
        datasets.CIFAR100(args.data_dir, train=True, download=True)
        datasets.CIFAR100(args.data_dir, train=False, download=True)
        run_dir = [os.path.join(args.ckpt_dir, time.strftime("%Y%m%d-%H%M%S"))]
    else:
        run_dir = [None]
    dist.broadcast_object_list(run_dir, src=0)
    run_dir = run_dir[0]

    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    set_seed(args.seed + rank)

    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.6, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
        transforms.RandomErasing(p=0.25),
    ])
    test_tf = transforms.Compose([transforms.Resize(224), transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    train_set = datasets.CIFAR100(args.data_dir, train=True, transform=train_tf)
    test_set = datasets.CIFAR100(args.data_dir, train=False, transform=test_tf)

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler, num_workers=8, pin_memory=True)

    model = timm.create_model(args.model, pretrained=True, num_classes=100, drop_path_rate=0.1).to(device)
    model = DDP(model, device_ids=[local_rank])

    base_lr = args.lr * args.bs * world_size / 512
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or n.endswith(".bias") or "pos_embed" in n or "cls_token" in n else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=base_lr)
    mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=0.1, num_classes=100)
    criterion = SoftTargetCrossEntropy()

    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        print(f"world={world_size} base_lr={base_lr:.2e} steps={total_steps} -> {run_dir}", flush=True)

    step, best_acc = 0, 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y_soft = mixup(x, y)
            lr = cosine_lr(step, total_steps, warmup_steps, base_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y_soft)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} lr {lr:.2e}", flush=True)

        val_loss, val_acc = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} val_acc {val_acc:.4f} ({time.time() - t0:.0f}s)",
                  flush=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch, "step": step, "val_acc": val_acc}
            torch.save(state, os.path.join(run_dir, "last.pt"))
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(state, os.path.join(run_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
