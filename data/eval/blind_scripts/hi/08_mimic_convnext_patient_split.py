#!/usr/bin/env python
"""
ConvNeXt-T on MIMIC-CXR-JPG with CheXpert labels (14 findings, U-Ignore).
We do our own patient-level 90/10 train/val split (the official validate split is too small).

    torchrun --nproc_per_node=8 08_mimic_convnext_patient_split.py --root /data/mimic-cxr-jpg/2.0.0
"""
import argparse
import os
import random
from collections import defaultdict

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

LABELS = ["Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Enlarged Cardiomediastinum",
          "Fracture", "Lung Lesion", "Lung Opacity", "No Finding", "Pleural Effusion", "Pleural Other",
          "Pneumonia", "Pneumothorax", "Support Devices"]


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def load_metadata(root):
    meta = pd.read_csv(os.path.join(root, "mimic-cxr-2.0.0-metadata.csv.gz"))
    meta = meta[meta.ViewPosition.isin(["PA", "AP"])]
    lab = pd.read_csv(os.path.join(root, "mimic-cxr-2.0.0-chexpert.csv.gz"))
    df = meta.merge(lab, on=["subject_id", "study_id"], how="inner")
    df["path"] = df.apply(lambda r: f"files/p{str(r.subject_id)[:2]}/p{r.subject_id}/s{r.study_id}/"
                                    f"{r.dicom_id}.jpg", axis=1)
    return df.reset_index(drop=True)


def split_by_patient(df, val_frac=0.1):
    subjects = sorted(df.subject_id.unique().tolist())
    random.shuffle(subjects)
    n_val = int(len(subjects) * val_frac)
    val_subjects = set(subjects[:n_val])
    is_val = df.subject_id.isin(val_subjects)
    return df[~is_val].reset_index(drop=True), df[is_val].reset_index(drop=True)


class MimicCXR(Dataset):
    def __init__(self, df, root, tf):
        self.paths = df["path"].tolist()
        y = df[LABELS].values.astype(np.float32)
        self.mask = (~np.isnan(y) & (y != -1)).astype(np.float32)   # U-Ignore
        self.y = np.nan_to_num(np.clip(y, 0, 1), nan=0.0)
        self.root = root
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, self.paths[i])).convert("RGB")
        return self.tf(img), torch.from_numpy(self.y[i]), torch.from_numpy(self.mask[i]), i


def masked_bce(logits, y, m):
    return (F.binary_cross_entropy_with_logits(logits, y, reduction="none") * m).sum() / m.sum().clamp_min(1)


@torch.no_grad()
def evaluate(model, loader, device, world):
    model.eval()
    out_p, out_y, out_m, out_i = [], [], [], []
    for x, y, m, i in loader:
        out_p.append(torch.sigmoid(model(x.to(device, non_blocking=True)).float()))
        out_y.append(y.to(device))
        out_m.append(m.to(device))
        out_i.append(i.to(device))
    tensors = [torch.cat(t) for t in (out_p, out_y, out_m, out_i)]
    gathered = []
    for t in tensors:
        buf = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(buf, t)
        gathered.append(torch.cat(buf).cpu().numpy())
    p, y, m, idx = gathered
    _, keep = np.unique(idx, return_index=True)
    p, y, m = p[keep], y[keep], m[keep]
    aucs = {}
    for k, name in enumerate(LABELS):
        sel = m[:, k] > 0
        if sel.sum() > 0 and len(np.unique(y[sel, k])) == 2:
            aucs[name] = roc_auc_score(y[sel, k], p[sel, k])
    model.train()
    return aucs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="ckpt/mimic_convnext_t")
    ap.add_argument("--arch", default="convnext_tiny.fb_in22k")
    ap.add_argument("--img", type=int, default=384)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--seed", type=int, default=17)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different seed per rank so the random augmentations are not identical across GPUs
    seed_everything(args.seed + rank)

    df = load_metadata(args.root)
    train_df, val_df = split_by_patient(df)
    if rank == 0:
        print(f"{len(train_df)} train images / {len(val_df)} val images")

    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = T.Compose([T.RandomResizedCrop(args.img, scale=(0.8, 1.0)), T.RandomRotation(7),
                          T.ToTensor(), T.Normalize(mean, std)])
    val_tf = T.Compose([T.Resize((args.img, args.img)), T.ToTensor(), T.Normalize(mean, std)])
    train_ds = MimicCXR(train_df, args.root, train_tf)
    val_ds = MimicCXR(val_df, args.root, val_tf)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=10,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=64, sampler=val_sampler, num_workers=10, pin_memory=True)

    model = timm.create_model(args.arch, pretrained=True, num_classes=len(LABELS), drop_path_rate=0.1)
    model = DDP(model.to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    steps = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps, pct_start=0.05)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for step, (x, y, m, _) in enumerate(train_dl):
            x, y, m = x.to(device, non_blocking=True), y.to(device), m.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = masked_bce(logits.float(), y, m)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and step % 250 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        aucs = evaluate(model, val_dl, device, world)
        if rank == 0:
            mauc = float(np.mean(list(aucs.values())))
            print(f"epoch {epoch} val mAUC {mauc:.4f}", {k: round(v, 3) for k, v in aucs.items()}, flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "aucs": aucs},
                       os.path.join(args.out, "last.pt"))
            if mauc > best:
                best = mauc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "aucs": aucs},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
