#!/usr/bin/env python
# RSNA Screening Mammography - image-level cancer classifier, 4 folds grouped by patient.
# Each fold gets its own process group (init/destroy), OOF probabilities are gathered
# on every rank and aggregated per (patient, laterality) for probabilistic F1.
#
#   torchrun --nproc_per_node=8 12_rsna_mammo_pf1_folds.py --csv data/train.csv --img-dir data/png_1536x960
import argparse
import os
import time
from datetime import timedelta

import cv2
import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.model_selection import StratifiedGroupKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--img-dir", required=True)
    ap.add_argument("--out", default="ckpt/mammo_effv2s")
    ap.add_argument("--arch", default="tf_efficientnetv2_s.in21k_ft_in1k")
    ap.add_argument("--folds", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--pos-weight", type=float, default=4.0)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


class EvalShard(Sampler):
    def __init__(self, n, rank, world_size):
        self.idx = np.arange(n)[rank::world_size].tolist()

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


class MammoDS(Dataset):
    def __init__(self, df, img_dir, train):
        self.paths = [os.path.join(img_dir, f"{p}/{i}.png") for p, i in zip(df.patient_id, df.image_id)]
        self.y = df.cancer.to_numpy(np.float32)
        self.rows = df.index.to_numpy()
        self.train = train

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = cv2.imread(self.paths[i], cv2.IMREAD_GRAYSCALE).astype(np.float32) / 255.0
        if self.train:
            if np.random.rand() < 0.5:
                img = img[:, ::-1]
            if np.random.rand() < 0.5:
                img = np.clip(img * np.random.uniform(0.85, 1.15) + np.random.uniform(-0.05, 0.05), 0, 1)
        x = torch.from_numpy(np.ascontiguousarray(img))[None].repeat(3, 1, 1)
        return (x - 0.45) / 0.25, self.y[i], self.rows[i]


def pfbeta(labels, preds, beta=1.0):
    preds = np.clip(preds, 0, 1)
    ctp = (preds * labels).sum()
    cfp = (preds * (1 - labels)).sum()
    y_true_count = labels.sum()
    if y_true_count == 0 or ctp + cfp == 0:
        return 0.0
    prec, rec = ctp / (ctp + cfp), ctp / y_true_count
    return float((1 + beta ** 2) * prec * rec / (beta ** 2 * prec + rec)) if prec + rec > 0 else 0.0


def best_pf1(df_pred):
    g = df_pred.groupby(["patient_id", "laterality"]).agg(y=("cancer", "max"), p=("prob", "mean"))
    scores = [(pfbeta(g.y.to_numpy(), (g.p.to_numpy() > t).astype(float)), t) for t in np.arange(0.05, 0.95, 0.01)]
    return max(scores)


@torch.no_grad()
def predict(net, loader, device, world_size):
    net.eval()
    probs, rows = [], []
    for x, _, r in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logit = net(x.to(device, non_blocking=True)) + net(x.flip(3).to(device, non_blocking=True))
        probs.append(torch.sigmoid(logit.float().squeeze(1) / 2))
        rows.append(r.to(device))
    probs, rows = torch.cat(probs), torch.cat(rows)
    all_probs = [torch.zeros_like(probs) for _ in range(world_size)]
    all_rows = [torch.zeros_like(rows) for _ in range(world_size)]
    dist.all_gather(all_probs, probs)
    dist.all_gather(all_rows, rows)
    return torch.cat(all_rows).cpu().numpy(), torch.cat(all_probs).cpu().numpy()


def run_fold(fold, df, args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=timedelta(minutes=45))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tr_df, va_df = df[df.fold != fold], df[df.fold == fold]
    tr_ds, va_ds = MammoDS(tr_df, args.img_dir, True), MammoDS(va_df, args.img_dir, False)
    tr_sampler = DistributedSampler(tr_ds, shuffle=True)
    tr_dl = DataLoader(tr_ds, args.bs, sampler=tr_sampler, num_workers=args.workers, pin_memory=True, drop_last=True)
    va_dl = DataLoader(va_ds, args.bs * 2, sampler=EvalShard(len(va_ds), rank, world_size),
                       num_workers=args.workers, pin_memory=True)

    net = timm.create_model(args.arch, pretrained=True, num_classes=1, drop_path_rate=0.2).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, epochs=args.epochs, steps_per_epoch=len(tr_dl),
                                                pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([args.pos_weight], device=device))

    best, best_oof = -1.0, None
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y, _ in tr_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(model(x).squeeze(1).float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()

        rows, probs = predict(net, va_dl, device, world_size)
        pred_df = df.loc[rows, ["patient_id", "laterality", "cancer"]].assign(prob=probs)
        pf1, thr = best_pf1(pred_df)
        if rank == 0:
            print(f"fold {fold} ep {epoch} pF1 {pf1:.4f} @ {thr:.2f} ({time.time() - t0:.0f}s)", flush=True)
            if pf1 > best:
                torch.save({"model": net.state_dict(), "thr": thr, "pf1": pf1},
                           os.path.join(args.out, f"{args.arch}_fold{fold}.pth"))
        if pf1 > best:
            best, best_oof = pf1, pred_df

    dist.barrier()
    dist.destroy_process_group()
    del model, net, opt
    torch.cuda.empty_cache()
    return best, best_oof


def main():
    args = get_args()
    os.makedirs(args.out, exist_ok=True)
    df = pd.read_csv(args.csv).reset_index(drop=True)
    sgkf = StratifiedGroupKFold(n_splits=args.folds, shuffle=True, random_state=2023)
    df["fold"] = -1
    for f, (_, va) in enumerate(sgkf.split(df, df.cancer, groups=df.patient_id)):
        df.loc[va, "fold"] = f

    oofs, scores = [], []
    for fold in range(args.folds):
        pf1, oof = run_fold(fold, df, args)
        scores.append(pf1)
        oofs.append(oof)

    if int(os.environ["RANK"]) == 0:
        oof = pd.concat(oofs)
        cv, thr = best_pf1(oof)
        print("fold pF1:", np.round(scores, 4), f"| OOF pF1 {cv:.4f} @ {thr:.2f}")
        oof.to_csv(os.path.join(args.out, "oof.csv"))


if __name__ == "__main__":
    main()
