"""TCN with quantile outputs for category x store weekly sales, tracked in W&B.

    torchrun --nproc_per_node=4 15_tcn_category_sales.py --data data/cat_store_weekly.parquet \
        --wandb_project demand-forecasting --run_name tcn-q-cat
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

QS = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95])


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/cat_store_weekly.parquet")
    p.add_argument("--ckpt_dir", default="checkpoints/tcn_q")
    p.add_argument("--wandb_project", default="demand-forecasting")
    p.add_argument("--run_name", default=None)
    p.add_argument("--context", type=int, default=78)
    p.add_argument("--horizon", type=int, default=12)
    p.add_argument("--origins", type=int, default=6)
    p.add_argument("--channels", type=int, default=48)
    p.add_argument("--levels", type=int, default=5)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--log_every", type=int, default=50)
    return p.parse_args()


def read_panel(path):
    df = pd.read_parquet(path)
    df["series"] = df["category"] + "/" + df["store"].astype(str)
    y = df.pivot_table(index="series", columns="week", values="sales", aggfunc="sum").fillna(0.0)
    return y.index.tolist(), y.to_numpy(np.float32)


class Weekly(Dataset):
    def __init__(self, y, scale, c, h, end):
        self.y, self.scale, self.c, self.h = y, scale, c, h
        self.pairs = [(s, t) for s in range(len(y)) for t in range(0, end - c - h + 1)]

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        s, t = self.pairs[i]
        w = self.y[s, t:t + self.c + self.h] / self.scale[s]
        woy = np.arange(t, t + self.c) % 52
        feats = np.stack([w[:self.c], np.sin(2 * np.pi * woy / 52), np.cos(2 * np.pi * woy / 52)])
        return torch.from_numpy(feats.astype(np.float32)), torch.from_numpy(w[self.c:])


class Chomp(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        return x[..., :-self.n] if self.n else x


class QuantileTCN(nn.Module):
    def __init__(self, c_in, ch, levels, horizon, n_q):
        super().__init__()
        layers = []
        for i in range(levels):
            d = 2 ** i
            layers += [nn.Conv1d(c_in if i == 0 else ch, ch, 3, padding=2 * d, dilation=d), Chomp(2 * d),
                       nn.GELU(), nn.Dropout(0.1)]
        self.net = nn.Sequential(*layers)
        self.head = nn.Linear(ch, horizon * n_q)
        self.horizon, self.n_q = horizon, n_q

    def forward(self, x):
        h = self.net(x)[..., -1]
        return self.head(h).view(-1, self.horizon, self.n_q)


def quantile_loss(pred, y, qs):
    d = y.unsqueeze(-1) - pred
    return torch.maximum(qs * d, (qs - 1) * d).mean()


@torch.no_grad()
def backtest(net, y, scale, args, rank, world, device, qs):
    net.eval()
    n, T = y.shape
    rows = np.arange(rank, n, world)
    s = torch.zeros(4, dtype=torch.float64, device=device)  # abs err, sum y, covered(5-95), points
    for k in range(args.origins, 0, -1):
        cut = T - k * args.horizon
        if len(rows) == 0:
            continue
        w = y[rows, cut - args.context:cut] / scale[rows, None]
        woy = np.arange(cut - args.context, cut) % 52
        x = np.concatenate([w[:, None], np.broadcast_to(np.sin(2 * np.pi * woy / 52), w.shape)[:, None],
                            np.broadcast_to(np.cos(2 * np.pi * woy / 52), w.shape)[:, None]], 1)
        q = net(torch.from_numpy(x.astype(np.float32)).to(device)).double()
        q = q * torch.from_numpy(scale[rows, None, None]).to(device)
        t = torch.from_numpy(y[rows, cut:cut + args.horizon]).to(device).double()
        med = q[..., qs.numel() // 2].clamp_min(0)
        s[0] += (med - t).abs().sum()
        s[1] += t.sum()
        s[2] += ((t >= q[..., 0]) & (t <= q[..., -1])).sum()
        s[3] += t.numel()
    dist.all_reduce(s)
    net.train()
    return {"wape": (s[0] / s[1]).item(), "coverage_90": (s[2] / s[3]).item()}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(5)

    run = wandb.init(project=args.wandb_project, name=args.run_name,
                     config={**vars(args), "world_size": world})

    names, y = read_panel(args.data)
    T = y.shape[1]
    train_end = T - args.origins * args.horizon
    scale = np.maximum(y[:, :train_end].mean(1), 1.0).astype(np.float32)
    ds = Weekly(y, scale, args.context, args.horizon, train_end)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    qs = QS.to(device)
    model = DDP(QuantileTCN(3, args.channels, args.levels, args.horizon, len(QS)).to(device),
                device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=10)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    step, best = 0, float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (x, target) in enumerate(loader):
            x, target = x.to(device, non_blocking=True), target.to(device, non_blocking=True)
            loss = quantile_loss(model(x), target, qs)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step(epoch + i / len(loader))
            step += 1
            if step % args.log_every == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                run.log({"train/qloss": l.item(), "lr": opt.param_groups[0]["lr"]}, step=step)

        m = backtest(model.module, y, scale, args, rank, world, device, qs)
        run.log({f"backtest/{k}": v for k, v in m.items()} | {"epoch": epoch}, step=step)
        if rank == 0:
            print(f"epoch {epoch}: wape {m['wape']:.4f} cov90 {m['coverage_90']:.3f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if m["wape"] < best:
                best = m["wape"]
                torch.save({"model": model.module.state_dict(), "series": names, "scale": scale,
                            "epoch": epoch, "metrics": m}, os.path.join(args.ckpt_dir, "best.pt"))
        dist.barrier()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
