"""MSI vs MSS prediction in colorectal cancer WSIs with attention MIL.

Patient-level K-fold CV (StratifiedGroupKFold on patient id).  For each fold:
train on K-1 folds (10% of training patients held out for model selection), pick the
epoch with the best validation AUC, then score the held-out fold with that checkpoint.

Launch:
    torchrun --nproc_per_node=4 07_abmil_msi_crc.py --feat-dir /data/crc/feats_kimianet
"""
import argparse
import os
import time

import h5py
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import GroupShuffleSplit, StratifiedGroupKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def build_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--clini-table", default="/data/crc/clini_table.csv")
    p.add_argument("--feat-dir", default="/data/crc/feats_kimianet")
    p.add_argument("--out-dir", default="./msi_abmil")
    p.add_argument("--n-splits", type=int, default=5)
    p.add_argument("--epochs", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--bag-size", type=int, default=512, help="patches sampled per bag while training")
    p.add_argument("--feat-dim", type=int, default=1024)
    p.add_argument("--seed", type=int, default=1337)
    return p


class BagDataset(Dataset):
    def __init__(self, slides, targets, feat_dir, bag_size=None):
        self.slides, self.targets = list(slides), list(targets)
        self.feat_dir = feat_dir
        self.bag_size = bag_size

    def __len__(self):
        return len(self.slides)

    def __getitem__(self, idx):
        with h5py.File(os.path.join(self.feat_dir, self.slides[idx] + ".h5"), "r") as f:
            feats = torch.from_numpy(f["feats"][:]).float()
        if self.bag_size is not None:
            # fixed-size bags while training: sample with replacement if the slide is small
            replace = feats.shape[0] < self.bag_size
            sel = np.random.choice(feats.shape[0], self.bag_size, replace=replace)
            feats = feats[torch.from_numpy(np.sort(sel))]
        return feats, torch.tensor(self.targets[idx]).float(), idx


class MILModel(nn.Module):
    def __init__(self, n_feats, n_hidden=256):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(n_feats, n_hidden), nn.ReLU())
        self.attention = nn.Sequential(nn.Linear(n_hidden, 128), nn.Tanh(), nn.Linear(128, 1))
        self.head = nn.Sequential(nn.BatchNorm1d(n_hidden), nn.Dropout(0.5), nn.Linear(n_hidden, 1))

    def forward(self, bags):
        # bags: B x N x F
        emb = self.encoder(bags)
        att = torch.softmax(self.attention(emb), dim=1)
        pooled = (att * emb).sum(dim=1)
        return self.head(pooled).squeeze(-1)


def worker_init(worker_id):
    info = torch.utils.data.get_worker_info()
    np.random.seed((info.seed + worker_id) % 2**32)


@torch.no_grad()
def score(model, loader, device, world):
    model.eval()
    local = []
    for feats, y, idx in loader:
        prob = torch.sigmoid(model(feats.to(device))).item()
        local.append((int(idx), prob, float(y)))
    parts = [None] * world
    dist.all_gather_object(parts, local)
    merged = dict((i, (p, y)) for part in parts for i, p, y in part)
    keys = sorted(merged)
    return keys, np.array([merged[k][0] for k in keys]), np.array([merged[k][1] for k in keys])


def main():
    args = build_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    clini = pd.read_csv(args.clini_table)
    clini = clini[clini.isMSIH.isin(["MSIH", "nonMSIH"])]
    clini = clini[clini.FILENAME.map(lambda s: os.path.exists(os.path.join(args.feat_dir, s + ".h5")))]
    clini = clini.sort_values("FILENAME").reset_index(drop=True)
    y_all = (clini.isMSIH == "MSIH").astype(int).values
    groups = clini.PATIENT.values

    os.makedirs(args.out_dir, exist_ok=True)
    skf = StratifiedGroupKFold(n_splits=args.n_splits, shuffle=True, random_state=args.seed)
    all_preds = []
    for fold, (trainval_idx, test_idx) in enumerate(skf.split(clini, y_all, groups)):
        gss = GroupShuffleSplit(n_splits=1, test_size=0.1, random_state=args.seed)
        tr, va = next(gss.split(trainval_idx, groups=groups[trainval_idx]))
        train_idx, val_idx = trainval_idx[tr], trainval_idx[va]

        def ds(idxs, bag_size=None):
            return BagDataset(clini.FILENAME.values[idxs], y_all[idxs], args.feat_dir, bag_size)

        train_ds, val_ds, test_ds = ds(train_idx, args.bag_size), ds(val_idx), ds(test_idx)
        train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
        train_dl = DataLoader(train_ds, batch_size=8, sampler=train_sampler, num_workers=8,
                              worker_init_fn=worker_init, drop_last=True)
        val_dl = DataLoader(val_ds, batch_size=1, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=4)
        test_dl = DataLoader(test_ds, batch_size=1, sampler=DistributedSampler(test_ds, shuffle=False), num_workers=4)

        model = MILModel(args.feat_dim).to(device)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = DDP(model, device_ids=[local_rank])
        pos = y_all[train_idx].mean()
        crit = nn.BCEWithLogitsLoss(pos_weight=torch.tensor((1 - pos) / pos, device=device))
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_dl))

        best_auc, best_path = -1.0, os.path.join(args.out_dir, f"fold{fold}_best.pt")
        for epoch in range(args.epochs):
            train_sampler.set_epoch(epoch)
            model.train()
            t0, running = time.time(), torch.zeros(2, device=device)
            for feats, y, _ in train_dl:
                feats, y = feats.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = crit(model(feats), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                running += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
            dist.all_reduce(running)
            _, p_val, y_val = score(model.module, val_dl, device, world)
            val_auc = roc_auc_score(y_val, p_val)
            if rank == 0:
                print(f"fold {fold} ep {epoch:02d} loss {(running[0] / running[1]).item():.4f} "
                      f"val auc {val_auc:.4f} [{time.time() - t0:.0f}s]", flush=True)
                if val_auc > best_auc:
                    best_auc = val_auc
                    torch.save(model.state_dict(), best_path)
            dist.barrier()

        best_model = MILModel(args.feat_dim).to(device)
        best_model.load_state_dict(torch.load(best_path, map_location=device))
        keys, p_test, y_test = score(best_model, test_dl, device, world)
        if rank == 0:
            auc = roc_auc_score(y_test, p_test)
            print(f"fold {fold}: test auc {auc:.4f} ({len(keys)} slides)", flush=True)
            all_preds.append(pd.DataFrame({"FILENAME": clini.FILENAME.values[test_idx][keys],
                                           "PATIENT": groups[test_idx][keys],
                                           "y_true": y_test, "p_msih": p_test, "fold": fold}))

    if rank == 0:
        preds = pd.concat(all_preds, ignore_index=True)
        preds.to_csv(os.path.join(args.out_dir, "patient_preds.csv"), index=False)
        pooled = roc_auc_score(preds.y_true, preds.p_msih)
        print(f"pooled AUC over all {len(preds)} test slides: {pooled:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
