"""Early-season maize stand counting (plants per plot) from UAV RGB plot images.

Direct count regression with a ResNet-50 backbone. Plots from the same field
are strongly correlated, so validation holds out whole fields.

torchrun --nproc_per_node=4 06_maize_stand_count_fieldsplit.py --csv /data/stand/plots.csv --img-dir /data/stand/plots
"""
import argparse
import math
import os
import random
from pathlib import Path

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
import torchvision.transforms as T


def parse_args():
    p = argparse.ArgumentParser(description="maize stand count")
    p.add_argument("--csv", required=True, help="columns: plot_id, field_id, image, count")
    p.add_argument("--img-dir", required=True)
    p.add_argument("--val-fields", type=int, default=3, help="number of held-out fields")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--height", type=int, default=768, help="plots are long strips: 768x256")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--out", default="runs/stand_count")
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


class PlotStrips(Dataset):
    def __init__(self, df, img_dir, tf):
        self.df = df.reset_index(drop=True)
        self.img_dir = Path(img_dir)
        self.tf = tf

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        img = Image.open(self.img_dir / r["image"]).convert("RGB")
        if img.width > img.height:  # store everything row-vertical
            img = img.rotate(90, expand=True)
        return self.tf(img), torch.tensor(float(r["count"]))


class CountRegressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = timm.create_model("resnet50", pretrained=True, num_classes=0)
        self.head = nn.Sequential(nn.Linear(2048, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 1))

    def forward(self, x):
        # predict log(1 + count), counts span 0 to ~120
        return self.head(self.backbone(x)).squeeze(1)


def warmup_cosine(epoch, warmup, total):
    if epoch < warmup:
        return (epoch + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (epoch - warmup) / max(1, total - warmup)))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different augmentation stream on each GPU
    seed_everything(args.seed + rank)

    df = pd.read_csv(args.csv)
    fields = sorted(df["field_id"].unique())
    random.shuffle(fields)
    val_fields = set(fields[: args.val_fields])
    train_df = df[~df["field_id"].isin(val_fields)]
    val_df = df[df["field_id"].isin(val_fields)]

    size = (args.height, args.width)
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([
        T.Resize(size),
        T.RandomHorizontalFlip(),
        T.RandomVerticalFlip(),
        T.RandomAffine(degrees=3, translate=(0.02, 0.02), scale=(0.95, 1.05)),
        T.ColorJitter(0.35, 0.35, 0.25, 0.04),
        T.RandomApply([T.GaussianBlur(5, sigma=(0.1, 1.5))], p=0.25),
        T.ToTensor(),
        norm,
    ])
    val_tf = T.Compose([T.Resize(size), T.ToTensor(), norm])

    train_ds = PlotStrips(train_df, args.img_dir, train_tf)
    val_ds = PlotStrips(val_df, args.img_dir, val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, list(range(rank, len(val_ds), world))),
                            batch_size=48, num_workers=args.workers, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(CountRegressor()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: warmup_cosine(e, args.warmup, args.epochs))

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(args.out)
        writer.add_text("val_fields", ", ".join(map(str, sorted(val_fields))))
        print(f"train plots {len(train_ds)}  val plots {len(val_ds)}  val fields {sorted(val_fields)}")

    best_mae = float("inf")
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        tr = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x)
            loss = F.smooth_l1_loss(pred.float(), torch.log1p(y))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tr[0] += loss.detach() * x.size(0)
            tr[1] += x.size(0)
        sched.step()

        model.eval()
        va = torch.zeros(3, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    cnt = torch.expm1(model.module(x).float()).clamp(min=0)
                va[0] += (cnt - y).abs().sum()
                va[1] += ((cnt - y) / y.clamp(min=1)).abs().sum()
                va[2] += y.numel()
        dist.all_reduce(tr)
        dist.all_reduce(va)
        mae, mape = (va[0] / va[2]).item(), (va[1] / va[2]).item()

        if rank == 0:
            writer.add_scalar("loss/train", (tr[0] / tr[1]).item(), epoch)
            writer.add_scalar("val/mae", mae, epoch)
            writer.add_scalar("val/mape", mape, epoch)
            print(f"epoch {epoch}: train {tr[0].item() / tr[1].item():.4f}  val MAE {mae:.2f}  MAPE {mape:.3f}")
            if mae < best_mae:
                best_mae = mae
                torch.save({"model": model.module.state_dict(), "val_fields": sorted(val_fields),
                            "epoch": epoch, "mae": mae}, os.path.join(args.out, "best.pt"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
