"""Happywhale - Whale and Dolphin Identification.
EfficientNet + GeM + ArcFace (sub-center), kNN on embeddings for MAP@5.

torchrun --nproc_per_node=4 09_happywhale_arcface.py --fold 0 --backbone tf_efficientnet_b5_ns
"""
import argparse
import math
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
from sklearn.neighbors import NearestNeighbors
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="/data/happywhale/train_folds.csv")
    p.add_argument("--img-dir", default="/data/happywhale/cropped_train_images")
    p.add_argument("--out", default="./hw_out")
    p.add_argument("--backbone", default="tf_efficientnet_b5_ns")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--bs", type=int, default=16)
    p.add_argument("--lr-backbone", type=float, default=1.6e-4)
    p.add_argument("--lr-head", type=float, default=1.6e-3)
    p.add_argument("--emb", type=int, default=512)
    p.add_argument("--s", type=float, default=30.0)
    p.add_argument("--m", type=float, default=0.3)
    p.add_argument("--new-thr", type=float, default=0.6)
    return p.parse_args()


class WhaleDS(Dataset):
    def __init__(self, df, img_dir, tfm):
        self.files, self.labels, self.img_dir, self.tfm = df.image.values, df.label.values, img_dir, tfm

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = cv2.cvtColor(cv2.imread(os.path.join(self.img_dir, self.files[i])), cv2.COLOR_BGR2RGB)
        return self.tfm(image=img)["image"], self.labels[i], i


def tfms(size):
    tr = A.Compose([A.Resize(size, size), A.HorizontalFlip(), A.Affine(rotate=(-15, 15), translate_percent=0.1, scale=(0.8, 1.2), shear=(-10, 10), p=0.7),
                    A.ToGray(p=0.1), A.RandomBrightnessContrast(p=0.5), A.Normalize(), ToTensorV2()])
    va = A.Compose([A.Resize(size, size), A.Normalize(), ToTensorV2()])
    return tr, va


class GeM(nn.Module):
    def __init__(self, p=3.0, eps=1e-6):
        super().__init__()
        self.p, self.eps = nn.Parameter(torch.ones(1) * p), eps

    def forward(self, x):
        return F.avg_pool2d(x.clamp(min=self.eps).pow(self.p), x.shape[-2:]).pow(1.0 / self.p).flatten(1)


class ArcMarginProduct(nn.Module):
    def __init__(self, in_f, out_f, s, m):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_f, in_f))
        nn.init.xavier_uniform_(self.weight)
        self.s, self.cos_m, self.sin_m = s, math.cos(m), math.sin(m)
        self.th, self.mm = math.cos(math.pi - m), math.sin(math.pi - m) * m

    def forward(self, x, label):
        cosine = F.linear(F.normalize(x), F.normalize(self.weight)).float()
        sine = torch.sqrt((1.0 - cosine.pow(2)).clamp(0, 1))
        phi = cosine * self.cos_m - sine * self.sin_m
        phi = torch.where(cosine > self.th, phi, cosine - self.mm)
        one_hot = F.one_hot(label, cosine.size(1)).float()
        return (one_hot * phi + (1.0 - one_hot) * cosine) * self.s


class WhaleNet(nn.Module):
    def __init__(self, backbone, n_classes, emb, s, m):
        super().__init__()
        self.backbone = timm.create_model(backbone, pretrained=True, num_classes=0, global_pool="")
        self.pool = GeM()
        self.neck = nn.Sequential(nn.Linear(self.backbone.num_features, emb), nn.BatchNorm1d(emb), nn.PReLU())
        self.arc = ArcMarginProduct(emb, n_classes, s, m)

    def extract(self, x):
        return self.neck(self.pool(self.backbone(x)))

    def forward(self, x, y):
        return self.arc(self.extract(x), y)


@torch.no_grad()
def embed(net, ds, bs, device):
    sampler = DistributedSampler(ds, shuffle=False)
    dl = DataLoader(ds, batch_size=bs, sampler=sampler, num_workers=6)
    net.eval()
    idx, E = [], []
    for x, _, i in dl:
        x = x.to(device)
        with torch.cuda.amp.autocast():
            e = net.extract(x) + net.extract(x.flip(3))
        E.append(F.normalize(e.float()).cpu().numpy())
        idx.append(i.numpy())
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (np.concatenate(idx), np.concatenate(E)))
    out = np.zeros((len(ds), E[0].shape[1]), dtype=np.float32)
    for i, e in parts:
        out[i] = e
    return out


def map5(db_emb, db_ids, q_emb, q_ids, new_thr):
    nn_ = NearestNeighbors(n_neighbors=50, metric="cosine").fit(db_emb)
    dist_, idx = nn_.kneighbors(q_emb)
    score = 0.0
    for q in range(len(q_emb)):
        preds = []
        for d, j in zip(dist_[q], idx[q]):
            if 1 - d < new_thr and "new_individual" not in preds:
                preds.append("new_individual")
            if db_ids[j] not in preds:
                preds.append(db_ids[j])
            if len(preds) == 5:
                break
        if q_ids[q] in preds[:5]:
            score += 1.0 / (preds.index(q_ids[q]) + 1)
    return score / len(q_emb)


def main():
    a = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, device = dist.get_rank(), torch.device("cuda", local_rank)
    torch.manual_seed(42)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)

    df = pd.read_csv(a.csv)
    ids_sorted = sorted(df.individual_id.unique())
    df["label"] = df.individual_id.map({k: i for i, k in enumerate(ids_sorted)})
    trn, val = df[df.fold != a.fold].reset_index(drop=True), df[df.fold == a.fold].reset_index(drop=True)
    tr_tf, va_tf = tfms(a.size)
    tr_ds = WhaleDS(trn, a.img_dir, tr_tf)
    sampler = DistributedSampler(tr_ds, shuffle=True, drop_last=True)
    dl = DataLoader(tr_ds, batch_size=a.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)

    model = WhaleNet(a.backbone, len(ids_sorted), a.emb, a.s, a.m).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam([
        {"params": model.backbone.parameters(), "lr": a.lr_backbone},
        {"params": list(model.pool.parameters()) + list(model.neck.parameters()) + list(model.arc.parameters()),
         "lr": a.lr_head},
    ])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[a.lr_backbone, a.lr_head],
                                                total_steps=a.epochs * len(dl), pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler()
    ce = nn.CrossEntropyLoss()

    best = 0.0
    for ep in range(a.epochs):
        sampler.set_epoch(ep)
        model.train()
        t0, tot = time.time(), torch.zeros(2, device=device)
        for x, y, _ in dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = ce(model(x, y), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        if ep % 2 == 1 or ep == a.epochs - 1:
            db_emb = embed(model.module, WhaleDS(trn, a.img_dir, va_tf), a.bs * 4, device)
            q_emb = embed(model.module, WhaleDS(val, a.img_dir, va_tf), a.bs * 4, device)
            if rank == 0:
                score = map5(db_emb, trn.individual_id.values, q_emb, val.individual_id.values, a.new_thr)
                print(f"ep {ep} loss {(tot[0] / tot[1]).item():.4f} MAP@5 {score:.4f} ({time.time() - t0:.0f}s)", flush=True)
                if score > best:
                    best = score
                    torch.save(model.module.state_dict(), os.path.join(a.out, f"{a.backbone}_fold{a.fold}.pth"))
                    np.save(os.path.join(a.out, f"val_emb_fold{a.fold}.npy"), q_emb)
            dist.barrier()
        elif rank == 0:
            print(f"ep {ep} loss {(tot[0] / tot[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
