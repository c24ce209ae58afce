"""Architecture/HP sweep for a PatchTST-style forecaster on ETTh1, logged to Weights & Biases.

The sweep grid comes from a YAML file; each grid point is one W&B run in the
sweep's group, trained with DDP and stopped early on the validation MSE.

    torchrun --standalone --nproc_per_node=4 14_patchtst_wandb_sweep.py --grid configs/ett_grid.yaml
"""
import argparse
import itertools
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

DEFAULT_GRID = {"patch_len": [8, 16], "d_model": [64, 128], "n_layers": [2, 3], "lr": [1e-4, 5e-4]}


class Windows(Dataset):
    def __init__(self, arr, seq_len, pred_len):
        self.x = torch.from_numpy(arr).float()
        self.seq_len, self.pred_len = seq_len, pred_len

    def __len__(self):
        return len(self.x) - self.seq_len - self.pred_len + 1

    def __getitem__(self, i):
        s = i + self.seq_len
        return self.x[i:s], self.x[s:s + self.pred_len]


def load_ett(path, seq_len, pred_len):
    df = pd.read_csv(path)
    values = df.drop(columns=["date"]).values.astype(np.float32)
    # standard ETTh1 borders: 12 / 4 / 4 months
    b1, b2, b3 = 12 * 30 * 24, 16 * 30 * 24, 20 * 30 * 24
    mean, std = values[:b1].mean(0), values[:b1].std(0) + 1e-5
    values = (values - mean) / std
    train = Windows(values[:b1], seq_len, pred_len)
    val = Windows(values[b1 - seq_len:b2], seq_len, pred_len)
    test = Windows(values[b2 - seq_len:b3], seq_len, pred_len)
    return train, val, test


class PatchTST(nn.Module):
    def __init__(self, n_vars, seq_len, pred_len, patch_len, d_model, n_layers, n_heads=4, dropout=0.2):
        super().__init__()
        self.patch_len, self.stride = patch_len, patch_len // 2
        n_patches = (seq_len - patch_len) // self.stride + 1
        self.embed = nn.Linear(patch_len, d_model)
        self.pos = nn.Parameter(torch.randn(1, n_patches, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers)
        self.head = nn.Sequential(nn.Flatten(1), nn.Dropout(dropout), nn.Linear(n_patches * d_model, pred_len))
        self.n_vars = n_vars

    def forward(self, x):  # x: (B, L, C)
        mu, sigma = x.mean(1, keepdim=True), x.std(1, keepdim=True) + 1e-5  # RevIN without affine
        x = ((x - mu) / sigma).permute(0, 2, 1)  # B, C, L
        B, C, L = x.shape
        p = x.unfold(-1, self.patch_len, self.stride).reshape(B * C, -1, self.patch_len)
        h = self.encoder(self.embed(p) + self.pos)
        y = self.head(h).reshape(B, C, -1).permute(0, 2, 1)
        return y * sigma + mu


@torch.no_grad()
def mse(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        acc[0] += ((model(x) - y) ** 2).sum()
        acc[1] += y.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="/data/ETT-small/ETTh1.csv")
    ap.add_argument("--grid", default=None)
    ap.add_argument("--project", default="ett-patchtst")
    ap.add_argument("--sweep-name", default="etth1-grid-v3")
    ap.add_argument("--seq-len", type=int, default=336)
    ap.add_argument("--pred-len", type=int, default=96)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--patience", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    grid = DEFAULT_GRID
    if args.grid:
        with open(args.grid) as f:
            grid = yaml.safe_load(f)
    train_set, val_set, test_set = load_ett(args.csv, args.seq_len, args.pred_len)
    n_vars = train_set.x.shape[1]
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), 256, num_workers=2)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), 256, num_workers=2)

    keys = sorted(grid)
    for trial_idx, values in enumerate(itertools.product(*(grid[k] for k in keys))):
        cfg = dict(zip(keys, values))
        run = wandb.init(project=args.project, group=args.sweep_name, name=f"trial-{trial_idx:02d}",
                         config={**cfg, "seq_len": args.seq_len, "pred_len": args.pred_len, "world_size": world},
                         reinit=True)
        torch.manual_seed(trial_idx)
        model = PatchTST(n_vars, args.seq_len, args.pred_len, cfg["patch_len"], cfg["d_model"], cfg["n_layers"]).to(device)
        model = DDP(model, device_ids=[local_rank])
        opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
        steps = args.epochs * len(train_loader)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))

        best, bad, best_state = float("inf"), 0, None
        for epoch in range(args.epochs):
            model.train()
            sampler.set_epoch(epoch)
            tot = torch.zeros(2, device=device)
            for x, y in train_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                tot += torch.stack([loss.detach(), torch.ones((), device=device)])
            dist.all_reduce(tot)
            val = mse(model, val_loader, device)
            run.log({"train/mse": (tot[0] / tot[1]).item(), "val/mse": val, "lr": sched.get_last_lr()[0]}, step=epoch)
            if val < best:
                best, bad = val, 0
                best_state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
            else:
                bad += 1
                if bad >= args.patience:
                    break

        model.module.load_state_dict(best_state)
        test = mse(model, test_loader, device)
        run.summary.update({"best_val_mse": best, "test_mse": test, "stopped_epoch": epoch})
        run.finish()
        if rank == 0:
            print(f"trial {trial_idx} {cfg}: val {best:.4f} test {test:.4f}", flush=True)
        del model, opt, best_state
        torch.cuda.empty_cache()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
