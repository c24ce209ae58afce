"""Barley net blotch severity classes from UAV plot crops, cross-season.

Train on the 2021 and 2022 seasons, validate on 2023 (new site, new camera
settings). ViT-S/16 from an in-domain self-supervised checkpoint.

    torchrun --nproc_per_node=4 08_barley_season_vit_wandb.py --data /data/barley --ssl-ckpt ssl/dino_vits16_fields.pth
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from PIL import Image
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

SEVERITY = ["0", "1-5%", "5-15%", "15-35%", ">35%"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--train-seasons", nargs="+", default=["2021", "2022"])
    p.add_argument("--val-seasons", nargs="+", default=["2023"])
    p.add_argument("--ssl-ckpt", default="")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--layer-decay", type=float, default=0.75)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--project", default="barley-netblotch")
    p.add_argument("--run-name", default=None)
    p.add_argument("--out", default="out/netblotch_vits")
    return p.parse_args()


class SeasonCrops(Dataset):
    def __init__(self, root, seasons, tf):
        df = pd.read_csv(os.path.join(root, "annotations.csv"), dtype={"season": str})
        df = df[df.season.isin(seasons)].reset_index(drop=True)
        self.paths = [os.path.join(root, "crops", s, f) for s, f in zip(df.season, df.file)]
        self.y = df.severity_class.astype(int).values
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.tf(Image.open(self.paths[i]).convert("RGB")), int(self.y[i])


def param_groups_lrd(model, weight_decay, layer_decay):
    """Layer-wise lr decay for a timm ViT."""
    num_layers = len(model.blocks) + 1
    scales = [layer_decay ** (num_layers - i) for i in range(num_layers + 1)]
    groups = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if n.startswith(("cls_token", "pos_embed", "patch_embed")):
            layer = 0
        elif n.startswith("blocks."):
            layer = int(n.split(".")[1]) + 1
        else:
            layer = num_layers
        no_wd = p.ndim == 1 or n in ("cls_token", "pos_embed")
        key = (layer, no_wd)
        if key not in groups:
            groups[key] = {"params": [], "weight_decay": 0.0 if no_wd else weight_decay, "lr_scale": scales[layer]}
        groups[key]["params"].append(p)
    return list(groups.values())


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(100 + rank)

    wandb.init(project=args.project, name=args.run_name, config=vars(args))

    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.35, 1.0), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(),
        transforms.RandomVerticalFlip(),
        transforms.RandAugment(num_ops=2, magnitude=9),
        transforms.ToTensor(),
        norm,
    ])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    train_ds = SeasonCrops(args.data, args.train_seasons, train_tf)
    val_ds = SeasonCrops(args.data, args.val_seasons, val_tf)

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=128,
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model("vit_small_patch16_224", pretrained=not args.ssl_ckpt, num_classes=len(SEVERITY),
                              drop_path_rate=0.1, global_pool="avg")
    if args.ssl_ckpt:
        sd = torch.load(args.ssl_ckpt, map_location="cpu")
        sd = {k.replace("backbone.", ""): v for k, v in sd.get("teacher", sd).items() if "head" not in k}
        msg = model.load_state_dict(sd, strict=False)
        if rank == 0:
            print("loaded ssl weights:", msg)
    model.to(device)
    groups = param_groups_lrd(model, 0.05, args.layer_decay)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999))
    for g in optimizer.param_groups:
        g["base_lr"] = lr * g["lr_scale"]
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=len(SEVERITY))
    criterion = SoftTargetCrossEntropy()
    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = 5 * steps_per_epoch

    best_acc, step = 0.0, 0
    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y in train_loader:
            if step < warmup_steps:
                f = step / warmup_steps
            else:
                f = 0.5 * (1 + np.cos(np.pi * (step - warmup_steps) / (total_steps - warmup_steps)))
            for g in optimizer.param_groups:
                g["lr"] = g["base_lr"] * f
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y_soft = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y_soft)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            optimizer.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "lr": optimizer.param_groups[-1]["lr"]}, step=step)

        model.eval()
        stats = torch.zeros(2 + len(SEVERITY) ** 2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model.module(x).argmax(1)
                stats[0] += (pred == y).sum()
                stats[1] += y.numel()
                stats[2:] += torch.bincount(y * len(SEVERITY) + pred, minlength=len(SEVERITY) ** 2).float()
        dist.all_reduce(stats)
        acc = (stats[0] / stats[1]).item()
        cm = stats[2:].view(len(SEVERITY), len(SEVERITY)).cpu().numpy()
        # adjacent-class accuracy: severity scoring is only reliable to +/- one class
        adj = sum(cm[i, j] for i in range(len(SEVERITY)) for j in range(len(SEVERITY)) if abs(i - j) <= 1) / cm.sum()

        if rank == 0:
            wandb.log({"val/acc": acc, "val/adjacent_acc": adj, "epoch": epoch,
                       "epoch_time": time.time() - t0}, step=step)
            print(f"epoch {epoch} val acc {acc:.4f} adj {adj:.4f}", flush=True)
            if acc > best_acc:
                best_acc = acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
                wandb.run.summary["best_val_acc"] = best_acc

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
