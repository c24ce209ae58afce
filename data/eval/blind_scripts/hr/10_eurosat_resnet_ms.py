"""EuroSAT-MS (13-band Sentinel-2) scene classification with a ResNet-50.

The first conv is widened from 3 to 13 input channels; the RGB filters of the
ImageNet weights are copied into B04/B03/B02 and the rest initialised with their mean.

Usage:
    torchrun --nproc_per_node=4 10_eurosat_resnet_ms.py --data /data/EuroSAT_MS --epochs 30
"""
import argparse
import os
import time

import numpy as np
import tifffile
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

CLASSES = ["AnnualCrop", "Forest", "HerbaceousVegetation", "Highway", "Industrial",
           "Pasture", "PermanentCrop", "Residential", "River", "SeaLake"]
# B01..B12 incl. B8A, EuroSAT order
MEAN = [1354.4, 1118.2, 1042.9, 947.6, 1199.5, 1999.8, 2369.2, 2296.8, 732.1, 12.1, 1819.0, 1118.9, 2594.1]
STD = [245.7, 333.0, 395.1, 593.7, 566.4, 861.2, 1086.6, 1117.9, 404.9, 4.8, 1002.6, 761.3, 1231.6]
RGB_IDX = [3, 2, 1]


def parse_args():
    parser = argparse.ArgumentParser(description="EuroSAT-MS DDP training")
    parser.add_argument("--data", default="/data/EuroSAT_MS")
    parser.add_argument("--output", default="./output/eurosat_r50")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--val-frac", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class EuroSATMS(Dataset):
    def __init__(self, root, train):
        self.samples = []
        for label, cls in enumerate(CLASSES):
            d = os.path.join(root, cls)
            for fname in sorted(os.listdir(d)):
                if fname.endswith(".tif"):
                    self.samples.append((os.path.join(d, fname), label))
        self.train = train
        self.mean = np.array(MEAN, dtype=np.float32)[:, None, None]
        self.std = np.array(STD, dtype=np.float32)[:, None, None]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        path, label = self.samples[idx]
        x = tifffile.imread(path).astype(np.float32).transpose(2, 0, 1)  # (13, 64, 64)
        x = (x - self.mean) / self.std
        if self.train:
            if np.random.rand() < 0.5:
                x = x[:, :, ::-1]
            if np.random.rand() < 0.5:
                x = x[:, ::-1, :]
            x = np.rot90(x, np.random.randint(4), axes=(1, 2))
        return torch.from_numpy(np.ascontiguousarray(x)), label


def build_model(num_bands, num_classes):
    model = torchvision.models.resnet50(weights=torchvision.models.ResNet50_Weights.IMAGENET1K_V2)
    old = model.conv1
    new = nn.Conv2d(num_bands, 64, kernel_size=7, stride=2, padding=3, bias=False)
    with torch.no_grad():
        w = old.weight.mean(dim=1, keepdim=True).repeat(1, num_bands, 1, 1)
        for dst, src in zip(RGB_IDX, range(3)):
            w[:, dst] = old.weight[:, src]
        new.weight.copy_(w)
    model.conv1 = new
    model.fc = nn.Linear(model.fc.in_features, num_classes)
    return model


def split_indices(n, val_frac, seed):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g).tolist()
    n_val = int(n * val_frac)
    return perm[n_val:], perm[:n_val]


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.backends.cudnn.benchmark = True

    full_train = EuroSATMS(args.data, train=True)
    full_eval = EuroSATMS(args.data, train=False)
    tr_idx, va_idx = split_indices(len(full_train), args.val_frac, args.seed)
    train_set = Subset(full_train, tr_idx)
    val_set = Subset(full_eval, va_idx[rank::world_size])

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=256, shuffle=False, num_workers=args.workers, pin_memory=True)

    model = build_model(len(MEAN), len(CLASSES)).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    # linear scaling from the reference lr at 256 images
    lr = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, weight_decay=args.wd, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    writer = None
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.output, "tb"))
        print(f"world={world_size} train={len(train_set)} val={len(va_idx)} lr={lr:.4f}")

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        meter = torch.zeros(3, device=device)  # loss sum, correct, count
        for images, targets in train_loader:
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            logits = model(images)
            loss = criterion(logits, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            meter += torch.stack([loss.detach() * images.size(0),
                                  (logits.argmax(1) == targets).sum().float(),
                                  torch.tensor(float(images.size(0)), device=device)])
        dist.all_reduce(meter)

        model.eval()
        val_meter = torch.zeros(2, device=device)
        with torch.no_grad():
            for images, targets in val_loader:
                images = images.to(device, non_blocking=True)
                targets = targets.to(device, non_blocking=True)
                pred = model.module(images).argmax(1)
                val_meter += torch.stack([(pred == targets).sum().float(),
                                          torch.tensor(float(targets.numel()), device=device)])
        dist.all_reduce(val_meter)
        val_acc = (val_meter[0] / val_meter[1]).item()

        if rank == 0:
            train_loss = (meter[0] / meter[2]).item()
            train_acc = (meter[1] / meter[2]).item()
            print(f"[{epoch:02d}] loss={train_loss:.4f} train_acc={train_acc:.4f} val_acc={val_acc:.4f} "
                  f"time={time.time() - start:.1f}s")
            writer.add_scalar("loss/train", train_loss, epoch)
            writer.add_scalar("acc/train", train_acc, epoch)
            writer.add_scalar("acc/val", val_acc, epoch)
            ckpt = {"epoch": epoch, "state_dict": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(), "val_acc": val_acc}
            torch.save(ckpt, os.path.join(args.output, "checkpoint.pth"))
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(ckpt, os.path.join(args.output, "model_best.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
