"""Resumable ABMIL training for lung adenocarcinoma growth-pattern grading (3 grades), DDP.

Jobs on the shared cluster get pre-empted, so every epoch writes <out>/fold<k>/last.pt and the
script picks it up automatically when restarted with the same arguments.

    torchrun --nproc_per_node=4 20_abmil_resume_nsclc.py --fold 1
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
from sklearn.metrics import cohen_kappa_score, roc_auc_score
from sklearn.model_selection import StratifiedGroupKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--meta", default="/shared/luad/grading_meta.csv")   # patient, slide, grade (1-3)
    ap.add_argument("--bags", default="/shared/luad/bags_conch")         # <slide>.pt
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--n_folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--out", default="/shared/luad/runs/abmil_grade")
    ap.add_argument("--seed", type=int, default=21)
    return ap.parse_args()


class Bags(Dataset):
    def __init__(self, slides, grades, root):
        self.slides, self.grades, self.root = list(slides), list(grades), root

    def __len__(self):
        return len(self.slides)

    def __getitem__(self, i):
        x = torch.load(os.path.join(self.root, f"{self.slides[i]}.pt"), map_location="cpu")
        return x.float(), self.grades[i] - 1, i


class ABMIL(nn.Module):
    def __init__(self, d_in=512, d=256, n_classes=3):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(d_in, d), nn.ReLU(), nn.Dropout(0.2))
        self.att_v = nn.Sequential(nn.Linear(d, 128), nn.Tanh())
        self.att_u = nn.Sequential(nn.Linear(d, 128), nn.Sigmoid())
        self.att_w = nn.Linear(128, 1)
        self.head = nn.Linear(d, n_classes)

    def forward(self, x):
        h = self.fc(x)
        a = torch.softmax(self.att_w(self.att_v(h) * self.att_u(h)), dim=0)
        return self.head((a * h).sum(0, keepdim=True))


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    rows = []
    for x, y, i in loader:
        prob = F.softmax(net(x[0].to(device, non_blocking=True)), -1)[0].cpu().numpy()
        rows.append((int(i), int(y), prob))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, rows)
    uniq = {i: (y, p) for part in parts for i, y, p in part}
    y = np.array([v[0] for v in uniq.values()])
    P = np.stack([v[1] for v in uniq.values()])
    auc = roc_auc_score(y, P, multi_class="ovr", average="macro")
    kappa = cohen_kappa_score(y, P.argmax(1), weights="quadratic")
    return auc, kappa


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    meta = pd.read_csv(args.meta).sort_values("slide").reset_index(drop=True)
    sgkf = StratifiedGroupKFold(n_splits=args.n_folds, shuffle=True, random_state=args.seed)
    folds = list(sgkf.split(meta, meta.grade, groups=meta.patient))
    trainval_idx, test_idx = folds[args.fold]
    # next fold's test patients (within train+val) serve as validation set
    val_mask = np.isin(trainval_idx, folds[(args.fold + 1) % args.n_folds][1])
    train_idx, val_idx = trainval_idx[~val_mask], trainval_idx[val_mask]
    mk = lambda idx: Bags(meta.slide.values[idx], meta.grade.values[idx], args.bags)
    train_ds, val_ds, test_ds = mk(train_idx), mk(val_idx), mk(test_idx)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=1, sampler=train_sampler, num_workers=6, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=1, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=4)
    test_dl = DataLoader(test_ds, batch_size=1, sampler=DistributedSampler(test_ds, shuffle=False), num_workers=4)

    net = ABMIL().to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=args.wd)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-6)

    run_dir = os.path.join(args.out, f"fold{args.fold}")
    os.makedirs(run_dir, exist_ok=True)
    last_path, best_path = os.path.join(run_dir, "last.pt"), os.path.join(run_dir, "best.pt")
    start_epoch, best_auc = 0, -1.0
    if os.path.exists(last_path):
        state = torch.load(last_path, map_location=device)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start_epoch, best_auc = state["epoch"] + 1, state["best_auc"]
        if rank == 0:
            print(f"resumed from epoch {state['epoch']} (best val AUC {best_auc:.4f})", flush=True)
    model = DDP(net, device_ids=[local_rank])

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for x, y, _ in train_dl:
            loss = F.cross_entropy(model(x[0].to(device, non_blocking=True)), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(acc)

        val_auc, val_kappa = evaluate(net, val_dl, device)
        if val_auc > best_auc:
            best_auc = val_auc
            torch.save(net.state_dict(), best_path)
        torch.save({"epoch": epoch, "model": net.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "best_auc": best_auc}, last_path)
        if rank == 0:
            print(f"epoch {epoch:02d} loss {(acc[0] / acc[1]).item():.4f} val AUC {val_auc:.4f} "
                  f"qwk {val_kappa:.4f} ({time.time() - t0:.0f}s)", flush=True)

    dist.barrier()
    net.load_state_dict(torch.load(best_path, map_location=device))
    test_auc, test_kappa = evaluate(net, test_dl, device)
    if rank == 0:
        print(f"fold {args.fold}: test macro AUC {test_auc:.4f}  quadratic kappa {test_kappa:.4f}")
        with open(os.path.join(run_dir, "test_metrics.csv"), "w") as f:
            f.write("fold,val_auc,test_auc,test_qwk\n")
            f.write(f"{args.fold},{best_auc:.5f},{test_auc:.5f},{test_kappa:.5f}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
