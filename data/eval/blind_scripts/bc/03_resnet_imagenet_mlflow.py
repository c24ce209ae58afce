"""ResNet-50 ImageNet training, multi-node DDP, MLflow tracking.

    torchrun --nnodes=$NNODES --nproc-per-node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=$HEAD:29400 --rdzv-id=$SLURM_JOB_ID --max-restarts=2 \
        train_resnet.py --config configs/r50.yaml
"""
import argparse
import os
import random
import time

import mlflow
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = OmegaConf.create({
    "data": {"root": "/datasets/imagenet", "workers": 10, "img_size": 224},
    "train": {"epochs": 90, "batch_size": 128, "lr": 0.1, "momentum": 0.9, "wd": 1e-4,
              "warmup_epochs": 5, "label_smoothing": 0.1, "amp": True},
    "run": {"name": "r50", "out_dir": "/shared/runs/r50", "mlflow_uri": "http://mlflow.internal:5000",
            "experiment": "imagenet", "print_freq": 100},
    "seed": 0,
})


def get_config():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=None)
    p.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. train.lr=0.2")
    a = p.parse_args()
    cfg = DEFAULTS
    if a.config:
        cfg = OmegaConf.merge(cfg, OmegaConf.load(a.config))
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(a.overrides))


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_loaders(cfg, rank, world):
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = T.Compose([T.RandomResizedCrop(cfg.data.img_size), T.RandomHorizontalFlip(),
                          T.ToTensor(), normalize])
    val_tf = T.Compose([T.Resize(256), T.CenterCrop(cfg.data.img_size), T.ToTensor(), normalize])
    train_ds = torchvision.datasets.ImageFolder(os.path.join(cfg.data.root, "train"), train_tf)
    val_ds = torchvision.datasets.ImageFolder(os.path.join(cfg.data.root, "val"), val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed)
    # strided shard of the val set, no padding, so every image is counted exactly once
    val_shard = Subset(val_ds, range(rank, len(val_ds), world))
    train_loader = DataLoader(train_ds, batch_size=cfg.train.batch_size, sampler=train_sampler,
                              num_workers=cfg.data.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True, prefetch_factor=4)
    val_loader = DataLoader(val_shard, batch_size=cfg.train.batch_size, shuffle=False,
                            num_workers=cfg.data.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


def lr_at(cfg, epoch, it, iters_per_epoch, world):
    base = cfg.train.lr * cfg.train.batch_size * world / 256
    t = epoch + it / iters_per_epoch
    if t < cfg.train.warmup_epochs:
        return base * t / cfg.train.warmup_epochs
    progress = (t - cfg.train.warmup_epochs) / (cfg.train.epochs - cfg.train.warmup_epochs)
    return base * 0.5 * (1 + np.cos(np.pi * progress))


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss sum, top1, top5
    n = torch.zeros(1, device=device)
    crit = nn.CrossEntropyLoss(reduction="sum")
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(images)
        stats[0] += crit(out.float(), target)
        top5 = out.topk(5, dim=1).indices
        stats[1] += (top5[:, 0] == target).sum()
        stats[2] += (top5 == target[:, None]).any(dim=1).sum()
        n += target.numel()
    dist.all_reduce(stats)
    dist.all_reduce(n)
    model.train()
    loss, top1, top5 = (stats / n).tolist()
    return loss, 100 * top1, 100 * top5


def save_ckpt(path, model, optimizer, scaler, epoch, best_acc):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(), "epoch": epoch, "best_acc": best_acc,
                "mlflow_run_id": mlflow.active_run().info.run_id}, tmp)
    os.replace(tmp, path)


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    seed_everything(cfg.seed + rank)
    torch.backends.cudnn.benchmark = True

    train_loader, val_loader, train_sampler = build_loaders(cfg, rank, world)

    model = torchvision.models.resnet50(weights=None)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)
    bn_params = [p for n, p in model.named_parameters() if p.ndim == 1]
    other = [p for n, p in model.named_parameters() if p.ndim > 1]
    optimizer = torch.optim.SGD([{"params": other, "weight_decay": cfg.train.wd},
                                 {"params": bn_params, "weight_decay": 0.0}],
                                lr=cfg.train.lr, momentum=cfg.train.momentum, nesterov=True)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg.train.amp)

    if rank == 0:
        os.makedirs(cfg.run.out_dir, exist_ok=True)
    ckpt_path = os.path.join(cfg.run.out_dir, "checkpoint.pt")
    start_epoch, best_acc, run_id = 0, 0.0, None
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc, run_id = ckpt["epoch"] + 1, ckpt["best_acc"], ckpt["mlflow_run_id"]

    if rank == 0:
        mlflow.set_tracking_uri(cfg.run.mlflow_uri)
        mlflow.set_experiment(cfg.run.experiment)
        mlflow.start_run(run_id=run_id, run_name=cfg.run.name)
        if run_id is None:
            mlflow.log_params({"world_size": world, **OmegaConf.to_container(cfg.train)})

    iters = len(train_loader)
    for epoch in range(start_epoch, cfg.train.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for it, (images, target) in enumerate(train_loader):
            lr = lr_at(cfg, epoch, it, iters, world)
            for g in optimizer.param_groups:
                g["lr"] = lr
            images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.train.amp):
                loss = criterion(model(images), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            running[0] += loss.detach()
            running[1] += 1

            if it % cfg.run.print_freq == 0:
                dist.all_reduce(running)
                avg = (running[0] / running[1]).item()
                running.zero_()
                if rank == 0:
                    ips = cfg.train.batch_size * world * (it + 1) / (time.time() - t0)
                    print(f"ep {epoch} it {it}/{iters} loss {avg:.4f} lr {lr:.4f} img/s {ips:.0f}",
                          flush=True)
                    mlflow.log_metrics({"train_loss": avg, "lr": lr}, step=epoch * iters + it)

        val_loss, top1, top5 = validate(model.module, val_loader, device)
        if rank == 0:
            mlflow.log_metrics({"val_loss": val_loss, "top1": top1, "top5": top5,
                                "epoch_time": time.time() - t0}, step=(epoch + 1) * iters)
            is_best = top1 > best_acc
            best_acc = max(best_acc, top1)
            save_ckpt(ckpt_path, model, optimizer, scaler, epoch, best_acc)
            if is_best:
                torch.save(model.module.state_dict(), os.path.join(cfg.run.out_dir, "best.pt"))
            print(f"epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f} best {best_acc:.2f}", flush=True)
        dist.barrier()

    if rank == 0:
        mlflow.end_run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
