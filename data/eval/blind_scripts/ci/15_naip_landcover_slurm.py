"""NAIP 1 m land cover (Chesapeake classes), multi-node data parallel under Slurm.

One task per GPU, started directly by srun:

    #SBATCH --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 --cpus-per-task=16
    srun python 15_naip_landcover_slurm.py --data /lustre/proj/naip_cb/patches \
        --run-dir /lustre/proj/naip_cb/runs/$SLURM_JOB_ID

The patch archive is copied once per node to node-local NVMe ($TMPDIR) before
training; checkpoints and logs go to the Lustre run directory.
"""
import argparse
import datetime
import os
import shutil
import subprocess
import tarfile
import time

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import segmentation_models_pytorch as smp

# Chesapeake LC: 1 water, 2 tree canopy, 3 low vegetation, 4 barren, 5 impervious, 6 roads, 15 nodata
LC_TO_TRAIN = np.full(256, 255, np.uint8)
for src_id, dst_id in {1: 0, 2: 1, 3: 2, 4: 3, 5: 4, 6: 5}.items():
    LC_TO_TRAIN[src_id] = dst_id
CLASSES = ["water", "tree_canopy", "low_vegetation", "barren", "impervious", "roads"]
NAIP_MEAN = np.array([112.0, 119.5, 106.1, 132.4], np.float32)[:, None, None]
NAIP_STD = np.array([42.3, 36.8, 33.1, 44.9], np.float32)[:, None, None]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="folder with train.tar and val.tar")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3, help="for 256 patches per step")
    ap.add_argument("--workers", type=int, default=12)
    return ap.parse_args()


def init_distributed_from_slurm():
    rank = int(os.environ["SLURM_PROCID"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    if "MASTER_ADDR" not in os.environ:
        nodes = subprocess.check_output(
            ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], text=True).split()
        os.environ["MASTER_ADDR"] = nodes[0]
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=60))
    return rank, local_rank, world_size


def stage_to_local_disk(archive_dir, local_rank):
    """Unpack train/val archives onto this node's local disk (once per node)."""
    local_root = os.path.join(os.environ.get("TMPDIR", "/tmp"), "naip_cb")
    if local_rank == 0:
        for split in ("train", "val"):
            dst = os.path.join(local_root, split)
            if not os.path.isdir(dst):
                os.makedirs(local_root, exist_ok=True)
                with tarfile.open(os.path.join(archive_dir, f"{split}.tar")) as tar:
                    tar.extractall(local_root + ".partial")
                shutil.move(os.path.join(local_root + ".partial", split), dst)
    return local_root


class NAIPPatches(Dataset):
    def __init__(self, root, split, augment):
        self.dir = os.path.join(root, split)
        self.ids = sorted(f[:-9] for f in os.listdir(self.dir) if f.endswith("_naip.tif"))
        self.augment = augment

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        pid = self.ids[i]
        with rasterio.open(os.path.join(self.dir, f"{pid}_naip.tif")) as s:
            x = s.read().astype(np.float32)
        with rasterio.open(os.path.join(self.dir, f"{pid}_lc.tif")) as s:
            y = LC_TO_TRAIN[s.read(1)].astype(np.int64)
        x = (x - NAIP_MEAN) / NAIP_STD
        if self.augment:
            if np.random.rand() < 0.5:
                x, y = x[:, :, ::-1], y[:, ::-1]
            if np.random.rand() < 0.5:
                x, y = x[:, ::-1], y[::-1]
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


def main():
    args = parse_args()
    rank, local_rank, world = init_distributed_from_slurm()
    device = torch.device("cuda", local_rank)

    data_root = stage_to_local_disk(args.data, local_rank)
    dist.barrier()          # every node has finished unpacking

    train_ds = NAIPPatches(data_root, "train", augment=True)
    val_ds = NAIPPatches(data_root, "val", augment=False)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=7)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True,
                          persistent_workers=True, prefetch_factor=4)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, np.array_split(np.arange(len(val_ds)), world)[rank]),
                        batch_size=args.batch_size, num_workers=4, pin_memory=True)

    torch.manual_seed(7)
    model = smp.Unet("resnext50_32x4d", encoder_weights=None, in_channels=4, classes=len(CLASSES))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    # SyncBN keeps running stats identical on all ranks, so there is nothing to broadcast
    ddp = DDP(model, device_ids=[local_rank], broadcast_buffers=False, gradient_as_bucket_view=True)

    global_batch = args.batch_size * world
    lr = args.lr * global_batch / 256
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    iters = args.epochs * len(train_dl)
    warmup = min(1000, iters // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: (i + 1) / warmup if i < warmup else (1 - (i - warmup) / (iters - warmup)) ** 0.9)
    criterion = nn.CrossEntropyLoss(ignore_index=255)

    ckpt_path = os.path.join(args.run_dir, "checkpoint.pt")
    start_epoch = 0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
        print(f"world {world}, global batch {global_batch}, lr {lr:.4f}, start epoch {start_epoch}", flush=True)

    n = len(CLASSES)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 200 == 0:
                print(f"ep {epoch} it {it}/{len(train_dl)} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.5f}", flush=True)
        epoch_time = time.time() - t0

        model.eval()
        cm = torch.zeros(n, n, dtype=torch.int64, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in val_dl:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                p = model(x).argmax(1)
                m = y != 255
                cm += torch.bincount(y[m] * n + p[m], minlength=n * n).view(n, n)
        dist.all_reduce(cm)
        cmd = cm.double()
        iou = cmd.diag() / (cmd.sum(0) + cmd.sum(1) - cmd.diag()).clamp(min=1)
        if rank == 0:
            print(f"epoch {epoch} ({epoch_time:.0f}s) mIoU {iou.mean().item():.4f} "
                  + " ".join(f"{c}:{v:.3f}" for c, v in zip(CLASSES, iou.tolist())), flush=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
