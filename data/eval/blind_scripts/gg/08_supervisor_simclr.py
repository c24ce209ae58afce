#!/usr/bin/env python3
"""SimCLR pre-training (ResNet-50) with a small supervisor process.

    python 08_supervisor_simclr.py --data /data/imagenet100/train --nproc 8 --out runs/simclr

The supervisor starts one `--worker` process per GPU with the usual env://
variables, sends each worker's output to <out>/logs/rank<k>.log, watches them,
and starts a new attempt (resuming from <out>/checkpoint.pt) when one exits
with an error.
"""
import argparse
import datetime
import math
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--max-attempts", type=int, default=5)
    p.add_argument("--restart-delay", type=float, default=30)
    p.add_argument("--data", default="/data/imagenet100/train")
    p.add_argument("--out", default="runs/simclr")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=0.3, help="x global_batch/256 (LARS-style scaling)")
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


class TwoCrops:
    def __init__(self, tf):
        self.tf = tf

    def __call__(self, img):
        return self.tf(img), self.tf(img)


def simclr_transform():
    return T.Compose([
        T.RandomResizedCrop(224, scale=(0.08, 1.0)),
        T.RandomHorizontalFlip(),
        T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        T.RandomGrayscale(p=0.2),
        T.RandomApply([T.GaussianBlur(23, sigma=(0.1, 2.0))], p=0.5),
        T.ToTensor(),
        T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ])


class SimCLR(nn.Module):
    def __init__(self, dim=128):
        super().__init__()
        self.backbone = torchvision.models.resnet50()
        feat = self.backbone.fc.in_features
        self.backbone.fc = nn.Identity()
        self.projector = nn.Sequential(nn.Linear(feat, 2048, bias=False), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
                                       nn.Linear(2048, dim, bias=False), nn.BatchNorm1d(dim, affine=False))

    def forward(self, x):
        return self.projector(self.backbone(x))


def info_nce(z1, z2, temperature, rank):
    """NT-Xent with negatives from every GPU (differentiable all_gather)."""
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    all_z2 = torch.cat(dist_nn.all_gather(z2), dim=0)
    all_z1 = torch.cat(dist_nn.all_gather(z1), dim=0)
    n = z1.size(0)
    labels = torch.arange(n, device=z1.device) + rank * n
    loss = F.cross_entropy(z1 @ all_z2.T / temperature, labels) + F.cross_entropy(z2 @ all_z1.T / temperature, labels)
    return loss / 2


def worker(args):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=20))
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    dataset = torchvision.datasets.ImageFolder(args.data, transform=TwoCrops(simclr_transform()))
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(SimCLR()).to(device)
    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-6)
    steps = len(loader)
    warmup = 10 * steps
    total = args.epochs * steps

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1
    model = DDP(model, device_ids=[local_rank])
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        loss_meter = torch.zeros(2, device=device)
        for i, ((x1, x2), _) in enumerate(loader):
            step = epoch * steps + i
            cur = lr * step / warmup if step < warmup else lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
            for g in optimizer.param_groups:
                g["lr"] = cur
            x1, x2 = x1.to(device, non_blocking=True), x2.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                z = model(torch.cat([x1, x2]))
                z1, z2 = z.float().chunk(2)
            loss = info_nce(z1, z2, args.temperature, rank)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            loss_meter += torch.stack([loss.detach(), torch.ones((), device=device)])
            if i % 50 == 0:
                print(f"ep {epoch} {i}/{steps} loss {loss.item():.4f} lr {cur:.4f}", flush=True)
        dist.all_reduce(loss_meter)
        if rank == 0:
            print(f"epoch {epoch} mean loss {(loss_meter[0] / loss_meter[1]).item():.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch}, ckpt_path + ".part")
            os.replace(ckpt_path + ".part", ckpt_path)
            if (epoch + 1) % 50 == 0:
                torch.save(model.module.backbone.state_dict(), os.path.join(args.out, f"backbone_ep{epoch + 1}.pt"))
        dist.barrier()

    dist.destroy_process_group()


# ----------------------------------------------------------------------------- supervisor
def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def start_workers(args, attempt):
    port = free_port()
    log_dir = os.path.join(args.out, "logs")
    os.makedirs(log_dir, exist_ok=True)
    procs = []
    for rank in range(args.nproc):
        env = os.environ.copy()
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(args.nproc), LOCAL_WORLD_SIZE=str(args.nproc), OMP_NUM_THREADS="4")
        logf = open(os.path.join(log_dir, f"rank{rank}.log"), "a")
        logf.write(f"==== attempt {attempt} ({time.ctime()}) ====\n")
        logf.flush()
        procs.append(subprocess.Popen([sys.executable, "-u", __file__, "--worker", *sys.argv[1:]],
                                      env=env, stdout=logf, stderr=subprocess.STDOUT))
        logf.close()
    return procs


def shutdown(procs, grace=30):
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.time() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()


def supervise(procs, poll=5.0):
    """Return (rank, returncode) of the first failed worker, or (None, 0) when all succeeded."""
    while True:
        for rank, p in enumerate(procs):
            rc = p.poll()
            if rc is not None and rc != 0:
                return rank, rc
        if all(p.poll() == 0 for p in procs):
            return None, 0
        time.sleep(poll)


def main(args):
    os.makedirs(args.out, exist_ok=True)
    procs = []
    try:
        for attempt in range(1, args.max_attempts + 1):
            procs = start_workers(args, attempt)
            print(f"[supervisor] attempt {attempt}: started {len(procs)} workers", flush=True)
            failed_rank, rc = supervise(procs)
            if failed_rank is None:
                print("[supervisor] training complete", flush=True)
                return 0
            print(f"[supervisor] rank {failed_rank} exited with code {rc}; "
                  f"restarting in {args.restart_delay:.0f}s", flush=True)
            time.sleep(args.restart_delay)
        print("[supervisor] out of attempts", flush=True)
        return 1
    except KeyboardInterrupt:
        print("[supervisor] interrupted, stopping workers", flush=True)
        shutdown(procs)
        return 130


if __name__ == "__main__":
    args = get_args()
    if args.worker:
        worker(args)
    else:
        sys.exit(main(args))
