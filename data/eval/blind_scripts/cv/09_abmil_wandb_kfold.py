"""Slide-level grading (low vs high grade) with ABMIL on pre-extracted features.

One wandb run per fold, grouped by experiment name, so the CV curves can be compared
side by side in the dashboard.

    torchrun --nproc_per_node=4 09_abmil_wandb_kfold.py --exp abmil_grade_r50 --features /scratch/feats/r50
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedGroupKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--exp", default="abmil_grade")
    p.add_argument("--project", default="wsi-grading")
    p.add_argument("--slides", default="/scratch/meta/grading_slides.csv")
    p.add_argument("--features", default="/scratch/feats/r50")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--patience", type=int, default=10)
    p.add_argument("--ckpt_dir", default="/scratch/ckpt")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class Bags(Dataset):
    def __init__(self, slide_ids, labels, features):
        self.slide_ids, self.labels, self.features = list(slide_ids), list(labels), features

    def __len__(self):
        return len(self.slide_ids)

    def __getitem__(self, i):
        x = torch.load(f"{self.features}/{self.slide_ids[i]}.pt", map_location="cpu")
        return x, self.labels[i], i


class Attn_Net(nn.Module):
    def __init__(self, L=512, D=256, dropout=True):
        super().__init__()
        layers = [nn.Linear(L, D), nn.Tanh()]
        if dropout:
            layers.append(nn.Dropout(0.25))
        layers.append(nn.Linear(D, 1))
        self.module = nn.Sequential(*layers)

    def forward(self, x):
        return self.module(x)


class ABMIL(nn.Module):
    def __init__(self, dim_in=1024, n_classes=2):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(dim_in, 512), nn.ReLU(), nn.Dropout(0.25))
        self.attention = Attn_Net(512, 256)
        self.classifier = nn.Linear(512, n_classes)

    def forward(self, x):
        h = self.fc(x)
        A = F.softmax(self.attention(h).T, dim=1)
        return self.classifier(A @ h)


@torch.no_grad()
def gather_predictions(net, loader, device, world):
    net.eval()
    mine = []
    for x, y, i in loader:
        p = F.softmax(net(x[0].to(device)), dim=1)[0, 1].item()
        mine.append((int(i), p, int(y)))
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    table = {}
    for chunk in everyone:
        for i, p, y in chunk:
            table[i] = (p, y)
    p = np.array([table[i][0] for i in sorted(table)])
    y = np.array([table[i][1] for i in sorted(table)])
    return p, y


def run_fold(args, fold, tr_df, te_df, rank, world, local_rank):
    device = torch.device(f"cuda:{local_rank}")
    run = wandb.init(project=args.project, group=args.exp, name=f"{args.exp}_fold{fold}",
                     config={**vars(args), "fold": fold, "world_size": world}, reinit=True)

    tr_ds = Bags(tr_df.slide_id, tr_df.y, args.features)
    te_ds = Bags(te_df.slide_id, te_df.y, args.features)
    tr_sampler = DistributedSampler(tr_ds, shuffle=True, seed=args.seed)
    tr_dl = DataLoader(tr_ds, batch_size=1, sampler=tr_sampler, num_workers=4, pin_memory=True)
    te_dl = DataLoader(te_ds, batch_size=1, sampler=DistributedSampler(te_ds, shuffle=False), num_workers=4)

    net = ABMIL(args.dim).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.wd)
    class_w = torch.tensor(len(tr_df) / (2 * np.bincount(tr_df.y, minlength=2)), dtype=torch.float, device=device)

    ckpt = os.path.join(args.ckpt_dir, args.exp, f"fold{fold}.pt")
    best_auc, since_best = -1.0, 0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for x, y, _ in tr_dl:
            out = model(x[0].to(device, non_blocking=True))
            loss = F.cross_entropy(out, y.to(device), weight=class_w)
            opt.zero_grad()
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        p, y = gather_predictions(net, te_dl, device, world)
        auc = roc_auc_score(y, p)
        run.log({"epoch": epoch, "train/loss": (acc[0] / acc[1]).item(), "test/auc": auc,
                 "epoch_time": time.time() - t0})
        if auc > best_auc:
            best_auc, since_best = auc, 0
            if rank == 0:
                torch.save(net.state_dict(), ckpt)
        else:
            since_best += 1
        if since_best >= args.patience:
            break

    run.summary["best_auc"] = best_auc
    run.finish()
    dist.barrier()
    return best_auc


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    df = pd.read_csv(args.slides)
    df = df[df.grade.isin(["low", "high"])].reset_index(drop=True)
    df["y"] = (df.grade == "high").astype(int)
    if rank == 0:
        os.makedirs(os.path.join(args.ckpt_dir, args.exp), exist_ok=True)
    dist.barrier()

    cv = StratifiedGroupKFold(n_splits=args.k, shuffle=True, random_state=args.seed)
    scores = []
    for fold, (tr, te) in enumerate(cv.split(df, df.y, groups=df.patient_id)):
        scores.append(run_fold(args, fold, df.iloc[tr].reset_index(drop=True),
                               df.iloc[te].reset_index(drop=True), rank, world, local_rank))
    if rank == 0:
        print("best AUC per fold:", " ".join(f"{s:.4f}" for s in scores))
        print(f"mean {np.mean(scores):.4f} +- {np.std(scores):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
