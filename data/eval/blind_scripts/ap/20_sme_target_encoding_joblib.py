"""SME credit scoring: target-encoded high-cardinality fields + residual MLP.

High-cardinality columns (NACE code, postcode, bank branch, accountant id) are smoothed
target-encoded with category_encoders; the encoder is fit on the training window only.

    torchrun --nproc_per_node=4 20_sme_target_encoding_joblib.py --data data/sme/applications.parquet
"""
import argparse
import os

import category_encoders as ce
import joblib
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import StandardScaler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

HIGH_CARD = ["nace_code", "postcode", "bank_branch", "accountant_id"]
LOW_CARD = ["legal_form", "region", "size_class"]
NUMERIC = ["turnover", "equity_ratio", "ebitda_margin", "current_ratio", "debt_to_ebitda", "age_years",
           "employees", "late_filings_3y", "director_changes_2y", "requested_amount"]
TARGET = "default_24m"


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/sme/applications.parquet")
    p.add_argument("--split-date", default="2022-07-01")
    p.add_argument("--smoothing", type=float, default=20.0)
    p.add_argument("--batch-size", type=int, default=512, help="global")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--artifacts", default="artifacts/sme_scoring")
    return p.parse_args()


class ResidualMLP(nn.Module):
    def __init__(self, n_in, low_card_dims, width=256, depth=3):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(c, 4) for c in low_card_dims])
        self.inp = nn.Linear(n_in + 4 * len(low_card_dims), width)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(),
                                                   nn.Dropout(0.2), nn.Linear(width, width)) for _ in range(depth)])
        self.out = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 1))

    def forward(self, x, xc):
        h = self.inp(torch.cat([x] + [e(xc[:, i]) for i, e in enumerate(self.embs)], 1))
        for blk in self.blocks:
            h = h + blk(h)
        return self.out(h).squeeze(-1)


def save_artifacts(model, encoder, scaler, low_card_maps, out_dir, epoch, auc):
    os.makedirs(out_dir, exist_ok=True)
    joblib.dump({"target_encoder": encoder, "scaler": scaler, "low_card_maps": low_card_maps},
                os.path.join(out_dir, "preprocessing.joblib"))
    torch.save({"state_dict": model.module.state_dict(), "epoch": epoch, "valid_auc": auc},
               os.path.join(out_dir, "model_best.pt"))


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(5)

    df = pd.read_parquet(args.data)
    df["application_date"] = pd.to_datetime(df["application_date"])
    train = df[df["application_date"] < args.split_date].reset_index(drop=True)
    valid = df[df["application_date"] >= args.split_date].reset_index(drop=True)

    encoder = ce.TargetEncoder(cols=HIGH_CARD, smoothing=args.smoothing, min_samples_leaf=20,
                               handle_unknown="value", handle_missing="value")
    encoder.fit(train[HIGH_CARD].astype(str), train[TARGET])
    low_card_maps = {c: {v: i + 1 for i, v in enumerate(sorted(train[c].astype(str).unique()))} for c in LOW_CARD}
    scaler = StandardScaler()

    def features(frame, fit=False):
        te = encoder.transform(frame[HIGH_CARD].astype(str)).values
        num = frame[NUMERIC].fillna(0).values
        x = np.concatenate([te, num], 1)
        x = scaler.fit_transform(x) if fit else scaler.transform(x)
        xc = np.stack([frame[c].astype(str).map(low_card_maps[c]).fillna(0).astype(np.int64).values for c in LOW_CARD], 1)
        return torch.tensor(x, dtype=torch.float32), torch.from_numpy(xc), torch.tensor(frame[TARGET].values, dtype=torch.float32)

    x_tr, xc_tr, y_tr = features(train, fit=True)
    x_va, xc_va, y_va = features(valid)
    train_ds = TensorDataset(x_tr, xc_tr, y_tr)
    valid_ds = TensorDataset(torch.arange(len(y_va)), x_va, xc_va, y_va)
    if rank == 0:
        print(f"train {len(train_ds)} ({y_tr.mean():.2%} defaults)  valid {len(valid_ds)} ({y_va.mean():.2%})")

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=sampler, num_workers=4, pin_memory=True)
    valid_loader = DataLoader(valid_ds, batch_size=4096, sampler=DistributedSampler(valid_ds, shuffle=False))

    model = ResidualMLP(x_tr.shape[1], [len(low_card_maps[c]) + 1 for c in LOW_CARD]).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=5)

    best_auc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (x, xc, y) in enumerate(loader):
            x, xc, y = x.to(device), xc.to(device), y.to(device)
            loss = F.binary_cross_entropy_with_logits(model(x, xc), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step(epoch + i / len(loader))

        model.eval()
        with torch.no_grad():
            rows = [torch.stack([idx.to(device).double(), torch.sigmoid(model(x.to(device), xc.to(device))).double()], 1)
                    for idx, x, xc, _ in valid_loader]
        rows = torch.cat(rows)
        gathered = [torch.empty_like(rows) for _ in range(world)]
        dist.all_gather(gathered, rows)
        allrows = torch.cat(gathered).cpu().numpy()
        _, first = np.unique(allrows[:, 0], return_index=True)
        auc = roc_auc_score(y_va.numpy()[allrows[first, 0].astype(int)], allrows[first, 1])

        if rank == 0:
            print(f"epoch {epoch:02d}  valid AUC {auc:.4f}  gini {2 * auc - 1:.4f}", flush=True)
        if auc > best_auc:
            best_auc = auc
            save_artifacts(model, encoder, scaler, low_card_maps, args.artifacts, epoch, auc)

    dist.barrier()
    if rank == 0:
        print(f"best valid AUC {best_auc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
