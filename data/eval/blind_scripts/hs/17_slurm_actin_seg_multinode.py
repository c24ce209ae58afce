"""Actin filament segmentation in cryo-ET, multi-node on the institute Slurm cluster.

One task per GPU, started by srun (no torchrun):

    #!/bin/bash
    #SBATCH --nodes=2 --ntasks-per-node=4 --gres=gpu:a100:4 --cpus-per-task=10
    #SBATCH --time=24:00:00 --signal=USR1@300 --requeue
    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))
    srun --kill-on-bad-exit=1 python 17_slurm_actin_seg_multinode.py --data /projects/cryoet/actin --run /projects/cryoet/runs/actin_$SLURM_JOB_ID

Training tomograms are staged once per node to the node-local SSD ($SLURM_TMPDIR); checkpoints
go to the shared project file system so that a requeued job (possibly on other nodes) resumes.
"""
import argparse
import datetime
import glob
import os
import shutil
import signal
import time

import mrcfile
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

STOP = False


def _on_usr1(signum, frame):
    global STOP
    STOP = True


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--patch", type=int, default=80)
    p.add_argument("--samples", type=int, default=16000)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def init_slurm():
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local_rank)
    # generous timeout: the first barrier waits for the per-node staging copy
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=60))
    return rank, world, local_rank


def stage_to_local(src_files, local_dir, local_rank):
    """Copy the training tomograms to this node's SSD; one copy per node, done by local rank 0."""
    dst = [os.path.join(local_dir, os.path.basename(f)) for f in src_files]
    if local_rank == 0:
        os.makedirs(local_dir, exist_ok=True)
        for s, d in zip(src_files, dst):
            if not os.path.exists(d):
                shutil.copyfile(s, d + ".part")
                os.rename(d + ".part", d)
    dist.barrier()
    return dst


class ActinPatches(Dataset):
    def __init__(self, tomo_files, patch, n):
        self.vols = []
        for f in tomo_files:
            lab_f = f.replace(".mrc", "_actin.mrc")
            with mrcfile.mmap(f, mode="r", permissive=True) as m:
                v = np.array(m.data, dtype=np.float32)
            with mrcfile.mmap(lab_f, mode="r", permissive=True) as m:
                l = np.array(m.data, dtype=np.uint8)
            self.vols.append(((v - v.mean()) / (v.std() + 1e-6), l))
        self.patch, self.n, self.epoch = patch, n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        rng = np.random.default_rng((idx, self.epoch))
        v, l = self.vols[idx % len(self.vols)]
        p = self.patch
        z, y, x = (int(rng.integers(0, s - p + 1)) for s in v.shape)
        a, b = v[z:z + p, y:y + p, x:x + p], l[z:z + p, y:y + p, x:x + p]
        k = int(rng.integers(4))
        a, b = np.rot90(a, k, (1, 2)), np.rot90(b, k, (1, 2))
        return torch.from_numpy(a.copy())[None], torch.from_numpy(b.astype(np.float32))[None]


def block(i, o):
    return nn.Sequential(nn.Conv3d(i, o, 3, padding=1, bias=False), nn.BatchNorm3d(o), nn.ReLU(inplace=True),
                         nn.Conv3d(o, o, 3, padding=1, bias=False), nn.BatchNorm3d(o), nn.ReLU(inplace=True))


class UNet3D(nn.Module):
    def __init__(self, f=(32, 64, 128, 256)):
        super().__init__()
        self.enc = nn.ModuleList([block(1 if i == 0 else f[i - 1], f[i]) for i in range(len(f))])
        self.up = nn.ModuleList([nn.ConvTranspose3d(f[i], f[i - 1], 2, 2) for i in range(len(f) - 1, 0, -1)])
        self.dec = nn.ModuleList([block(2 * f[i - 1], f[i - 1]) for i in range(len(f) - 1, 0, -1)])
        self.head = nn.Conv3d(f[0], 1, 1)

    def forward(self, x):
        skips = []
        for i, e in enumerate(self.enc):
            x = e(x if i == 0 else F.max_pool3d(x, 2))
            skips.append(x)
        x = skips.pop()
        for u, d in zip(self.up, self.dec):
            x = d(torch.cat([u(x), skips.pop()], 1))
        return self.head(x)


def main():
    args = parse()
    signal.signal(signal.SIGUSR1, _on_usr1)
    rank, world, local_rank = init_slurm()
    device = torch.device("cuda", local_rank)

    tomos = sorted(glob.glob(os.path.join(args.data, "train", "*[0-9].mrc")))
    labels = [t.replace(".mrc", "_actin.mrc") for t in tomos]
    local_dir = os.path.join(os.environ.get("SLURM_TMPDIR", "/tmp"), "actin_stage")
    local_tomos = stage_to_local(tomos + labels, local_dir, local_rank)[:len(tomos)]

    train_ds = ActinPatches(local_tomos, args.patch, args.samples)
    val_ds = ActinPatches(sorted(glob.glob(os.path.join(args.data, "val", "*[0-9].mrc"))), args.patch, 64 * world)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=DistributedSampler(val_ds, world, rank, shuffle=False),
                        num_workers=2)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(UNet3D()).to(device)
    model = DDP(model, device_ids=[local_rank])
    # linear scaling from the 8-GPU reference run (global batch 32)
    lr = args.lr * (world * args.batch_size) / 32
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    ckpt_path = os.path.join(args.run, "checkpoint.pt")
    start = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(args.run, exist_ok=True)
        print(f"world {world}, resume from epoch {start}, lr {lr:.2e}", flush=True)

    def save(epoch):
        if rank == 0:
            tmp = ckpt_path + ".tmp"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "world": world}, tmp)
            os.replace(tmp, ckpt_path)
        dist.barrier()

    stop_flag = torch.zeros(1, device=device)
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        train_ds.epoch = epoch
        model.train()
        t0 = time.time()
        for step, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.binary_cross_entropy_with_logits(model(x), y, pos_weight=torch.tensor(5.0, device=device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        model.eval()
        stats = torch.zeros(3, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                pred = model(x) > 0
                stats[0] += (pred & (y > 0.5)).sum()
                stats[1] += pred.sum()
                stats[2] += (y > 0.5).sum()
        dist.all_reduce(stats)
        dice = (2 * stats[0] / (stats[1] + stats[2]).clamp(min=1)).item()
        if rank == 0:
            print(f"epoch {epoch} dice {dice:.4f} loss(last) {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)
        save(epoch)

        # every rank must agree on stopping, the signal may reach the tasks at different times
        stop_flag.fill_(1.0 if STOP else 0.0)
        dist.all_reduce(stop_flag, op=dist.ReduceOp.MAX)
        if stop_flag.item() > 0:
            if rank == 0:
                print("USR1 received, checkpoint written, requeueing", flush=True)
                os.system(f"scontrol requeue {os.environ['SLURM_JOB_ID']}")
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
