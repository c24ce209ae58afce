"""ABMIL with instance dropout augmentation for IDH-mutation prediction in glioma WSIs.

Folds are built at patient level on the fly (several FFPE / frozen slides per patient
must never be split between train and test).

    torchrun --nproc_per_node=8 12_abmil_patient_folds.py --meta gbm_lgg.csv --feats /feats/ctp
"""
import argparse
import json
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import balanced_accuracy_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--meta", required=True, help="columns: patient, slide, idh (0/1)")
    ap.add_argument("--feats", required=True, help="directory of <slide>.pt bags")
    ap.add_argument("--n_folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--drop_inst", type=float, default=0.3, help="fraction of instances dropped per bag")
    ap.add_argument("--out", default="exp/idh_abmil")
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def patient_folds(meta, n_folds):
    patients = meta.patient.unique()
    np.random.shuffle(patients)
    return [set(chunk) for chunk in np.array_split(patients, n_folds)]


class PtBags(Dataset):
    def __init__(self, slides, labels, feats_dir, drop_inst=0.0):
        self.slides, self.labels = list(slides), list(labels)
        self.feats_dir = feats_dir
        self.drop_inst = drop_inst

    def __len__(self):
        return len(self.slides)

    def __getitem__(self, idx):
        bag = torch.load(os.path.join(self.feats_dir, f"{self.slides[idx]}.pt"), map_location="cpu").float()
        if self.drop_inst > 0 and bag.shape[0] > 16:
            keep = torch.rand(bag.shape[0]) >= self.drop_inst
            bag = bag[keep]
        return bag, self.labels[idx], self.slides[idx]


class ABMIL(nn.Module):
    def __init__(self, d_in=768, d_hid=384, n_cls=2):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(d_in, d_hid), nn.GELU(), nn.Dropout(0.1))
        self.att_v = nn.Linear(d_hid, 128)
        self.att_u = nn.Linear(d_hid, 128)
        self.att_w = nn.Linear(128, 1)
        self.cls = nn.Linear(d_hid, n_cls)

    def forward(self, bag):
        h = self.embed(bag)
        a = self.att_w(torch.tanh(self.att_v(h)) * torch.sigmoid(self.att_u(h)))
        a = torch.softmax(a, dim=0)
        return self.cls((a * h).sum(0, keepdim=True)), a.squeeze(-1)


@torch.no_grad()
def infer(net, loader, device):
    net.eval()
    out = []
    for bag, y, slide in loader:
        logits, _ = net(bag[0].to(device, non_blocking=True))
        out.append((slide[0], int(y), logits.softmax(-1)[0, 1].item()))
    world = dist.get_world_size()
    buf = [None] * world
    dist.all_gather_object(buf, out)
    dedup = {s: (y, p) for part in buf for s, y, p in part}
    slides = sorted(dedup)
    y = np.array([dedup[s][0] for s in slides])
    prob = np.array([dedup[s][1] for s in slides])
    return slides, y, prob


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    # different instance-dropout masks on each GPU
    seed_everything(args.seed + rank)

    meta = pd.read_csv(args.meta).dropna(subset=["idh"])
    meta["idh"] = meta.idh.astype(int)
    folds = patient_folds(meta, args.n_folds)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()

    all_pred = []
    for k, test_patients in enumerate(folds):
        tr = meta[~meta.patient.isin(test_patients)]
        te = meta[meta.patient.isin(test_patients)]
        train_ds = PtBags(tr.slide, tr.idh, args.feats, drop_inst=args.drop_inst)
        test_ds = PtBags(te.slide, te.idh, args.feats)
        sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
        train_dl = DataLoader(train_ds, batch_size=1, sampler=sampler, num_workers=6, pin_memory=True)
        test_dl = DataLoader(test_ds, batch_size=1, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=6, pin_memory=True)

        net = ABMIL().to(device)
        model = DDP(net, device_ids=[local_rank])
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))

        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            stat = torch.zeros(2, device=device)
            for bag, y, _ in train_dl:
                logits, _ = model(bag[0].to(device, non_blocking=True))
                loss = F.cross_entropy(logits, y.to(device), label_smoothing=0.1)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                stat += torch.stack([loss.detach(), torch.ones((), device=device)])
            dist.all_reduce(stat)
            if rank == 0:
                print(f"[fold {k}] epoch {epoch:02d} loss {(stat[0] / stat[1]).item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e}", flush=True)

        slides, y, prob = infer(net, test_dl, device)
        if rank == 0:
            auc = roc_auc_score(y, prob)
            bacc = balanced_accuracy_score(y, prob > 0.5)
            print(f"fold {k}: AUC {auc:.4f}  bAcc {bacc:.4f}  ({len(slides)} test slides)")
            torch.save(net.state_dict(), os.path.join(args.out, f"fold{k}.pt"))
            all_pred.append(pd.DataFrame({"slide": slides, "idh": y, "prob": prob, "fold": k}))
        dist.barrier()

    if rank == 0:
        pred = pd.concat(all_pred, ignore_index=True)
        pred.to_csv(os.path.join(args.out, "oof_predictions.csv"), index=False)
        per_fold = pred.groupby("fold").apply(lambda d: roc_auc_score(d.idh, d.prob))
        summary = {"pooled_auc": roc_auc_score(pred.idh, pred.prob),
                   "mean_fold_auc": float(per_fold.mean()), "std_fold_auc": float(per_fold.std())}
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(summary)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
