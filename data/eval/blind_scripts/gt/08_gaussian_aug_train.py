"""Gaussian data augmentation training of a base classifier for randomized
smoothing (Cohen, Rosenfeld & Kolter, 2019) -- CIFAR-10, ResNet-110, DDP.

    torchrun --nproc_per_node=4 08_gaussian_aug_train.py cifar10 cifar_resnet110 \
        models/cifar10/resnet110/noise_0.50 --noise_sd 0.50
"""
import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import SGD
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader

from architectures import ARCHITECTURES, get_architecture
from datasets import DATASETS, get_dataset

parser = argparse.ArgumentParser(description="Gaussian augmentation training (DDP)")
parser.add_argument("dataset", type=str, choices=DATASETS)
parser.add_argument("arch", type=str, choices=ARCHITECTURES)
parser.add_argument("outdir", type=str, help="folder to save model and training log")
parser.add_argument("--workers", default=4, type=int)
parser.add_argument("--epochs", default=90, type=int)
parser.add_argument("--batch", default=256, type=int, help="global batch size")
parser.add_argument("--lr", default=0.1, type=float)
parser.add_argument("--lr_step_size", type=int, default=30)
parser.add_argument("--gamma", type=float, default=0.1)
parser.add_argument("--momentum", default=0.9, type=float)
parser.add_argument("--weight-decay", default=1e-4, type=float)
parser.add_argument("--noise_sd", default=0.0, type=float, help="std of Gaussian noise for augmentation")
parser.add_argument("--print-freq", default=50, type=int)
parser.add_argument("--seed", default=0, type=int)


class AverageMeter:
    def __init__(self):
        self.sum = 0.0
        self.count = 0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n

    @property
    def avg(self):
        return self.sum / max(self.count, 1)


def accuracy(output, target, topk=(1,)):
    with torch.no_grad():
        maxk = max(topk)
        _, pred = output.topk(maxk, 1, True, True)
        correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
        return [correct[:k].reshape(-1).float().sum().item() * 100.0 / target.size(0) for k in topk]


def reduce_mean(value, device):
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def train_one_epoch(loader, model, criterion, optimizer, epoch, noise_sd, device, rank, print_freq):
    losses, top1 = AverageMeter(), AverageMeter()
    model.train()
    end = time.time()
    for i, (inputs, targets) in enumerate(loader):
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        inputs = inputs + torch.randn_like(inputs) * noise_sd
        outputs = model(inputs)
        loss = criterion(outputs, targets)
        acc1, = accuracy(outputs, targets)
        losses.update(loss.item(), inputs.size(0))
        top1.update(acc1, inputs.size(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and i % print_freq == 0:
            print(f"Epoch: [{epoch}][{i}/{len(loader)}]\tTime {time.time() - end:.3f}\t"
                  f"Loss {losses.avg:.4f}\tAcc@1 {top1.avg:.3f}", flush=True)
        end = time.time()
    return reduce_mean(losses.avg, device), reduce_mean(top1.avg, device)


@torch.no_grad()
def test_noisy(loader, model, criterion, noise_sd, device):
    losses, top1 = AverageMeter(), AverageMeter()
    model.eval()
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        inputs = inputs + torch.randn_like(inputs) * noise_sd
        outputs = model(inputs)
        losses.update(criterion(outputs, targets).item(), inputs.size(0))
        top1.update(accuracy(outputs, targets)[0], inputs.size(0))
    return losses.avg, top1.avg


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    if rank == 0 and not os.path.exists(args.outdir):
        os.makedirs(args.outdir)

    train_dataset = get_dataset(args.dataset, "train")
    test_dataset = get_dataset(args.dataset, "test")
    train_loader = DataLoader(train_dataset, shuffle=True, batch_size=args.batch // world_size,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_dataset, shuffle=False, batch_size=256,
                             num_workers=args.workers, pin_memory=True)

    # get_architecture puts a NormalizeLayer in front of the network
    model = get_architecture(args.arch, args.dataset).to(device)
    model = DDP(model, device_ids=[local_rank])

    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = StepLR(optimizer, step_size=args.lr_step_size, gamma=args.gamma)

    logfilename = os.path.join(args.outdir, "log.txt")
    if rank == 0:
        with open(logfilename, "w") as f:
            f.write("epoch\ttime\tlr\ttrain loss\ttrain acc\ttestloss\ttest acc\n")

    for epoch in range(args.epochs):
        before = time.time()
        train_loss, train_acc = train_one_epoch(train_loader, model, criterion, optimizer, epoch,
                                                args.noise_sd, device, rank, args.print_freq)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()

        if rank == 0:
            test_loss, test_acc = test_noisy(test_loader, model.module, criterion, args.noise_sd, device)
            after = time.time()
            with open(logfilename, "a") as f:
                f.write(f"{epoch}\t{datetime.timedelta(seconds=after - before)}\t{lr:.3}\t"
                        f"{train_loss:.3}\t{train_acc:.3}\t{test_loss:.3}\t{test_acc:.3}\n")
            torch.save({
                "epoch": epoch + 1,
                "arch": args.arch,
                "state_dict": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
            }, os.path.join(args.outdir, "checkpoint.pth.tar"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
