"""Stochastic Weight Averaging for WRN-28-10 on CIFAR-100 (torch.optim.swa_utils).

Standard schedule: cosine-ish decay for the first 75% of training, then a
constant SWA learning rate, averaging once per epoch. BN statistics of the
averaged model are recomputed at the end with update_bn.

    torchrun --standalone --nproc_per_node=4 05_swa_wideresnet.py --epochs 200 --swa-start 150
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
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms


class WideBasic(nn.Module):
    def __init__(self, cin, cout, stride, drop):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, 1, 1, bias=False)
        self.drop = nn.Dropout(drop)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride, 1, bias=False)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False))

    def forward(self, x):
        out = self.drop(self.conv1(F.relu(self.bn1(x))))
        out = self.conv2(F.relu(self.bn2(out)))
        return out + self.shortcut(x)


class WideResNet(nn.Module):
    def __init__(self, depth=28, widen=10, num_classes=100, drop=0.0):
        super().__init__()
        n = (depth - 4) // 6
        widths = [16, 16 * widen, 32 * widen, 64 * widen]
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        layers, cin = [], widths[0]
        for i, stride in enumerate((1, 2, 2)):
            for j in range(n):
                layers.append(WideBasic(cin, widths[i + 1], stride if j == 0 else 1, drop))
                cin = widths[i + 1]
        self.blocks = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(cin)
        self.linear = nn.Linear(cin, num_classes)

    def forward(self, x):
        out = F.relu(self.bn(self.blocks(self.conv1(x))))
        return self.linear(F.adaptive_avg_pool2d(out, 1).flatten(1))


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/cifar100")
    p.add_argument("--out", default="checkpoints/swa_wrn28x10")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--swa-start", type=int, default=150)
    p.add_argument("--bs", type=int, default=32, help="per-GPU batch size (global 128 on 4 GPUs)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--swa-lr", type=float, default=0.05)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--resume", default="")
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = model(x)
        s[0] += F.cross_entropy(out, y, reduction="sum")
        s[1] += out.argmax(1).eq(y).sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    rank = dist.get_rank()
    is_main = rank == 0

    logging.basicConfig(level=logging.INFO if is_main else logging.ERROR,
                        format="[%(asctime)s] %(message)s")
    log = logging.getLogger(__name__)
    writer = SummaryWriter(os.path.join(args.out, "tb")) if is_main else None

    norm = transforms.Normalize((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
    train_tf = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.ToTensor(), norm])
    train_set = datasets.CIFAR100(args.data, train=True, transform=train_tf, download=False)
    test_set = datasets.CIFAR100(args.data, train=False, transform=test_tf, download=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    # CIFAR test set (10k) splits evenly across 1/2/4/8 GPUs, so no padded duplicates
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler,
                             num_workers=args.workers, pin_memory=True)

    model = WideResNet(28, 10, 100).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    swa_model = AveragedModel(model.module)

    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    base_sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.swa_start)
    swa_sched = SWALR(opt, swa_lr=args.swa_lr, anneal_epochs=5, anneal_strategy="cos")

    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ck["model"])
        swa_model.load_state_dict(ck["swa_model"])
        opt.load_state_dict(ck["opt"])
        base_sched.load_state_dict(ck["base_sched"])
        swa_sched.load_state_dict(ck["swa_sched"])
        start_epoch = ck["epoch"] + 1
        log.info("resumed from %s at epoch %d", args.resume, start_epoch)

    os.makedirs(args.out, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        if epoch >= args.swa_start:
            swa_model.update_parameters(model.module)
            swa_sched.step()
        else:
            base_sched.step()

        test_loss, test_acc = evaluate(model, test_loader, device)
        lr = opt.param_groups[0]["lr"]
        log.info("epoch %d lr %.4f train_loss %.4f test_loss %.4f test_acc %.4f (%.0fs)",
                 epoch, lr, (run[0] / run[1]).item(), test_loss, test_acc, time.time() - t0)
        if is_main:
            writer.add_scalar("train/loss", (run[0] / run[1]).item(), epoch)
            writer.add_scalar("test/loss", test_loss, epoch)
            writer.add_scalar("test/acc", test_acc, epoch)
            writer.add_scalar("lr", lr, epoch)
            if (epoch + 1) % 10 == 0:
                torch.save({"model": model.module.state_dict(), "swa_model": swa_model.state_dict(),
                            "opt": opt.state_dict(), "base_sched": base_sched.state_dict(),
                            "swa_sched": swa_sched.state_dict(), "epoch": epoch},
                           os.path.join(args.out, "last.pt"))

    # recompute BN statistics for the averaged weights (SyncBN: global batch statistics)
    update_bn(train_loader, swa_model, device=device)
    swa_loss, swa_acc = evaluate(swa_model, test_loader, device)
    log.info("SWA model: test_loss %.4f test_acc %.4f", swa_loss, swa_acc)
    torch.save({"swa_model": swa_model.module.state_dict(), "epochs": args.epochs,
                "test_acc": swa_acc, "test_loss": swa_loss},
               os.path.join(args.out, "swa_final.pt"))
    if is_main:
        writer.add_scalar("swa/test_acc", swa_acc, args.epochs)
        writer.close()

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
