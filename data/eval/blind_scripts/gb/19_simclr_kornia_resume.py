"""SimCLR pre-training, both views generated on the GPU with kornia.

The CPU side only decodes and resizes; the NT-Xent loss uses negatives from all GPUs
(differentiable all_gather), and BatchNorm is synchronised across GPUs.

torchrun --nproc_per_node=8 19_simclr_kornia_resume.py --data /data/imagenet/train \
    --resume /shared/simclr/r50/ckpt_last.pth
"""
import argparse
import math
import os
import time

import kornia.augmentation as K
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--lr", type=float, default=0.3, help="per 256 images")
    p.add_argument("--wd", type=float, default=1e-6)
    p.add_argument("--temperature", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--out", default="/shared/simclr/r50")
    p.add_argument("--resume", default="")
    p.add_argument("--save-every", type=int, default=5)
    return p.parse_args()


class SimCLR(nn.Module):
    def __init__(self, dim=128):
        super().__init__()
        self.backbone = torchvision.models.resnet50()
        feat = self.backbone.fc.in_features
        self.backbone.fc = nn.Identity()
        self.projector = nn.Sequential(
            nn.Linear(feat, 2048, bias=False), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
            nn.Linear(2048, dim, bias=False), nn.BatchNorm1d(dim, affine=False),
        )

    def forward(self, x):
        return self.projector(self.backbone(x))


def nt_xent(z1, z2, temperature, rank):
    z1 = F.normalize(z1.float(), dim=1)
    z2 = F.normalize(z2.float(), dim=1)
    # gather negatives from every GPU, keeping the gradient path to the local shard
    all_z2 = torch.cat(dist_fn.all_gather(z2), dim=0)
    all_z1 = torch.cat(dist_fn.all_gather(z1), dim=0)
    n = z1.size(0)
    labels = torch.arange(n, device=z1.device) + rank * n
    logits_12 = z1 @ all_z2.t() / temperature
    logits_21 = z2 @ all_z1.t() / temperature
    return 0.5 * (F.cross_entropy(logits_12, labels) + F.cross_entropy(logits_21, labels))


def build_gpu_augment(device):
    color = K.ColorJitter(0.4, 0.4, 0.2, 0.1, p=0.8)
    view1 = nn.Sequential(
        K.RandomResizedCrop((224, 224), scale=(0.08, 1.0)), K.RandomHorizontalFlip(), color,
        K.RandomGrayscale(p=0.2), K.RandomGaussianBlur((23, 23), (0.1, 2.0), p=1.0),
    )
    view2 = nn.Sequential(
        K.RandomResizedCrop((224, 224), scale=(0.08, 1.0)), K.RandomHorizontalFlip(), color,
        K.RandomGrayscale(p=0.2), K.RandomGaussianBlur((23, 23), (0.1, 2.0), p=0.1),
        K.RandomSolarize(0.0, 0.0, p=0.2),
    )
    norm = K.Normalize(mean=torch.tensor([0.485, 0.456, 0.406]), std=torch.tensor([0.229, 0.224, 0.225]))
    return view1.to(device), view2.to(device), norm.to(device)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    dataset = torchvision.datasets.ImageFolder(
        args.data, transforms.Compose([transforms.Resize(256), transforms.CenterCrop(256), transforms.PILToTensor()]))
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)
    aug1, aug2, norm = build_gpu_augment(device)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(SimCLR()).to(device)
    model = DDP(model, device_ids=[local_rank])
    peak_lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=0.9, weight_decay=args.wd)
    scaler = torch.cuda.amp.GradScaler()

    steps_per_epoch = len(loader)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = 10 * steps_per_epoch

    start_epoch = 0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for i, (img, _) in enumerate(loader):
            step = epoch * steps_per_epoch + i
            if step < warmup_steps:
                lr = peak_lr * step / warmup_steps
            else:
                lr = peak_lr * 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / (total_steps - warmup_steps)))
            for g in optimizer.param_groups:
                g["lr"] = lr

            img = img.to(device, non_blocking=True).float().div_(255)
            with torch.no_grad():
                x1, x2 = norm(aug1(img)), norm(aug2(img))
            with torch.autocast("cuda", dtype=torch.float16):
                z = model(torch.cat([x1, x2], dim=0))
            z1, z2 = z.chunk(2)
            loss = nt_xent(z1, z2, args.temperature, rank)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])

            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} [{i}/{steps_per_epoch}] loss {loss.item():.4f} lr {lr:.4f}", flush=True)

        dist.all_reduce(loss_acc)
        if rank == 0:
            print(f"epoch {epoch} mean loss {(loss_acc[0] / loss_acc[1]).item():.4f} "
                  f"time {time.time() - t0:.0f}s", flush=True)
            if (epoch + 1) % args.save_every == 0 or epoch == args.epochs - 1:
                os.makedirs(args.out, exist_ok=True)
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "scaler": scaler.state_dict(), "epoch": epoch}
                torch.save(state, os.path.join(args.out, "ckpt_last.pth.tmp"))
                os.replace(os.path.join(args.out, "ckpt_last.pth.tmp"), os.path.join(args.out, "ckpt_last.pth"))
                torch.save(model.module.backbone.state_dict(), os.path.join(args.out, f"backbone_ep{epoch}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
