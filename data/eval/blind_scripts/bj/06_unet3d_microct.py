"""3D U-Net segmentation of synchrotron micro-CT rock volumes (pore / grain / clay).

Volumes are stored as zarr arrays (2048^3 uint16) on the project file system and cut
into random 96^3 patches on the fly; at 96^3 with fp16 only 2 patches fit per GPU.

    #SBATCH --nodes=4 --gpus-per-node=4 --ntasks-per-node=1
    srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=4 --rdzv_backend=c10d \
         --rdzv_endpoint=$MASTER_ADDR:29500 06_unet3d_microct.py --config configs/unet3d.yaml
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
import zarr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class PatchDataset(Dataset):
    def __init__(self, volumes, labels, patch, samples_per_volume, intensity_stats, train=True):
        self.vols = [zarr.open(v, mode="r") for v in volumes]
        self.labs = [zarr.open(l, mode="r") for l in labels]
        self.patch = patch
        self.spv = samples_per_volume
        self.mu, self.sigma = intensity_stats
        self.train = train

    def __len__(self):
        return len(self.vols) * self.spv

    def __getitem__(self, idx):
        v = idx // self.spv
        rng = np.random.default_rng(None if self.train else idx)
        shape = self.vols[v].shape
        z, y, x = (rng.integers(0, s - self.patch) for s in shape)
        sl = (slice(z, z + self.patch), slice(y, y + self.patch), slice(x, x + self.patch))
        img = (self.vols[v][sl].astype(np.float32) - self.mu) / self.sigma
        lab = self.labs[v][sl].astype(np.int64)
        if self.train:
            for ax in range(3):
                if rng.random() < 0.5:
                    img, lab = np.flip(img, ax), np.flip(lab, ax)
        return torch.from_numpy(img.copy())[None], torch.from_numpy(lab.copy())


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv3d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm3d(cout),
        nn.ReLU(inplace=True),
        nn.Conv3d(cout, cout, 3, padding=1, bias=False),
        nn.BatchNorm3d(cout),
        nn.ReLU(inplace=True),
    )


class UNet3D(nn.Module):
    def __init__(self, in_ch=1, n_classes=3, base=32, depth=4):
        super().__init__()
        chs = [base * 2 ** i for i in range(depth + 1)]
        self.down = nn.ModuleList([conv_block(in_ch, chs[0])] +
                                  [conv_block(chs[i], chs[i + 1]) for i in range(depth)])
        self.up = nn.ModuleList([nn.ConvTranspose3d(chs[i + 1], chs[i], 2, stride=2) for i in reversed(range(depth))])
        self.dec = nn.ModuleList([conv_block(2 * chs[i], chs[i]) for i in reversed(range(depth))])
        self.head = nn.Conv3d(chs[0], n_classes, 1)

    def forward(self, x):
        skips = []
        for i, blk in enumerate(self.down):
            x = blk(x)
            if i < len(self.down) - 1:
                skips.append(x)
                x = F.max_pool3d(x, 2)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips)):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.head(x)


def dice_loss(logits, target, n_classes, eps=1.0):
    probs = logits.softmax(1)
    onehot = F.one_hot(target, n_classes).permute(0, 4, 1, 2, 3).float()
    inter = (probs * onehot).sum(dim=(0, 2, 3, 4))
    denom = probs.sum(dim=(0, 2, 3, 4)) + onehot.sum(dim=(0, 2, 3, 4))
    return 1 - ((2 * inter + eps) / (denom + eps)).mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    stats = np.load(cfg["intensity_stats"])  # mean / std of the training volumes, precomputed
    stats = (float(stats["mean"]), float(stats["std"]))
    train_ds = PatchDataset(cfg["train_volumes"], cfg["train_labels"], cfg["patch"],
                            cfg["samples_per_volume"], stats, train=True)
    val_ds = PatchDataset(cfg["val_volumes"], cfg["val_labels"], cfg["patch"],
                          cfg["val_samples_per_volume"], stats, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=cfg["batch_size"], num_workers=4)

    n_classes = cfg["n_classes"]
    model = UNet3D(n_classes=n_classes, base=cfg["base_channels"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=1e-5)
    steps = cfg["epochs"] * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg["lr"], total_steps=steps, pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler()
    class_w = torch.tensor(cfg["class_weights"], device=device)

    writer = SummaryWriter(cfg["log_dir"]) if rank == 0 else None
    if rank == 0:
        os.makedirs(cfg["ckpt_dir"], exist_ok=True)
    step = 0
    best_miou = 0.0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for img, lab in train_loader:
            img, lab = img.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(img)
                loss = F.cross_entropy(logits, lab, weight=class_w) + dice_loss(logits.float(), lab, n_classes)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if writer is not None and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)

        # confusion matrix over this rank's patches, summed across ranks
        model.eval()
        conf = torch.zeros(n_classes, n_classes, device=device, dtype=torch.long)
        with torch.no_grad():
            for img, lab in val_loader:
                img, lab = img.to(device), lab.to(device)
                with torch.autocast("cuda", dtype=torch.float16):
                    pred = model.module(img).argmax(1)
                conf += torch.bincount(lab.view(-1) * n_classes + pred.view(-1),
                                       minlength=n_classes ** 2).view(n_classes, n_classes)
        dist.all_reduce(conf)
        tp = conf.diag().float()
        iou = tp / (conf.sum(0) + conf.sum(1) - conf.diag()).float().clamp(min=1)
        miou = iou.mean().item()

        if rank == 0:
            print(f"epoch {epoch} mIoU {miou:.4f} per-class {[round(v, 3) for v in iou.tolist()]} "
                  f"{time.time() - t0:.0f}s", flush=True)
            writer.add_scalar("val/mIoU", miou, step)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch}
            torch.save(ckpt, os.path.join(cfg["ckpt_dir"], "last.pt"))
            if miou > best_miou:
                best_miou = miou
                torch.save(ckpt, os.path.join(cfg["ckpt_dir"], "best.pt"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
