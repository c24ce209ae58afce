"""Fine-tune an ImageNet-21k ViT-B/16 on Food-101 with label smoothing and early stopping.

    torchrun --nproc_per_node=4 14_finetune_early_stop.py --config configs/food101_vitb.yaml
"""
import argparse
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms


class EarlyStopping:
    def __init__(self, patience=5, min_delta=0.0):
        self.patience = patience
        self.min_delta = min_delta
        self.best = -math.inf
        self.num_bad = 0

    def step(self, metric):
        """Returns (improved, should_stop)."""
        if metric > self.best + self.min_delta:
            self.best = metric
            self.num_bad = 0
            return True, False
        self.num_bad += 1
        return False, self.num_bad >= self.patience


def layer_decay_groups(model, base_lr, weight_decay, decay_rate):
    num_layers = len(model.blocks) + 1
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.startswith(("cls_token", "pos_embed", "patch_embed")):
            layer_id = 0
        elif name.startswith("blocks."):
            layer_id = int(name.split(".")[1]) + 1
        else:
            layer_id = num_layers
        no_wd = p.ndim == 1 or name in ("cls_token", "pos_embed")
        key = (layer_id, no_wd)
        if key not in groups:
            scale = decay_rate ** (num_layers - layer_id)
            groups[key] = {"params": [], "lr": base_lr * scale, "lr_scale": scale,
                           "weight_decay": 0.0 if no_wd else weight_decay}
        groups[key]["params"].append(p)
    return list(groups.values())


def build_loaders(cfg, rank, world):
    mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(cfg["img_size"], scale=(0.35, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    test_tf = transforms.Compose([
        transforms.Resize(int(cfg["img_size"] / 0.875)),
        transforms.CenterCrop(cfg["img_size"]),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    train_set = datasets.Food101(cfg["data_root"], split="train", transform=train_tf)
    test_set = datasets.Food101(cfg["data_root"], split="test", transform=test_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    # unpadded shard of the test set: every image is counted exactly once
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=cfg["eval_batch_size"], num_workers=cfg["workers"],
                             pin_memory=True)
    return train_loader, test_loader, train_sampler


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    m = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = model(x).argmax(1)
        m[0] += (pred == y).sum()
        m[1] += y.numel()
    dist.all_reduce(m)
    return (100 * m[0] / m[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_loader, test_loader, train_sampler = build_loaders(cfg, rank, world)

    model = timm.create_model(cfg["model"], pretrained=True, num_classes=101,
                              drop_path_rate=cfg.get("drop_path", 0.1)).to(device)
    eff_batch = cfg["batch_size"] * world
    base_lr = cfg["blr"] * eff_batch / 256
    param_groups = layer_decay_groups(model, base_lr, cfg["weight_decay"], cfg["layer_decay"])
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(param_groups, lr=base_lr, betas=(0.9, 0.999))
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.get("smoothing", 0.1))

    total = cfg["epochs"] * len(train_loader)
    warmup = cfg["warmup_epochs"] * len(train_loader)

    def lr_lambda(s):
        if s < warmup:
            return s / warmup
        return 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))

    stopper = EarlyStopping(patience=cfg.get("patience", 5))
    writer = SummaryWriter(cfg["log_dir"]) if rank == 0 else None
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)

    step = 0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            scale = lr_lambda(step)
            for g in optimizer.param_groups:
                g["lr"] = base_lr * scale * g["lr_scale"]

            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x), y)
            if not torch.isfinite(loss):
                print(f"[rank {rank}] non-finite loss at step {step}, skipping batch")
                optimizer.zero_grad(set_to_none=True)
                continue

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), cfg.get("clip_grad", 1.0))
            scaler.step(optimizer)
            scaler.update()
            step += 1

            if rank == 0 and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", base_lr * scale, step)

        acc = evaluate(model.module, test_loader, device)
        improved, stop = stopper.step(acc)
        if rank == 0:
            writer.add_scalar("test/top1", acc, epoch)
            print(f"epoch {epoch} top1 {acc:.2f} best {stopper.best:.2f} ({time.time() - t0:.0f}s)")
            if improved:
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "top1": acc,
                            "cfg": cfg}, os.path.join(cfg["out_dir"], "best.pth"))
        if stop:
            break

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
