"""FT-Transformer (Gorishniy et al. 2021) for California housing regression.

Numeric features are tokenised (one learned affine map per feature), a [CLS]
token is prepended and its final representation is regressed to the
standardised target. Supports resuming from a checkpoint written by a run with
a different number of GPUs (the checkpoint only holds the unwrapped weights).

    torchrun --nproc_per_node=4 20_ft_transformer_housing.py
    torchrun --nproc_per_node=2 20_ft_transformer_housing.py --resume runs/ft_housing/last.pt
"""
import argparse
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import fetch_california_housing
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-home", default="data/sklearn")
    ap.add_argument("--out", default="runs/ft_housing")
    ap.add_argument("--resume", default="")
    ap.add_argument("--d-token", type=int, default=192)
    ap.add_argument("--n-layers", type=int, default=3)
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--attn-dropout", type=float, default=0.2)
    ap.add_argument("--ffn-dropout", type=float, default=0.1)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--patience", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class FeatureTokenizer(nn.Module):
    def __init__(self, n_features, d):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_features, d))
        self.bias = nn.Parameter(torch.empty(n_features, d))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        nn.init.kaiming_uniform_(self.bias, a=math.sqrt(5))

    def forward(self, x):
        return x.unsqueeze(-1) * self.weight + self.bias


class FTTransformer(nn.Module):
    def __init__(self, n_features, d, n_layers, n_heads, attn_dropout, ffn_dropout):
        super().__init__()
        self.tokenizer = FeatureTokenizer(n_features, d)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, n_heads, dim_feedforward=int(d * 4 / 3), dropout=ffn_dropout,
                                           activation="gelu", batch_first=True, norm_first=True)
        layer.self_attn.dropout = attn_dropout
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, 1))

    def forward(self, x):
        tok = self.tokenizer(x)
        tok = torch.cat([self.cls_token.expand(len(x), -1, -1), tok], dim=1)
        return self.head(self.encoder(tok)[:, 0]).squeeze(-1)


def get_data(data_home, seed, rank):
    if rank == 0:
        fetch_california_housing(data_home=data_home)  # download into the shared cache once
    dist.barrier()
    X, y = fetch_california_housing(data_home=data_home, return_X_y=True)
    X[:, [2, 3, 4]] = np.log1p(X[:, [2, 3, 4]])  # rooms, bedrooms, population are heavy-tailed
    y = np.log(y)
    idx = np.arange(len(y))
    tr, te = train_test_split(idx, test_size=0.2, random_state=seed)
    tr, va = train_test_split(tr, test_size=0.2, random_state=seed)
    x_mu, x_sd = X[tr].mean(0), X[tr].std(0)
    y_mu, y_sd = y[tr].mean(), y[tr].std()
    Xn = torch.tensor((X - x_mu) / x_sd, dtype=torch.float32)
    yn = torch.tensor((y - y_mu) / y_sd, dtype=torch.float32)
    ds = TensorDataset(Xn, yn, torch.arange(len(y)))
    return Subset(ds, tr), Subset(ds, va), Subset(ds, te), (y_mu, y_sd), X


@torch.no_grad()
def evaluate(net, ds, rank, world, device, y_stats):
    """RMSE in dollars (x100k) over an unpadded shard per rank, summed across ranks."""
    net.eval()
    loader = DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=4096)
    s = torch.zeros(2, device=device, dtype=torch.float64)
    preds = []
    for x, y, i in loader:
        p = net(x.to(device)).double().cpu()
        pd_ = torch.exp(p * y_stats[1] + y_stats[0])
        yd = torch.exp(y.double() * y_stats[1] + y_stats[0])
        s[0] += ((pd_ - yd) ** 2).sum().to(device)
        s[1] += len(y)
        preds.append(torch.stack([i.double(), pd_, yd], 1))
    dist.all_reduce(s)
    net.train()
    return math.sqrt((s[0] / s[1]).item()), torch.cat(preds)


def lr_at(epoch, args):
    if epoch < args.warmup_epochs:
        return args.lr * (epoch + 1) / args.warmup_epochs
    return args.lr


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_ds, val_ds, test_ds, y_stats, X_raw = get_data(args.data_home, args.seed, rank)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.global_batch // world, sampler=sampler, drop_last=True)

    net = FTTransformer(X_raw.shape[1], args.d_token, args.n_layers, args.n_heads,
                        args.attn_dropout, args.ffn_dropout).to(device)
    no_decay = [p for n, p in net.named_parameters() if n.endswith("bias") or "norm" in n or n == "cls_token"
                or n.startswith("tokenizer")]
    decay = [p for n, p in net.named_parameters() if not any(p is q for q in no_decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 1e-5}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr)

    start, best, stale = 0, float("inf"), 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        state = {k.removeprefix("module."): v for k, v in ck["model"].items()}
        net.load_state_dict(state)
        opt.load_state_dict(ck["opt"])
        start, best, stale = ck["epoch"] + 1, ck["best"], ck["stale"]
    model = DDP(net, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(start, args.epochs):
        for g in opt.param_groups:
            g["lr"] = lr_at(epoch, args)
        sampler.set_epoch(epoch)
        for x, y, _ in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x)
            loss = F.mse_loss(pred.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        val_rmse, _ = evaluate(model.module, val_ds, rank, world, device, y_stats)
        improved = val_rmse < best
        best, stale = (val_rmse, 0) if improved else (best, stale + 1)
        if rank == 0:
            print(f"epoch {epoch:3d} lr {lr_at(epoch, args):.1e} val RMSE {val_rmse:.4f}{' *' if improved else ''}",
                  flush=True)
            ck = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                  "best": best, "stale": stale}
            torch.save(ck, os.path.join(args.out, "last.pt"))
            if improved:
                torch.save(ck, os.path.join(args.out, "best.pt"))
        dist.barrier()
        if stale >= args.patience:
            break

    ck = torch.load(os.path.join(args.out, "best.pt"), map_location="cpu")
    model.module.load_state_dict(ck["model"])
    test_rmse, rows = evaluate(model.module, test_ds, rank, world, device, y_stats)
    parts = [None] * world
    dist.all_gather_object(parts, rows)
    if rank == 0:
        allrows = torch.cat(parts).numpy()
        df = pd.DataFrame(allrows, columns=["row", "pred", "true"])
        df["lat_bin"] = pd.cut(X_raw[df["row"].astype(int), 6], bins=8)
        per_bin = df.groupby("lat_bin", observed=True).apply(
            lambda g: pd.Series({"n": len(g), "mae": (g.pred - g.true).abs().mean(),
                                 "mape": 100 * ((g.pred - g.true).abs() / g.true).mean()}))
        per_bin.to_csv(os.path.join(args.out, "test_error_by_latitude.csv"))
        print(f"best epoch {ck['epoch']}  test RMSE {test_rmse:.4f} (x$100k)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
