"""Swin-B fine-tuning on a medical imaging dataset (multi-label chest X-ray).
Mixed precision (fp16) with GradScaler, gradient accumulation, DDP.

torchrun --nproc_per_node=4 19_ddp_swin_amp.py --cfg configs/swin_cxr.yaml
"""
import argparse
import contextlib
import os
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

LABELS = ["Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Effusion", "Emphysema", "Fibrosis",
          "Hernia", "Infiltration", "Mass", "Nodule", "Pleural_Thickening", "Pneumonia", "Pneumothorax"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--cfg", default=None)
    p.add_argument("--root", default="/data/nih_cxr")
    p.add_argument("--model", default="swin_base_patch4_window7_224.ms_in22k")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch_size", type=int, default=48)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--out", default="output/swin_cxr")
    args = p.parse_args()
    if args.cfg:
        with open(args.cfg) as f:
            for k, v in yaml.safe_load(f).items():
                setattr(args, k, v)
    return args


class CXRDataset(Dataset):
    def __init__(self, root, split_file, tf):
        df = pd.read_csv(os.path.join(root, "Data_Entry_2017.csv"))
        with open(os.path.join(root, split_file)) as f:
            keep = set(line.strip() for line in f)
        df = df[df["Image Index"].isin(keep)].reset_index(drop=True)
        self.paths = [os.path.join(root, "images", n) for n in df["Image Index"]]
        self.targets = np.stack([df["Finding Labels"].str.contains(l).values for l in LABELS], 1).astype(np.float32)
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(self.paths[i]).convert("RGB")
        return self.tf(img), torch.from_numpy(self.targets[i])


@torch.no_grad()
def gather_predictions(model, loader, device, world):
    model.eval()
    probs, targets = [], []
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            probs.append(torch.sigmoid(model(x.to(device)).float()))
        targets.append(y.to(device))
    probs, targets = torch.cat(probs), torch.cat(targets)
    out_p = [torch.empty_like(probs) for _ in range(world)]
    out_t = [torch.empty_like(targets) for _ in range(world)]
    dist.all_gather(out_p, probs)
    dist.all_gather(out_t, targets)
    model.train()
    return torch.cat(out_p).cpu().numpy(), torch.cat(out_t).cpu().numpy()


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(args.device)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.7, 1.0)),
                                   transforms.RandomRotation(7), transforms.ToTensor(), norm])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    train_ds = CXRDataset(args.root, "train_val_list.txt", train_tf)
    val_ds = CXRDataset(args.root, "test_list.txt", val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    # equal-sized shards so all_gather gets equal shapes; drops < world images
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=128, sampler=val_sampler, num_workers=8, pin_memory=True)

    model = timm.create_model(args.model, pretrained=True, num_classes=len(LABELS))
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    pos_frac = torch.from_numpy(train_ds.targets.mean(0))
    criterion = nn.BCEWithLogitsLoss(pos_weight=((1 - pos_frac) / pos_frac).clamp(max=20).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    updates_per_epoch = len(train_loader) // args.accum
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * updates_per_epoch)
    scaler = torch.cuda.amp.GradScaler()

    best_auc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            if it >= updates_per_epoch * args.accum:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            update = (it + 1) % args.accum == 0
            with contextlib.nullcontext() if update else model.no_sync():
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = criterion(model(x), y) / args.accum
                scaler.scale(loss).backward()
            if update:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            if rank == 0 and it % 100 == 0:
                print(f"[{epoch}] {it}/{len(train_loader)} loss {loss.item() * args.accum:.4f} "
                      f"scale {scaler.get_scale():.0f} {time.time() - t0:.0f}s", flush=True)

        probs, targets = gather_predictions(model.module, val_loader, device, world)
        if rank == 0:
            aucs = [roc_auc_score(targets[:, k], probs[:, k]) for k in range(len(LABELS))]
            mean_auc = float(np.mean(aucs))
            print(f"epoch {epoch} mean AUROC {mean_auc:.4f} | "
                  + " ".join(f"{l[:5]}={a:.3f}" for l, a in zip(LABELS, aucs)), flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "auc": mean_auc},
                       os.path.join(args.out, "last.pth"))
            if mean_auc > best_auc:
                best_auc = mean_auc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
