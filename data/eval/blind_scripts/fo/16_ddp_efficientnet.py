"""EfficientNet-B3 fine-tuning for plant-disease classification.
DDP, fp16 autocast + GradScaler, EMA of weights, gradient accumulation.

torchrun --standalone --nproc_per_node=4 16_ddp_efficientnet.py --csv data/train.csv --img_dir data/images
"""
import argparse
import contextlib
import copy
import os

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--img_dir", required=True)
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--arch", default="efficientnet_b3")
    p.add_argument("--img_size", type=int, default=384)
    p.add_argument("--bs", type=int, default=24)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--ema_decay", type=float, default=0.9995)
    p.add_argument("--out", default="weights")
    return p.parse_args()


class LeafDataset(Dataset):
    def __init__(self, df, img_dir, tf):
        self.paths = [os.path.join(img_dir, f) for f in df["image_id"]]
        self.labels = df["label"].tolist()
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.tf(Image.open(self.paths[i]).convert("RGB")), self.labels[i]


class ModelEma:
    def __init__(self, model, decay):
        self.module = copy.deepcopy(model).eval()
        self.decay = decay
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for e, m in zip(self.module.state_dict().values(), model.state_dict().values()):
            if e.dtype.is_floating_point:
                e.mul_(self.decay).add_(m.detach(), alpha=1 - self.decay)
            else:
                e.copy_(m)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            p = model(x).argmax(1)
        s[0] += (p == y).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    df = pd.read_csv(args.csv)
    skf = StratifiedKFold(n_splits=5, shuffle=True, random_state=42)
    train_idx, val_idx = list(skf.split(df, df["label"]))[args.fold]
    num_classes = df["label"].nunique()

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(args.img_size, scale=(0.5, 1.0)),
        transforms.RandomHorizontalFlip(), transforms.RandomVerticalFlip(),
        transforms.ColorJitter(0.2, 0.2, 0.2), transforms.ToTensor(), norm])
    val_tf = transforms.Compose([transforms.Resize(args.img_size), transforms.CenterCrop(args.img_size),
                                 transforms.ToTensor(), norm])
    train_ds = LeafDataset(df.iloc[train_idx], args.img_dir, train_tf)
    val_ds = LeafDataset(df.iloc[val_idx], args.img_dir, val_tf)
    val_part = torch.utils.data.Subset(val_ds, list(range(rank, len(val_ds), world)))

    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_part, batch_size=64, shuffle=False, num_workers=4, pin_memory=True)

    model = timm.create_model(args.arch, pretrained=True, num_classes=num_classes, drop_rate=0.3)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    ema = ModelEma(model, args.ema_decay)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-2)
    steps = args.epochs * (len(train_loader) // args.accum)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr * world, total_steps=steps,
                                                    pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.05)

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        optimizer.zero_grad(set_to_none=True)
        n_updates = len(train_loader) // args.accum
        for i, (x, y) in enumerate(train_loader):
            if i >= n_updates * args.accum:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            do_update = (i + 1) % args.accum == 0
            with contextlib.nullcontext() if do_update else model.no_sync():
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = criterion(model(x), y) / args.accum
                scaler.scale(loss).backward()
            if do_update:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 3.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                ema.update(model.module)
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} iter {i}/{len(train_loader)} loss {loss.item() * args.accum:.4f}", flush=True)

        acc = evaluate(model.module, val_loader, device)
        acc_ema = evaluate(ema.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} fold {args.fold} acc {acc:.4f} ema_acc {acc_ema:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            if max(acc, acc_ema) > best:
                best = max(acc, acc_ema)
                sd = ema.module.state_dict() if acc_ema >= acc else model.module.state_dict()
                torch.save(sd, os.path.join(args.out, f"{args.arch}_fold{args.fold}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
