"""Land-use classification on satellite tiles (EfficientNet-B3 via timm).

sbatch job:
    #SBATCH -N 2 --ntasks-per-node=1 --gpus-per-node=4 --cpus-per-task=32
    head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
    srun torchrun --nnodes=2 --nproc_per_node=4 --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d \
        --rdzv_endpoint=$head:29400 10_landuse_effnet_srun_torchrun.py --cfg configs/landuse.yaml
"""
import argparse
import json
import os
import time
from collections import Counter

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

DEFAULTS = {
    "train_dir": "/shared/landuse/train",
    "val_dir": "/shared/landuse/val",
    "out_dir": "/shared/runs/landuse_effb3",
    "arch": "efficientnet_b3",
    "img_size": 300,
    "batch_size": 48,
    "epochs": 30,
    "base_lr": 5e-4,
    "weight_decay": 0.02,
    "warmup_epochs": 2,
    "workers": 8,
    "seed": 3,
}


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    ap.add_argument("--resume", default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.cfg:
        with open(a.cfg) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg["resume"] = a.resume
    return cfg


def transforms_for(size):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train = transforms.Compose([
        transforms.RandomResizedCrop(size, scale=(0.5, 1.0)),
        transforms.RandomHorizontalFlip(), transforms.RandomVerticalFlip(),
        transforms.RandomApply([transforms.RandomRotation(90)], p=0.5),
        transforms.ToTensor(), transforms.Normalize(mean, std)])
    val = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size),
                              transforms.ToTensor(), transforms.Normalize(mean, std)])
    return train, val


def lr_at(epoch_float, cfg, peak):
    if epoch_float < cfg["warmup_epochs"]:
        return peak * epoch_float / cfg["warmup_epochs"]
    t = (epoch_float - cfg["warmup_epochs"]) / max(1, cfg["epochs"] - cfg["warmup_epochs"])
    return peak * 0.5 * (1 + torch.cos(torch.tensor(t * 3.14159265)).item())


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    train_tf, val_tf = transforms_for(cfg["img_size"])
    train_set = datasets.ImageFolder(cfg["train_dir"], transform=train_tf)
    val_set = datasets.ImageFolder(cfg["val_dir"], transform=val_tf)
    assert train_set.class_to_idx == val_set.class_to_idx, "train/val class folders differ"
    n_classes = len(train_set.classes)

    counts = Counter(train_set.targets)
    class_w = torch.tensor([len(train_set) / (n_classes * counts[c]) for c in range(n_classes)], dtype=torch.float32)

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=cfg["seed"], drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=cfg["batch_size"] * 2, sampler=val_sampler,
                            num_workers=cfg["workers"], pin_memory=True)

    model = timm.create_model(cfg["arch"], pretrained=True, num_classes=n_classes, drop_rate=0.3)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    peak_lr = cfg["base_lr"] * cfg["batch_size"] * world / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=cfg["weight_decay"])
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(weight=class_w.to(device), label_smoothing=0.05)

    os.makedirs(cfg["out_dir"], exist_ok=True)
    start_epoch, best_acc = 0, 0.0
    if cfg["resume"]:
        ck = torch.load(cfg["resume"], map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, best_acc = ck["epoch"] + 1, ck["best_acc"]

    steps = len(train_loader)
    for epoch in range(start_epoch, cfg["epochs"]):
        model.train()
        t0 = time.time()
        for i, (images, targets) in enumerate(train_loader):
            for g in optimizer.param_groups:
                g["lr"] = lr_at(epoch + i / steps, cfg, peak_lr)
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(images), targets)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            scaler.step(optimizer)
            scaler.update()
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} [{i}/{steps}] loss {loss.item():.4f}", flush=True)

        model.eval()
        correct = torch.zeros(n_classes, device=device)
        total = torch.zeros(n_classes, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            for images, targets in val_loader:
                images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
                pred = model(images).argmax(1)
                total += torch.bincount(targets, minlength=n_classes)
                correct += torch.bincount(targets[pred == targets], minlength=n_classes)
        dist.all_reduce(correct)
        dist.all_reduce(total)
        acc = (correct.sum() / total.sum()).item()
        bal_acc = (correct / total.clamp(min=1)).mean().item()

        if rank == 0:
            print(json.dumps({"epoch": epoch, "val_acc": round(acc, 4), "val_bal_acc": round(bal_acc, 4),
                              "time_s": round(time.time() - t0, 1)}), flush=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch, "best_acc": max(best_acc, bal_acc),
                     "classes": train_set.classes, "cfg": cfg}
            torch.save(state, os.path.join(cfg["out_dir"], "last.pt"))
            if bal_acc > best_acc:
                torch.save(state, os.path.join(cfg["out_dir"], "best.pt"))
        best_acc = max(best_acc, bal_acc)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
