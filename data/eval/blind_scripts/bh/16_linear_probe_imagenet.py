#!/usr/bin/env python
"""ImageNet linear classification on top of a frozen self-supervised ResNet-50.

Large-batch protocol: LARS, batch 4096 (512 per GPU on 8 GPUs), 90 epochs, warm-up + cosine.

    torchrun --nproc_per_node=8 16_linear_probe_imagenet.py /data/imagenet \
        --pretrained moco_v3_r50/checkpoint_0099.pth.tar --batch-size 512
"""
import argparse
import math
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms

parser = argparse.ArgumentParser(description="Linear probe")
parser.add_argument("data", metavar="DIR")
parser.add_argument("-a", "--arch", default="resnet50")
parser.add_argument("--pretrained", required=True, type=str)
parser.add_argument("-j", "--workers", default=12, type=int)
parser.add_argument("--epochs", default=90, type=int)
parser.add_argument("--warmup-epochs", default=10, type=int)
parser.add_argument("-b", "--batch-size", default=512, type=int, help="per-GPU batch size")
parser.add_argument("--lr", default=0.1, type=float, help="base lr, scaled by total batch / 256")
parser.add_argument("--wd", default=0.0, type=float)
parser.add_argument("-p", "--print-freq", default=50, type=int)
parser.add_argument("--output-dir", default="lincls_out")


class AverageMeter:
    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n

    @property
    def avg(self):
        return self.sum / max(1, self.count)


class LARS(torch.optim.Optimizer):
    def __init__(self, params, lr=0, weight_decay=0, momentum=0.9, trust_coefficient=0.001):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                                      trust_coefficient=trust_coefficient))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                dp = p.grad
                if dp is None:
                    continue
                if p.ndim > 1:
                    dp = dp.add(p, alpha=g["weight_decay"])
                    param_norm, update_norm = torch.norm(p), torch.norm(dp)
                    one = torch.ones_like(param_norm)
                    q = torch.where(param_norm > 0.,
                                    torch.where(update_norm > 0, g["trust_coefficient"] * param_norm / update_norm, one),
                                    one)
                    dp = dp.mul(q)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                state["mu"].mul_(g["momentum"]).add_(dp)
                p.add_(state["mu"], alpha=-g["lr"])


def load_pretrained(model, path):
    checkpoint = torch.load(path, map_location="cpu")
    state_dict = checkpoint["state_dict"]
    for k in list(state_dict.keys()):
        # keep only the query/base encoder, drop its projection head
        if k.startswith("module.base_encoder") and not k.startswith("module.base_encoder.fc"):
            state_dict[k[len("module.base_encoder."):]] = state_dict[k]
        elif k.startswith("base_encoder") and not k.startswith("base_encoder.fc"):
            state_dict[k[len("base_encoder."):]] = state_dict[k]
        del state_dict[k]
    msg = model.load_state_dict(state_dict, strict=False)
    assert set(msg.missing_keys) == {"fc.weight", "fc.bias"}, msg.missing_keys


def accuracy(output, target, topk=(1,)):
    with torch.no_grad():
        maxk = max(topk)
        _, pred = output.topk(maxk, 1, True, True)
        correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
        return [correct[:k].reshape(-1).float().sum(0) * 100.0 / target.size(0) for k in topk]


def adjust_learning_rate(optimizer, epoch, args):
    if epoch < args.warmup_epochs:
        lr = args.lr * epoch / args.warmup_epochs
    else:
        lr = args.lr * 0.5 * (1. + math.cos(math.pi * (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def train(loader, model, criterion, optimizer, epoch, args):
    # the frozen backbone keeps its BN statistics: eval mode for the whole network
    model.eval()
    n = len(loader)
    end = time.time()
    for i, (images, target) in enumerate(loader):
        lr = adjust_learning_rate(optimizer, epoch + i / n, args)
        images = images.cuda(args.gpu, non_blocking=True)
        target = target.cuda(args.gpu, non_blocking=True)
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if i % args.print_freq == 0 and args.rank == 0:
            print(f"Epoch [{epoch}][{i}/{n}] loss {loss.item():.4f} lr {lr:.4f} {time.time() - end:.2f}s")
        end = time.time()


def validate(loader, model, criterion, args):
    top1, top5, losses = AverageMeter(), AverageMeter(), AverageMeter()
    model.eval()
    with torch.no_grad():
        for images, target in loader:
            images = images.cuda(args.gpu, non_blocking=True)
            target = target.cuda(args.gpu, non_blocking=True)
            output = model(images)
            loss = criterion(output, target)
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            losses.update(loss.item(), images.size(0))
            top1.update(acc1.item(), images.size(0))
            top5.update(acc5.item(), images.size(0))
    if args.rank == 0:
        print(f" * Acc@1 {top1.avg:.3f} Acc@5 {top5.avg:.3f} loss {losses.avg:.4f}")
    return top1.avg


def main():
    args = parser.parse_args()
    args.gpu = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend="nccl")
    args.rank, args.world_size = dist.get_rank(), dist.get_world_size()

    model = models.__dict__[args.arch]()
    for name, param in model.named_parameters():
        if name not in ["fc.weight", "fc.bias"]:
            param.requires_grad = False
    model.fc.weight.data.normal_(mean=0.0, std=0.01)
    model.fc.bias.data.zero_()
    load_pretrained(model, args.pretrained)
    model.cuda(args.gpu)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])

    args.lr = args.lr * args.batch_size * args.world_size / 256
    parameters = [p for p in model.parameters() if p.requires_grad]
    assert len(parameters) == 2  # fc.weight, fc.bias
    optimizer = LARS(parameters, lr=args.lr, weight_decay=args.wd)
    criterion = nn.CrossEntropyLoss().cuda(args.gpu)

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_dataset = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]))
    val_dataset = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize]))
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
    val_sampler = torch.utils.data.distributed.DistributedSampler(val_dataset, shuffle=False)
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler,
                                               num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = torch.utils.data.DataLoader(val_dataset, batch_size=256, sampler=val_sampler,
                                             num_workers=args.workers, pin_memory=True)

    if args.rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    best_acc1 = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, epoch, args)
        acc1 = validate(val_loader, model.module, criterion, args)
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        if args.rank == 0:
            path = os.path.join(args.output_dir, "checkpoint.pth.tar")
            torch.save({"epoch": epoch + 1, "arch": args.arch, "state_dict": model.module.state_dict(),
                        "best_acc1": best_acc1, "optimizer": optimizer.state_dict()}, path)
            if is_best:
                shutil.copyfile(path, os.path.join(args.output_dir, "model_best.pth.tar"))

    if args.rank == 0:
        print(f"best top-1: {best_acc1:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
