#!/usr/bin/env python
"""MoCo v3 (ResNet-50) pre-training with LARS and a cosine momentum schedule.

torchrun --nnodes=1 --nproc_per_node=8 04_moco_v3_resnet_lars.py \
    --data /datasets/imagenet/train --batch-size 4096 --epochs 100 --out ckpt/mocov3_r50
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
import torchvision
import torchvision.transforms as T
from PIL import ImageFilter, ImageOps
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
import wandb


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="ckpt/mocov3")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--warmup-epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=4096, help="global batch size")
    p.add_argument("--lr", type=float, default=0.6, help="base lr for batch 256")
    p.add_argument("--wd", type=float, default=1e-6)
    p.add_argument("--moco-m", type=float, default=0.99)
    p.add_argument("--moco-t", type=float, default=1.0)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--mlp-dim", type=int, default=4096)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--resume", default="")
    p.add_argument("--wandb-project", default="mocov3")
    return p.parse_args()


class LARS(torch.optim.Optimizer):
    """LARS; biases and norm parameters are in a group with lars_exclude=True."""

    def __init__(self, params, lr=0, weight_decay=0, momentum=0.9, trust_coefficient=0.001):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                                      trust_coefficient=trust_coefficient, lars_exclude=False))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                dp = p.grad
                if dp is None:
                    continue
                if not g["lars_exclude"]:
                    dp = dp.add(p, alpha=g["weight_decay"])
                    param_norm, update_norm = torch.norm(p), torch.norm(dp)
                    one = torch.ones_like(param_norm)
                    q = torch.where(param_norm > 0.0,
                                    torch.where(update_norm > 0, g["trust_coefficient"] * param_norm / update_norm, one),
                                    one)
                    dp = dp.mul(q)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                mu = state["mu"]
                mu.mul_(g["momentum"]).add_(dp)
                p.add_(mu, alpha=-g["lr"])


def build_mlp(num_layers, in_dim, mlp_dim, out_dim, last_bn=True):
    layers = []
    for l in range(num_layers):
        d1 = in_dim if l == 0 else mlp_dim
        d2 = out_dim if l == num_layers - 1 else mlp_dim
        layers.append(nn.Linear(d1, d2, bias=False))
        if l < num_layers - 1:
            layers += [nn.BatchNorm1d(d2), nn.ReLU(inplace=True)]
        elif last_bn:
            layers.append(nn.BatchNorm1d(d2, affine=False))
    return nn.Sequential(*layers)


@torch.no_grad()
def concat_all_gather(t):
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out, 0)


class MoCoV3(nn.Module):
    def __init__(self, dim=256, mlp_dim=4096, T=1.0):
        super().__init__()
        self.T = T
        self.base_encoder = self._backbone(dim, mlp_dim)
        self.momentum_encoder = self._backbone(dim, mlp_dim)
        self.predictor = build_mlp(2, dim, mlp_dim, dim, last_bn=False)
        for p_b, p_m in zip(self.base_encoder.parameters(), self.momentum_encoder.parameters()):
            p_m.data.copy_(p_b.data)
            p_m.requires_grad = False

    @staticmethod
    def _backbone(dim, mlp_dim):
        net = torchvision.models.resnet50(zero_init_residual=True)
        hidden = net.fc.weight.shape[1]
        net.fc = build_mlp(2, hidden, mlp_dim, dim)
        return net

    @torch.no_grad()
    def update_momentum_encoder(self, m):
        for p_b, p_m in zip(self.base_encoder.parameters(), self.momentum_encoder.parameters()):
            p_m.data.mul_(m).add_(p_b.data, alpha=1.0 - m)

    def contrastive_loss(self, q, k):
        q = F.normalize(q, dim=1)
        k = F.normalize(k, dim=1)
        k = concat_all_gather(k)
        logits = torch.einsum("nc,mc->nm", q, k) / self.T
        n = logits.shape[0]
        labels = torch.arange(n, dtype=torch.long, device=q.device) + n * dist.get_rank()
        return F.cross_entropy(logits, labels) * (2 * self.T)

    def forward(self, x1, x2):
        q1 = self.predictor(self.base_encoder(x1))
        q2 = self.predictor(self.base_encoder(x2))
        with torch.no_grad():
            k1 = self.momentum_encoder(x1)
            k2 = self.momentum_encoder(x2)
        return self.contrastive_loss(q1, k2) + self.contrastive_loss(q2, k1)


class GaussianBlur:
    def __init__(self, sigma=(0.1, 2.0)):
        self.sigma = sigma

    def __call__(self, x):
        return x.filter(ImageFilter.GaussianBlur(radius=random.uniform(*self.sigma)))


class Solarize:
    def __call__(self, x):
        return ImageOps.solarize(x)


class TwoCrops:
    def __init__(self, t1, t2):
        self.t1, self.t2 = t1, t2

    def __call__(self, x):
        return [self.t1(x), self.t2(x)]


def build_transforms():
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    common = [T.RandomResizedCrop(224, scale=(0.08, 1.0)),
              T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
              T.RandomGrayscale(p=0.2)]
    aug1 = T.Compose(common + [T.RandomApply([GaussianBlur()], p=1.0), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    aug2 = T.Compose(common + [T.RandomApply([GaussianBlur()], p=0.1), T.RandomApply([Solarize()], p=0.2),
                               T.RandomHorizontalFlip(), T.ToTensor(), norm])
    return TwoCrops(aug1, aug2)


def lr_at(epoch_float, args):
    lr = args.lr * args.batch_size / 256
    if epoch_float < args.warmup_epochs:
        return lr * epoch_float / args.warmup_epochs
    return lr * 0.5 * (1.0 + math.cos(math.pi * (epoch_float - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))


def momentum_at(epoch_float, args):
    return 1.0 - 0.5 * (1.0 + math.cos(math.pi * epoch_float / args.epochs)) * (1.0 - args.moco_m)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0

    model = MoCoV3(args.dim, args.mlp_dim, args.moco_t)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim == 1 else decay).append(p)
    optimizer = LARS([{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lars_exclude": True}],
                     lr=0.0, weight_decay=args.wd)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"]

    dataset = torchvision.datasets.ImageFolder(args.data, build_transforms())
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size // world_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)

    if is_main:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project=args.wandb_project, config=vars(args), dir=args.out)

    iters_per_epoch = len(loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device="cuda")
        for i, (images, _) in enumerate(loader):
            ep = epoch + i / iters_per_epoch
            lr = lr_at(ep, args)
            for g in optimizer.param_groups:
                g["lr"] = lr
            m = momentum_at(ep, args)

            x1 = images[0].cuda(non_blocking=True)
            x2 = images[1].cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x1, x2)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            model.update_momentum_encoder(m)

            loss_acc[0] += loss.detach()
            loss_acc[1] += 1
            if is_main and i % 50 == 0:
                wandb.log({"loss": loss.item(), "lr": lr, "moco_m": m}, step=epoch * iters_per_epoch + i)

        dist.all_reduce(loss_acc)
        if is_main:
            avg = (loss_acc[0] / loss_acc[1]).item()
            print(f"epoch {epoch}: loss {avg:.4f} ({time.time() - t0:.0f}s)", flush=True)
            wandb.log({"epoch_loss": avg, "epoch": epoch})
            torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict()}, os.path.join(args.out, "checkpoint.pth.tar"))

    if is_main:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
