#!/usr/bin/env python
"""Histopathology tile classifier (ResNet-50), Slurm, one srun task per GPU.

    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=4
    #SBATCH --gpus-per-node=4
    #SBATCH --cpus-per-task=16
    #SBATCH --tmp=400G
    srun python histo_train.py --tar /project/pathology/tiles_v3.tar --results /project/pathology/runs

The tile archive is unpacked to the node-local SSD ($SLURM_TMPDIR) once per
node; training reads from there, which is much faster than Lustre for
millions of small PNGs. Run outputs are written next to the data and copied
to --results when the job finishes.
"""
import argparse
import datetime
import os
import shutil
import subprocess
import tarfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def slurm_init(port_base=17000):
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    first = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                                    text=True).split()[0]
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method=f"tcp://{first}:{port_base + int(os.environ['SLURM_JOB_ID']) % 10000}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(hours=1))
    return rank, world, local_rank


def stage_data(tar_path, local_root, local_rank):
    target = os.path.join(local_root, "tiles")
    if local_rank == 0 and not os.path.isdir(target):
        t0 = time.time()
        with tarfile.open(tar_path) as tf:
            tf.extractall(local_root)
        print(f"[{os.uname().nodename}] staged {tar_path} in {time.time() - t0:.0f}s", flush=True)
    dist.barrier()
    return target


def loaders(root, rank, world, per_gpu):
    norm = T.Normalize([0.70, 0.55, 0.70], [0.15, 0.20, 0.15])
    train_tf = T.Compose([T.RandomResizedCrop(224, scale=(0.5, 1.0)), T.RandomHorizontalFlip(),
                          T.RandomVerticalFlip(), T.ColorJitter(0.2, 0.2, 0.1, 0.05), T.ToTensor(), norm])
    eval_tf = T.Compose([T.Resize(224), T.ToTensor(), norm])
    train_ds = torchvision.datasets.ImageFolder(os.path.join(root, "train"), train_tf)
    val_ds = torchvision.datasets.ImageFolder(os.path.join(root, "val"), eval_tf)
    test_ds = torchvision.datasets.ImageFolder(os.path.join(root, "test"), eval_tf)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    mk = lambda ds: DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=256, num_workers=8,
                               pin_memory=True)
    train_dl = DataLoader(train_ds, batch_size=per_gpu, sampler=sampler, num_workers=12, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    return train_dl, mk(val_ds), mk(test_ds), sampler, len(train_ds.classes)


@torch.no_grad()
def accuracy(net, loader, device):
    net.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            c[0] += (net(x).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tar", required=True)
    ap.add_argument("--results", required=True)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--per-gpu-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05, help="for a global batch of 512")
    args = ap.parse_args()

    rank, world, local_rank = slurm_init()
    device = torch.device("cuda", local_rank)
    local_root = os.environ.get("SLURM_TMPDIR", f"/tmp/{os.environ['USER']}_{os.environ['SLURM_JOB_ID']}")
    data_root = stage_data(args.tar, local_root, local_rank)
    run_dir = os.path.join(local_root, "run")
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)

    train_dl, val_dl, test_dl, sampler, n_cls = loaders(data_root, rank, world, args.per_gpu_batch)
    net = torchvision.models.resnet50(weights="IMAGENET1K_V2")
    net.fc = nn.Linear(net.fc.in_features, n_cls)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    net = DDP(net, device_ids=[local_rank])

    lr = args.lr * args.per_gpu_batch * world / 512
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_dl), pct_start=0.1)
    crit = nn.CrossEntropyLoss()
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        net.train()
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = crit(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        val_acc = accuracy(net.module, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} val_acc {val_acc:.4f} {time.time() - t0:.0f}s", flush=True)
            if val_acc > best:
                best = val_acc
                torch.save(net.module.state_dict(), os.path.join(run_dir, "best.pt"))
            torch.save({"model": net.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(run_dir, "last.pt"))
        dist.barrier()

    # final test with the best weights
    state = torch.load(os.path.join(run_dir, "best.pt"), map_location="cpu")
    net.module.load_state_dict(state)
    test_acc = accuracy(net.module, test_dl, device)
    if rank == 0:
        print(f"best val {best:.4f} test_acc {test_acc:.4f}", flush=True)
        dest = os.path.join(args.results, os.environ["SLURM_JOB_ID"])
        shutil.copytree(run_dir, dest, dirs_exist_ok=True)
        print(f"copied {run_dir} -> {dest}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
