#!/usr/bin/env python3
"""CLAM-SB for metastasis detection (Camelyon16 + 17 pooled), patient-level 10-fold CV, DDP.

Training objective: bag CE + clustering loss on the instance classifier of the slide's
class only (subtyping=False), as in the reference implementation for binary tasks.
Early stopping on validation loss (patience 20, not before epoch 50).
"""
import argparse
import os
from collections import OrderedDict

import h5py
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

p = argparse.ArgumentParser()
p.add_argument("--data_dir", default="/data/camelyon/feats_r50/h5_files")
p.add_argument("--csv", default="dataset_csv/camelyon_pooled.csv")
p.add_argument("--split_dir", default="splits/camelyon_pooled_100")
p.add_argument("--k", type=int, default=10)
p.add_argument("--max_epochs", type=int, default=200)
p.add_argument("--lr", type=float, default=2e-4)
p.add_argument("--reg", type=float, default=1e-5)
p.add_argument("--bag_weight", type=float, default=0.7)
p.add_argument("--k_sample", type=int, default=8)
p.add_argument("--patience", type=int, default=20)
p.add_argument("--stop_epoch", type=int, default=50)
p.add_argument("--results_dir", default="results/clam_sb_camelyon")
p.add_argument("--seed", type=int, default=1)


class H5MILDataset(Dataset):
    def __init__(self, df, data_dir):
        self.ids = df.slide_id.tolist()
        self.y = df.label.tolist()
        self.data_dir = data_dir

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        with h5py.File(os.path.join(self.data_dir, f"{self.ids[i]}.h5"), "r") as f:
            x = torch.from_numpy(f["features"][:])
        return x, self.y[i], i


class GatedAttn(nn.Module):
    def __init__(self, L=512, D=256, dropout=0.25):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(L, D), nn.Tanh(), nn.Dropout(dropout))
        self.b = nn.Sequential(nn.Linear(L, D), nn.Sigmoid(), nn.Dropout(dropout))
        self.c = nn.Linear(D, 1)

    def forward(self, h):
        return self.c(self.a(h) * self.b(h))


class CLAM_SB(nn.Module):
    def __init__(self, in_dim=1024, n_classes=2, k_sample=8, dropout=0.25):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(in_dim, 512), nn.ReLU(), nn.Dropout(dropout))
        self.attention_net = GatedAttn(512, 256, dropout)
        self.classifiers = nn.Linear(512, n_classes)
        self.instance_classifiers = nn.ModuleList([nn.Linear(512, 2) for _ in range(n_classes)])
        self.k_sample = k_sample
        self.n_classes = n_classes

    def inst_eval(self, A, h, classifier):
        k = min(self.k_sample, A.shape[1])
        top_p = h[torch.topk(A, k, dim=1)[1][-1]]
        top_n = h[torch.topk(-A, k, dim=1)[1][-1]]
        targets = torch.cat([torch.ones(k, device=h.device), torch.zeros(k, device=h.device)]).long()
        return F.cross_entropy(classifier(torch.cat([top_p, top_n])), targets)

    def forward(self, x, label=None, instance_eval=False):
        h = self.fc(x)
        A = F.softmax(self.attention_net(h).T, dim=1)    # 1 x N
        inst_loss = torch.zeros((), device=x.device)
        if instance_eval:
            # only the classifier of the slide's own class is trained on this bag
            inst_loss = self.inst_eval(A, h, self.instance_classifiers[int(label)])
        logits = self.classifiers(A @ h)
        return logits, A, inst_loss


def ddp_setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return local_rank


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    local = []
    for x, y, i in loader:
        logits, _, _ = net(x[0].to(device, non_blocking=True))
        loss = F.cross_entropy(logits, y.to(device)).item()
        local.append((int(i), F.softmax(logits, 1)[0, 1].item(), int(y), loss))
    allp = [None] * dist.get_world_size()
    dist.all_gather_object(allp, local)
    rows = OrderedDict()
    for part in allp:
        for i, prob, y, loss in part:
            rows[i] = (prob, y, loss)        # padded duplicates from the sampler collapse here
    prob = np.array([r[0] for r in rows.values()])
    y = np.array([r[1] for r in rows.values()])
    return float(np.mean([r[2] for r in rows.values()])), roc_auc_score(y, prob), float(((prob > 0.5) == y).mean())


def train_fold(args, fold, df, local_rank, writer):
    rank, device = dist.get_rank(), torch.device("cuda", local_rank)
    split = pd.read_csv(os.path.join(args.split_dir, f"splits_{fold}.csv"))
    sets = {s: H5MILDataset(df[df.slide_id.isin(split[s].dropna())].reset_index(drop=True), args.data_dir)
            for s in ("train", "val", "test")}
    train_sampler = DistributedSampler(sets["train"], shuffle=True, seed=args.seed)
    dl = {s: DataLoader(ds, batch_size=1, num_workers=4, pin_memory=True,
                        sampler=train_sampler if s == "train" else DistributedSampler(ds, shuffle=False))
          for s, ds in sets.items()}

    net = CLAM_SB(k_sample=args.k_sample).to(device)
    # instance_classifiers[1 - y] gets no gradient on a bag of class y
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.reg)

    ckpt = os.path.join(args.results_dir, f"s_{fold}_checkpoint.pt")
    best_val, counter = np.inf, 0
    stop = torch.zeros(1, device=device)
    for epoch in range(args.max_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        m = torch.zeros(3, device=device)
        for x, y, _ in dl["train"]:
            x, y = x[0].to(device, non_blocking=True), y.to(device)
            logits, _, inst_loss = model(x, label=y, instance_eval=True)
            loss = args.bag_weight * F.cross_entropy(logits, y) + (1 - args.bag_weight) * inst_loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            m += torch.stack([loss.detach(), inst_loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(m)
        val_loss, val_auc, val_acc = evaluate(net, dl["val"], device)

        if rank == 0:
            writer.add_scalar(f"fold{fold}/train_loss", (m[0] / m[2]).item(), epoch)
            writer.add_scalar(f"fold{fold}/inst_loss", (m[1] / m[2]).item(), epoch)
            writer.add_scalar(f"fold{fold}/val_loss", val_loss, epoch)
            writer.add_scalar(f"fold{fold}/val_auc", val_auc, epoch)
            print(f"fold {fold} epoch {epoch}: train {(m[0] / m[2]).item():.4f} val loss {val_loss:.4f} "
                  f"auc {val_auc:.4f} acc {val_acc:.4f}", flush=True)
            if val_loss < best_val:
                best_val, counter = val_loss, 0
                torch.save(net.state_dict(), ckpt)
            else:
                counter += 1
            stop.fill_(float(epoch >= args.stop_epoch and counter >= args.patience))
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            break

    dist.barrier()
    net.load_state_dict(torch.load(ckpt, map_location=device))
    _, test_auc, test_acc = evaluate(net, dl["test"], device)
    _, val_auc, _ = evaluate(net, dl["val"], device)
    return val_auc, test_auc, test_acc


def main():
    args = p.parse_args()
    local_rank = ddp_setup()
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    df = pd.read_csv(args.csv)
    df["label"] = df.label.map({"normal": 0, "tumor": 1}).astype(int)

    writer = None
    if rank == 0:
        os.makedirs(args.results_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.results_dir, "tb"))
    dist.barrier()

    res = []
    for fold in range(args.k):
        val_auc, test_auc, test_acc = train_fold(args, fold, df, local_rank, writer)
        res.append((fold, val_auc, test_auc, test_acc))
        if rank == 0:
            print(f"== fold {fold}: val auc {val_auc:.4f}  test auc {test_auc:.4f}  test acc {test_acc:.4f}")

    if rank == 0:
        out = pd.DataFrame(res, columns=["folds", "val_auc", "test_auc", "test_acc"])
        out.to_csv(os.path.join(args.results_dir, "summary.csv"), index=False)
        print(out.describe().loc[["mean", "std"]])
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
