#!/usr/bin/env python
# MoCo v3 self-supervised pretraining of ViT-S/16 on ImageNet-1k.
#
#   torchrun --nproc_per_node=8 07_mocov3_vit.py -a vit_small_patch16_224 --batch-size 128 \
#       --epochs 300 --warmup-epochs 40 --stop-grad-conv1 /datasets/imagenet
import argparse
import math
import os
import shutil
import time
from functools import partial

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.datasets as datasets
import torchvision.transforms as transforms
from PIL import ImageFilter, ImageOps
import random

parser = argparse.ArgumentParser(description="MoCo v3 ImageNet pre-training")
parser.add_argument("data", metavar="DIR")
parser.add_argument("-a", "--arch", default="vit_small_patch16_224")
parser.add_argument("-j", "--workers", default=10, type=int)
parser.add_argument("--epochs", default=300, type=int)
parser.add_argument("-b", "--batch-size", default=128, type=int, help="mini-batch size on each GPU")
parser.add_argument("--lr", "--learning-rate", default=1.5e-4, type=float, dest="lr",
                    help="base learning rate, scaled as lr * batch / 256")
parser.add_argument("--wd", "--weight-decay", default=0.1, type=float, dest="weight_decay")
parser.add_argument("--warmup-epochs", default=40, type=int)
parser.add_argument("--moco-dim", default=256, type=int)
parser.add_argument("--moco-mlp-dim", default=4096, type=int)
parser.add_argument("--moco-m", default=0.99, type=float)
parser.add_argument("--moco-t", default=0.2, type=float)
parser.add_argument("--stop-grad-conv1", action="store_true")
parser.add_argument("--resume", default="", type=str)
parser.add_argument("--output-dir", default="./mocov3_out")
parser.add_argument("--print-freq", default=50, type=int)


class GaussianBlur:
    def __init__(self, sigma=(0.1, 2.0)):
        self.sigma = sigma

    def __call__(self, x):
        return x.filter(ImageFilter.GaussianBlur(radius=random.uniform(*self.sigma)))


class Solarize:
    def __call__(self, x):
        return ImageOps.solarize(x)


class TwoCropsTransform:
    def __init__(self, t1, t2):
        self.t1, self.t2 = t1, t2

    def __call__(self, x):
        return [self.t1(x), self.t2(x)]


def build_mlp(num_layers, input_dim, mlp_dim, output_dim, last_bn=True):
    layers = []
    for l in range(num_layers):
        dim1 = input_dim if l == 0 else mlp_dim
        dim2 = output_dim if l == num_layers - 1 else mlp_dim
        layers.append(nn.Linear(dim1, dim2, bias=False))
        if l < num_layers - 1:
            layers.append(nn.BatchNorm1d(dim2))
            layers.append(nn.ReLU(inplace=True))
        elif last_bn:
            layers.append(nn.BatchNorm1d(dim2, affine=False))
    return nn.Sequential(*layers)


@torch.no_grad()
def concat_all_gather(tensor):
    tensors_gather = [torch.ones_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(tensors_gather, tensor, async_op=False)
    return torch.cat(tensors_gather, dim=0)


class MoCoViT(nn.Module):
    def __init__(self, arch, dim, mlp_dim, T, stop_grad_conv1):
        super().__init__()
        self.T = T
        self.base_encoder = timm.create_model(arch, num_classes=0, drop_path_rate=0.0)
        self.momentum_encoder = timm.create_model(arch, num_classes=0, drop_path_rate=0.0)
        hidden = self.base_encoder.num_features
        self.base_encoder.head = build_mlp(3, hidden, mlp_dim, dim)
        self.momentum_encoder.head = build_mlp(3, hidden, mlp_dim, dim)
        self.predictor = build_mlp(2, dim, mlp_dim, dim, last_bn=False)
        if stop_grad_conv1:
            self.base_encoder.patch_embed.proj.weight.requires_grad = False
            self.base_encoder.patch_embed.proj.bias.requires_grad = False
        for p_b, p_m in zip(self.base_encoder.parameters(), self.momentum_encoder.parameters()):
            p_m.data.copy_(p_b.data)
            p_m.requires_grad = False

    @torch.no_grad()
    def _update_momentum_encoder(self, m):
        for p_b, p_m in zip(self.base_encoder.parameters(), self.momentum_encoder.parameters()):
            p_m.data.mul_(m).add_(p_b.data, alpha=1.0 - m)

    def contrastive_loss(self, q, k):
        q = nn.functional.normalize(q, dim=1)
        k = nn.functional.normalize(k, dim=1)
        k = concat_all_gather(k)
        logits = torch.einsum("nc,mc->nm", [q, k]) / self.T
        N = logits.shape[0]
        labels = (torch.arange(N, dtype=torch.long) + N * dist.get_rank()).cuda()
        return nn.functional.cross_entropy(logits, labels) * (2 * self.T)

    def forward(self, x1, x2, m):
        q1 = self.predictor(self.base_encoder(x1))
        q2 = self.predictor(self.base_encoder(x2))
        with torch.no_grad():
            self._update_momentum_encoder(m)
            k1 = self.momentum_encoder(x1)
            k2 = self.momentum_encoder(x2)
        return self.contrastive_loss(q1, k2) + self.contrastive_loss(q2, k1)


def adjust_learning_rate(optimizer, epoch, args):
    if epoch < args.warmup_epochs:
        lr = args.lr * epoch / args.warmup_epochs
    else:
        lr = args.lr * 0.5 * (1.0 + math.cos(math.pi * (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    return lr


def adjust_moco_momentum(epoch, args):
    return 1.0 - 0.5 * (1.0 + math.cos(math.pi * epoch / args.epochs)) * (1.0 - args.moco_m)


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()

    model = MoCoViT(args.arch, args.moco_dim, args.moco_mlp_dim, args.moco_t, args.stop_grad_conv1)
    args.lr = args.lr * args.batch_size / 256
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda(local_rank)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), args.lr, weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if args.resume and os.path.isfile(args.resume):
        checkpoint = torch.load(args.resume, map_location=f"cuda:{local_rank}")
        start_epoch = checkpoint["epoch"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        if rank == 0:
            print(f"=> resumed '{args.resume}' (epoch {start_epoch})")

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    aug1 = [transforms.RandomResizedCrop(224, scale=(0.08, 1.0)),
            transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
            transforms.RandomGrayscale(p=0.2), transforms.RandomApply([GaussianBlur()], p=1.0),
            transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]
    aug2 = [transforms.RandomResizedCrop(224, scale=(0.08, 1.0)),
            transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
            transforms.RandomGrayscale(p=0.2), transforms.RandomApply([GaussianBlur()], p=0.1),
            transforms.RandomApply([Solarize()], p=0.2),
            transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]
    train_dataset = datasets.ImageFolder(os.path.join(args.data, "train"),
                                         TwoCropsTransform(transforms.Compose(aug1), transforms.Compose(aug2)))
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
        pin_memory=True, sampler=train_sampler, drop_last=True, persistent_workers=True)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    iters_per_epoch = len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        end = time.time()
        for i, (images, _) in enumerate(train_loader):
            lr = adjust_learning_rate(optimizer, epoch + i / iters_per_epoch, args)
            moco_m = adjust_moco_momentum(epoch + i / iters_per_epoch, args)
            x1 = images[0].cuda(local_rank, non_blocking=True)
            x2 = images[1].cuda(local_rank, non_blocking=True)
            with torch.cuda.amp.autocast(True):
                loss = model(x1, x2, moco_m)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if i % args.print_freq == 0 and rank == 0:
                print(f"Epoch [{epoch}][{i}/{iters_per_epoch}] loss {loss.item():.4f} lr {lr:.3e} "
                      f"m {moco_m:.4f} time {time.time() - end:.2f}", flush=True)
            end = time.time()

        if rank == 0:
            state = {"epoch": epoch + 1, "arch": args.arch, "state_dict": model.state_dict(),
                     "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}
            path = os.path.join(args.output_dir, "checkpoint_last.pth.tar")
            torch.save(state, path)
            if (epoch + 1) % 50 == 0:
                shutil.copyfile(path, os.path.join(args.output_dir, f"checkpoint_{epoch + 1:04d}.pth.tar"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
