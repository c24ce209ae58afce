#!/usr/bin/env python
"""SimCLR (ResNet-50) self-supervised pretraining on satellite image chips.

    #SBATCH --nodes=4
    #SBATCH --ntasks-per-node=4
    #SBATCH --gres=gpu:4
    #SBATCH --cpus-per-task=10
    #SBATCH --time=24:00:00

    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
    export MASTER_PORT=23456
    export NCCL_DEBUG=WARN
    srun python simclr.py --data /gpfs/eo/chips_256 --out /gpfs/eo/ssl/simclr_r50

The NT-Xent loss uses negatives from all GPUs (features are all-gathered with
gradients), so the effective number of negatives is 2 * global_batch - 2.
"""
import argparse
import datetime
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T
from torchvision.datasets import ImageFolder


class TwoViews:
    def __init__(self, size=224):
        self.tf = T.Compose([
            T.RandomResizedCrop(size, scale=(0.08, 1.0)),
            T.RandomHorizontalFlip(), T.RandomVerticalFlip(),
            T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
            T.RandomGrayscale(p=0.2),
            T.RandomApply([T.GaussianBlur(23, sigma=(0.1, 2.0))], p=0.5),
            T.ToTensor(),
            T.Normalize([0.36, 0.37, 0.33], [0.21, 0.19, 0.18]),
        ])

    def __call__(self, img):
        return self.tf(img), self.tf(img)


class SimCLR(nn.Module):
    def __init__(self, proj_dim=128):
        super().__init__()
        backbone = torchvision.models.resnet50()
        feat = backbone.fc.in_features
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.proj = nn.Sequential(nn.Linear(feat, 2048), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
                                  nn.Linear(2048, proj_dim))

    def forward(self, x):
        return F.normalize(self.proj(self.backbone(x)), dim=1)


def nt_xent(z1, z2, temperature, rank):
    z = torch.cat([z1, z2], 0)                                   # 2B x D (local)
    z_all = torch.cat(dist_nn.all_gather(z), 0)                  # 2B*W x D
    b = z1.shape[0]
    logits = z @ z_all.t() / temperature
    offset = rank * 2 * b
    idx = torch.arange(2 * b, device=z.device)
    logits[idx, offset + idx] = float("-inf")                     # remove self-similarity
    pos = torch.cat([idx[b:], idx[:b]]) + offset
    return F.cross_entropy(logits, pos)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch", type=int, default=256, help="per GPU")
    ap.add_argument("--base-lr", type=float, default=0.3, help="LARS lr per 256 images")
    ap.add_argument("--temperature", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()

    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])

    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=30))
    # make sure every node can talk to every other node before loading anything
    probe = torch.ones(1).cuda()
    dist.all_reduce(probe)
    if rank == 0:
        print(f"NCCL up: {int(probe.item())} ranks", flush=True)
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    ds = ImageFolder(args.data, transform=TwoViews())
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, drop_last=True,
                        num_workers=int(os.environ.get("SLURM_CPUS_PER_TASK", 8)),
                        pin_memory=True, persistent_workers=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(SimCLR()).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.base_lr * args.batch * world / 256
    params_bn_bias = [p for n, p in model.named_parameters() if p.ndim == 1]
    params_w = [p for n, p in model.named_parameters() if p.ndim > 1]
    opt = torch.optim.SGD([{"params": params_w, "weight_decay": 1e-6},
                           {"params": params_bn_bias, "weight_decay": 0.0}],
                          lr=lr, momentum=0.9)
    steps = len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / (args.warmup * steps)) *
        0.5 * (1 + math.cos(math.pi * s / (args.epochs * steps))))
    scaler = torch.cuda.amp.GradScaler()

    ckpt_path = os.path.join(args.out, "checkpoint.pth")
    start = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        start = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        total = torch.zeros(2, device=device)
        for i, ((v1, v2), _) in enumerate(loader):
            v1 = v1.to(device, non_blocking=True)
            v2 = v2.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                z = model(torch.cat([v1, v2], 0))
            z1, z2 = z.float().chunk(2)
            loss = nt_xent(z1, z2, args.temperature, rank)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            total += torch.stack([loss.detach(), torch.tensor(1.0, device=device)])
            if rank == 0 and i % 50 == 0:
                print(f"ep {epoch} it {i}/{steps} loss {loss.item():.4f}", flush=True)

        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch} mean loss {(total[0] / total[1]).item():.4f} "
                  f"time {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": epoch}, ckpt_path)
            if (epoch + 1) % 50 == 0:
                torch.save(model.module.backbone.state_dict(),
                           os.path.join(args.out, f"backbone_ep{epoch + 1}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
