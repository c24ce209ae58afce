"""Lymphovascular invasion (LVI) present/absent from WSIs: gated ABMIL, class-balanced sampling, DDP.

Only ~12% of slides are LVI-positive, so training draws slides with probability inversely
proportional to class frequency (same as CLAM's --weighted_sample).

    torchrun --nproc_per_node=4 18_abmil_weighted_sampling.py --split_dir splits/lvi_5fold --k 5
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
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler


def arguments():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="dataset_csv/lvi.csv")          # case_id, slide_id, label
    ap.add_argument("--data_root", default="/data/lvi/FEATURES_uni")
    ap.add_argument("--split_dir", default="splits/lvi_5fold")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--reg", type=float, default=1e-4)
    ap.add_argument("--weighted_sample", type=int, default=1)
    ap.add_argument("--results_dir", default="results/lvi_abmil")
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


class SlideBags(Dataset):
    def __init__(self, df, data_root):
        self.df = df.reset_index(drop=True)
        self.data_root = data_root

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        sid = self.df.slide_id[i]
        x = torch.load(os.path.join(self.data_root, "pt_files", f"{sid}.pt"), map_location="cpu")
        return x, int(self.df.label[i]), i

    def sample_weights(self):
        y = self.df.label.values
        per_class = len(y) / np.bincount(y, minlength=2)
        return torch.as_tensor(per_class[y], dtype=torch.double)


class Attn_Net_Gated(nn.Module):
    def __init__(self, L=512, D=256, dropout=0.25):
        super().__init__()
        self.attention_a = nn.Sequential(nn.Linear(L, D), nn.Tanh(), nn.Dropout(dropout))
        self.attention_b = nn.Sequential(nn.Linear(L, D), nn.Sigmoid(), nn.Dropout(dropout))
        self.attention_c = nn.Linear(D, 1)

    def forward(self, x):
        return self.attention_c(self.attention_a(x) * self.attention_b(x))


class ABMIL(nn.Module):
    def __init__(self, in_dim=1024, n_classes=2):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(in_dim, 512), nn.ReLU(), nn.Dropout(0.25))
        self.attention_net = Attn_Net_Gated()
        self.classifiers = nn.Linear(512, n_classes)

    def forward(self, x):
        h = self.fc(x)
        A = F.softmax(self.attention_net(h).transpose(1, 0), dim=1)
        return self.classifiers(torch.mm(A, h)), A


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    local = []
    for x, y, i in loader:
        logits, _ = net(x[0].to(device, non_blocking=True))
        local.append((int(i), F.softmax(logits, 1)[0, 1].item(), int(y)))
    world = dist.get_world_size()
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    merged = {i: (p, y) for part in gathered for i, p, y in part}
    p = np.array([v[0] for v in merged.values()])
    y = np.array([v[1] for v in merged.values()])
    return roc_auc_score(y, p), average_precision_score(y, p)


def run_fold(args, fold, df, rank, local_rank):
    device = torch.device("cuda", local_rank)
    split = pd.read_csv(os.path.join(args.split_dir, f"splits_{fold}.csv"))
    train_ds = SlideBags(df[df.slide_id.isin(split.train.dropna())], args.data_root)
    val_ds = SlideBags(df[df.slide_id.isin(split.val.dropna())], args.data_root)
    test_ds = SlideBags(df[df.slide_id.isin(split.test.dropna())], args.data_root)

    if args.weighted_sample:
        train_sampler = WeightedRandomSampler(train_ds.sample_weights(), num_samples=len(train_ds), replacement=True)
    else:
        train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=1, sampler=train_sampler, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=4)
    test_loader = DataLoader(test_ds, batch_size=1, sampler=DistributedSampler(test_ds, shuffle=False), num_workers=4)

    net = ABMIL().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.reg)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-6)

    ckpt = os.path.join(args.results_dir, f"s_{fold}_checkpoint.pt")
    best = -1.0
    for epoch in range(args.epochs):
        if isinstance(train_sampler, DistributedSampler):
            train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        m = torch.zeros(3, device=device)
        for x, y, _ in train_loader:
            y = y.to(device)
            logits, _ = model(x[0].to(device, non_blocking=True))
            loss = F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            m += torch.stack([loss.detach(), (logits.argmax(1) == y).float().sum(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(m)
        val_auc, val_ap = evaluate(net, val_loader, device)
        if rank == 0:
            print(f"fold {fold} ep {epoch:02d}  loss {(m[0] / m[2]).item():.4f}  acc {(m[1] / m[2]).item():.3f}  "
                  f"val AUC {val_auc:.4f} AP {val_ap:.4f}  {time.time() - t0:.0f}s", flush=True)
            if val_auc > best:
                best = val_auc
                torch.save(net.state_dict(), ckpt)
        dist.barrier()

    net.load_state_dict(torch.load(ckpt, map_location=device))
    test_auc, test_ap = evaluate(net, test_loader, device)
    return best, test_auc, test_ap


def main():
    args = arguments()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    df = pd.read_csv(args.csv)
    df["label"] = df.label.astype(int)
    if rank == 0:
        os.makedirs(args.results_dir, exist_ok=True)
    dist.barrier()

    summary = []
    for fold in range(args.k):
        val_auc, test_auc, test_ap = run_fold(args, fold, df, rank, local_rank)
        summary.append({"folds": fold, "val_auc": val_auc, "test_auc": test_auc, "test_ap": test_ap})
        if rank == 0:
            print(f"fold {fold}: test AUC {test_auc:.4f}  AP {test_ap:.4f}", flush=True)
    if rank == 0:
        s = pd.DataFrame(summary)
        s.to_csv(os.path.join(args.results_dir, "summary.csv"), index=False)
        print(f"mean test AUC {s.test_auc.mean():.4f} +- {s.test_auc.std():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
