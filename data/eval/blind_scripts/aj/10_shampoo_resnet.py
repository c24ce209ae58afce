"""Shampoo vs. SGD on CIFAR-10 ResNet-20/32/56.

Preconditioned optimizer from torch-optimizer; the preconditioner roots are
recomputed every --update-freq steps. BN/bias parameters are optimised with
plain SGD (their Kronecker factors are 1-D and not worth it).

torchrun --nproc_per_node=2 10_shampoo_resnet.py --depth 56 --optimizer shampoo
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch_optimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = self.b2(self.c2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class CifarResNet(nn.Module):
    def __init__(self, depth=56, num_classes=10):
        super().__init__()
        n = (depth - 2) // 6
        self.conv = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        stages, cin = [], 16
        for cout, stride in [(16, 1), (32, 2), (64, 2)]:
            for i in range(n):
                stages.append(Block(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        x = self.stages(x)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))

    def parameter_groups(self):
        """Split into matrix-shaped weights (preconditioned) and vectors (plain SGD)."""
        matrices, vectors = [], []
        for p in self.parameters():
            (matrices if p.ndim >= 2 else vectors).append(p)
        return matrices, vectors


def build_optimizers(model, args, lr):
    matrices, vectors = model.parameter_groups()
    if args.optimizer == "shampoo":
        main_opt = torch_optimizer.Shampoo(matrices, lr=lr, momentum=0.9,
                                           weight_decay=args.wd, epsilon=args.eps,
                                           update_freq=args.update_freq)
    else:
        main_opt = torch.optim.SGD(matrices, lr=lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    vec_opt = torch.optim.SGD(vectors, lr=lr, momentum=0.9)
    return [main_opt, vec_opt]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--depth", type=int, default=56)
    p.add_argument("--optimizer", choices=["shampoo", "sgd"], default="shampoo")
    p.add_argument("--epochs", type=int, default=160)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="for a global batch of 128")
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--eps", type=float, default=1e-4)
    p.add_argument("--update-freq", type=int, default=20)
    p.add_argument("--data", default="./data")
    p.add_argument("--logdir", default="runs/shampoo")
    return p.parse_args()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010))
    train = datasets.CIFAR10(args.data, train=True, transform=transforms.Compose([
        transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    test = datasets.CIFAR10(args.data, train=False, transform=transforms.Compose([transforms.ToTensor(), norm]))
    train_sampler = DistributedSampler(train, shuffle=True)
    test_sampler = DistributedSampler(test, shuffle=False, drop_last=True)
    train_loader = DataLoader(train, args.batch_size, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test, 500, sampler=test_sampler, num_workers=4)

    model = CifarResNet(args.depth).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 128
    optimizers = build_optimizers(model, args, lr)
    schedulers = [torch.optim.lr_scheduler.MultiStepLR(o, milestones=[80, 120], gamma=0.1) for o in optimizers]

    writer = SummaryWriter(os.path.join(args.logdir, f"{args.optimizer}_r{args.depth}")) if rank == 0 else None
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        meter = torch.zeros(3, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            loss = F.cross_entropy(out, y)
            for o in optimizers:
                o.zero_grad(set_to_none=True)
            loss.backward()
            for o in optimizers:
                o.step()
            meter += torch.stack([loss.detach() * y.numel(), (out.argmax(1) == y).sum().float(),
                                  torch.tensor(float(y.numel()), device=device)])
        for s in schedulers:
            s.step()
        epoch_time = time.time() - tic

        model.eval()
        tmeter = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.to(device), y.to(device)
                tmeter[0] += (model(x).argmax(1) == y).sum()
                tmeter[1] += y.numel()
        dist.all_reduce(meter)
        dist.all_reduce(tmeter)

        if rank == 0:
            train_loss = (meter[0] / meter[2]).item()
            train_acc = (100 * meter[1] / meter[2]).item()
            test_acc = (100 * tmeter[0] / tmeter[1]).item()
            writer.add_scalar("train/loss", train_loss, epoch)
            writer.add_scalar("train/acc", train_acc, epoch)
            writer.add_scalar("test/acc", test_acc, epoch)
            writer.add_scalar("time/epoch", epoch_time, epoch)
            print(f"{epoch:3d} loss {train_loss:.3f} train {train_acc:.2f} test {test_acc:.2f} "
                  f"{epoch_time:.1f}s")
            if (epoch + 1) % 20 == 0 or epoch + 1 == args.epochs:
                torch.save({"model": model.module.state_dict(),
                            "optimizers": [o.state_dict() for o in optimizers],
                            "epoch": epoch},
                           os.path.join(args.logdir, f"{args.optimizer}_r{args.depth}.pt"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
