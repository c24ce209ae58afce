# TPS (tabular playground) binary classification - 5-fold MLP with DDP.
# Everything (folds, OOF, test preds) in one job:
#   torchrun --nproc_per_node=2 10_tps_tabular_kfold_ddp.py --n_folds 5 --epochs 40
import argparse
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold
from sklearn.preprocessing import QuantileTransformer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", default="input/train.csv")
    p.add_argument("--test", default="input/test.csv")
    p.add_argument("--n_folds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--bs", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--patience", type=int, default=6)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default="output")
    return p.parse_args()


class ResidualMLP(nn.Module):
    def __init__(self, d_in, d_hidden=512, n_blocks=3, p=0.25):
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(d_in, d_hidden), nn.SiLU())
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.LayerNorm(d_hidden), nn.Linear(d_hidden, d_hidden * 2), nn.SiLU(),
                          nn.Dropout(p), nn.Linear(d_hidden * 2, d_hidden))
            for _ in range(n_blocks)
        ])
        self.out = nn.Sequential(nn.LayerNorm(d_hidden), nn.Linear(d_hidden, 1))

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.out(h).squeeze(-1)


def shard(n, rank, world):
    return list(range(rank, n, world))


@torch.no_grad()
def predict(model, ds, rank, world, device, bs=8192):
    """Predict this rank's unpadded shard, then gather (index, pred) pairs from every rank."""
    idx = shard(len(ds), rank, world)
    loader = DataLoader(Subset(ds, idx), batch_size=bs, shuffle=False)
    model.eval()
    out = [torch.sigmoid(model(batch[0].to(device))).cpu() for batch in loader]
    local = (np.asarray(idx), torch.cat(out).numpy() if out else np.zeros(0, dtype=np.float32))
    parts = [None] * world
    dist.all_gather_object(parts, local)
    res = np.zeros(len(ds), dtype=np.float32)
    for i, p in parts:
        res[i] = p
    return res


def run_fold(fold, X, y, X_test, trn_idx, val_idx, args, rank, world, device):
    train_ds = TensorDataset(torch.tensor(X[trn_idx]), torch.tensor(y[trn_idx]))
    val_ds = TensorDataset(torch.tensor(X[val_idx]))
    test_ds = TensorDataset(torch.tensor(X_test))

    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed + fold)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, drop_last=True, pin_memory=True)

    torch.manual_seed(args.seed + fold)
    model = DDP(ResidualMLP(X.shape[1]).to(device), device_ids=[device.index])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=2)
    crit = nn.BCEWithLogitsLoss()

    best_auc, bad_epochs = -1.0, 0
    ckpt_path = os.path.join(args.out, f"mlp_fold{fold}.pt")
    for epoch in range(args.epochs):
        model.train()
        tot = torch.zeros(2, device=device)
        for xb, yb in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            loss = crit(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach() * xb.size(0), torch.tensor(float(xb.size(0)), device=device)])
        dist.all_reduce(tot)

        val_pred = predict(model.module, val_ds, rank, world, device)
        auc = roc_auc_score(y[val_idx], val_pred)
        sched.step(auc)
        if auc > best_auc:
            best_auc, bad_epochs = auc, 0
            if rank == 0:
                torch.save(model.module.state_dict(), ckpt_path)
        else:
            bad_epochs += 1
        if rank == 0:
            print(f"fold {fold} ep {epoch:02d} loss {(tot[0] / tot[1]).item():.5f} auc {auc:.5f}", flush=True)
        if bad_epochs >= args.patience:
            break

    dist.barrier()
    model.module.load_state_dict(torch.load(ckpt_path, map_location=device))
    oof = predict(model.module, val_ds, rank, world, device)
    test_pred = predict(model.module, test_ds, rank, world, device)
    return oof, test_pred, best_auc


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train = pd.read_csv(args.train)
    test = pd.read_csv(args.test)
    feats = [c for c in train.columns if c.startswith("f_")]
    qt = QuantileTransformer(n_quantiles=1000, output_distribution="normal", random_state=args.seed)
    X = qt.fit_transform(train[feats].values).astype(np.float32)
    X_test = qt.transform(test[feats].values).astype(np.float32)
    y = train["target"].values.astype(np.float32)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()

    oof = np.zeros(len(train), dtype=np.float32)
    test_pred = np.zeros(len(test), dtype=np.float32)
    skf = StratifiedKFold(n_splits=args.n_folds, shuffle=True, random_state=args.seed)
    for fold, (trn_idx, val_idx) in enumerate(skf.split(X, y)):
        o, t, best = run_fold(fold, X, y, X_test, trn_idx, val_idx, args, rank, world, device)
        oof[val_idx] = o
        test_pred += t / args.n_folds
        if rank == 0:
            print(f"==> fold {fold} best auc {best:.5f}", flush=True)

    if rank == 0:
        print(f"CV AUC {roc_auc_score(y, oof):.5f}")
        np.save(os.path.join(args.out, "oof.npy"), oof)
        pd.DataFrame({"id": test["id"], "target": test_pred}).to_csv(
            os.path.join(args.out, "submission.csv"), index=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
