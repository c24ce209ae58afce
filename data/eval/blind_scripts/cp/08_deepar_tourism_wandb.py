"""DeepAR-style autoregressive LSTM (Student-t likelihood) on the Tourism monthly set.

    torchrun --nproc_per_node=4 08_deepar_tourism_wandb.py --wandb_project tourism-deepar
"""
import argparse
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from torch.distributions import StudentT
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_csv", default="/data/tourism/monthly_in.csv")
    p.add_argument("--test_csv", default="/data/tourism/monthly_oos.csv")
    p.add_argument("--ctx", type=int, default=48)
    p.add_argument("--horizon", type=int, default=24)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--emb", type=int, default=20)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--n_samples", type=int, default=200)
    p.add_argument("--wandb_project", default="tourism-deepar")
    p.add_argument("--ckpt", default="ckpt/deepar_tourism.pt")
    return p.parse_args()


def read_wide(path):
    # tourism csvs: one column per series, header rows = length/start, then values
    df = pd.read_csv(path)
    out = []
    for c in df.columns:
        v = df[c].to_numpy()
        n = int(v[0])
        out.append(v[3:3 + n].astype(np.float32))
    return out


class ARWindows(Dataset):
    def __init__(self, series, ctx, horizon, train=True):
        self.series, self.C, self.H = list(series), ctx, horizon
        self.items = []
        for sid, s in enumerate(series):
            if train:
                for end in range(ctx + horizon, len(s) + 1):
                    self.items.append((sid, end))
            else:
                self.items.append((sid, len(s) + horizon))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        sid, end = self.items[i]
        s = self.series[sid]
        w = np.full(self.C + self.H, np.nan, np.float32)
        seg = s[max(0, end - self.C - self.H):end]
        w[-len(seg):] = seg
        obs = ~np.isnan(w)
        w = np.nan_to_num(w)
        scale = w[:self.C][obs[:self.C]].mean() + 1.0 if obs[:self.C].any() else 1.0
        return sid, w / scale, obs.astype(np.float32), np.float32(scale)


class DeepAR(nn.Module):
    def __init__(self, n_series, emb, hidden, layers):
        super().__init__()
        self.emb = nn.Embedding(n_series, emb)
        self.rnn = nn.LSTM(1 + emb, hidden, layers, batch_first=True, dropout=0.1)
        self.mu = nn.Linear(hidden, 1)
        self.sigma = nn.Linear(hidden, 1)
        self.df = nn.Linear(hidden, 1)

    def dist(self, h):
        return StudentT(2.0 + nn.functional.softplus(self.df(h)).squeeze(-1),
                        self.mu(h).squeeze(-1),
                        nn.functional.softplus(self.sigma(h)).squeeze(-1) + 1e-4)

    def forward(self, sid, z):
        # teacher forcing: input z_{t-1}, predict z_t
        e = self.emb(sid)[:, None].expand(-1, z.shape[1] - 1, -1)
        h, _ = self.rnn(torch.cat([z[:, :-1, None], e], -1))
        return self.dist(h)

    @torch.no_grad()
    def sample(self, sid, z_ctx, horizon, n):
        B = z_ctx.shape[0]
        sid = sid.repeat_interleave(n)
        z = z_ctx.repeat_interleave(n, 0)
        e = self.emb(sid)[:, None]
        h, state = self.rnn(torch.cat([z[:, :-1, None], e.expand(-1, z.shape[1] - 1, -1)], -1))
        last = z[:, -1:]
        outs = []
        for _ in range(horizon):
            h, state = self.rnn(torch.cat([last[..., None], e], -1), state)
            last = self.dist(h).sample()
            outs.append(last)
        return torch.cat(outs, 1).view(B, n, horizon)


@torch.no_grad()
def forecast_metrics(model, loader, ctx, horizon, n, device):
    model.eval()
    tot = torch.zeros(3, device=device, dtype=torch.float64)
    for sid, w, obs, scale in loader:
        sid, w, obs, scale = sid.to(device), w.to(device), obs.to(device), scale.to(device)
        samples = model.module.sample(sid, w[:, :ctx], horizon, n) * scale[:, None, None]
        med = samples.median(1).values
        y = w[:, ctx:] * scale[:, None]
        m = obs[:, ctx:]
        ape = (med - y).abs() / (y.abs() + med.abs()).clamp(min=1e-8) * 200
        tot += torch.stack([((med - y).abs() * m).sum(), (ape * m).sum(), m.sum()]).double()
    dist.all_reduce(tot)
    model.train()
    return {"mae": (tot[0] / tot[2]).item(), "smape": (tot[1] / tot[2]).item()}


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    run = wandb.init(project=args.wandb_project, config=vars(args),
                     name=f"deepar-c{args.ctx}-h{args.horizon}")

    train_series = read_wide(args.train_csv)
    test_series = read_wide(args.test_csv)
    # last horizon of the in-sample part is the validation window
    fit_series = [s[:-args.horizon] for s in train_series]
    train_ds = ARWindows(fit_series, args.ctx, args.horizon, train=True)
    val_ds = ARWindows(fit_series, args.ctx, args.horizon, train=False)
    for sid, s in enumerate(train_series):
        val_ds.series[sid] = s  # context from fit part, target from the held-out tail
    test_full = [np.concatenate([a, b]) for a, b in zip(train_series, test_series)]
    test_ds = ARWindows(train_series, args.ctx, args.horizon, train=False)
    test_ds.series = test_full

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=4, drop_last=True)
    shard = lambda ds: Subset(ds, list(range(rank, len(ds), world)))
    val_dl = DataLoader(shard(val_ds), batch_size=256)
    test_dl = DataLoader(shard(test_ds), batch_size=256)

    model = DDP(DeepAR(len(train_series), args.emb, args.hidden, args.layers).to(device),
                device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    best = math.inf
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for sid, w, obs, scale in train_dl:
            sid, w, obs = sid.to(device), w.to(device), obs.to(device)
            d = model(sid, w)
            nll = -(d.log_prob(w[:, 1:]) * obs[:, 1:]).sum() / obs[:, 1:].sum()
            opt.zero_grad()
            nll.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            step += 1
            if step % 50 == 0:
                wandb.log({"train/nll": nll.item(), "epoch": epoch}, step=step)
        if epoch % 5 == 4:
            val = forecast_metrics(model, val_dl, args.ctx, args.horizon, args.n_samples, device)
            wandb.log({f"val/{k}": v for k, v in val.items()}, step=step)
            if rank == 0:
                print(f"epoch {epoch}: val {val}", flush=True)
                if val["smape"] < best:
                    best = val["smape"]
                    os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                    torch.save(model.module.state_dict(), args.ckpt)
    dist.barrier()
    model.module.load_state_dict(torch.load(args.ckpt, map_location=device))
    test = forecast_metrics(model, test_dl, args.ctx, args.horizon, args.n_samples, device)
    wandb.log({f"test/{k}": v for k, v in test.items()})
    if rank == 0:
        print("test", test)
    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
