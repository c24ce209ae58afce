# EuroSAT (13-band Sentinel-2) land cover classification with a ResNet-50
# whose first conv takes 13 channels.
#
# run: torchrun --standalone --nproc_per_node=4 02_eurosat_multispectral_resnet.py \
#          --data_root /data/EuroSATallBands --epochs 30
import argparse
import glob
import os
import random

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

CLASSES = ["AnnualCrop", "Forest", "HerbaceousVegetation", "Highway", "Industrial",
           "Pasture", "PermanentCrop", "Residential", "River", "SeaLake"]
# per-band mean / std computed once on the training split
BAND_MEAN = [1354.4, 1118.2, 1042.9, 947.6, 1199.5, 2003.0, 2374.0, 2301.2, 732.2, 12.1, 1820.7, 1118.2, 2599.8]
BAND_STD = [245.7, 333.0, 395.1, 593.8, 566.4, 861.2, 1086.6, 1118.0, 404.9, 4.8, 1002.6, 761.3, 1231.6]


def get_args():
    parser = argparse.ArgumentParser(description="EuroSAT multispectral training")
    parser.add_argument("--data_root", type=str, default="/data/EuroSATallBands")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch_size", type=int, default=64, help="batch size per process")
    parser.add_argument("--lr", type=float, default=0.1, help="base lr for a global batch of 256")
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--save_dir", type=str, default="checkpoints/eurosat_r50")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class EuroSATMS(Dataset):
    def __init__(self, files, labels, train=True):
        self.files = files
        self.labels = labels
        self.train = train
        self.mean = torch.tensor(BAND_MEAN).view(-1, 1, 1)
        self.std = torch.tensor(BAND_STD).view(-1, 1, 1)

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        with rasterio.open(self.files[idx]) as src:
            img = src.read().astype(np.float32)  # (13, 64, 64)
        x = (torch.from_numpy(img) - self.mean) / self.std
        if self.train:
            if random.random() < 0.5:
                x = torch.flip(x, dims=[2])
            if random.random() < 0.5:
                x = torch.flip(x, dims=[1])
            x = torch.rot90(x, k=random.randint(0, 3), dims=[1, 2])
        return x, self.labels[idx]


def build_splits(root, seed):
    files, labels = [], []
    for ci, cname in enumerate(CLASSES):
        fs = sorted(glob.glob(os.path.join(root, cname, "*.tif")))
        files += fs
        labels += [ci] * len(fs)
    idx = np.random.RandomState(seed).permutation(len(files))
    n_val = int(0.2 * len(files))
    files = [files[i] for i in idx]
    labels = [labels[i] for i in idx]
    return (files[n_val:], labels[n_val:]), (files[:n_val], labels[:n_val])


def build_model(num_classes=10, in_ch=13):
    model = torchvision.models.resnet50(weights=None)
    model.conv1 = nn.Conv2d(in_ch, 64, kernel_size=7, stride=2, padding=3, bias=False)
    model.fc = nn.Linear(model.fc.in_features, num_classes)
    return model


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    (tr_f, tr_y), (va_f, va_y) = build_splits(args.data_root, args.seed)
    train_set = EuroSATMS(tr_f, tr_y, train=True)
    val_set = EuroSATMS(va_f, va_y, train=False)
    # each rank evaluates a strided slice of the validation set (no padding)
    val_set = Subset(val_set, list(range(rank, len(val_set), world_size)))

    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=128, shuffle=False, num_workers=args.workers)

    model = build_model(len(CLASSES))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    global_bs = args.batch_size * world_size
    lr = args.lr * global_bs / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    writer = None
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.save_dir, "tb"))
        print(f"world_size={world_size} global batch={global_bs} lr={lr:.4f}")

    best_acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        pbar = tqdm(train_loader, disable=rank != 0, desc=f"epoch {epoch}")
        for step, (x, y) in enumerate(pbar):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            out = model(x)
            loss = F.cross_entropy(out, y, label_smoothing=0.1)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % 20 == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg)
                avg /= world_size
                if rank == 0:
                    pbar.set_postfix(loss=f"{avg.item():.3f}")
                    writer.add_scalar("train/loss", avg.item(), epoch * len(train_loader) + step)
        scheduler.step()

        # validation: every rank on its own slice, then sum the counts
        model.eval()
        correct = torch.zeros(1, device=device)
        total = torch.zeros(1, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                pred = model.module(x).argmax(1)
                correct += (pred == y).sum()
                total += y.numel()
        dist.all_reduce(correct)
        dist.all_reduce(total)
        acc = (correct / total).item()

        if rank == 0:
            writer.add_scalar("val/acc", acc, epoch)
            print(f"[epoch {epoch}] val acc {acc:.4f}")
            state = {"epoch": epoch, "model": model.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "acc": acc}
            torch.save(state, os.path.join(args.save_dir, "last.pth"))
            if acc > best_acc:
                best_acc = acc
                torch.save(state, os.path.join(args.save_dir, "best.pth"))

    if rank == 0:
        writer.close()
        print(f"done, best val acc {best_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
