"""Grid search for the gas-turbine NOx emission regressor (sensor tabular data).

Every grid point is trained with DDP over all GPUs of the node, results are appended to
grid_results.csv and the best model is kept.

    torchrun --nproc_per_node=4 16_turbine_nox_grid_search.py --data data/gt_emissions_2011_2015.csv
"""
import argparse
import itertools
import os
import time

import joblib
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import mean_absolute_error, r2_score
from sklearn.preprocessing import StandardScaler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

FEATURES = ["AT", "AP", "AH", "AFDP", "GTEP", "TIT", "TAT", "TEY", "CDP"]
TARGET = "NOX"

GRID = {
    "hidden": [(128, 64), (256, 128), (512, 256, 128)],
    "dropout": [0.0, 0.1],
    "lr": [3e-4, 1e-3],
    "weight_decay": [0.0, 1e-4],
}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/gt_emissions_2011_2015.csv")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=256, help="global")
    p.add_argument("--out", default="runs/nox_grid")
    return p.parse_args()


def make_mlp(n_in, hidden, dropout):
    layers, d = [], n_in
    for h in hidden:
        layers += [nn.Linear(d, h), nn.LayerNorm(h), nn.SiLU(), nn.Dropout(dropout)]
        d = h
    layers.append(nn.Linear(d, 1))
    return nn.Sequential(*layers)


def load_data(path):
    df = pd.read_csv(path)
    # the data comes as one file per year; years 2011-2013 train, 2014 validation, 2015 test
    tr, va, te = df[df["year"] <= 2013], df[df["year"] == 2014], df[df["year"] == 2015]
    scaler = StandardScaler().fit(tr[FEATURES].values)
    y_mean, y_std = tr[TARGET].mean(), tr[TARGET].std()

    def ds(frame):
        x = torch.tensor(scaler.transform(frame[FEATURES].values), dtype=torch.float32)
        y = torch.tensor(((frame[TARGET] - y_mean) / y_std).values, dtype=torch.float32)
        return TensorDataset(torch.arange(len(frame)), x, y)

    return ds(tr), ds(va), ds(te), scaler, (y_mean, y_std)


@torch.no_grad()
def predict(model, ds, device, rank, world):
    sampler = DistributedSampler(ds, shuffle=False)
    loader = DataLoader(ds, batch_size=4096, sampler=sampler)
    model.eval()
    out = [(i.numpy(), model(x.to(device)).squeeze(-1).cpu().numpy()) for i, x, _ in loader]
    allparts = [None] * world
    dist.all_gather_object(allparts, out)
    pred = np.zeros(len(ds), dtype=np.float32)
    for part in allparts:
        for i, p in part:
            pred[i] = p
    return pred


def train_config(cfg, data, args, rank, world, local_rank):
    train_ds, valid_ds = data[0], data[1]
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(42)
    model = make_mlp(len(FEATURES), cfg["hidden"], cfg["dropout"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=42, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=sampler, num_workers=2)
    loss_fn = nn.SmoothL1Loss(beta=0.5)
    y_valid = valid_ds.tensors[2].numpy()

    best_mae, best_state = np.inf, None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for _, x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = loss_fn(model(x).squeeze(-1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        sched.step()
        if epoch % 5 == 4 or epoch == args.epochs - 1:
            mae = mean_absolute_error(y_valid, predict(model, valid_ds, device, rank, world))
            if mae < best_mae:
                best_mae = mae
                best_state = {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}
    return best_mae, best_state


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    data = load_data(args.data)
    _, _, test_ds, scaler, (y_mean, y_std) = data
    keys = list(GRID)
    configs = [dict(zip(keys, vals)) for vals in itertools.product(*GRID.values())]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(configs)} grid points on {world} GPUs", flush=True)

    results, best = [], (np.inf, None, None)
    for i, cfg in enumerate(configs):
        t0 = time.time()
        mae, state = train_config(cfg, data, args, rank, world, local_rank)
        mae_orig = mae * y_std
        results.append({**cfg, "hidden": str(cfg["hidden"]), "valid_mae": mae_orig, "sec": time.time() - t0})
        if mae < best[0]:
            best = (mae, cfg, state)
        if rank == 0:
            print(f"[{i + 1}/{len(configs)}] {cfg} -> valid MAE {mae_orig:.3f} mg/m3", flush=True)
            pd.DataFrame(results).to_csv(os.path.join(args.out, "grid_results.csv"), index=False)

    if rank == 0:
        mae, cfg, state = best
        final = make_mlp(len(FEATURES), cfg["hidden"], cfg["dropout"])
        final.load_state_dict(state)
        final.eval()
        with torch.no_grad():
            p = final(test_ds.tensors[1]).squeeze(-1).numpy() * y_std + y_mean
        y_test = test_ds.tensors[2].numpy() * y_std + y_mean
        print(f"best {cfg}: test MAE {mean_absolute_error(y_test, p):.3f}  R2 {r2_score(y_test, p):.4f}")
        torch.save({"state_dict": state, "config": cfg}, os.path.join(args.out, "best_nox_mlp.pt"))
        joblib.dump(scaler, os.path.join(args.out, "scaler.joblib"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
