"""Automated valuation model (AVM) for residential transactions, FT-Transformer.

Trains on sales up to --train-end, early-stops on the following quarter and reports
MdAPE / within-10% on the quarter after that.

    torchrun --nproc_per_node=4 19_property_valuation_ftt.py --sales data/avm/sales.parquet
"""
import argparse
import json
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CATEGORICAL = ["postcode_district", "property_type", "tenure", "new_build", "epc_rating", "council_tax_band"]
NUMERIC = ["floor_area_m2", "n_rooms", "n_bathrooms", "year_built", "lat", "lon", "dist_station_km",
           "school_score", "district_median_price_lag", "month_index"]


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--sales", default="data/avm/sales.parquet")
    p.add_argument("--train-end", default="2023-03-31")
    p.add_argument("--valid-end", default="2023-06-30")
    p.add_argument("--test-end", default="2023-09-30")
    p.add_argument("--d-token", type=int, default=128)
    p.add_argument("--n-blocks", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4, help="for a 256 global batch; scaled linearly")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--out", default="runs/avm_ftt")
    return p.parse_args()


class NumericTokenizer(nn.Module):
    def __init__(self, n, d):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, d))
        self.bias = nn.Parameter(torch.empty(n, d))
        for t in (self.weight, self.bias):
            nn.init.uniform_(t, -1 / math.sqrt(d), 1 / math.sqrt(d))

    def forward(self, x):
        return x.unsqueeze(-1) * self.weight + self.bias


class FTT(nn.Module):
    def __init__(self, cards, n_num, d, n_blocks, heads=8):
        super().__init__()
        self.num_tok = NumericTokenizer(n_num, d)
        self.cat_tok = nn.ModuleList([nn.Embedding(c, d) for c in cards])
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.backbone = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, heads, int(4 * d / 3), 0.1, activation="gelu", batch_first=True,
                                       norm_first=True), n_blocks)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, 1))

    def forward(self, xc, xn):
        tokens = torch.cat([self.cls.expand(len(xc), -1, -1),
                            torch.stack([emb(xc[:, i]) for i, emb in enumerate(self.cat_tok)], 1),
                            self.num_tok(xn)], 1)
        return self.head(self.backbone(tokens)[:, 0]).squeeze(-1)


def as_dataset(frame, vocab, mean, std):
    xc = np.stack([frame[c].astype(str).map(vocab[c]).fillna(0).astype(np.int64).values for c in CATEGORICAL], 1)
    xn = ((frame[NUMERIC] - mean) / std).fillna(0).values.astype(np.float32)
    y = np.log(frame["price"].values).astype(np.float32)
    return TensorDataset(torch.from_numpy(xc), torch.from_numpy(xn), torch.from_numpy(y))


@torch.no_grad()
def valuation_metrics(model, ds, device, rank, world):
    """Scores a strided shard per rank and sums the error statistics across ranks."""
    net = model.module
    net.eval()
    shard = torch.utils.data.Subset(ds, range(rank, len(ds), world))
    stats = torch.zeros(4, device=device, dtype=torch.float64)  # n, sq log err, |pct err| <= 10%, abs log err
    ape = []
    for xc, xn, y in DataLoader(shard, batch_size=8192):
        pred = net(xc.to(device), xn.to(device)).double()
        y = y.to(device).double()
        err = pred - y
        pct = (torch.exp(pred) - torch.exp(y)).abs() / torch.exp(y)
        stats += torch.stack([torch.tensor(float(len(y)), device=device, dtype=torch.float64),
                              (err ** 2).sum(), (pct <= 0.10).sum().double(), err.abs().sum()])
        ape.append(pct.float())
    dist.all_reduce(stats)
    ape = torch.cat(ape)
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(ape)], device=device))
    max_n = int(max(s.item() for s in sizes))
    padded = torch.full((max_n,), float("nan"), device=device)
    padded[:len(ape)] = ape
    allape = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(allape, padded)
    allape = torch.cat(allape)
    mdape = torch.nanmedian(allape).item()
    n = stats[0]
    return {"rmse_log": math.sqrt((stats[1] / n).item()), "within10": (stats[2] / n).item(),
            "mae_log": (stats[3] / n).item(), "mdape": mdape}


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    sales = pd.read_parquet(args.sales)
    sales["sale_date"] = pd.to_datetime(sales["sale_date"])
    sales = sales[(sales["price"] > 10_000) & (sales["price"] < 20_000_000)]
    tr = sales[sales["sale_date"] <= args.train_end]
    va = sales[(sales["sale_date"] > args.train_end) & (sales["sale_date"] <= args.valid_end)]
    te = sales[(sales["sale_date"] > args.valid_end) & (sales["sale_date"] <= args.test_end)]
    vocab = {c: {v: i + 1 for i, v in enumerate(sorted(tr[c].astype(str).unique()))} for c in CATEGORICAL}
    mean, std = tr[NUMERIC].mean(), tr[NUMERIC].std().replace(0, 1)
    train_ds, valid_ds, test_ds = (as_dataset(f, vocab, mean, std) for f in (tr, va, te))

    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6, pin_memory=True)
    model = FTT([len(vocab[c]) + 1 for c in CATEGORICAL], len(NUMERIC), args.d_token, args.n_blocks).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-5)
    loss_fn = nn.HuberLoss(delta=0.2)

    ckpt_path = os.path.join(args.out, "avm_ftt_best.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best, wait = float("inf"), 0
    for epoch in range(args.epochs):
        model.train()
        for xc, xn, y in loader:
            xc, xn, y = xc.to(device, non_blocking=True), xn.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(xc, xn)
            loss = loss_fn(pred.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        m = valuation_metrics(model, valid_ds, device, rank, world)
        if m["rmse_log"] < best:
            best, wait = m["rmse_log"], 0
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "vocab": vocab,
                            "mean": mean.to_dict(), "std": std.to_dict(), "epoch": epoch}, ckpt_path)
        else:
            wait += 1
        if rank == 0:
            print(f"epoch {epoch:02d} valid {json.dumps({k: round(v, 4) for k, v in m.items()})}", flush=True)
        if wait >= args.patience:  # m is all-reduced, so every rank stops at the same epoch
            break

    dist.barrier()
    state = torch.load(ckpt_path, map_location=device)
    model.module.load_state_dict(state["model"])
    test_m = valuation_metrics(model, test_ds, device, rank, world)
    if rank == 0:
        print(f"test (best epoch {state['epoch']}): {test_m}")
        with open(os.path.join(args.out, "test_metrics.json"), "w") as f:
            json.dump(test_m, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
