"""WideResNet-28-10 on CIFAR-100, one node, processes started with mp.spawn.

fp16 autocast + GradScaler (unscale_ before clipping), SyncBatchNorm, gradient
accumulation with no_sync, exact distributed evaluation.

    python 12_spawn_cifar_syncbn.py --gpus 4 --data ./data --accum 2
"""
import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride, drop):
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(cin), nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2, self.conv2 = nn.BatchNorm2d(cout), nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.drop = drop
        self.short = None if (cin == cout and stride == 1) else nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x):
        o = F.relu(self.bn1(x))
        y = self.conv1(o)
        y = F.dropout(F.relu(self.bn2(y)), self.drop, self.training)
        y = self.conv2(y)
        return y + (x if self.short is None else self.short(o))


class WideResNet(nn.Module):
    def __init__(self, depth=28, k=10, num_classes=100, drop=0.3):
        super().__init__()
        n = (depth - 4) // 6
        widths = [16, 16 * k, 32 * k, 64 * k]
        self.conv = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        layers, cin = [], widths[0]
        for i, stride in enumerate([1, 2, 2]):
            for j in range(n):
                layers.append(BasicBlock(cin, widths[i + 1], stride if j == 0 else 1, drop))
                cin = widths[i + 1]
        self.blocks = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.blocks(self.conv(x))
        x = F.adaptive_avg_pool2d(F.relu(self.bn(x)), 1).flatten(1)
        return self.fc(x)


def worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    # the parent process downloaded the data already; download=False avoids concurrent writes
    train_set = torchvision.datasets.CIFAR100(args.data, train=True, transform=train_tf, download=False)
    test_set = torchvision.datasets.CIFAR100(args.data, train=False, transform=test_tf, download=False)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world_size)), batch_size=500,
                             num_workers=2, pin_memory=True)

    model = WideResNet(num_classes=100)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[rank])

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    updates_per_epoch = len(train_loader) // args.accum
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=updates_per_epoch)
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        run_loss = torch.zeros(2, device=device)
        for i, (x, y) in enumerate(train_loader):
            if i >= updates_per_epoch * args.accum:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            step_now = (i + 1) % args.accum == 0
            with contextlib.nullcontext() if step_now else model.no_sync():
                with torch.autocast(device_type="cuda", dtype=torch.float16):
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss / args.accum).backward()
            run_loss += torch.stack([loss.detach().float() * y.size(0), torch.tensor(float(y.size(0)), device=device)])
            if step_now:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()

        model.eval()
        stats = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast(device_type="cuda", dtype=torch.float16):
                    pred = model.module(x).argmax(1)
                stats[0] += (pred == y).sum()
                stats[1] += y.numel()
        dist.all_reduce(stats)
        dist.all_reduce(run_loss)
        if rank == 0:
            print(f"epoch {epoch:3d} train_loss {(run_loss[0] / run_loss[1]).item():.4f} "
                  f"test_acc {100 * (stats[0] / stats[1]).item():.2f} "
                  f"lr {scheduler.get_last_lr()[0]:.4f} scale {scaler.get_scale():.0f}", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "scheduler": scheduler.state_dict()},
                       os.path.join(args.out, "wrn28_10_last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--data", default="./data")
    parser.add_argument("--out", default="./checkpoints")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64, help="per GPU per micro step")
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=29531)
    args = parser.parse_args()

    os.makedirs(args.out, exist_ok=True)
    torchvision.datasets.CIFAR100(args.data, train=True, download=True)
    torchvision.datasets.CIFAR100(args.data, train=False, download=True)
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
