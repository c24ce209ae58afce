"""Online hard example mining (OHEM) for image classification, DDP.

Only the top `keep_ratio` fraction of each micro-batch (by loss) contributes to
the gradient; the ratio is annealed from 1.0 down to `keep_ratio_final`, so the
model first sees everything and then concentrates on the hard examples.

    torchrun --nproc_per_node=8 06_ohem_resume.py --config configs/ohem_r50.yaml
    torchrun --nproc_per_node=8 06_ohem_resume.py --config configs/ohem_r50.yaml --resume work_dirs/ohem_r50/latest.pth
"""
import argparse
import math
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

DEFAULTS = {
    "data_root": "/data/imagenet",
    "arch": "resnet50",
    "epochs": 90,
    "batch_size": 128,
    "lr": 0.1,              # per 256 images
    "momentum": 0.9,
    "weight_decay": 1e-4,
    "warmup_epochs": 5,
    "keep_ratio_final": 0.5,
    "ohem_start_epoch": 10,
    "ohem_ramp_epochs": 20,
    "workers": 10,
    "work_dir": "work_dirs/ohem_r50",
    "print_freq": 100,
}


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", default="")
    ap.add_argument("--opts", nargs="*", default=[], help="key=value overrides")
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    for kv in a.opts:
        k, v = kv.split("=", 1)
        cfg[k] = type(DEFAULTS[k])(v) if k in DEFAULTS else v
    cfg["resume"] = a.resume
    return cfg


def keep_ratio(cfg, epoch):
    if epoch < cfg["ohem_start_epoch"]:
        return 1.0
    t = min(1.0, (epoch - cfg["ohem_start_epoch"]) / max(1, cfg["ohem_ramp_epochs"]))
    return 1.0 - t * (1.0 - cfg["keep_ratio_final"])


def ohem_loss(logits, target, ratio):
    per = F.cross_entropy(logits, target, reduction="none")
    if ratio >= 1.0:
        return per.mean(), per
    k = max(1, int(math.ceil(ratio * per.numel())))
    hard, _ = per.topk(k)
    return hard.mean(), per


def lr_at(cfg, base_lr, epoch, it, iters):
    e = epoch + it / iters
    if e < cfg["warmup_epochs"]:
        return base_lr * e / cfg["warmup_epochs"]
    p = (e - cfg["warmup_epochs"]) / (cfg["epochs"] - cfg["warmup_epochs"])
    return 0.5 * base_lr * (1 + math.cos(math.pi * p))


def build_loaders(cfg, world, rank):
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_set = torchvision.datasets.ImageFolder(os.path.join(cfg["data_root"], "train"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]))
    val_set = torchvision.datasets.ImageFolder(os.path.join(cfg["data_root"], "val"), transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize]))
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True, persistent_workers=True)
    # strided, unpadded shard: every validation image is scored exactly once
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=200,
                            num_workers=cfg["workers"], pin_memory=True)
    return train_loader, val_loader, train_sampler, len(val_set)


@torch.no_grad()
def validate(model, loader, device, n_val):
    model.eval()
    top1 = torch.zeros((), device=device)
    for images, target in loader:
        images = images.cuda(device, non_blocking=True)
        target = target.cuda(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(images)
        top1 += (out.argmax(1) == target).sum()
    dist.all_reduce(top1)
    return top1.item() / n_val


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(cfg["work_dir"], exist_ok=True)
        print(cfg, flush=True)

    train_loader, val_loader, train_sampler, n_val = build_loaders(cfg, world, rank)
    model = torchvision.models.__dict__[cfg["arch"]]().to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    base_lr = cfg["lr"] * cfg["batch_size"] * world / 256
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": cfg["weight_decay"]},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=base_lr, momentum=cfg["momentum"], nesterov=True)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_acc = 0, 0.0
    if cfg["resume"] and os.path.isfile(cfg["resume"]):
        ckpt = torch.load(cfg["resume"])
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]
        if rank == 0:
            print(f"resumed from {cfg['resume']} (epoch {ckpt['epoch']})", flush=True)

    iters = len(train_loader)
    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        ratio = keep_ratio(cfg, epoch)
        model.train()
        t_end = time.time()
        for it, (images, target) in enumerate(train_loader):
            for g in optimizer.param_groups:
                g["lr"] = lr_at(cfg, base_lr, epoch, it, iters)
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(images)
            loss, per = ohem_loss(logits.float(), target, ratio)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if it % cfg["print_freq"] == 0:
                stats = torch.stack([loss.detach(), per.detach().mean()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    dt = (time.time() - t_end) / (it + 1)
                    print(f"ep {epoch} [{it}/{iters}] ohem_loss {stats[0]:.4f} mean_loss {stats[1]:.4f} "
                          f"keep {ratio:.2f} lr {optimizer.param_groups[0]['lr']:.4f} {dt:.3f}s/it", flush=True)

        acc = validate(model.module, val_loader, device, n_val)
        if rank == 0:
            is_best = acc > best_acc
            best_acc = max(acc, best_acc)
            print(f"epoch {epoch} top1 {acc:.4f} best {best_acc:.4f}", flush=True)
            path = os.path.join(cfg["work_dir"], "latest.pth")
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "best_acc": best_acc, "cfg": cfg}, path)
            if is_best:
                shutil.copyfile(path, os.path.join(cfg["work_dir"], "best.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
