"""Motor claims severity: Tweedie-loss network on policy + vehicle features.

Tracks runs in the team MLflow server. Launch:

    MLFLOW_TRACKING_URI=http://mlflow.internal:5000 \
    torchrun --nproc_per_node=4 06_claims_severity_mlflow.py --train data/claims/train.parquet --valid data/claims/valid.parquet
"""
import argparse
import os

import mlflow
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import mean_absolute_error, mean_tweedie_deviance
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CAT_FEATURES = ["vehicle_make", "vehicle_body", "fuel", "region", "area_type", "driver_age_band", "bonus_malus_band"]
NUM_FEATURES = ["vehicle_age", "vehicle_power", "driver_age", "license_years", "exposure", "density_log", "bonus_malus"]


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--experiment", default="claims-severity")
    p.add_argument("--power", type=float, default=1.5, help="Tweedie variance power")
    p.add_argument("--emb-dim", type=int, default=8)
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 128])
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--save-dir", default="artifacts/severity")
    return p.parse_args()


class PolicyDataset(Dataset):
    def __init__(self, df, encoders, num_mean, num_std):
        self.cat = np.stack([df[c].map(encoders[c]).fillna(0).astype(np.int64).values for c in CAT_FEATURES], 1)
        self.num = ((df[NUM_FEATURES].values - num_mean) / num_std).astype(np.float32)
        self.y = df["claim_amount"].values.astype(np.float32)
        self.w = df["exposure"].values.astype(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return i, torch.from_numpy(self.cat[i]), torch.from_numpy(self.num[i]), self.y[i], self.w[i]


class SeverityNet(nn.Module):
    def __init__(self, cards, n_num, emb_dim, hidden):
        super().__init__()
        self.embeddings = nn.ModuleList([nn.Embedding(n + 1, emb_dim) for n in cards])
        d = emb_dim * len(cards) + n_num
        layers = []
        for h in hidden:
            layers += [nn.Linear(d, h), nn.LayerNorm(h), nn.GELU(), nn.Dropout(0.1)]
            d = h
        layers.append(nn.Linear(d, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, cat, num):
        e = torch.cat([emb(cat[:, i]) for i, emb in enumerate(self.embeddings)], dim=1)
        return self.mlp(torch.cat([e, num], dim=1)).squeeze(-1)  # log of expected amount


def tweedie_loss(log_mu, y, w, p):
    # negative Tweedie log-likelihood up to constants
    a = y * torch.exp(log_mu * (1 - p)) / (1 - p)
    b = torch.exp(log_mu * (2 - p)) / (2 - p)
    return (w * (-a + b)).sum() / w.sum()


@torch.no_grad()
def collect_predictions(model, loader, device, n_total):
    model.eval()
    rows = []
    for idx, cat, num, y, w in loader:
        mu = torch.exp(model(cat.to(device), num.to(device))).cpu().numpy()
        rows.append((idx.numpy(), mu))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, rows)
    pred = np.zeros(n_total, dtype=np.float64)
    for part in parts:
        for idx, mu in part:
            pred[idx] = mu
    return pred


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train = pd.read_parquet(args.train)
    valid = pd.read_parquet(args.valid)
    encoders = {c: {v: i + 1 for i, v in enumerate(sorted(train[c].astype(str).unique()))} for c in CAT_FEATURES}
    for frame in (train, valid):
        for c in CAT_FEATURES:
            frame[c] = frame[c].astype(str)
    num_mean = train[NUM_FEATURES].mean().values
    num_std = train[NUM_FEATURES].std().values + 1e-6
    train_ds = PolicyDataset(train, encoders, num_mean, num_std)
    valid_ds = PolicyDataset(valid, encoders, num_mean, num_std)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size // world_size, sampler=train_sampler,
                              num_workers=6, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=8192, num_workers=2,
                              sampler=DistributedSampler(valid_ds, shuffle=False))

    model = SeverityNet([len(encoders[c]) for c in CAT_FEATURES], len(NUM_FEATURES), args.emb_dim, args.hidden)
    # start from the portfolio mean so the first epochs are not spent learning the intercept
    with torch.no_grad():
        model.mlp[-1].bias.fill_(float(np.log(np.average(train["claim_amount"], weights=train["exposure"]) + 1e-3)))
    model = DDP(model.to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=2)

    mlflow.set_experiment(args.experiment)
    with mlflow.start_run(run_name=f"tweedie_p{args.power}"):
        mlflow.log_params(vars(args) | {"world_size": world_size, "n_train": len(train_ds)})
        best_dev = float("inf")
        for epoch in range(args.epochs):
            train_sampler.set_epoch(epoch)
            model.train()
            stats = torch.zeros(2, device=device)
            for _, cat, num, y, w in train_loader:
                cat, num = cat.to(device, non_blocking=True), num.to(device, non_blocking=True)
                y, w = y.to(device, non_blocking=True), w.to(device, non_blocking=True)
                loss = tweedie_loss(model(cat, num), y, w, args.power)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                optimizer.step()
                stats += torch.stack([loss.detach(), torch.ones((), device=device)])
            dist.all_reduce(stats)
            train_loss = (stats[0] / stats[1]).item()

            pred = collect_predictions(model, valid_loader, device, len(valid_ds))
            dev = mean_tweedie_deviance(valid_ds.y, pred, sample_weight=valid_ds.w, power=args.power)
            mae = mean_absolute_error(valid_ds.y, pred, sample_weight=valid_ds.w)
            scheduler.step(dev)  # dev is identical on all ranks, so the lr stays in sync
            mlflow.log_metrics({"train_loss": train_loss, "valid_deviance": dev, "valid_mae": mae,
                                "lr": optimizer.param_groups[0]["lr"]}, step=epoch)
            if rank == 0:
                print(f"epoch {epoch:02d} train {train_loss:.4f} valid_dev {dev:.4f} mae {mae:.1f}", flush=True)
            if dev < best_dev:
                best_dev = dev
                if rank == 0:
                    os.makedirs(args.save_dir, exist_ok=True)
                    torch.save({"model": model.module.state_dict(), "encoders": encoders,
                                "num_mean": num_mean, "num_std": num_std, "args": vars(args)},
                               os.path.join(args.save_dir, "severity_best.pt"))
            dist.barrier()

        mlflow.log_metric("best_valid_deviance", best_dev)
        mlflow.log_artifact(os.path.join(args.save_dir, "severity_best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
