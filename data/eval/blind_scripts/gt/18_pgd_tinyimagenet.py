"""PGD adversarial training on Tiny-ImageNet-200 (64x64), PreActResNet-18, DDP.

eps = 4/255 by default (8/255 is very hard on 200 classes at this resolution).

    torchrun --nproc_per_node=4 18_pgd_tinyimagenet.py --data /data/tiny-imagenet-200 \
        --output-dir output/tin_pgd_eps4
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from models.preact_resnet import PreActResNet18

TIN_MEAN = [0.4802, 0.4481, 0.3975]
TIN_STD = [0.2302, 0.2265, 0.2262]


def get_parser():
    parser = argparse.ArgumentParser("Tiny-ImageNet PGD-AT")
    parser.add_argument("--data", type=str, required=True)
    parser.add_argument("--output-dir", type=str, default="output/tin_pgd")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64, help="per-GPU batch size")
    parser.add_argument("--lr", type=float, default=0.1, help="lr for a total batch of 256")
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--epsilon", type=float, default=4.0)
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--train-iters", type=int, default=10)
    parser.add_argument("--eval-iters", type=int, default=20)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


class Normalize(nn.Module):
    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1))

    def forward(self, x):
        return (x - self.mean) / self.std


def pgd_attack(model, images, labels, eps, alpha, iters):
    adv = images + torch.empty_like(images).uniform_(-eps, eps)
    adv = adv.clamp(0, 1).detach()
    for _ in range(iters):
        adv.requires_grad_(True)
        cost = F.cross_entropy(model(adv), labels)
        grad = torch.autograd.grad(cost, adv)[0]
        adv = adv.detach() + alpha * grad.sign()
        eta = torch.clamp(adv - images, min=-eps, max=eps)
        adv = torch.clamp(images + eta, 0, 1).detach()
    return adv


def setup_logger(output_dir, rank):
    logger = logging.getLogger("tin")
    logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    if rank == 0:
        fmt = logging.Formatter("%(asctime)s %(message)s")
        for h in (logging.StreamHandler(), logging.FileHandler(os.path.join(output_dir, "train.log"))):
            h.setFormatter(fmt)
            logger.addHandler(h)
    return logger


def evaluate(model, loader, args, device):
    model.eval()
    eps, alpha = args.epsilon / 255, args.alpha / 255
    out = torch.zeros(3, device=device)
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        adv = pgd_attack(model, images, labels, eps, alpha, args.eval_iters)
        with torch.no_grad():
            out[0] += (model(images).argmax(1) == labels).sum()
            out[1] += (model(adv).argmax(1) == labels).sum()
        out[2] += labels.numel()
    dist.all_reduce(out)
    return (out[0] / out[2]).item(), (out[1] / out[2]).item()


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    dist.barrier()
    logger = setup_logger(args.output_dir, rank)
    logger.info("world size %d, args %s", world_size, vars(args))

    train_tf = transforms.Compose([
        transforms.RandomCrop(64, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
    ])
    # val/ has been rearranged into class folders (val/<wnid>/images/*.JPEG)
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.ToTensor())
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=128, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = nn.Sequential(Normalize(TIN_MEAN, TIN_STD), PreActResNet18(num_classes=200)).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    lr = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    eps, alpha = args.epsilon / 255, args.alpha / 255

    best_adv = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        totals = torch.zeros(3, device=device)
        for step, (images, labels) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            adv = pgd_attack(model, images, labels, eps, alpha, args.train_iters)
            logits = model(adv)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            totals[0] += loss.detach() * labels.numel()
            totals[1] += (logits.argmax(1) == labels).sum()
            totals[2] += labels.numel()
            if step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_loader), loss.item())
        scheduler.step()
        dist.all_reduce(totals)

        clean_acc, adv_acc = evaluate(model, val_loader, args, device)
        logger.info("epoch %d | %.0fs | train loss %.4f acc %.4f | val clean %.4f PGD-%d %.4f",
                    epoch, time.time() - start, (totals[0] / totals[2]).item(),
                    (totals[1] / totals[2]).item(), clean_acc, args.eval_iters, adv_acc)

        if rank == 0:
            torch.save({"epoch": epoch + 1, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                       os.path.join(args.output_dir, "checkpoint.pth"))
            if adv_acc > best_adv:
                best_adv = adv_acc
                torch.save(model.module.state_dict(), os.path.join(args.output_dir, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
