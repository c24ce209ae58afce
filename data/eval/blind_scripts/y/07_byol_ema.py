"""BYOL pretraining (ResNet-50) on ImageNet-style folders.

online = backbone + projector + predictor (trained, DDP)
target = backbone + projector (EMA of the online weights, never gets gradients)

torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 byol.py --data /data/imagenet/train
"""
import argparse
import copy
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import ImageFilter, ImageOps
import random
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


class GaussianBlur:
    def __init__(self, p):
        self.p = p

    def __call__(self, img):
        if random.random() < self.p:
            return img.filter(ImageFilter.GaussianBlur(radius=random.uniform(0.1, 2.0)))
        return img


class Solarize:
    def __init__(self, p):
        self.p = p

    def __call__(self, img):
        return ImageOps.solarize(img) if random.random() < self.p else img


class TwoViews:
    def __init__(self):
        norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        base = [T.RandomResizedCrop(224, scale=(0.08, 1.0)), T.RandomHorizontalFlip(),
                T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8), T.RandomGrayscale(p=0.2)]
        self.t1 = T.Compose(base + [GaussianBlur(1.0), T.ToTensor(), norm])
        self.t2 = T.Compose(base + [GaussianBlur(0.1), Solarize(0.2), T.ToTensor(), norm])

    def __call__(self, x):
        return self.t1(x), self.t2(x)


def mlp(in_dim, hidden=4096, out=256):
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
                         nn.Linear(hidden, out))


class Online(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = torchvision.models.resnet50()
        feat = self.backbone.fc.in_features
        self.backbone.fc = nn.Identity()
        self.projector = mlp(feat)
        self.predictor = mlp(256)

    def forward(self, x):
        z = self.projector(self.backbone(x))
        return self.predictor(z)


class Target(nn.Module):
    def __init__(self, online):
        super().__init__()
        self.backbone = copy.deepcopy(online.backbone)
        self.projector = copy.deepcopy(online.projector)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.projector(self.backbone(x))


def regression_loss(p, z):
    return 2 - 2 * F.cosine_similarity(p, z.detach(), dim=-1).mean()


@torch.no_grad()
def update_target(online, target, m):
    for po, pt in zip(online.backbone.parameters(), target.backbone.parameters()):
        pt.mul_(m).add_(po.detach(), alpha=1 - m)
    for po, pt in zip(online.projector.parameters(), target.projector.parameters()):
        pt.mul_(m).add_(po.detach(), alpha=1 - m)


def exclude_from_wd(named_params, wd):
    decay, no_decay = [], []
    for n, p in named_params:
        (no_decay if p.ndim == 1 else decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=256, help="per GPU")
    ap.add_argument("--base-lr", type=float, default=0.2, help="for a global batch of 256")
    ap.add_argument("--wd", type=float, default=1.5e-6)
    ap.add_argument("--base-momentum", type=float, default=0.996)
    ap.add_argument("--warmup-epochs", type=int, default=10)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--out", default="runs/byol_r50")
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    ds = torchvision.datasets.ImageFolder(args.data, transform=TwoViews())
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    online = Online()
    online = nn.SyncBatchNorm.convert_sync_batchnorm(online)
    target = Target(online).to(device)
    online = online.to(device)
    model = DDP(online, device_ids=[local_rank])

    lr = args.base_lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(exclude_from_wd(model.named_parameters(), args.wd), lr=lr, momentum=0.9)
    iters_per_epoch = len(loader)
    total_iters = args.epochs * iters_per_epoch
    warmup_iters = args.warmup_epochs * iters_per_epoch

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["online"])
        target.load_state_dict(ckpt["target"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world}, global batch {args.batch_size * world}, lr {lr:.3f}")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        target.train()
        loss_sum = torch.zeros(1, device=device)
        t0 = time.time()
        for i, ((v1, v2), _) in enumerate(loader):
            it = epoch * iters_per_epoch + i
            if it < warmup_iters:
                cur_lr = lr * it / warmup_iters
            else:
                cur_lr = lr * 0.5 * (1 + math.cos(math.pi * (it - warmup_iters) / (total_iters - warmup_iters)))
            for g in optimizer.param_groups:
                g["lr"] = cur_lr
            m = 1 - (1 - args.base_momentum) * (math.cos(math.pi * it / total_iters) + 1) / 2

            v1 = v1.to(device, non_blocking=True)
            v2 = v2.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                views = torch.cat([v1, v2])
                p = model(views)
                with torch.no_grad():
                    z = target(views)
                p1, p2 = p.float().chunk(2)
                z1, z2 = z.float().chunk(2)
                loss = regression_loss(p1, z2) + regression_loss(p2, z1)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            update_target(model, target, m)
            loss_sum += loss.detach()

            if i % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} [{i}/{iters_per_epoch}] loss {l.item():.4f} lr {cur_lr:.4f} "
                          f"m {m:.5f} {(time.time() - t0) / (i + 1):.3f}s/it", flush=True)

        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"epoch {epoch} mean loss {loss_sum.item() / iters_per_epoch:.4f}")
            torch.save({"online": model.module.state_dict(), "target": target.state_dict(),
                        "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "checkpoint.pth"))
            if (epoch + 1) % 50 == 0:
                torch.save(model.module.backbone.state_dict(), os.path.join(args.out, f"backbone_ep{epoch + 1}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
