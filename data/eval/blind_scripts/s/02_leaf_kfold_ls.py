"""
Cassava-style leaf disease classifier. 5 folds, one fold per launch.
    torchrun --standalone --nproc_per_node=8 02_leaf_kfold_ls.py --fold 2
"""
import os
import sys
import math
import time
import argparse
import warnings

import numpy as np
import pandas as pd
from PIL import Image
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel
import torchvision.transforms as T
import timm

warnings.filterwarnings("ignore")


class CFG:
    root = "/data/cassava"
    model_name = "tf_efficientnet_b4_ns"
    size = 448
    n_classes = 5
    epochs = 10
    bs = 24  # per gpu
    lr = 1e-4
    min_lr = 1e-6
    weight_decay = 1e-6
    smoothing = 0.1
    num_workers = 8
    seed = 719
    out = "./weights"


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=CFG.epochs)
    ap.add_argument("--bs", type=int, default=CFG.bs)
    ap.add_argument("--debug", action="store_true")
    return ap.parse_args()


class LeafDataset(Dataset):
    def __init__(self, df, tfm):
        self.files = df["image_id"].values
        self.labels = df["label"].values
        self.tfm = tfm

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(os.path.join(CFG.root, "train_images", self.files[i])).convert("RGB")
        return self.tfm(img), int(self.labels[i]), i


train_tfm = T.Compose([
    T.RandomResizedCrop(CFG.size, scale=(0.6, 1.0)),
    T.RandomHorizontalFlip(),
    T.RandomVerticalFlip(),
    T.ColorJitter(0.2, 0.2, 0.2, 0.05),
    T.ToTensor(),
    T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
])
valid_tfm = T.Compose([
    T.Resize((CFG.size, CFG.size)),
    T.ToTensor(),
    T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
])


class AverageMeter:
    def __init__(self):
        self.sum = 0.0
        self.n = 0

    def update(self, v, n=1):
        self.sum += v * n
        self.n += n

    @property
    def avg(self):
        return self.sum / max(self.n, 1)


def train_one_epoch(model, loader, optimizer, scheduler, scaler, criterion, device, epoch, rank):
    model.train()
    meter = AverageMeter()
    for i, (x, y, _) in enumerate(loader):
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            out = model(x)
            loss = criterion(out, y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        meter.update(loss.item(), x.size(0))
        if rank == 0 and i % 50 == 0:
            print(f"  ep{epoch} it{i}/{len(loader)} loss {meter.avg:.4f}", flush=True)
    t = torch.tensor([meter.sum, meter.n], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


@torch.no_grad()
def valid_one_epoch(model, loader, device):
    model.eval()
    ce = nn.CrossEntropyLoss(reduction="none")
    idxs, losses, hits = [], [], []
    for x, y, ix in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            out = model(x)
        losses.append(ce(out.float(), y).cpu())
        hits.append((out.argmax(1) == y).float().cpu())
        idxs.append(ix)
    local = (torch.cat(idxs).numpy(), torch.cat(losses).numpy(), torch.cat(hits).numpy())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    ix = np.concatenate([g[0] for g in gathered])
    ls = np.concatenate([g[1] for g in gathered])
    hs = np.concatenate([g[2] for g in gathered])
    _, keep = np.unique(ix, return_index=True)  # sampler pads with repeats
    return float(ls[keep].mean()), float(hs[keep].mean())


def main():
    args = get_args()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(CFG.seed)
    np.random.seed(CFG.seed + rank)

    df = pd.read_csv(os.path.join(CFG.root, "train_folds.csv"))
    if args.debug:
        df = df.sample(800, random_state=CFG.seed).reset_index(drop=True)
    tr = df[df.fold != args.fold].reset_index(drop=True)
    va = df[df.fold == args.fold].reset_index(drop=True)

    train_ds = LeafDataset(tr, train_tfm)
    valid_ds = LeafDataset(va, valid_tfm)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    valid_sampler = DistributedSampler(valid_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler,
                              num_workers=CFG.num_workers, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=args.bs * 2, sampler=valid_sampler,
                              num_workers=CFG.num_workers, pin_memory=True)

    model = timm.create_model(CFG.model_name, pretrained=True, num_classes=CFG.n_classes)
    model = model.to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])

    optimizer = torch.optim.Adam(model.parameters(), lr=CFG.lr, weight_decay=CFG.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=args.epochs * len(train_loader), eta_min=CFG.min_lr)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=CFG.smoothing)

    if rank == 0:
        os.makedirs(CFG.out, exist_ok=True)
        hist = []
    best = 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        tr_loss = train_one_epoch(model, train_loader, optimizer, scheduler, scaler,
                                  criterion, device, epoch, rank)
        va_loss, va_acc = valid_one_epoch(model, valid_loader, device)
        if rank == 0:
            print(f"[fold {args.fold}] epoch {epoch} train {tr_loss:.4f} valid {va_loss:.4f} "
                  f"acc {va_acc:.4f} time {time.time() - t0:.1f}s", flush=True)
            hist.append(dict(epoch=epoch, train_loss=tr_loss, valid_loss=va_loss, acc=va_acc))
            pd.DataFrame(hist).to_csv(f"{CFG.out}/hist_fold{args.fold}.csv", index=False)
            if va_acc > best:
                best = va_acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": va_acc},
                           f"{CFG.out}/{CFG.model_name}_fold{args.fold}.pth")

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
