"""PBT for an LSTM load forecaster (electricity consumption, 370 clients).

Population: one member per rank.  Hyper-parameters explored: learning rate,
dropout, teacher-forcing ratio.  Exploit/explore every ``--pbt-every`` epochs
through checkpoints on the shared run directory.

    torchrun --nproc_per_node=8 pbt_lstm.py --csv data/LD2011_2014.csv
"""
import argparse
import json
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="data/LD2011_2014.csv")
    p.add_argument("--out", default="runs/pbt_lstm")
    p.add_argument("--context", type=int, default=168)
    p.add_argument("--horizon", type=int, default=24)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--pbt-every", type=int, default=5)
    p.add_argument("--patience", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class Windows(Dataset):
    def __init__(self, series, context, horizon, stride=24):
        self.x = torch.from_numpy(series.astype(np.float32))  # (T, clients)
        self.c, self.h = context, horizon
        self.starts = list(range(0, self.x.shape[0] - context - horizon, stride))

    def __len__(self):
        return len(self.starts) * self.x.shape[1]

    def __getitem__(self, i):
        s = self.starts[i // self.x.shape[1]]
        k = i % self.x.shape[1]
        seq = self.x[s:s + self.c + self.h, k]
        return seq[:self.c].unsqueeze(-1), seq[self.c:].unsqueeze(-1)


class Seq2Seq(nn.Module):
    def __init__(self, hidden, layers, dropout):
        super().__init__()
        self.enc = nn.LSTM(1, hidden, layers, batch_first=True, dropout=dropout)
        self.dec = nn.LSTM(1, hidden, layers, batch_first=True, dropout=dropout)
        self.proj = nn.Linear(hidden, 1)

    def forward(self, ctx, target=None, horizon=24, tf_ratio=0.0):
        _, state = self.enc(ctx)
        step_in = ctx[:, -1:, :]
        outs = []
        for t in range(horizon):
            o, state = self.dec(step_in, state)
            y = self.proj(o)
            outs.append(y)
            use_tf = target is not None and random.random() < tf_ratio
            step_in = target[:, t:t + 1, :] if use_tf else y.detach()
        return torch.cat(outs, dim=1)


def load_series(path):
    df = pd.read_csv(path, sep=";", decimal=",", index_col=0, parse_dates=True)
    df = df.resample("1h").mean().loc["2012-01-01":]
    values = df.values
    scale = values[: int(0.7 * len(values))].mean(axis=0) + 1e-3
    values = values / scale
    n = len(values)
    return values[: int(0.7 * n)], values[int(0.7 * n): int(0.85 * n)]


def set_member_hparams(model, opt, hp):
    for g in opt.param_groups:
        g["lr"] = hp["lr"]
    model.enc.dropout = hp["dropout"]
    model.dec.dropout = hp["dropout"]


@torch.no_grad()
def validate(model, loader, device, horizon):
    model.eval()
    err, n = 0.0, 0
    for ctx, tgt in loader:
        ctx, tgt = ctx.to(device), tgt.to(device)
        pred = model(ctx, horizon=horizon)
        err += (pred - tgt).abs().sum().item()
        n += tgt.numel()
    return err / n


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    rng = np.random.default_rng(args.seed + rank)
    hp = {"lr": float(10 ** rng.uniform(-4, -2.5)), "dropout": float(rng.uniform(0.0, 0.4)),
          "tf_ratio": float(rng.uniform(0.0, 0.8))}

    train_s, val_s = load_series(args.csv)
    train_loader = DataLoader(Windows(train_s, args.context, args.horizon), batch_size=args.batch_size,
                              shuffle=True, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Windows(val_s, args.context, args.horizon, stride=args.horizon),
                            batch_size=1024, num_workers=4)

    model = Seq2Seq(args.hidden, args.layers, hp["dropout"]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=hp["lr"])
    loss_fn = nn.SmoothL1Loss()

    ck_dir = os.path.join(args.out, "ckpt")
    if rank == 0:
        os.makedirs(ck_dir, exist_ok=True)
    dist.barrier()

    best_mae, bad_epochs, log = float("inf"), 0, []
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        for ctx, tgt in train_loader:
            ctx, tgt = ctx.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            pred = model(ctx, tgt, horizon=args.horizon, tf_ratio=hp["tf_ratio"])
            loss = loss_fn(pred, tgt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()

        mae = validate(model, val_loader, device, args.horizon)
        log.append({"epoch": epoch, "val_mae": mae, **hp})
        print(f"[m{rank}] epoch {epoch} val_mae {mae:.4f} lr {hp['lr']:.2e} "
              f"({time.time() - t0:.0f}s)", flush=True)

        if mae < best_mae - 1e-4:
            best_mae, bad_epochs = mae, 0
        else:
            bad_epochs += 1
            if bad_epochs >= args.patience:
                print(f"[m{rank}] no improvement for {args.patience} epochs, stopping", flush=True)
                break

        if epoch % args.pbt_every == 0:
            t = torch.tensor([mae], device=device)
            all_mae = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(all_mae, t)
            all_mae = [v.item() for v in all_mae]
            order = np.argsort(all_mae)  # lower is better
            q = max(1, world // 4)
            winners, losers = order[:q].tolist(), order[-q:].tolist()

            if rank in winners:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hp": hp,
                            "mae": mae}, os.path.join(ck_dir, f"m{rank}.pt"))
            dist.barrier()
            if rank in losers:
                src = winners[losers.index(rank)]
                state = torch.load(os.path.join(ck_dir, f"m{src}.pt"), map_location=device)
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["opt"])
                hp = {"lr": state["hp"]["lr"] * float(rng.choice([0.8, 1.25])),
                      "dropout": float(np.clip(state["hp"]["dropout"] + rng.normal(0, 0.05), 0, 0.5)),
                      "tf_ratio": float(np.clip(state["hp"]["tf_ratio"] + rng.normal(0, 0.1), 0, 1))}
                set_member_hparams(model, opt, hp)
                best_mae, bad_epochs = state["mae"], 0
            dist.barrier()

    with open(os.path.join(args.out, f"member_{rank}.json"), "w") as f:
        json.dump(log, f)
    final = [None] * world
    dist.all_gather_object(final, {"rank": rank, "best_mae": best_mae, "hp": hp})
    if rank == 0:
        final.sort(key=lambda d: d["best_mae"])
        with open(os.path.join(args.out, "leaderboard.json"), "w") as f:
            json.dump(final, f, indent=2)
        print("best:", final[0], flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
