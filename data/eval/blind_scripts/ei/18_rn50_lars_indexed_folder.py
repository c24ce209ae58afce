"""ResNet-50 / LARS on the Lustre copy of ImageNet, with a cached file index.

Listing 1.28M files on Lustre takes several minutes, so the (path, label) index
is built once and cached as JSON next to the run outputs.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        18_rn50_lars_indexed_folder.py --data /lustre/imagenet --work-dir /lustre/$USER/rn50_lars
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from timm.optim import Lars
from timm.utils import ModelEmaV2

IMG_EXT = (".jpeg", ".jpg", ".png")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--lr", type=float, default=0.2, help="per 256 images")
    p.add_argument("--wd", type=float, default=5e-5)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--ema-decay", type=float, default=0.9999)
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


def load_or_build_index(root, split, cache_dir):
    cache = os.path.join(cache_dir, f"index_{split}.json")
    if os.path.exists(cache):
        with open(cache) as f:
            return json.load(f)
    split_dir = os.path.join(root, split)
    classes = sorted(e.name for e in os.scandir(split_dir) if e.is_dir())
    samples = []
    for label, cls in enumerate(classes):
        for e in os.scandir(os.path.join(split_dir, cls)):
            if e.name.lower().endswith(IMG_EXT):
                samples.append((os.path.join(cls, e.name), label))
    samples.sort()
    index = {"root": split_dir, "classes": classes, "samples": samples}
    os.makedirs(cache_dir, exist_ok=True)
    with open(cache, "w") as f:
        json.dump(index, f)
    return index


class IndexedFolder(Dataset):
    def __init__(self, index, transform):
        self.root = index["root"]
        self.samples = index["samples"]
        self.transform = transform

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        rel, label = self.samples[i]
        with open(os.path.join(self.root, rel), "rb") as f:
            img = Image.open(f).convert("RGB")
        return self.transform(img), label


def make_loaders(args):
    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_idx = load_or_build_index(args.data, "train", args.work_dir)
    val_idx = load_or_build_index(args.data, "val", args.work_dir)
    train_ds = IndexedFolder(train_idx, T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(),
                                                   T.ToTensor(), norm]))
    val_ds = IndexedFolder(val_idx, T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    ts = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    vs = DistributedSampler(val_ds, shuffle=False)
    tl = DataLoader(train_ds, args.batch_size, sampler=ts, num_workers=args.workers,
                    pin_memory=True, drop_last=True, persistent_workers=True)
    vl = DataLoader(val_ds, 250, sampler=vs, num_workers=args.workers, pin_memory=True)
    return tl, vl, ts


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        x = x.to(device, non_blocking=True, memory_format=torch.channels_last)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        s[0] += (out.argmax(1) == y).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    return (100 * s[0] / s[1]).item()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    t_index = time.time()
    train_loader, val_loader, train_sampler = make_loaders(args)
    if rank == 0:
        print(f"index ready in {time.time() - t_index:.1f}s: "
              f"{len(train_loader.dataset)} train / {len(val_loader.dataset)} val", flush=True)

    model = torchvision.models.resnet50(zero_init_residual=True)
    model = model.to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])
    ema = ModelEmaV2(model.module, decay=args.ema_decay)

    peak = args.lr * args.batch_size * world / 256
    optimizer = Lars([{"params": [p for p in model.parameters() if p.ndim > 1],
                       "weight_decay": args.wd},
                      {"params": [p for p in model.parameters() if p.ndim <= 1],
                       "weight_decay": 0.0}],
                     lr=peak, momentum=0.9, trust_coeff=0.001)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    n = len(train_loader)
    total, warm = n * args.epochs, n * args.warmup_epochs

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            step = epoch * n + i
            lr = peak * (step + 1) / warm if step < warm else \
                peak * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
            for g in optimizer.param_groups:
                g["lr"] = lr
            x = x.to(device, non_blocking=True, memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            ema.update(model.module)
            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} {i}/{n} loss {loss.item():.4f} lr {lr:.4f} "
                      f"{(i + 1) * args.batch_size * world / (time.time() - t0):.0f} img/s",
                      flush=True)

        top1 = evaluate(model, val_loader, device)
        top1_ema = evaluate(ema.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: top1 {top1:.2f} ema {top1_ema:.2f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "ema": ema.module.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(args.work_dir, "last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
