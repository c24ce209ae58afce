"""
UBC-OCEAN subtype classifier on pre-extracted tiles.
torchrun --nproc_per_node=4 08_ubc_tiles_localrank.py --fold 0 --epochs 15
"""
import os
import time
import random
import argparse

import numpy as np
import pandas as pd
from PIL import Image
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
import torchvision.transforms as T
from sklearn.metrics import balanced_accuracy_score
import timm

LABELS = ["CC", "EC", "HGSC", "LGSC", "MC"]


def parse_args():
    parser = argparse.ArgumentParser(description="UBC tiles")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--tiles_csv", default="/mnt/ubc/tiles_512/tiles.csv")
    parser.add_argument("--tile_dir", default="/mnt/ubc/tiles_512")
    parser.add_argument("--model", default="efficientnet_b2")
    parser.add_argument("--fold", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=2023)
    parser.add_argument("--output", default="./out_ubc")
    return parser.parse_args()


def set_seed(s):
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)
    torch.cuda.manual_seed_all(s)


class TileDataset(Dataset):
    def __init__(self, df, tile_dir, transform):
        self.paths = [os.path.join(tile_dir, p) for p in df.tile_path]
        self.labels = df.label.map({l: i for i, l in enumerate(LABELS)}).values
        self.image_ids = df.image_id.values
        self.transform = transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, idx):
        img = Image.open(self.paths[idx]).convert("RGB")
        return self.transform(img), self.labels[idx], idx


def get_transforms():
    norm = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train = T.Compose([
        T.RandomResizedCrop(448, scale=(0.5, 1.0)),
        T.RandomHorizontalFlip(), T.RandomVerticalFlip(),
        T.RandomApply([T.RandomRotation(90)], p=0.5),
        T.ColorJitter(0.3, 0.3, 0.3, 0.1),
        T.ToTensor(), norm,
    ])
    val = T.Compose([T.Resize(448), T.ToTensor(), norm])
    return train, val


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    device = torch.device("cuda", args.local_rank)
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    set_seed(args.seed + rank)

    df = pd.read_csv(args.tiles_csv)
    tr_df = df[df.fold != args.fold].reset_index(drop=True)
    va_df = df[df.fold == args.fold].reset_index(drop=True)
    tf_tr, tf_va = get_transforms()
    train_ds = TileDataset(tr_df, args.tile_dir, tf_tr)
    val_ds = TileDataset(va_df, args.tile_dir, tf_va)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, pretrained=True, num_classes=len(LABELS))
    model.cuda(args.local_rank)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    # class weights against the HGSC majority
    counts = np.bincount(train_ds.labels, minlength=len(LABELS))
    w = torch.tensor(counts.sum() / (len(LABELS) * counts), dtype=torch.float32, device=device)
    criterion = nn.CrossEntropyLoss(weight=w)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer,
                                                           T_max=args.epochs * len(train_loader))
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        log_rows = []
    best_bacc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        loss_sum = torch.zeros(1, device=device)
        for step, (images, targets, _) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = criterion(model(images), targets)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum)
        train_loss = loss_sum.item() / (len(train_loader) * world_size)

        # tile-level probs -> slide-level vote
        model.eval()
        probs, idxs = [], []
        with torch.no_grad():
            for images, _, idx in val_loader:
                with torch.cuda.amp.autocast():
                    out = model(images.to(device, non_blocking=True)).softmax(1)
                probs.append(out.float().cpu().numpy())
                idxs.append(idx.numpy())
        gathered = [None] * world_size
        dist.all_gather_object(gathered, (np.concatenate(probs), np.concatenate(idxs)))

        if rank == 0:
            P = np.concatenate([g[0] for g in gathered])
            I = np.concatenate([g[1] for g in gathered])
            I, first = np.unique(I, return_index=True)
            tiles = va_df.loc[I, ["image_id", "label"]].copy()
            tiles[LABELS] = P[first]
            slide = tiles.groupby("image_id").agg({**{l: "mean" for l in LABELS}, "label": "first"})
            pred = np.array(LABELS)[slide[LABELS].values.argmax(1)]
            bacc = balanced_accuracy_score(slide.label.values, pred)
            print(f"epoch {epoch}: loss={train_loss:.4f} slide_bacc={bacc:.4f} "
                  f"({time.time() - tic:.0f}s)", flush=True)
            log_rows.append({"epoch": epoch, "loss": train_loss, "bacc": bacc})
            pd.DataFrame(log_rows).to_csv(os.path.join(args.output, f"log_f{args.fold}.csv"),
                                          index=False)
            if bacc > best_bacc:
                best_bacc = bacc
                torch.save(model.module.state_dict(),
                           os.path.join(args.output, f"{args.model}_f{args.fold}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
