#!/usr/bin/env python3
"""ImageNet ResNet-50 training across several nodes, without torchrun.

Run the same command on every node, changing only --node-rank:

    node0$ python 17_multinode_popen_resnet50.py --nnodes 2 --node-rank 0 --master-addr 10.0.0.11 --gpus 0,1,2,3,4,5,6,7
    node1$ python 17_multinode_popen_resnet50.py --nnodes 2 --node-rank 1 --master-addr 10.0.0.11 --gpus 0,1,2,3,4,5,6,7

The node launcher starts one worker per listed GPU with the env:// variables
filled in, sends each worker's output to <out>/logs/node<n>_gpu<g>.log, and restarts its
workers if one of them fails. --out must be on storage shared by all nodes.
"""
import argparse
import math
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
    p.add_argument("--worker", action="store_true")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=23456)
    p.add_argument("--gpus", default="0,1,2,3,4,5,6,7")
    p.add_argument("--retries", type=int, default=3)
    p.add_argument("--data", default="/datasets/imagenet")
    p.add_argument("--out", default="/shared/runs/r50", help="shared across nodes")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="per 256 images")
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def loaders(args, rank, world):
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_set = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), normalize]))
    val_set = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"),
        T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), normalize]))
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_subset = torch.utils.data.Subset(val_set, range(rank, len(val_set), world))
    val_loader = DataLoader(val_subset, batch_size=128, num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


def accuracy_counts(output, target, ks=(1, 5)):
    pred = output.topk(max(ks), dim=1).indices
    hit = pred == target[:, None]
    return [hit[:, :k].any(dim=1).sum() for k in ks]


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    c = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        top1, top5 = accuracy_counts(out, y)
        c += torch.stack([top1, top5, torch.tensor(y.numel(), device=device)]).float()
    dist.all_reduce(c)
    model.train()
    return (c[0] / c[2]).item(), (c[1] / c[2]).item()


def worker(args):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    train_loader, val_loader, sampler = loaders(args, rank, world)
    model = torchvision.models.resnet50(zero_init_residual=True).to(device)
    lr = args.lr * args.batch_size * world / 256
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-5}, {"params": no_decay, "weight_decay": 0}],
                          lr=lr, momentum=0.9, nesterov=True)
    steps = len(train_loader)
    warm = 5 * steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else
        0.5 * (1 + math.cos(math.pi * (s - warm) / (args.epochs * steps - warm))))
    scaler = torch.cuda.amp.GradScaler()

    start, best = 0, 0.0
    ckpt = os.path.join(args.out, "checkpoint.pth.tar")
    if os.path.isfile(ckpt):
        st = torch.load(ckpt, map_location=device)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        scaler.load_state_dict(st["scaler"])
        start, best = st["epoch"] + 1, st["best"]
    model = DDP(model, device_ids=[local_rank])

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and i % 200 == 0:
                print(f"[{epoch}][{i}/{steps}] loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.4f}", flush=True)
        top1, top5 = validate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} top1 {top1:.4f} top5 {top5:.4f} {time.time() - t0:.0f}s", flush=True)
            best = max(best, top1)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch, "best": best}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- node launcher
def start_workers(args, gpus, attempt):
    world_size = len(gpus)
    log_dir = os.path.join(args.out, "logs")
    os.makedirs(log_dir, exist_ok=True)
    procs = []
    for local_rank, gpu in enumerate(gpus):
        env = os.environ.copy()
        env.update({
            "MASTER_ADDR": args.master_addr,
            "MASTER_PORT": str(args.master_port),
            "RANK": str(args.node_rank * world_size + local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(len(gpus)),
            "CUDA_VISIBLE_DEVICES": ",".join(gpus),
            "OMP_NUM_THREADS": "6",
        })
        log = open(os.path.join(log_dir, f"node{args.node_rank}_gpu{gpu}.log"), "a")
        log.write(f"---- attempt {attempt} {time.ctime()} ----\n")
        log.flush()
        cmd = [sys.executable, "-u", os.path.abspath(__file__), "--worker", *sys.argv[1:]]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
        log.close()
    print(f"[node {args.node_rank}] attempt {attempt}: started {len(procs)} workers", flush=True)
    return procs


def kill_all(procs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    time.sleep(10)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def node_main(args):
    gpus = [g for g in args.gpus.split(",") if g]
    for attempt in range(args.retries + 1):
        procs = start_workers(args, gpus, attempt)
        try:
            while True:
                rcs = [p.poll() for p in procs]
                if all(rc == 0 for rc in rcs):
                    return 0
                if any(rc not in (None, 0) for rc in rcs):
                    print(f"[node {args.node_rank}] worker failure {rcs}, restarting", flush=True)
                    break
                time.sleep(5)
        finally:
            kill_all(procs)
        time.sleep(30)
    return 1


if __name__ == "__main__":
    a = parse_args()
    sys.exit(worker(a) if a.worker else node_main(a))
