"""TiDE (dense encoder/decoder MLP) for long-horizon forecasting of a large panel.

Point (MSE/MAE) or probabilistic (quantile) training from the same model code.

    torchrun --nproc_per_node=8 09_tide_mlp_heads.py --loss mse --data /data/panel/wiki_traffic.npz
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

QUANTILES = [0.1, 0.5, 0.9]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/panel/wiki_traffic.npz")
    p.add_argument("--out", default="runs/tide")
    p.add_argument("--loss", choices=["mse", "mae", "quantile"], default="mse")
    p.add_argument("--lookback", type=int, default=720)
    p.add_argument("--horizon", type=int, default=96)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--enc_layers", type=int, default=2)
    p.add_argument("--dec_layers", type=int, default=2)
    p.add_argument("--temporal_width", type=int, default=4)
    p.add_argument("--decoder_out", type=int, default=16)
    p.add_argument("--id_dim", type=int, default=32)
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--batch_size", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class ResBlock(nn.Module):
    def __init__(self, d_in, d_hidden, d_out, dropout):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_out),
                                nn.Dropout(dropout))
        self.skip = nn.Linear(d_in, d_out)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x):
        return self.norm(self.fc(x) + self.skip(x))


class TiDE(nn.Module):
    def __init__(self, a, n_series, n_cov):
        super().__init__()
        L, H = a.lookback, a.horizon
        self.H, self.loss_type = H, a.loss
        self.id_emb = nn.Embedding(n_series, a.id_dim)
        self.cov_proj = ResBlock(n_cov, a.hidden, a.temporal_width, a.dropout)
        enc_in = L + (L + H) * a.temporal_width + a.id_dim
        enc = [ResBlock(enc_in, a.hidden, a.hidden, a.dropout)]
        enc += [ResBlock(a.hidden, a.hidden, a.hidden, a.dropout) for _ in range(a.enc_layers - 1)]
        self.encoder = nn.Sequential(*enc)
        dec = [ResBlock(a.hidden, a.hidden, a.hidden, a.dropout) for _ in range(a.dec_layers - 1)]
        dec += [ResBlock(a.hidden, a.hidden, H * a.decoder_out, a.dropout)]
        self.decoder = nn.Sequential(*dec)
        self.temporal_dec = ResBlock(a.decoder_out + a.temporal_width, a.hidden, a.hidden, a.dropout)
        self.heads = nn.ModuleDict({
            "point": nn.Linear(a.hidden, 1),
            "quantile": nn.Linear(a.hidden, len(QUANTILES)),
        })
        self.lookback_skip = nn.Linear(L, H)

    def forward(self, y_past, cov, sid):
        B = y_past.shape[0]
        c = self.cov_proj(cov)                                   # (B, L+H, tw)
        z = torch.cat([y_past, c.flatten(1), self.id_emb(sid)], dim=-1)
        g = self.decoder(self.encoder(z)).view(B, self.H, -1)   # (B, H, decoder_out)
        t = self.temporal_dec(torch.cat([g, c[:, -self.H:]], -1))
        head = "quantile" if self.loss_type == "quantile" else "point"
        out = self.heads[head](t)
        return out + self.lookback_skip(y_past).unsqueeze(-1)


class PanelWindows(Dataset):
    def __init__(self, y, cov, L, H, t_lo, t_hi, stride):
        self.y, self.cov, self.L, self.H = y, cov, L, H
        ts = np.arange(t_lo, t_hi - L - H + 1, stride)
        ss = np.arange(y.shape[0])
        self.index = np.stack(np.meshgrid(ss, ts, indexing="ij"), -1).reshape(-1, 2)

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        s, t = self.index[i]
        L, H = self.L, self.H
        return (torch.from_numpy(self.y[s, t:t + L]), torch.from_numpy(self.cov[t:t + L + H]),
                int(s), torch.from_numpy(self.y[s, t + L:t + L + H]))


def loss_fn(kind, pred, y):
    if kind == "quantile":
        q = pred.new_tensor(QUANTILES).view(1, 1, -1)
        e = y.unsqueeze(-1) - pred
        return torch.maximum(q * e, (q - 1) * e).mean()
    p = pred.squeeze(-1)
    return F.mse_loss(p, y) if kind == "mse" else F.l1_loss(p, y)


@torch.no_grad()
def evaluate(model, loader, device, kind):
    model.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for y_past, cov, sid, y in loader:
        y_past, cov, sid, y = (t.to(device, non_blocking=True) for t in (y_past, cov, sid, y))
        pred = model(y_past, cov, sid)
        point = pred[..., QUANTILES.index(0.5)] if kind == "quantile" else pred.squeeze(-1)
        s[0] += ((point - y) ** 2).sum()
        s[1] += (point - y).abs().sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    a = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    dev = torch.device(f"cuda:{lr_}")
    torch.manual_seed(42)

    npz = np.load(a.data)
    y, cov = npz["y"].astype(np.float32), npz["cov"].astype(np.float32)  # (N, T), (T, n_cov)
    N, T = y.shape
    t_val, t_test = int(0.7 * T), int(0.8 * T)
    mu = y[:, :t_val].mean(1, keepdims=True)
    sd = y[:, :t_val].std(1, keepdims=True) + 1e-5
    y = (y - mu) / sd
    cmu, csd = cov[:t_val].mean(0), cov[:t_val].std(0) + 1e-5
    cov = (cov - cmu) / csd

    L, H = a.lookback, a.horizon
    tr = PanelWindows(y, cov, L, H, 0, t_val, 1)
    va = PanelWindows(y, cov, L, H, t_val - L, t_test, H)
    te = PanelWindows(y, cov, L, H, t_test - L, T, H)
    tr_s = DistributedSampler(tr, shuffle=True, drop_last=True)
    tr_dl = DataLoader(tr, a.batch_size, sampler=tr_s, num_workers=a.workers, pin_memory=True,
                       drop_last=True)
    # eval shards are contiguous index blocks, no padding duplicates
    shard = lambda ds: torch.utils.data.Subset(ds, np.array_split(np.arange(len(ds)), world)[rank])
    va_dl = DataLoader(shard(va), 1024, num_workers=4)
    te_dl = DataLoader(shard(te), 1024, num_workers=4)

    model = DDP(TiDE(a, N, cov.shape[1]).to(dev), device_ids=[lr_])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.epochs * len(tr_dl))

    os.makedirs(a.out, exist_ok=True)
    best = float("inf")
    for ep in range(a.epochs):
        tr_s.set_epoch(ep)
        t0 = time.time()
        for i, (y_past, c, sid, yt) in enumerate(tr_dl):
            y_past, c, sid, yt = (t.to(dev, non_blocking=True) for t in (y_past, c, sid, yt))
            loss = loss_fn(a.loss, model(y_past, c, sid), yt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and i % 500 == 0:
                print(f"ep {ep} it {i} loss {loss.item():.4f}", flush=True)
        mse, mae = evaluate(model, va_dl, dev, a.loss)
        if rank == 0:
            print(f"== ep {ep} val mse {mse:.4f} mae {mae:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if mse < best:
                best = mse
                torch.save({"model": model.module.state_dict(), "args": vars(a),
                            "scaler": {"mu": mu, "sd": sd}}, os.path.join(a.out, "best.pt"))
        dist.barrier()

    ck = torch.load(os.path.join(a.out, "best.pt"), map_location=dev, weights_only=False)
    model.module.load_state_dict(ck["model"])
    mse, mae = evaluate(model, te_dl, dev, a.loss)
    if rank == 0:
        print(f"test mse {mse:.4f} mae {mae:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
