"""Gated ABMIL, prostate biopsy cancer detection (benign vs cancer), launched with mp.spawn.

Usage (one node, all visible GPUs):
    python 16_abmil_mp_spawn.py --fold 0 --feat_dir /data/panda/feats_r50
Slides with very few tissue patches (< --min_patches) are excluded up front using the
patch counts written by the extraction step, so every process sees the same slide list.
"""
import argparse
import os
import random
from datetime import timedelta

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import cohen_kappa_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--feat_dir", default="/data/panda/feats_r50")
    ap.add_argument("--slide_csv", default="/data/panda/train_with_patients.csv")
    ap.add_argument("--patch_counts", default="/data/panda/feats_r50/patch_counts.csv")
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--min_patches", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--patience", type=int, default=5)
    ap.add_argument("--out", default="ckpt/panda_abmil")
    ap.add_argument("--port", type=str, default="29531")
    ap.add_argument("--use_wandb", action="store_true")
    ap.add_argument("--seed", type=int, default=3)
    return ap.parse_args()


class BiopsyBags(Dataset):
    def __init__(self, df, feat_dir):
        self.ids = df.image_id.tolist()
        self.y = df.target.tolist()
        self.feat_dir = feat_dir

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        x = torch.load(os.path.join(self.feat_dir, "pt_files", f"{self.ids[i]}.pt"), map_location="cpu")
        return x, self.y[i]


class GatedABMIL(nn.Module):
    def __init__(self, in_dim=1024, L=512, D=128):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(in_dim, L), nn.ReLU(), nn.Dropout(0.25))
        self.att_a = nn.Sequential(nn.Linear(L, D), nn.Tanh())
        self.att_b = nn.Sequential(nn.Linear(L, D), nn.Sigmoid())
        self.att_c = nn.Linear(D, 1)
        self.cls = nn.Linear(L, 2)

    def forward(self, x):
        h = self.fc(x)
        a = torch.softmax(self.att_c(self.att_a(h) * self.att_b(h)), dim=0)
        return self.cls((a * h).sum(dim=0, keepdim=True))


def load_splits(args):
    df = pd.read_csv(args.slide_csv)
    counts = pd.read_csv(args.patch_counts)  # image_id, n_patches
    df = df.merge(counts, on="image_id")
    df = df[df.n_patches >= args.min_patches].sort_values("image_id").reset_index(drop=True)
    df["target"] = (df.isup_grade > 0).astype(int)
    test = df[df.fold == args.fold]
    val = df[df.fold == (args.fold + 1) % 5]
    train = df[~df.fold.isin([args.fold, (args.fold + 1) % 5])]
    return train, val, test


@torch.no_grad()
def predict_all(net, ds, device):
    """Full pass over a dataset on the calling process only (no collectives)."""
    net.eval()
    loader = DataLoader(ds, batch_size=1, shuffle=False, num_workers=4, pin_memory=True)
    probs, ys = [], []
    for x, y in loader:
        probs.append(net(x[0].to(device, non_blocking=True)).softmax(-1)[0, 1].item())
        ys.append(int(y))
    return np.array(probs), np.array(ys)


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=timedelta(minutes=60))
    device = torch.device("cuda", rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    train_df, val_df, test_df = load_splits(args)
    train_ds = BiopsyBags(train_df, args.feat_dir)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=1, sampler=sampler, num_workers=4, pin_memory=True)

    net = GatedABMIL().to(device)
    model = DDP(net, device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)

    run = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if args.use_wandb:
            import wandb
            run = wandb.init(project="panda-mil", name=f"abmil_fold{args.fold}", config=vars(args))

    ckpt = os.path.join(args.out, f"fold{args.fold}.pt")
    best, bad = -1.0, 0
    flag = torch.zeros(1, device=device)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for x, y in loader:
            loss = F.cross_entropy(model(x[0].to(device, non_blocking=True)), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        # validation on rank 0 with the bare module; the others wait at the broadcast
        if rank == 0:
            p, y = predict_all(net, BiopsyBags(val_df, args.feat_dir), device)
            auc = roc_auc_score(y, p)
            print(f"epoch {epoch}: loss {(tot[0] / tot[1]).item():.4f}  val AUC {auc:.4f}", flush=True)
            if run is not None:
                run.log({"loss": (tot[0] / tot[1]).item(), "val_auc": auc}, step=epoch)
            if auc > best:
                best, bad = auc, 0
                torch.save(net.state_dict(), ckpt)
            else:
                bad += 1
            flag.fill_(1.0 if bad >= args.patience else 0.0)
        dist.broadcast(flag, src=0)
        if flag.item() == 1.0:
            break

    dist.barrier()
    if rank == 0:
        net.load_state_dict(torch.load(ckpt, map_location=device))
        p, y = predict_all(net, BiopsyBags(test_df, args.feat_dir), device)
        auc = roc_auc_score(y, p)
        kappa = cohen_kappa_score(y, (p > 0.5).astype(int))
        print(f"fold {args.fold}: test AUC {auc:.4f}  kappa {kappa:.4f}  ({len(y)} biopsies)")
        pd.DataFrame({"image_id": test_df.image_id.values, "target": y, "prob": p}).to_csv(
            os.path.join(args.out, f"fold{args.fold}_test.csv"), index=False)
        if run is not None:
            run.summary.update({"test_auc": auc, "test_kappa": kappa})
            run.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    world_size = torch.cuda.device_count()
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)
