"""BigNAS-style supernet training with the sandwich rule.

Per step: the largest child (trained on labels), the smallest child and N
random children (all three trained on the largest child's soft labels).
Children are sampled from a generator seeded with the step, so every rank
picks the same children.

    torchrun --standalone --nproc_per_node=8 04_bignas_sandwich.py --config configs/bignas_s.yaml
"""
import argparse
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from bignas.models import build_supernet
from bignas.data import build_imagenet


def load_config():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--resume", default="")
    cli = parser.parse_args()
    with open(cli.config) as f:
        cfg = yaml.safe_load(f)
    cfg["resume"] = cli.resume
    return cfg


def soft_ce(logits, soft_target):
    return torch.sum(-soft_target * F.log_softmax(logits, dim=-1), dim=-1).mean()


def cosine_lr(step, total, warmup, base):
    if step < warmup:
        return base * (step + 1) / warmup
    return 0.5 * base * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


@torch.no_grad()
def calibrate_bn(model, loader, num_batches, device):
    model.train()
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            m.momentum = None
    for i, (images, _) in enumerate(loader):
        if i >= num_batches:
            break
        model(images.to(device, non_blocking=True))
    # average the running statistics over ranks so every replica agrees
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            dist.all_reduce(m.running_mean)
            dist.all_reduce(m.running_var)
            m.running_mean /= dist.get_world_size()
            m.running_var /= dist.get_world_size()


@torch.no_grad()
def validate(model, calib_loader, val_loader, device, cfg):
    results = {}
    for name in ("min", "max"):
        if name == "min":
            model.sample_min_subnet()
        else:
            model.sample_max_subnet()
        calibrate_bn(model, calib_loader, cfg["bn_calib_batches"], device)
        model.eval()
        counts = torch.zeros(2, device=device)
        for images, target in val_loader:
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            counts[0] += (model(images).argmax(1) == target).sum()
            counts[1] += target.numel()
        dist.all_reduce(counts)
        results[name] = (100.0 * counts[0] / counts[1]).item()
    return results


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg["seed"])

    train_set, val_set = build_imagenet(cfg["data_root"], cfg["resolution"])
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=cfg["seed"])
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size_per_gpu"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_shard = torch.utils.data.Subset(val_set, range(rank, len(val_set), world_size))
    val_loader = DataLoader(val_shard, batch_size=200, shuffle=False,
                            num_workers=cfg["workers"], pin_memory=True)

    supernet = build_supernet(cfg["supernet"]).to(device)
    supernet = nn.SyncBatchNorm.convert_sync_batchnorm(supernet) if cfg.get("sync_bn") else supernet
    # elastic depth skips blocks for the smaller children
    model = DDP(supernet, device_ids=[local_rank], find_unused_parameters=True)

    global_bs = cfg["batch_size_per_gpu"] * world_size
    base_lr = cfg["lr"] * global_bs / 256
    no_wd = [p for n, p in model.named_parameters() if p.ndim == 1]
    wd = [p for n, p in model.named_parameters() if p.ndim > 1]
    optimizer = torch.optim.SGD([{"params": wd, "weight_decay": cfg["weight_decay"]},
                                 {"params": no_wd, "weight_decay": 0.0}],
                                lr=base_lr, momentum=0.9, nesterov=True)
    scaler = GradScaler()

    start_epoch = 0
    if cfg["resume"]:
        ckpt = torch.load(cfg["resume"], map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1

    writer = SummaryWriter(cfg["log_dir"]) if rank == 0 else None
    steps_per_epoch = len(train_loader)
    total_steps = cfg["epochs"] * steps_per_epoch
    warmup = cfg["warmup_epochs"] * steps_per_epoch

    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (images, target) in enumerate(train_loader):
            step = epoch * steps_per_epoch + i
            lr = cosine_lr(step, total_steps, warmup, base_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            rng = random.Random(cfg["seed"] * 7919 + step)
            optimizer.zero_grad(set_to_none=True)

            model.module.sample_max_subnet()
            with autocast():
                logits_max = model(images)
                loss = F.cross_entropy(logits_max, target, label_smoothing=0.1)
            scaler.scale(loss).backward()
            soft = F.softmax(logits_max.detach().float(), dim=-1)

            for k in range(cfg["num_random"] + 1):
                if k == 0:
                    model.module.sample_min_subnet()
                else:
                    model.module.sample_random_subnet(rng)
                with autocast():
                    loss_kd = soft_ce(model(images).float(), soft)
                scaler.scale(loss_kd).backward()

            scaler.unscale_(optimizer)
            nn.utils.clip_grad_value_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()

            if rank == 0 and i % 100 == 0:
                writer.add_scalar("train/loss_max", loss.item(), step)
                writer.add_scalar("train/loss_kd_last", loss_kd.item(), step)
                writer.add_scalar("train/lr", lr, step)
                print(f"ep {epoch} it {i}/{steps_per_epoch} loss {loss.item():.3f} "
                      f"kd {loss_kd.item():.3f} {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % cfg["eval_every"] == 0:
            accs = validate(model, train_loader, val_loader, device, cfg)
            if rank == 0:
                writer.add_scalar("val/top1_min", accs["min"], epoch)
                writer.add_scalar("val/top1_max", accs["max"], epoch)
                print(f"epoch {epoch} val min {accs['min']:.2f} max {accs['max']:.2f}", flush=True)

        if rank == 0:
            os.makedirs(cfg["ckpt_dir"], exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(cfg["ckpt_dir"], "last.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
