#!/usr/bin/env python3
"""WRN-28-10 on CIFAR-100 with EMA weights.

Without --local_rank this file acts as its own launcher and re-executes itself
once per GPU, the way torch.distributed.launch used to:

    python 08_cifar_wrn_launch.py --nproc 4 --data /data/cifar100 --out runs/wrn28_10
"""
import argparse
import copy
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--nproc", type=int, default=torch.cuda.device_count())
    p.add_argument("--master-port", type=int, default=29477)
    p.add_argument("--data", default="/data/cifar100")
    p.add_argument("--out", default="runs/wrn")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=128, help="total over all GPUs")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--ema", type=float, default=0.999)
    return p.parse_args()


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride, drop):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.drop = drop
        self.short = None if cin == cout and stride == 1 else nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x):
        o = F.relu(self.bn1(x))
        y = self.conv1(o)
        y = F.dropout(F.relu(self.bn2(y)), self.drop, self.training)
        y = self.conv2(y)
        return y + (x if self.short is None else self.short(o))


class WideResNet(nn.Module):
    def __init__(self, depth=28, k=10, n_cls=100, drop=0.3):
        super().__init__()
        n = (depth - 4) // 6
        w = [16, 16 * k, 32 * k, 64 * k]
        self.conv = nn.Conv2d(3, w[0], 3, 1, 1, bias=False)
        layers, cin = [], w[0]
        for i, stride in enumerate([1, 2, 2]):
            for j in range(n):
                layers.append(BasicBlock(cin, w[i + 1], stride if j == 0 else 1, drop))
                cin = w[i + 1]
        self.blocks = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, n_cls)

    def forward(self, x):
        x = self.blocks(self.conv(x))
        x = F.relu(self.bn(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


# ------------------------------------------------------------------ launcher
def launch(args):
    procs = []
    base_env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.master_port),
                    WORLD_SIZE=str(args.nproc))
    passthrough = [a for a in sys.argv[1:]]
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    for r in range(args.nproc):
        env = dict(base_env, RANK=str(r), LOCAL_RANK=str(r))
        cmd = [sys.executable, "-u", os.path.abspath(__file__), f"--local-rank={r}"] + passthrough
        out = open(os.path.join(args.out, "logs", f"worker{r}.txt"), "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))

    def stop(signum, frame):
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait()
        sys.exit(1)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)

    alive = set(range(len(procs)))
    while alive:
        for i in list(alive):
            rc = procs[i].poll()
            if rc is None:
                continue
            alive.discard(i)
            if rc != 0:
                print(f"worker {i} exited with {rc}, killing the others", file=sys.stderr)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                sys.exit(rc)
        time.sleep(1)


# ------------------------------------------------------------------ worker
@torch.no_grad()
def ema_update(ema, model, decay):
    for e, m in zip(ema.state_dict().values(), model.state_dict().values()):
        if e.dtype.is_floating_point:
            e.mul_(decay).add_(m.detach(), alpha=1 - decay)
        else:
            e.copy_(m)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        c[0] += (net(x).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def train(args):
    local_rank = args.local_rank
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train_tf = T.Compose([T.RandomCrop(32, padding=4, padding_mode="reflect"), T.RandomHorizontalFlip(),
                          T.ToTensor(), T.Normalize(mean, std)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    if rank == 0:
        torchvision.datasets.CIFAR100(args.data, train=True, download=True)
        torchvision.datasets.CIFAR100(args.data, train=False, download=True)
    dist.barrier()
    train_ds = torchvision.datasets.CIFAR100(args.data, train=True, transform=train_tf)
    test_ds = torchvision.datasets.CIFAR100(args.data, train=False, transform=test_tf)

    per_gpu = args.batch_size // world
    sampler = DistributedSampler(train_ds, shuffle=True)
    dl = DataLoader(train_ds, batch_size=per_gpu, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    test_dl = DataLoader(torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world)),
                         batch_size=256, num_workers=2)

    net = WideResNet()
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    ema = copy.deepcopy(net).eval()
    for p in ema.parameters():
        p.requires_grad_(False)
    model = DDP(net, device_ids=[local_rank])

    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(dl))

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            ema_update(ema, model.module, args.ema)
        acc = evaluate(model.module, test_dl, device)
        ema_acc = evaluate(ema, test_dl, device)
        if rank == 0:
            print(f"epoch {epoch:3d} loss {loss.item():.3f} acc {acc:.4f} ema {ema_acc:.4f} "
                  f"lr {sched.get_last_lr()[0]:.4f} {time.time() - t0:.0f}s", flush=True)
            if ema_acc > best:
                best = ema_acc
                torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(), "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    a = parse_args()
    if a.local_rank < 0:
        launch(a)
    else:
        train(a)
