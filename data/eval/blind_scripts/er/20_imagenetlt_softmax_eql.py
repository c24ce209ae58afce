"""Softmax Equalization Loss (Tan et al., CVPR 2020, Sec. 5 "image classification")
on ImageNet-LT with ResNet-50.

For a sample of class j, the negative logits of tail classes k (frequency f_k < lambda)
are dropped from the softmax denominator with probability 1 - gamma.

    torchrun --nproc_per_node=8 imagenetlt_softmax_eql.py --data /data/imagenet \
        --lists /data/ImageNet_LT --lambda-thr 1.76e-3 --gamma 0.9
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.models as models
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
import torchvision.transforms as transforms


def get_parser():
    parser = argparse.ArgumentParser(description="ImageNet-LT softmax EQL")
    parser.add_argument("--data", default="/data/imagenet")
    parser.add_argument("--lists", default="/data/ImageNet_LT")
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("-b", "--batch-size", type=int, default=64, help="mini-batch size per process")
    parser.add_argument("--lr", type=float, default=0.1, help="lr for a total batch of 256")
    parser.add_argument("--wd", type=float, default=5e-4)
    parser.add_argument("--lambda-thr", type=float, default=1.76e-3)
    parser.add_argument("--gamma", type=float, default=0.9)
    parser.add_argument("-j", "--workers", type=int, default=8)
    parser.add_argument("--print-freq", type=int, default=100)
    parser.add_argument("--save-dir", default="./checkpoints/eql_r50")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


class ImageNetLT(Dataset):
    def __init__(self, root, txt, transform):
        self.root, self.transform = root, transform
        self.samples = []
        with open(txt) as f:
            for line in f:
                path, label = line.strip().split()
                self.samples.append((path, int(label)))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        path, label = self.samples[idx]
        img = Image.open(os.path.join(self.root, path)).convert("RGB")
        return self.transform(img), label


class SoftmaxEQL(nn.Module):
    def __init__(self, class_freq, lambda_thr, gamma):
        super().__init__()
        self.register_buffer("is_tail", torch.as_tensor(class_freq < lambda_thr))
        self.gamma = gamma

    def forward(self, logits, target):
        n, c = logits.shape
        onehot = F.one_hot(target, c).bool()
        # beta = 1 with probability gamma: keep the negative logit, else drop it
        keep = torch.rand(n, c, device=logits.device) < self.gamma
        drop = (~keep) & self.is_tail.unsqueeze(0) & (~onehot)
        logits = logits.masked_fill(drop, float("-inf"))
        return F.cross_entropy(logits, target)


@torch.no_grad()
def validate(model, loader, train_counts, device):
    model.eval()
    num_classes = len(train_counts)
    correct = torch.zeros(num_classes, device=device)
    total = torch.zeros(num_classes, device=device)
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        pred = model(images).argmax(1)
        total += torch.bincount(target, minlength=num_classes)
        correct += torch.bincount(target, weights=(pred == target).float(), minlength=num_classes)
    dist.all_reduce(correct)
    dist.all_reduce(total)
    acc = (correct / total.clamp(min=1)).cpu().numpy()
    return (correct.sum() / total.sum()).item() * 100, acc[train_counts > 100].mean() * 100, \
        acc[(train_counts <= 100) & (train_counts >= 20)].mean() * 100, acc[train_counts < 20].mean() * 100


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.backends.cudnn.benchmark = True

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_dataset = ImageNetLT(args.data, os.path.join(args.lists, "ImageNet_LT_train.txt"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.4, 0.4, 0.4), transforms.ToTensor(), normalize]))
    val_dataset = ImageNetLT(args.data, os.path.join(args.lists, "ImageNet_LT_test.txt"), transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize]))
    train_counts = np.bincount([y for _, y in train_dataset.samples], minlength=1000)
    class_freq = train_counts / train_counts.sum()

    train_sampler = DistributedSampler(train_dataset)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_indices = list(range(rank, len(val_dataset), world_size))
    val_loader = DataLoader(torch.utils.data.Subset(val_dataset, val_indices), batch_size=200,
                            num_workers=args.workers, pin_memory=True)

    model = models.__dict__[args.arch](num_classes=1000).to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)
    criterion = SoftmaxEQL(class_freq, args.lambda_thr, args.gamma).to(device)
    lr = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    writer = SummaryWriter(args.save_dir) if rank == 0 else None
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        end = time.time()
        for i, (images, target) in enumerate(train_loader):
            images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
            loss = criterion(model(images), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 0 and i % args.print_freq == 0:
                print(f"Epoch [{epoch}][{i}/{len(train_loader)}] loss {loss.item():.4f} "
                      f"time {time.time() - end:.1f}s", flush=True)
                writer.add_scalar("train/loss", loss.item(), epoch * len(train_loader) + i)
        scheduler.step()

        top1, many, med, few = validate(model.module, val_loader, train_counts, device)
        if rank == 0:
            print(f" * Epoch {epoch}: Acc@1 {top1:.2f} Many {many:.2f} Medium {med:.2f} Few {few:.2f}", flush=True)
            writer.add_scalars("val", {"top1": top1, "many": many, "medium": med, "few": few}, epoch)
            state = {"epoch": epoch + 1, "arch": args.arch, "state_dict": model.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "best_acc": max(best_acc, top1)}
            os.makedirs(args.save_dir, exist_ok=True)
            torch.save(state, os.path.join(args.save_dir, "checkpoint.pth.tar"))
            if top1 > best_acc:
                best_acc = top1
                torch.save(state, os.path.join(args.save_dir, "model_best.pth.tar"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
