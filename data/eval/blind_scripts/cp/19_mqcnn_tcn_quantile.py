"""MQ-CNN style forecaster: dilated causal TCN encoder + multi-horizon MLP
decoder emitting several quantiles, trained on a hierarchical demand panel.

    torchrun --standalone --nproc_per_node=8 19_mqcnn_tcn_quantile.py --data /data/demand/panel.npz
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.parametrizations import weight_norm
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

QUANTILES = (0.1, 0.5, 0.9)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/demand/panel.npz")
    ap.add_argument("--out", default="runs/mqcnn")
    ap.add_argument("--lookback", type=int, default=256)
    ap.add_argument("--horizon", type=int, default=52)
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--levels", type=int, default=7)
    ap.add_argument("--kernel", type=int, default=2)
    ap.add_argument("--global_ctx", type=int, default=128)
    ap.add_argument("--local_ctx", type=int, default=16)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--n_folds", type=int, default=4)
    ap.add_argument("--fold_step", type=int, default=13)
    return ap.parse_args()


class CausalConv(nn.Module):
    def __init__(self, c_in, c_out, k, dilation):
        super().__init__()
        self.pad = (k - 1) * dilation
        self.conv = weight_norm(nn.Conv1d(c_in, c_out, k, dilation=dilation))

    def forward(self, x):
        return self.conv(nn.functional.pad(x, (self.pad, 0)))


class TCNBlock(nn.Module):
    def __init__(self, c_in, c_out, k, dilation, drop=0.1):
        super().__init__()
        self.net = nn.Sequential(CausalConv(c_in, c_out, k, dilation), nn.ReLU(), nn.Dropout(drop),
                                 CausalConv(c_out, c_out, k, dilation), nn.ReLU(), nn.Dropout(drop))
        self.down = nn.Conv1d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x):
        return torch.relu(self.net(x) + self.down(x))


class MQCNN(nn.Module):
    def __init__(self, n_in, n_fut, n_items, a):
        super().__init__()
        H, C = a.horizon, a.channels
        self.H, self.local_ctx = H, a.local_ctx
        self.item_emb = nn.Embedding(n_items, 16)
        blocks = [TCNBlock(n_in + 16 if i == 0 else C, C, a.kernel, 2 ** i) for i in range(a.levels)]
        self.tcn = nn.Sequential(*blocks)
        self.global_mlp = nn.Sequential(nn.Linear(C + H * n_fut, 256), nn.ReLU(),
                                        nn.Linear(256, a.global_ctx + H * a.local_ctx))
        self.local_mlp = nn.Sequential(nn.Linear(a.global_ctx + a.local_ctx + n_fut, 64), nn.ReLU(),
                                       nn.Linear(64, len(QUANTILES)))
        self.gc = a.global_ctx

    def forward(self, past, fut, item):
        B, L, _ = past.shape
        e = self.item_emb(item)[:, :, None].expand(-1, -1, L)
        h = self.tcn(torch.cat([past.transpose(1, 2), e], 1))[:, :, -1]      # (B, C) last step
        g = self.global_mlp(torch.cat([h, fut.flatten(1)], -1))
        ctx_g = g[:, :self.gc, None].transpose(1, 2).expand(-1, self.H, -1)
        ctx_l = g[:, self.gc:].view(B, self.H, self.local_ctx)
        return self.local_mlp(torch.cat([ctx_g, ctx_l, fut], -1))          # (B, H, Q)


class Origins(Dataset):
    def __init__(self, y, x, fut, items, origins, L, H, scale):
        self.y, self.x, self.fut, self.items, self.scale = y, x, fut, items, scale
        self.idx = [(s, o) for o in origins for s in range(y.shape[0])]
        self.L, self.H = L, H

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        s, o = self.idx[i]
        L, H, sc = self.L, self.H, self.scale[s]
        past = np.column_stack([self.y[s, o - L:o] / sc, self.x[s, o - L:o]])
        return (torch.from_numpy(past.astype(np.float32)), torch.from_numpy(self.fut[o:o + H]),
                int(self.items[s]), torch.from_numpy((self.y[s, o:o + H] / sc).astype(np.float32)),
                torch.tensor(sc, dtype=torch.float32))


def qloss(pred, y):
    q = pred.new_tensor(QUANTILES).view(1, 1, -1)
    d = y.unsqueeze(-1) - pred
    return (torch.maximum(q * d, (q - 1) * d)).mean()


@torch.no_grad()
def eval_folds(model, loaders, dev):
    model.eval()
    res = []
    for dl in loaders:
        acc = torch.zeros(4, device=dev, dtype=torch.float64)
        for past, fut, item, y, sc in dl:
            past, fut, item, y, sc = (t.to(dev) for t in (past, fut, item, y, sc))
            p = model(past, fut, item)
            pu, yu = p * sc[:, None, None], y * sc[:, None]
            acc[0] += qloss(p, y).double() * y.numel()
            acc[1] += (pu[..., 1] - yu).abs().sum()
            acc[2] += yu.abs().sum()
            acc[3] += y.numel()
        dist.all_reduce(acc)
        res.append({"qloss": (acc[0] / acc[3]).item(), "wape": (acc[1] / acc[2]).item()})
    model.train()
    return res


def main():
    a = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    z = np.load(a.data)
    y, x, fut, items = z["demand"], z["past_cov"], z["future_cov"], z["item_idx"]   # (N,T) (N,T,k) (T,f) (N,)
    N, T = y.shape
    L, H = a.lookback, a.horizon
    # rolling-origin folds at the end of the history; training stops before the first fold
    folds = [T - H - k * a.fold_step for k in reversed(range(a.n_folds))]
    t_train_end = folds[0]
    scale = np.maximum(y[:, :t_train_end].mean(1), 1e-2)
    fut = fut.astype(np.float32)

    train_ds = Origins(y, x, fut, items, range(L, t_train_end - H + 1), L, H, scale)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=a.batch, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    fold_dls = []
    for o in folds:
        ds = Origins(y, x, fut, items, [o], L, H, scale)
        fold_dls.append(DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=1024, num_workers=2))

    model = MQCNN(1 + x.shape[2], fut.shape[1], int(items.max()) + 1, a).to(dev)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[int(a.epochs * 0.6), int(a.epochs * 0.85)])
    os.makedirs(a.out, exist_ok=True)

    best = float("inf")
    for ep in range(a.epochs):
        t0, tot = time.time(), torch.zeros((), device=dev)
        for past, f, item, yt, _ in train_dl:
            past, f, item, yt = (t.to(dev, non_blocking=True) for t in (past, f, item, yt))
            loss = qloss(model(past, f, item), yt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += loss.detach()
        sched.step()
        dist.all_reduce(tot)
        res = eval_folds(model, fold_dls, dev)
        mean_q = float(np.mean([r["qloss"] for r in res]))
        if rank == 0:
            print(f"ep {ep} train {tot.item() / world / len(train_dl):.4f} folds "
                  f"{[round(r['wape'], 4) for r in res]} mean qloss {mean_q:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if mean_q < best:
                torch.save({"model": model.module.state_dict(), "epoch": ep, "folds": res},
                           os.path.join(a.out, "best.pt"))
        best = min(best, mean_q)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
