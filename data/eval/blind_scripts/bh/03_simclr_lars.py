"""SimCLR pre-training (ResNet-50, NT-Xent with negatives from all GPUs, LARS).

    torchrun --nproc_per_node=8 03_simclr_lars.py --data /datasets/imagenet --batch-size 512
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

logger = logging.getLogger("simclr")


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=str, required=True)
    parser.add_argument("--out", type=str, default="runs/simclr_r50")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--warmup-epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=512, help="images per GPU")
    parser.add_argument("--base-lr", type=float, default=0.3)
    parser.add_argument("--weight-decay", type=float, default=1e-6)
    parser.add_argument("--temperature", type=float, default=0.1)
    parser.add_argument("--proj-dim", type=int, default=128)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--resume", type=str, default=None)
    return parser.parse_args()


def setup_logging(rank, out):
    level = logging.INFO if rank == 0 else logging.WARNING
    handlers = [logging.StreamHandler()]
    if rank == 0:
        handlers.append(logging.FileHandler(os.path.join(out, "train.log")))
    logging.basicConfig(level=level, format="%(asctime)s %(message)s", handlers=handlers)


class ContrastiveViews:
    def __init__(self, size=224, s=1.0):
        color_jitter = transforms.ColorJitter(0.8 * s, 0.8 * s, 0.8 * s, 0.2 * s)
        self.transform = transforms.Compose([
            transforms.RandomResizedCrop(size, scale=(0.08, 1.0)),
            transforms.RandomHorizontalFlip(),
            transforms.RandomApply([color_jitter], p=0.8),
            transforms.RandomGrayscale(p=0.2),
            transforms.RandomApply([transforms.GaussianBlur(23, sigma=(0.1, 2.0))], p=0.5),
            transforms.ToTensor(),
        ])

    def __call__(self, x):
        return self.transform(x), self.transform(x)


class SimCLR(nn.Module):
    def __init__(self, proj_dim=128):
        super().__init__()
        self.encoder = torchvision.models.resnet50()
        feat_dim = self.encoder.fc.in_features
        self.encoder.fc = nn.Identity()
        self.projector = nn.Sequential(
            nn.Linear(feat_dim, feat_dim, bias=False),
            nn.BatchNorm1d(feat_dim),
            nn.ReLU(inplace=True),
            nn.Linear(feat_dim, feat_dim, bias=False),
            nn.BatchNorm1d(feat_dim),
            nn.ReLU(inplace=True),
            nn.Linear(feat_dim, proj_dim, bias=False),
            nn.BatchNorm1d(proj_dim, affine=False),
        )

    def forward(self, x):
        return self.projector(self.encoder(x))


class GatherLayer(torch.autograd.Function):
    """all_gather that keeps the gradient path to the local shard."""

    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        all_grads = torch.stack(grads)
        dist.all_reduce(all_grads)
        return all_grads[dist.get_rank()]


def nt_xent(z1, z2, temperature):
    z1 = F.normalize(z1.float(), dim=1)
    z2 = F.normalize(z2.float(), dim=1)
    z1_all = torch.cat(GatherLayer.apply(z1), dim=0)
    z2_all = torch.cat(GatherLayer.apply(z2), dim=0)
    n = z1.size(0)
    labels = torch.arange(n, device=z1.device) + dist.get_rank() * n
    self_mask = F.one_hot(labels, z1_all.size(0)).bool()

    logits_ab = z1 @ z2_all.t() / temperature
    logits_aa = (z1 @ z1_all.t() / temperature).masked_fill(self_mask, float("-inf"))
    logits_ba = z2 @ z1_all.t() / temperature
    logits_bb = (z2 @ z2_all.t() / temperature).masked_fill(self_mask, float("-inf"))

    loss_a = F.cross_entropy(torch.cat([logits_ab, logits_aa], dim=1), labels)
    loss_b = F.cross_entropy(torch.cat([logits_ba, logits_bb], dim=1), labels)
    return 0.5 * (loss_a + loss_b)


class LARS(torch.optim.Optimizer):
    def __init__(self, params, lr, weight_decay=0.0, momentum=0.9, trust_coefficient=0.001):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                        trust_coefficient=trust_coefficient, lars_exclude=False)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                dp = p.grad
                if not g["lars_exclude"]:
                    dp = dp.add(p, alpha=g["weight_decay"])
                    w_norm, g_norm = torch.norm(p), torch.norm(dp)
                    trust = torch.where((w_norm > 0) & (g_norm > 0),
                                        g["trust_coefficient"] * w_norm / g_norm,
                                        torch.ones_like(w_norm))
                    dp = dp.mul(trust)
                buf = self.state[p].get("momentum_buffer")
                if buf is None:
                    buf = self.state[p]["momentum_buffer"] = torch.clone(dp).detach()
                else:
                    buf.mul_(g["momentum"]).add_(dp)
                p.add_(buf, alpha=-g["lr"])


def param_groups_lars(model, weight_decay):
    regular, excluded = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (excluded if p.ndim == 1 else regular).append(p)
    return [{"params": regular, "weight_decay": weight_decay},
            {"params": excluded, "weight_decay": 0.0, "lars_exclude": True}]


def lr_at(step, total_steps, warmup_steps, peak_lr):
    if step < warmup_steps:
        return peak_lr * step / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak_lr * 0.5 * (1.0 + np.cos(np.pi * progress))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
    dist.barrier()
    setup_logging(rank, args.out)

    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    views = ContrastiveViews()
    views.transform.transforms.append(normalize)
    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), transform=views)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True,
                        persistent_workers=True, prefetch_factor=4)

    model = SimCLR(args.proj_dim)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    peak_lr = args.base_lr * args.batch_size / 256
    optimizer = LARS(param_groups_lars(model, args.weight_decay), lr=peak_lr)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    steps_per_epoch = len(loader)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
        logger.info("resumed from %s (epoch %d)", args.resume, ckpt["epoch"])

    logger.info("world_size=%d per-gpu batch=%d peak lr=%.4f steps/epoch=%d",
                world_size, args.batch_size, peak_lr, steps_per_epoch)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        tic = time.time()
        for i, ((x1, x2), _) in enumerate(loader):
            step = epoch * steps_per_epoch + i
            lr = lr_at(step, total_steps, warmup_steps, peak_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr

            x1 = x1.to(device, non_blocking=True)
            x2 = x2.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                z = model(torch.cat([x1, x2], dim=0))
            z1, z2 = z.chunk(2)
            loss = nt_xent(z1, z2, args.temperature)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            if (i + 1) % args.log_every == 0:
                dist.all_reduce(running)
                logger.info("epoch %d step %d/%d loss %.4f lr %.5f %.1f img/s", epoch, i + 1,
                            steps_per_epoch, (running[0] / running[1]).item(), lr,
                            args.log_every * args.batch_size * world_size / (time.time() - tic))
                running.zero_()
                tic = time.time()

        if rank == 0:
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(), "epoch": epoch}
            torch.save(ckpt, os.path.join(args.out, "last.pth"))
            if (epoch + 1) % 20 == 0:
                torch.save(model.module.encoder.state_dict(),
                           os.path.join(args.out, f"encoder_ep{epoch + 1}.pth"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
