#!/usr/bin/env python
# DANN (Ganin & Lempitsky) on Office-31 with a ResNet-50 backbone.
# Source-only warm-up for a few epochs, then adversarial alignment.
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.autograd import Function
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.datasets import ImageFolder


def parse_args():
    parser = argparse.ArgumentParser(description="DANN Office-31")
    parser.add_argument("--root", default="/datasets/office31")
    parser.add_argument("--source", default="amazon")
    parser.add_argument("--target", default="webcam")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--warmup-epochs", type=int, default=3,
                        help="source-only epochs before the domain loss is switched on")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--trade-off", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", default="checkpoints/dann")
    return parser.parse_args()


class GradReverse(Function):
    @staticmethod
    def forward(ctx, x, coeff):
        ctx.coeff = coeff
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.neg() * ctx.coeff, None


class DANN(nn.Module):
    def __init__(self, num_classes, bottleneck_dim=256):
        super().__init__()
        backbone = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.bottleneck = nn.Sequential(nn.Linear(2048, bottleneck_dim),
                                        nn.BatchNorm1d(bottleneck_dim), nn.ReLU())
        self.head = nn.Linear(bottleneck_dim, num_classes)
        self.domain_discriminator = nn.Sequential(
            nn.Linear(bottleneck_dim, 1024), nn.BatchNorm1d(1024), nn.ReLU(),
            nn.Linear(1024, 1024), nn.BatchNorm1d(1024), nn.ReLU(),
            nn.Linear(1024, 1))

    def forward(self, x, coeff=1.0):
        f = self.bottleneck(self.backbone(x))
        logits = self.head(f)
        d = self.domain_discriminator(GradReverse.apply(f, coeff))
        return logits, d

    def param_groups(self, lr):
        return [
            {"params": self.backbone.parameters(), "lr": 0.1 * lr},
            {"params": self.bottleneck.parameters(), "lr": lr},
            {"params": self.head.parameters(), "lr": lr},
            {"params": self.domain_discriminator.parameters(), "lr": lr},
        ]


def build_transforms():
    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.Resize(256), transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize])
    test_tf = transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize])
    return train_tf, test_tf


def grl_coeff(progress, high=1.0, alpha=10.0):
    return float(2.0 * high / (1.0 + np.exp(-alpha * progress)) - high)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    count = torch.zeros(1, device=device)
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        logits, _ = model(images)
        correct += (logits.argmax(1) == labels).sum()
        count += labels.size(0)
    dist.all_reduce(correct)
    dist.all_reduce(count)
    return 100.0 * (correct / count).item()


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = dist.get_rank()
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    train_tf, test_tf = build_transforms()
    source = ImageFolder(os.path.join(args.root, args.source, "images"), transform=train_tf)
    target = ImageFolder(os.path.join(args.root, args.target, "images"), transform=train_tf)
    target_test = ImageFolder(os.path.join(args.root, args.target, "images"), transform=test_tf)
    assert source.classes == target.classes
    num_classes = len(source.classes)

    src_sampler = DistributedSampler(source, shuffle=True, drop_last=True)
    tgt_sampler = DistributedSampler(target, shuffle=True, drop_last=True)
    src_loader = DataLoader(source, batch_size=args.batch_size, sampler=src_sampler,
                            num_workers=args.workers, pin_memory=True, drop_last=True)
    tgt_loader = DataLoader(target, batch_size=args.batch_size, sampler=tgt_sampler,
                            num_workers=args.workers, pin_memory=True, drop_last=True)
    # strided shard without padding so every target image is counted exactly once
    test_shard = Subset(target_test, list(range(rank, len(target_test), dist.get_world_size())))
    test_loader = DataLoader(test_shard, batch_size=64, shuffle=False, num_workers=args.workers)

    model = DANN(num_classes).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = torch.optim.SGD(model.param_groups(args.lr), lr=args.lr, momentum=0.9,
                                weight_decay=1e-3, nesterov=True)
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    model = DistributedDataParallel(model, device_ids=[local_rank])

    iters_per_epoch = max(len(src_loader), len(tgt_loader))
    total_iters = args.epochs * iters_per_epoch
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"{args.source}->{args.target}: {len(source)} src / {len(target)} tgt, "
              f"{iters_per_epoch} it/epoch", flush=True)

    best = 0.0
    global_it = 0
    for epoch in range(args.epochs):
        src_sampler.set_epoch(epoch)
        tgt_sampler.set_epoch(epoch)
        src_iter, tgt_iter = iter(src_loader), iter(tgt_loader)
        model.train()
        adapt = epoch >= args.warmup_epochs
        tic = time.time()
        for it in range(iters_per_epoch):
            try:
                xs, ys = next(src_iter)
            except StopIteration:
                src_iter = iter(src_loader)
                xs, ys = next(src_iter)
            try:
                xt, _ = next(tgt_iter)
            except StopIteration:
                tgt_iter = iter(tgt_loader)
                xt, _ = next(tgt_iter)
            xs, ys, xt = xs.to(device, non_blocking=True), ys.to(device), xt.to(device, non_blocking=True)

            # inverse-decay learning-rate annealing from the DANN paper
            progress = global_it / total_iters
            for g, base_lr in zip(optimizer.param_groups, base_lrs):
                g["lr"] = base_lr * (1 + 10 * progress) ** (-0.75)

            coeff = grl_coeff(progress)
            logits, d_logits = model(torch.cat([xs, xt]), coeff)
            logits_s = logits[: xs.size(0)]
            cls_loss = F.cross_entropy(logits_s, ys)
            loss = cls_loss
            if adapt:
                d_labels = torch.cat([torch.ones(xs.size(0), 1), torch.zeros(xt.size(0), 1)]).to(device)
                domain_loss = F.binary_cross_entropy_with_logits(d_logits, d_labels)
                loss = loss + args.trade_off * domain_loss
            else:
                domain_loss = torch.zeros((), device=device)

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            global_it += 1

            if rank == 0 and it % 50 == 0:
                d_acc = ((d_logits > 0).float() == torch.cat(
                    [torch.ones(xs.size(0), 1), torch.zeros(xt.size(0), 1)]).to(device)).float().mean()
                print(f"[{epoch}][{it}/{iters_per_epoch}] cls {cls_loss.item():.4f} "
                      f"dom {domain_loss.item():.4f} d_acc {d_acc.item():.3f} coeff {coeff:.3f}",
                      flush=True)

        acc = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: target acc {acc:.2f} ({time.time() - tic:.0f}s)", flush=True)
            ckpt = {"epoch": epoch, "state_dict": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(), "acc": acc}
            torch.save(ckpt, os.path.join(args.save_dir, "latest.pth"))
            if acc > best:
                best = acc
                torch.save(ckpt, os.path.join(args.save_dir, "best.pth"))
    if rank == 0:
        print(f"best target acc {best:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
