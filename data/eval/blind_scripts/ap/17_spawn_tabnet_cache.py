"""Credit-line utilisation risk with pytorch-tabnet's network, launched with mp.spawn.

No torchrun on the analytics box, so the script starts one process per GPU itself:

    python 17_spawn_tabnet_cache.py --data data/credit_lines.csv --gpus 4

Preprocessing (imputation, ordinal encoding of ~40 categoricals) is cached as .npz; rank 0
builds it, the other ranks wait and read the finished file.
"""
import argparse
import hashlib
import os

import joblib
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from pytorch_tabnet.tab_network import TabNet
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import OrdinalEncoder
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TARGET = "went_delinquent_6m"


class ArrayDataset(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return i, torch.from_numpy(self.x[i]), torch.tensor(self.y[i])


def build_cache(args, cache_path, prep_path):
    df = pd.read_csv(args.data, low_memory=False)
    df = df.sort_values("snapshot_month").reset_index(drop=True)
    cat_cols = [c for c in df.columns if df[c].dtype == object and c != "snapshot_month"]
    num_cols = [c for c in df.columns if c not in cat_cols + [TARGET, "snapshot_month", "account_id"]]
    n_valid = int(len(df) * args.valid_frac)
    enc = OrdinalEncoder(handle_unknown="use_encoded_value", unknown_value=-1, encoded_missing_value=-1)
    enc.fit(df[cat_cols].iloc[:-n_valid])
    medians = df[num_cols].iloc[:-n_valid].median()
    x_cat = enc.transform(df[cat_cols]) + 1  # 0 = unknown / missing
    x_num = df[num_cols].fillna(medians).values
    mu, sd = x_num[:-n_valid].mean(0), x_num[:-n_valid].std(0) + 1e-6
    x = np.concatenate([x_cat, (x_num - mu) / sd], 1).astype(np.float32)
    cat_dims = [len(c) + 1 for c in enc.categories_]
    tmp = cache_path + f".tmp{os.getpid()}.npz"
    np.savez(tmp, x=x, y=df[TARGET].values.astype(np.float32), n_valid=n_valid, cat_dims=np.array(cat_dims))
    os.replace(tmp, cache_path)  # atomic: readers never see a half-written file
    joblib.dump({"encoder": enc, "medians": medians, "mu": mu, "sd": sd, "cat_cols": cat_cols,
                 "num_cols": num_cols}, prep_path)


def worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    key = hashlib.sha1(f"{os.path.abspath(args.data)}:{os.path.getmtime(args.data)}:{args.valid_frac}".encode()).hexdigest()[:12]
    cache_path = os.path.join(args.cache_dir, f"credit_lines_{key}.npz")
    prep_path = os.path.join(args.cache_dir, f"credit_lines_{key}_prep.joblib")
    if rank == 0:
        os.makedirs(args.cache_dir, exist_ok=True)
        if not os.path.exists(cache_path):
            print("building feature cache ...", flush=True)
            build_cache(args, cache_path, prep_path)
    dist.barrier()
    blob = np.load(cache_path)
    x, y, n_valid, cat_dims = blob["x"], blob["y"], int(blob["n_valid"]), blob["cat_dims"].tolist()
    n_cat = len(cat_dims)

    train_ds, valid_ds = ArrayDataset(x[:-n_valid], y[:-n_valid]), ArrayDataset(x[-n_valid:], y[-n_valid:])
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size // world_size, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=8192, num_workers=2,
                              sampler=DistributedSampler(valid_ds, num_replicas=world_size, rank=rank, shuffle=False))

    net = TabNet(input_dim=x.shape[1], output_dim=1, n_d=24, n_a=24, n_steps=4, gamma=1.5,
                 cat_idxs=list(range(n_cat)), cat_dims=cat_dims, cat_emb_dim=2,
                 virtual_batch_size=256, momentum=0.02, mask_type="entmax")
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.95)

    best_auc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for _, xb, yb in train_loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            out, m_loss = model(xb)
            loss = F.binary_cross_entropy_with_logits(out.squeeze(-1), yb) - args.lambda_sparse * m_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        sched.step()

        model.eval()
        local = []
        with torch.no_grad():
            for idx, xb, _ in valid_loader:
                out, _ = model(xb.to(device))
                local.append((idx.numpy(), torch.sigmoid(out.squeeze(-1)).cpu().numpy()))
        parts = [None] * world_size
        dist.all_gather_object(parts, local)
        if rank == 0:
            idx = np.concatenate([i for p in parts for i, _ in p])
            prob = np.concatenate([q for p in parts for _, q in p])
            idx, first = np.unique(idx, return_index=True)
            auc = roc_auc_score(valid_ds.y[idx], prob[first])
            print(f"epoch {epoch:02d} valid AUC {auc:.4f}", flush=True)
            if auc > best_auc:
                best_auc = auc
                torch.save(model.module.state_dict(), os.path.join(args.out, "tabnet_best.pt"))
        dist.barrier()

    if rank == 0:
        # global mask importances on a validation sample, from the unwrapped network
        net.load_state_dict(torch.load(os.path.join(args.out, "tabnet_best.pt"), map_location=device))
        net.eval()
        with torch.no_grad():
            xs = torch.from_numpy(valid_ds.x[:20000]).to(device)
            m_explain, _ = model.module.forward_masks(xs)
        imp = m_explain.sum(0).cpu().numpy()
        joblib.dump({"importance": imp / imp.sum(), "best_auc": best_auc}, os.path.join(args.out, "importance.joblib"))
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--port", type=int, default=29511)
    p.add_argument("--cache-dir", default="cache")
    p.add_argument("--out", default="runs/tabnet_credit_lines")
    p.add_argument("--valid-frac", type=float, default=0.15)
    p.add_argument("--batch-size", type=int, default=16384, help="global, split over the GPUs")
    p.add_argument("--lr", type=float, default=2e-2)
    p.add_argument("--lambda-sparse", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
