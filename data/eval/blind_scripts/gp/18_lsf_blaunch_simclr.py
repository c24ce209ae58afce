#!/usr/bin/env python3
"""SimCLR pretraining (ResNet-50) under LSF, blaunch per host + one process per GPU.

    #BSUB -J simclr
    #BSUB -q gpu_v100
    #BSUB -n 4
    #BSUB -R "span[ptile=1] affinity[core(20)]"
    #BSUB -gpu "num=4:mode=shared:j_exclusive=yes"
    #BSUB -W 48:00
    #BSUB -o logs/simclr.%J.out
    blaunch python simclr_lsf.py --data /gpfs/data/imagenet100/train --out /gpfs/runs/simclr_r50

On each host LSF sets CUDA_VISIBLE_DEVICES to the GPUs it allocated to the job
(not necessarily 0-3). The launcher gives every child exactly one of them, so
inside a child that GPU is always cuda:0.
"""
import argparse
import os
import signal
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--batch", type=int, default=128, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.3, help="for a global batch of 256")
    ap.add_argument("--temperature", type=float, default=0.2)
    ap.add_argument("--port", type=int, default=29650)
    return ap.parse_args()


def launch(args):
    # "hostA 1 hostB 1 ..." -> [hostA, hostB, ...]
    toks = os.environ["LSB_MCPU_HOSTS"].split()
    hosts = [toks[i].split(".")[0] for i in range(0, len(toks), 2)]
    node_rank = hosts.index(socket.gethostname().split(".")[0])
    gpu_ids = [g for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g]
    nproc = len(gpu_ids)
    world = nproc * len(hosts)
    children = []
    for i, gid in enumerate(gpu_ids):
        env = os.environ.copy()
        env.update(CUDA_VISIBLE_DEVICES=gid, LOCAL_RANK=str(i), RANK=str(node_rank * nproc + i),
                   WORLD_SIZE=str(world), MASTER_ADDR=hosts[0], MASTER_PORT=str(args.port),
                   SIMCLR_CHILD="1")
        children.append(subprocess.Popen([sys.executable, os.path.abspath(__file__)] + sys.argv[1:], env=env))
    signal.signal(signal.SIGTERM, lambda *_: [c.terminate() for c in children])
    codes = [c.wait() for c in children]
    sys.exit(max(codes, key=abs))


class TwoCrops:
    def __init__(self, tf):
        self.tf = tf

    def __call__(self, x):
        return self.tf(x), self.tf(x)


def nt_xent(z1, z2, temperature):
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    # differentiable gather: negatives from every GPU, gradients flow back to their owners
    all1 = torch.cat(dist_nn.all_gather(z1), 0)
    all2 = torch.cat(dist_nn.all_gather(z2), 0)
    n, rank = z1.size(0), dist.get_rank()
    labels = torch.arange(n, device=z1.device) + rank * n
    keys = torch.cat([all1, all2], 0)
    logits1 = z1 @ keys.t() / temperature
    logits2 = z2 @ keys.t() / temperature
    total = all1.size(0)
    self_mask1 = F.one_hot(labels, 2 * total).bool()
    self_mask2 = F.one_hot(labels + total, 2 * total).bool()
    logits1 = logits1.masked_fill(self_mask1, float("-inf"))
    logits2 = logits2.masked_fill(self_mask2, float("-inf"))
    return 0.5 * (F.cross_entropy(logits1, labels + total) + F.cross_entropy(logits2, labels))


class SimCLR(nn.Module):
    def __init__(self, dim=128):
        super().__init__()
        self.backbone = torchvision.models.resnet50()
        feat = self.backbone.fc.in_features
        self.backbone.fc = nn.Identity()
        self.proj = nn.Sequential(nn.Linear(feat, 2048, bias=False), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
                                  nn.Linear(2048, dim, bias=False), nn.BatchNorm1d(dim, affine=False))

    def forward(self, x):
        return self.proj(self.backbone(x))


def child(args):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world)
    torch.backends.cudnn.benchmark = True

    aug = T.Compose([
        T.RandomResizedCrop(224, scale=(0.08, 1.0)), T.RandomHorizontalFlip(),
        T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8), T.RandomGrayscale(0.2),
        T.RandomApply([T.GaussianBlur(23, (0.1, 2.0))], p=0.5), T.ToTensor(),
        T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    ds = torchvision.datasets.ImageFolder(args.data, TwoCrops(aug))
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=10, pin_memory=True,
                    drop_last=True, persistent_workers=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(SimCLR()).to(device)
    model = DDP(model, device_ids=[0])
    lr = args.lr * args.batch * world / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(dl))
    scaler = torch.cuda.amp.GradScaler()

    start = 0
    ck_path = os.path.join(args.out, "checkpoint.pth")
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        start = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} global_batch={args.batch * world} lr={lr:.3f} start={start}", flush=True)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for (x1, x2), _ in dl:
            x1, x2 = x1.to(device, non_blocking=True), x2.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                z = model(torch.cat([x1, x2], 0))
            z1, z2 = z.float().chunk(2)
            loss = nt_xent(z1, z2, args.temperature)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)
        if rank == 0:
            print(f"epoch {epoch} loss {(run[0] / run[1]).item():.4f} lr {sched.get_last_lr()[0]:.4f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch}, ck_path + ".tmp")
            os.replace(ck_path + ".tmp", ck_path)
        dist.barrier()

    if rank == 0:
        torch.save(model.module.backbone.state_dict(), os.path.join(args.out, "resnet50_simclr.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    a = get_args()
    if os.environ.get("SIMCLR_CHILD") == "1":
        child(a)
    else:
        launch(a)
