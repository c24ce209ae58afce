"""
Study-level CheXpert classifier that fuses the frontal view with the lateral view when the
study has one. Two ConvNeXt-S towers (no weight sharing), late fusion by concatenation.

    torchrun --nproc_per_node=4 11_frontal_lateral_fusion.py --root /data/CheXpert-v1.0 --bs 12
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

TASKS = ["Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Pleural Effusion"]


def study_table(root, csv_name):
    df = pd.read_csv(os.path.join(root, csv_name))
    df["study"] = df["Path"].str.rsplit("/", n=1).str[0]
    rows = []
    for study, g in df.groupby("study", sort=True):
        fr = g[g["Frontal/Lateral"] == "Frontal"]
        la = g[g["Frontal/Lateral"] == "Lateral"]
        if len(fr) == 0:
            continue
        lab = fr.iloc[0][TASKS].fillna(0).replace(-1, 1).values.astype(np.float32)  # U-Ones
        rows.append((fr.iloc[0]["Path"], la.iloc[0]["Path"] if len(la) else None, lab))
    return rows


class StudyDataset(Dataset):
    def __init__(self, rows, prefix, size, train):
        self.rows = rows
        self.prefix = prefix
        aug = [T.RandomResizedCrop(size, scale=(0.85, 1.0)), T.RandomRotation(8)] if train else [T.Resize((size, size))]
        self.tf = T.Compose(aug + [T.ToTensor(), T.Normalize([0.5] * 3, [0.25] * 3)])
        self.size = size

    def __len__(self):
        return len(self.rows)

    def _load(self, rel):
        return self.tf(Image.open(os.path.join(self.prefix, rel)).convert("RGB"))

    def __getitem__(self, i):
        frontal_path, lateral_path, y = self.rows[i]
        frontal = self._load(frontal_path)
        if lateral_path is not None:
            lateral, has_lat = self._load(lateral_path), True
        else:
            lateral, has_lat = torch.zeros(3, self.size, self.size), False
        return frontal, lateral, torch.tensor(has_lat), torch.from_numpy(y), i


class FusionNet(nn.Module):
    def __init__(self, arch, n_out):
        super().__init__()
        self.frontal_net = timm.create_model(arch, pretrained=True, num_classes=0)
        self.lateral_net = timm.create_model(arch, pretrained=True, num_classes=0)
        d = self.frontal_net.num_features
        self.head = nn.Sequential(nn.Linear(2 * d + 1, 512), nn.GELU(), nn.Dropout(0.2), nn.Linear(512, n_out))

    def forward(self, frontal, lateral, has_lat):
        f = self.frontal_net(frontal)
        l = torch.zeros_like(f)
        if has_lat.any():
            l[has_lat] = self.lateral_net(lateral[has_lat]).to(l.dtype)
        return self.head(torch.cat([f, l, has_lat.float().unsqueeze(1).to(f.dtype)], dim=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--arch", default="convnext_small.fb_in22k_ft_in1k")
    ap.add_argument("--size", type=int, default=320)
    ap.add_argument("--bs", type=int, default=12)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--out", default="runs/fusion_convnext_s")
    args = ap.parse_args()

    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", lr_)
    torch.manual_seed(0)

    prefix = os.path.dirname(args.root.rstrip("/"))
    train_rows = study_table(args.root, "train.csv")
    valid_rows = study_table(args.root, "valid.csv")
    train_ds = StudyDataset(train_rows, prefix, args.size, True)
    valid_ds = StudyDataset(valid_rows, prefix, args.size, False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True,
                          drop_last=True)
    valid_dl = DataLoader(valid_ds, batch_size=32, shuffle=False, num_workers=4)
    if rank == 0:
        n_lat = sum(r[1] is not None for r in train_rows)
        print(f"{len(train_rows)} train studies, {n_lat} with a lateral view; {len(valid_rows)} valid studies")

    model = FusionNet(args.arch, len(TASKS)).to(dev)
    model = DDP(model, device_ids=[lr_])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_dl), eta_min=1e-6)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (fr, la, has_lat, y, _) in enumerate(train_dl):
            fr, la, has_lat, y = fr.to(dev, non_blocking=True), la.to(dev, non_blocking=True), has_lat.to(dev), y.to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(fr, la, has_lat)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{len(train_dl)} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)

        if rank == 0:
            net = model.module.eval()
            probs, gts = [], []
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                for fr, la, has_lat, y, _ in valid_dl:
                    probs.append(torch.sigmoid(net(fr.to(dev), la.to(dev), has_lat.to(dev)).float()).cpu())
                    gts.append(y)
            p, g = torch.cat(probs).numpy(), torch.cat(gts).numpy()
            aucs = [roc_auc_score(g[:, k], p[:, k]) for k in range(len(TASKS))]
            mean_auc = float(np.mean(aucs))
            print(f"epoch {epoch} valid AUC " + " ".join(f"{t}={a:.3f}" for t, a in zip(TASKS, aucs))
                  + f" mean={mean_auc:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if mean_auc > best:
                best = mean_auc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "auc": mean_auc},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
