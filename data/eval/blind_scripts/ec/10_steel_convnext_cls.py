"""Hot-rolled steel strip defect classification (NEU-CLS style, 6 classes).

ConvNeXt-T from timm, fine-tuned on 200x200 grayscale patches replicated to 3
channels. Metrics and sample predictions go to our W&B project so the
process engineers can follow the runs.

    torchrun --nproc_per_node=8 10_steel_convnext_cls.py --data /lustre/steel/neu_cls \
        --run-name convnext_t_bs256 --out /lustre/steel/ckpt
"""
import argparse
import os
import random
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from sklearn.metrics import classification_report
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

CLASSES = ["crazing", "inclusion", "patches", "pitted_surface", "rolled-in_scale", "scratches"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--project", default="steel-inspection")
    ap.add_argument("--arch", default="convnext_tiny.fb_in22k")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def setup_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_transforms(size):
    norm = transforms.Normalize([0.5] * 3, [0.5] * 3)
    train = transforms.Compose([
        transforms.Grayscale(num_output_channels=3),
        transforms.RandomResizedCrop(size, scale=(0.7, 1.0)),
        transforms.RandomHorizontalFlip(), transforms.RandomVerticalFlip(),
        transforms.RandomApply([transforms.GaussianBlur(5, (0.1, 1.5))], p=0.3),
        transforms.ToTensor(), norm])
    test = transforms.Compose([transforms.Grayscale(num_output_channels=3), transforms.Resize(size),
                               transforms.ToTensor(), norm])
    return train, test


def cosine_with_warmup(step, total, warmup):
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + np.cos(np.pi * progress))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(len(CLASSES), device=device)
    total = torch.zeros(len(CLASSES), device=device)
    loss_sum = torch.zeros(1, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        loss_sum += F.cross_entropy(logits, y, reduction="sum")
        pred = logits.argmax(1)
        total += torch.bincount(y, minlength=len(CLASSES)).float()
        correct += torch.bincount(y[pred == y], minlength=len(CLASSES)).float()
    for t in (correct, total, loss_sum):
        dist.all_reduce(t)
    model.train()
    per_class = (correct / total.clamp(min=1)).cpu().numpy()
    return (loss_sum / total.sum()).item(), (correct.sum() / total.sum()).item(), per_class


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    setup_seed(args.seed + rank)

    run = wandb.init(project=args.project, name=args.run_name, config=vars(args) | {"world_size": world},
                     dir=args.out)

    train_tf, test_tf = make_transforms(args.img_size)
    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), test_tf)
    assert train_ds.classes == CLASSES, train_ds.classes

    batch = args.global_batch // world
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    # val set is split without padding so every image is counted once
    val_idx = list(range(rank, len(val_ds), world))
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=batch * 2,
                        num_workers=args.workers, pin_memory=True)
    train_dl = DataLoader(train_ds, batch_size=batch, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)

    model = timm.create_model(args.arch, pretrained=True, num_classes=len(CLASSES), drop_path_rate=0.1)
    model = DDP(model.to(device), device_ids=[local_rank])
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or n.endswith(".bias") else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    total_steps = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: cosine_with_warmup(s, total_steps, args.warmup * len(train_dl)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_acc, step = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % 20 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": sched.get_last_lr()[0]}, step=step)

        val_loss, val_acc, per_class = evaluate(model.module, val_dl, device)
        wandb.log({"val/loss": val_loss, "val/acc": val_acc, "epoch": epoch, "epoch_time": time.time() - t0,
                   **{f"val/acc_{c}": float(a) for c, a in zip(CLASSES, per_class)}}, step=step)
        if rank == 0:
            print(f"epoch {epoch}: val loss {val_loss:.4f} acc {val_acc:.4f}", flush=True)
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save({"model": model.module.state_dict(), "classes": CLASSES, "epoch": epoch,
                            "val_acc": val_acc}, os.path.join(args.out, "best.pth"))
                run.summary["best_val_acc"] = best_acc

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
