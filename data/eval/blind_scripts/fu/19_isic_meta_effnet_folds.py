"""SIIM-ISIC melanoma: image + patient metadata, triple-stratified 5-fold, DDP on 8 GPUs.

Image features come from an EfficientNet backbone (GeM-pooled feature map) and are
concatenated with a small MLP over the tabular metadata.

    torchrun --nproc_per_node=8 19_isic_meta_effnet_folds.py --data /data/isic2020_512 --out runs/b4_meta
"""
import argparse
import os
import time

import albumentations as A
import cv2
import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from albumentations.pytorch import ToTensorV2
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

META_COLS = ["sex", "age_approx", "n_images", "image_size"] + [
    f"site_{s}" for s in ["head/neck", "lower extremity", "oral/genital", "palms/soles", "torso", "upper extremity",
                          "nan"]]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="folder with train.csv (incl. tfrecord fold) and jpeg/")
    ap.add_argument("--out", default="runs/b4_meta")
    ap.add_argument("--arch", default="tf_efficientnet_b4_ns")
    ap.add_argument("--size", type=int, default=448)
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--bs", type=int, default=24)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def prepare_meta(df, data_dir):
    df = df.copy()
    df["sex"] = df["sex"].map({"male": 1, "female": 0}).fillna(-1)
    df["age_approx"] = df["age_approx"].fillna(0) / 90.0
    df["n_images"] = np.log1p(df.patient_id.map(df.patient_id.value_counts()))
    sizes = [os.path.getsize(os.path.join(data_dir, "jpeg", f"{n}.jpg")) for n in df.image_name]
    df["image_size"] = np.log(np.asarray(sizes, np.float32))
    site = df["anatom_site_general_challenge"].fillna("nan")
    for s in META_COLS[4:]:
        df[s] = (site == s[len("site_"):]).astype(np.float32)
    for c in ["n_images", "image_size"]:
        df[c] = (df[c] - df[c].mean()) / df[c].std()
    return df


class ISICDataset(Dataset):
    def __init__(self, df, img_dir, tf):
        self.paths = [os.path.join(img_dir, f"{n}.jpg") for n in df.image_name]
        self.meta = df[META_COLS].to_numpy(np.float32)
        self.y = df.target.to_numpy(np.float32)
        self.rows = df.index.to_numpy()
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = cv2.cvtColor(cv2.imread(self.paths[i]), cv2.COLOR_BGR2RGB)
        img = self.tf(image=img)["image"]
        return img, torch.from_numpy(self.meta[i]), self.y[i], self.rows[i]


def get_tf(size, train):
    if not train:
        return A.Compose([A.Resize(size, size), A.Normalize(), ToTensorV2()])
    return A.Compose([
        A.Transpose(p=0.5), A.VerticalFlip(p=0.5), A.HorizontalFlip(p=0.5),
        A.RandomBrightnessContrast(0.2, 0.2, p=0.75),
        A.OneOf([A.MotionBlur(blur_limit=5), A.MedianBlur(blur_limit=5), A.GaussianBlur(blur_limit=(3, 5))], p=0.7),
        A.HueSaturationValue(10, 20, 10, p=0.5),
        A.ShiftScaleRotate(shift_limit=0.1, scale_limit=0.1, rotate_limit=15, border_mode=0, p=0.85),
        A.Resize(size, size), A.CoarseDropout(max_holes=1, max_height=int(size * 0.375),
                                              max_width=int(size * 0.375), p=0.7),
        A.Normalize(), ToTensorV2(),
    ])


class GeM(nn.Module):
    def __init__(self, p=3.0, eps=1e-6):
        super().__init__()
        self.p = nn.Parameter(torch.ones(1) * p)
        self.eps = eps

    def forward(self, x):
        return F.avg_pool2d(x.clamp(min=self.eps).pow(self.p), x.shape[-2:]).pow(1.0 / self.p).flatten(1)


class MelanomaNet(nn.Module):
    def __init__(self, arch, n_meta):
        super().__init__()
        self.backbone = timm.create_model(arch, pretrained=True)
        nf = self.backbone.num_features
        self.pool = GeM()
        self.meta = nn.Sequential(nn.Linear(n_meta, 128), nn.BatchNorm1d(128), nn.SiLU(), nn.Dropout(0.3),
                                  nn.Linear(128, 32), nn.BatchNorm1d(32), nn.SiLU())
        self.dropouts = nn.ModuleList([nn.Dropout(0.5) for _ in range(5)])
        self.fc = nn.Linear(nf + 32, 1)

    def forward(self, x, meta):
        feat = self.pool(self.backbone.forward_features(x))
        feat = torch.cat([feat, self.meta(meta)], 1)
        if self.training:
            return torch.stack([self.fc(d(feat)) for d in self.dropouts]).mean(0).squeeze(1)
        return self.fc(feat).squeeze(1)


@torch.no_grad()
def predict(model, loader, device, world_size):
    model.eval()
    rows, probs = [], []
    for x, m, _, r in loader:
        x, m = x.to(device), m.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            p = torch.stack([torch.sigmoid(model(t, m).float()) for t in (x, x.flip(2), x.flip(3), x.transpose(2, 3))])
        probs.append(p.mean(0).cpu().numpy())
        rows.append(r.numpy())
    parts = [None] * world_size
    dist.all_gather_object(parts, (np.concatenate(rows), np.concatenate(probs)))
    rows = np.concatenate([q[0] for q in parts])
    probs = np.concatenate([q[1] for q in parts])
    rows, keep = np.unique(rows, return_index=True)
    return rows, probs[keep]


def run_fold(fold, df, args, rank, local_rank, world_size):
    device = torch.device("cuda", local_rank)
    img_dir = os.path.join(args.data, "jpeg")
    tr_ds = ISICDataset(df[df.fold != fold], img_dir, get_tf(args.size, True))
    va_ds = ISICDataset(df[df.fold == fold], img_dir, get_tf(args.size, False))
    tr_sampler = DistributedSampler(tr_ds, shuffle=True)
    tr_dl = DataLoader(tr_ds, args.bs, sampler=tr_sampler, num_workers=args.workers, pin_memory=True, drop_last=True)
    va_dl = DataLoader(va_ds, args.bs * 2, sampler=DistributedSampler(va_ds, shuffle=False),
                       num_workers=args.workers, pin_memory=True)

    model = MelanomaNet(args.arch, len(META_COLS))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=args.epochs - 1, eta_min=1e-7)
    scaler = torch.cuda.amp.GradScaler()

    best_auc, best = 0.0, None
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, m, y, _ in tr_dl:
            x, m, y = x.to(device, non_blocking=True), m.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.binary_cross_entropy_with_logits(model(x, m).float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        sched.step()

        rows, probs = predict(model, va_dl, device, world_size)
        auc = roc_auc_score(df.loc[rows, "target"], probs)
        if rank == 0:
            print(f"fold {fold} epoch {epoch} val AUC {auc:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if auc > best_auc:
                torch.save(model.module.state_dict(), os.path.join(args.out, f"{args.arch}_meta_fold{fold}.pth"))
        if auc > best_auc:
            best_auc, best = auc, (rows, probs)
    return best_auc, best


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.out, exist_ok=True)

    df = pd.read_csv(os.path.join(args.data, "train.csv"))
    # 15 tfrecords from the triple-stratified split (by patient, target, count) -> 5 folds
    df["fold"] = df["tfrecord"] % args.folds
    df = prepare_meta(df, args.data).reset_index(drop=True)

    oof = np.zeros(len(df), np.float32)
    aucs = []
    for fold in range(args.folds):
        auc, (rows, probs) = run_fold(fold, df, args, rank, local_rank, world_size)
        oof[rows] = probs
        aucs.append(auc)
    if rank == 0:
        print("fold AUC", np.round(aucs, 4), f"| OOF AUC {roc_auc_score(df.target, oof):.4f}")
        df[["image_name", "patient_id", "target", "fold"]].assign(pred=oof).to_csv(
            os.path.join(args.out, "oof.csv"), index=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
