"""ConvNeXt-T on ImageNet-1k, one Slurm task per GPU (no torchrun).

#!/bin/bash
#SBATCH --job-name=cnx-t-in1k
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=12
#SBATCH --time=48:00:00
#SBATCH --output=logs/%x-%j.out
module load cuda/12.1
source ~/venvs/pt22/bin/activate
srun python train_convnext.py --data /lustre/datasets/imagenet --out /lustre/$USER/runs/cnx-t-$SLURM_JOB_ID
"""
import argparse
import datetime
import os
import socket
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.scheduler import CosineLRScheduler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--warmup-epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--blr", type=float, default=4e-3, help="lr at global batch 4096")
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--drop-path", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--port", type=int, default=None)
    return p.parse_args()


def slurm_dist_env(args):
    """Fill in the env:// variables from what srun gives every task."""
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    os.environ["LOCAL_RANK"] = str(local_rank)
    if "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = socket.gethostname()
    if "MASTER_PORT" not in os.environ:
        port = args.port or 20000 + int(os.environ["SLURM_JOB_ID"]) % 20000
        os.environ["MASTER_PORT"] = str(port)
    return rank, world, local_rank


def accuracy(logits, target, topk=(1, 5)):
    maxk = max(topk)
    _, pred = logits.topk(maxk, 1, True, True)
    correct = pred.t().eq(target.view(1, -1))
    return [correct[:k].reshape(-1).float().sum() for k in topk]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        c1, c5 = accuracy(out, y)
        stats += torch.stack([c1, c5, torch.tensor(float(y.numel()), device=device)])
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = get_args()
    rank, world, local_rank = slurm_dist_env(args)
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=30))
    if rank == 0:
        print(f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} world {world}", flush=True)

    train_tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = create_transform(224, is_training=False, crop_pct=0.875, interpolation="bicubic")
    train_ds = ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_ds = ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    # 50000 val images divide evenly over 4/8/16/32 ranks, so no padding
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, 200, sampler=val_sampler, num_workers=args.workers, pin_memory=True)

    model = timm.create_model("convnext_tiny", num_classes=1000, drop_path_rate=args.drop_path)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    eff_bs = args.batch_size * world
    lr = args.blr * eff_bs / 4096
    decay, no_decay = [], []
    for n, p in model.module.named_parameters():
        (no_decay if p.ndim <= 1 or n.endswith(".bias") else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    n_iter = len(train_dl)
    sched = CosineLRScheduler(opt, t_initial=args.epochs * n_iter, lr_min=1e-6,
                              warmup_t=args.warmup_epochs * n_iter, warmup_lr_init=1e-6, t_in_epochs=False)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    os.makedirs(args.out, exist_ok=True)
    ckpt = os.path.join(args.out, "checkpoint.pth")
    start_epoch, best = 0, 0.0
    if os.path.exists(ckpt):
        sd = torch.load(ckpt, map_location="cpu")
        model.module.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
        start_epoch, best = sd["epoch"] + 1, sd["best"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step_update(epoch * n_iter + i + 1)
            if rank == 0 and i % 200 == 0:
                print(f"ep {epoch} [{i}/{n_iter}] loss {loss.item():.4f} lr {opt.param_groups[0]['lr']:.2e}",
                      flush=True)

        top1, top5 = evaluate(model, val_dl, device)
        best = max(best, top1)
        if rank == 0:
            print(f"ep {epoch} top1 {top1:.4f} top5 {top5:.4f} best {best:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "epoch": epoch, "best": best}, ckpt + ".part")
            os.replace(ckpt + ".part", ckpt)
            if top1 >= best:
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
