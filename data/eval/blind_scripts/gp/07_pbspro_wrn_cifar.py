#!/usr/bin/env python3
"""WideResNet-28-10 on CIFAR-100, PBS Pro, one MPI rank per node, one process per GPU.

    #PBS -N wrn28
    #PBS -l select=2:ncpus=32:ngpus=4:mpiprocs=1
    #PBS -l walltime=06:00:00
    #PBS -j oe
    cd $PBS_O_WORKDIR
    mpiexec -n 2 --ppn 1 python wrn_cifar.py --data /lus/datasets/cifar100 --out /lus/proj/runs/wrn28

mpiexec is only used as a remote-exec: it starts this file once on every chunk's
host; there is no MPI communication. Each copy spawns one worker per GPU.
"""
import argparse
import os
import socket
import time
import zlib

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
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
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
        for i, (w, s) in enumerate(zip(widths[1:], [1, 2, 2])):
            for j in range(n):
                layers.append(BasicBlock(cin, w, s if j == 0 else 1, drop))
                cin = w
        self.blocks = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.blocks(self.conv(x))
        x = F.adaptive_avg_pool2d(F.relu(self.bn(x)), 1).flatten(1)
        return self.fc(x)


def pbs_nodes():
    with open(os.environ["PBS_NODEFILE"]) as f:
        # the nodefile repeats a host once per mpiproc; keep first-seen order
        return list(dict.fromkeys(line.strip().split(".")[0] for line in f if line.strip()))


def worker(local_rank, node_rank, nnodes, master, port, args):
    ngpus = torch.cuda.device_count()
    rank = node_rank * ngpus + local_rank
    world = nnodes * ngpus
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world)
    device = torch.device("cuda", local_rank)

    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    # the dataset is already extracted on the shared filesystem (download=False)
    train_ds = torchvision.datasets.CIFAR100(args.data, train=True, transform=train_tf, download=False)
    test_ds = torchvision.datasets.CIFAR100(args.data, train=False, transform=test_tf, download=False)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    per_gpu = args.global_batch // world
    train_dl = DataLoader(train_ds, batch_size=per_gpu, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    # uneven shards are fine here: evaluation runs on the bare module, no DDP hooks
    test_dl = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=500, num_workers=4)

    model = WideResNet(num_classes=100)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[60, 120, 160], gamma=0.2)

    start = 0
    ckpt_file = os.path.join(args.out, "last.pt")
    if os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} per_gpu_batch={per_gpu} start_epoch={start}", flush=True)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_dl:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                hits[0] += (model.module(x).argmax(1) == y).sum()
                hits[1] += y.numel()
        dist.all_reduce(hits)
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.3f} test_acc {100 * hits[0] / hits[1]:.2f} "
                  f"lr {sched.get_last_lr()[0]:.4f} {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, ckpt_file + ".part")
            os.replace(ckpt_file + ".part", ckpt_file)
        dist.barrier()

    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    nodes = pbs_nodes()
    me = socket.gethostname().split(".")[0]
    node_rank = nodes.index(me)
    # same port on every node, derived from the job id
    port = 20000 + zlib.crc32(os.environ["PBS_JOBID"].encode()) % 20000
    print(f"{me}: node {node_rank}/{len(nodes)}, master {nodes[0]}:{port}", flush=True)
    mp.spawn(worker, args=(node_rank, len(nodes), nodes[0], port, args),
             nprocs=torch.cuda.device_count(), join=True)


if __name__ == "__main__":
    main()
