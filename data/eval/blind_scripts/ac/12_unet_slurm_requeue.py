"""2D U-Net for liver/tumour segmentation on CT slices, one Slurm task per GPU.

#!/bin/bash
#SBATCH --job-name=ct-unet
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=4
#SBATCH --gres=gpu:4
#SBATCH --cpus-per-task=8
#SBATCH --time=12:00:00
#SBATCH --signal=USR1@300
#SBATCH --requeue
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((15000 + SLURM_JOB_ID % 10000))
srun --kill-on-bad-exit=1 python train_unet.py --data /project/ct/lits.h5 \
    --run-dir /project/ct/runs/unet-$SLURM_JOB_ID
"""
import argparse
import os
import shutil
import signal
import time

import h5py
import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

STOP = False


def _on_usr1(signum, frame):
    global STOP
    STOP = True


class Slices(Dataset):
    def __init__(self, h5_path, split, augment):
        self.path, self.split, self.augment = h5_path, split, augment
        with h5py.File(h5_path, "r") as f:
            self.n = f[f"{split}/image"].shape[0]
        self.f = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.f is None:  # open lazily, one handle per worker
            self.f = h5py.File(self.path, "r")
        img = self.f[f"{self.split}/image"][i].astype(np.float32)
        seg = self.f[f"{self.split}/mask"][i].astype(np.int64)
        img = np.clip(img, -200, 250) / 225.0
        if self.augment:
            if np.random.rand() < 0.5:
                img, seg = img[:, ::-1], seg[:, ::-1]
            k = np.random.randint(4)
            img, seg = np.rot90(img, k), np.rot90(seg, k)
        return torch.from_numpy(img.copy())[None], torch.from_numpy(seg.copy())


def dice_counts(logits, target, n_cls=3):
    pred = logits.argmax(1)
    out = []
    for c in range(1, n_cls):
        p, t = pred == c, target == c
        out += [(p & t).sum(), p.sum() + t.sum()]
    return torch.stack(out).double()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    args = ap.parse_args()

    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=world)
    signal.signal(signal.SIGUSR1, _on_usr1)

    # copy the HDF5 to the node's local SSD once per node, the other tasks on the node wait
    local_copy = os.path.join(os.environ.get("SLURM_TMPDIR", "/tmp"), os.path.basename(args.data))
    if local_rank == 0 and not os.path.exists(local_copy):
        shutil.copy(args.data, local_copy + ".part")
        os.rename(local_copy + ".part", local_copy)
    dist.barrier()

    train_ds = Slices(local_copy, "train", augment=True)
    val_ds = Slices(local_copy, "val", augment=False)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=6,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=32, num_workers=6)

    model = smp.Unet("resnet34", encoder_weights="imagenet", in_channels=1, classes=3)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    dice_loss = smp.losses.DiceLoss("multiclass")
    ce = nn.CrossEntropyLoss()
    lr = args.lr * world * args.bs / 64
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    os.makedirs(args.run_dir, exist_ok=True)
    ckpt_path = os.path.join(args.run_dir, "last.pt")
    start, best = 0, 0.0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start, best = ck["epoch"] + 1, ck["best"]

    def save(epoch):
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "best": best}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    for epoch in range(start, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tr = torch.zeros(2, device=device, dtype=torch.float64)
        for img, seg in train_dl:
            img, seg = img.to(device, non_blocking=True), seg.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(img)
            loss = ce(logits.float(), seg) + dice_loss(logits.float(), seg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tr += torch.stack([loss.detach().double(), torch.ones((), device=device, dtype=torch.float64)])
        sched.step()

        net = model.module
        net.eval()
        counts = torch.zeros(4, device=device, dtype=torch.float64)
        with torch.no_grad():
            for img, seg in val_dl:
                img, seg = img.to(device), seg.to(device)
                counts += dice_counts(net(img), seg)
        dist.all_reduce(counts)
        dist.all_reduce(tr)
        dice = (2 * counts[0::2] / counts[1::2].clamp(min=1)).tolist()
        if rank == 0:
            print(f"epoch {epoch} loss {(tr[0] / tr[1]).item():.4f} dice liver {dice[0]:.4f} tumour {dice[1]:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if dice[1] > best:
                torch.save(model.module.state_dict(), os.path.join(args.run_dir, "best_tumour.pt"))
        best = max(best, dice[1])
        save(epoch)

        # tasks can get USR1 at different points of the epoch; agree before leaving
        stop = torch.tensor([1.0 if STOP else 0.0], device=device)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item() > 0:
            if rank == 0:
                print("USR1 received, requeueing", flush=True)
                os.system(f"scontrol requeue {os.environ['SLURM_JOB_ID']}")
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
