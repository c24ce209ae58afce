# RANZCR CLiP - catheter/line position, 11 labels. Soft pseudo-labels on NIH CXR14, 2-3 rounds.
#
#   torchrun --nproc_per_node=8 16_ranzcr_pseudo_rounds.py --fold 0 --rounds 3
#
import os
import time
import argparse

import cv2
import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader, ConcatDataset
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
import albumentations as A
from albumentations.pytorch import ToTensorV2
from sklearn.metrics import roc_auc_score
import timm

TARGETS = ["ETT - Abnormal", "ETT - Borderline", "ETT - Normal", "NGT - Abnormal",
           "NGT - Borderline", "NGT - Incompletely Imaged", "NGT - Normal", "CVC - Abnormal",
           "CVC - Borderline", "CVC - Normal", "Swan Ganz Catheter Present"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ranzcr", default="/data/ranzcr")
    p.add_argument("--nih", default="/data/nih_cxr14/images_512")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--arch", default="resnet200d")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--bs", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--pl_frac", type=float, default=1.0, help="fraction of NIH used per round")
    p.add_argument("--out", default="./pl_runs")
    return p.parse_args()


def tf(size, train):
    t = [A.RandomResizedCrop(size, size, scale=(0.85, 1.0)), A.HorizontalFlip(),
         A.RandomBrightnessContrast(0.2, 0.2, p=0.7),
         A.ShiftScaleRotate(0.05, 0.1, 15, border_mode=0, p=0.7)] if train else [A.Resize(size, size)]
    return A.Compose(t + [A.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
                          ToTensorV2()])


class CXR(Dataset):
    def __init__(self, paths, labels, transform):
        self.paths = list(paths)
        self.labels = labels.astype(np.float32)
        self.t = transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = cv2.imread(self.paths[i], cv2.IMREAD_GRAYSCALE)
        img = cv2.cvtColor(img, cv2.COLOR_GRAY2RGB)
        return self.t(image=img)["image"], self.labels[i], i


@torch.no_grad()
def predict(net, ds, bs, device, world):
    """distributed inference over ds; returns full prediction array on every rank"""
    sampler = DistributedSampler(ds, shuffle=False)
    dl = DataLoader(ds, bs, sampler=sampler, num_workers=8, pin_memory=True)
    net.eval()
    P, I = [], []
    for x, _, i in dl:
        x = x.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            p = (net(x).sigmoid() + net(x.flip(3)).sigmoid()) / 2
        P.append(p.float().cpu().numpy())
        I.append(i.numpy())
    parts = [None] * world
    dist.all_gather_object(parts, (np.concatenate(P), np.concatenate(I)))
    P = np.concatenate([q[0] for q in parts])
    I = np.concatenate([q[1] for q in parts])
    out = np.zeros((len(ds), P.shape[1]), dtype=np.float32)
    out[I] = P
    return out


def train_round(rnd, args, train_ds, val_ds, val_y, device, rank, world, local_rank):
    net = timm.create_model(args.arch, pretrained=True, num_classes=len(TARGETS)).to(device)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    model = DDP(net, device_ids=[local_rank])
    sampler = DistributedSampler(train_ds, shuffle=True, seed=rnd)
    dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=8, pin_memory=True,
                    drop_last=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * len(dl), eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    bce = nn.BCEWithLogitsLoss()
    best_path = f"{args.out}/{args.arch}_f{args.fold}_r{rnd}.pth"
    best = 0.0
    for ep in range(args.epochs):
        sampler.set_epoch(ep)
        model.train()
        t0 = time.time()
        for x, y, _ in dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = bce(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
        pv = predict(net, val_ds, args.bs * 2, device, world)
        auc = np.mean([roc_auc_score(val_y[:, c], pv[:, c]) for c in range(len(TARGETS))])
        if rank == 0:
            print(f"[round {rnd}] ep {ep} val mAUC {auc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if auc > best:
                best = auc
                torch.save(net.state_dict(), best_path)
    return net, best_path


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    df = pd.read_csv(f"{args.ranzcr}/train_folds.csv")
    tr, va = df[df.fold != args.fold], df[df.fold == args.fold]
    img = lambda d: [f"{args.ranzcr}/train_512/{u}.jpg" for u in d.StudyInstanceUID]
    lab_ds = CXR(img(tr), tr[TARGETS].values, tf(args.size, True))
    val_ds = CXR(img(va), va[TARGETS].values, tf(args.size, False))
    val_y = va[TARGETS].values

    nih = pd.read_csv(f"{args.nih}/../Data_Entry_2017.csv")
    nih_paths = [f"{args.nih}/{f}" for f in nih["Image Index"].values]
    nih_plain = CXR(nih_paths, np.zeros((len(nih), len(TARGETS))), tf(args.size, False))

    train_ds = lab_ds
    for rnd in range(args.rounds):
        net, best_path = train_round(rnd, args, train_ds, val_ds, val_y, device, rank, world,
                                     local_rank)
        if rnd == args.rounds - 1:
            break
        # teacher = best epoch of this round
        net.load_state_dict(torch.load(best_path, map_location=device))
        soft = predict(net, nih_plain, args.bs * 2, device, world)
        if rank == 0:
            pl = pd.DataFrame(soft, columns=TARGETS)
            pl.insert(0, "path", nih_paths)
            pl.to_csv(f"{args.out}/nih_pl_f{args.fold}_r{rnd}.csv", index=False)
        rng = np.random.default_rng(rnd)
        take = rng.permutation(len(nih))[: int(args.pl_frac * len(nih))]
        pl_ds = CXR([nih_paths[i] for i in take], soft[take], tf(args.size, True))
        train_ds = ConcatDataset([lab_ds, pl_ds])
        del net
        torch.cuda.empty_cache()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
