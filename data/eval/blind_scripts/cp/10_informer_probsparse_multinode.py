"""Informer with ProbSparse self-attention, multi-node training on the
ECL/Traffic panels.  Checkpoints go to the shared Lustre scratch.

    # on each of the 2 nodes (8 GPUs each)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$MASTER_ADDR:29500 10_informer_probsparse_multinode.py \
        --dataset traffic --ckpt_dir /lustre/scratch/$USER/informer_traffic
"""
import argparse
import math
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="traffic")
    p.add_argument("--data_root", default="/lustre/datasets/ltsf")
    p.add_argument("--ckpt_dir", required=True)
    p.add_argument("--seq_len", type=int, default=168)
    p.add_argument("--label_len", type=int, default=96)
    p.add_argument("--pred_len", type=int, default=168)
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--e_layers", type=int, default=3)
    p.add_argument("--factor", type=int, default=5)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class SeriesWindows(Dataset):
    def __init__(self, arr, seq_len, label_len, pred_len):
        self.a, self.s, self.l, self.p = arr, seq_len, label_len, pred_len

    def __len__(self):
        return len(self.a) - self.s - self.p + 1

    def __getitem__(self, i):
        x = self.a[i:i + self.s]
        y = self.a[i + self.s - self.l:i + self.s + self.p]
        return torch.from_numpy(x), torch.from_numpy(y)


class ProbAttention(nn.Module):
    """Top-u query selection by the max-mean sparsity measurement (Zhou et al. 2021)."""

    def __init__(self, d_model, heads, factor, dropout=0.05):
        super().__init__()
        self.h, self.dk, self.factor = heads, d_model // heads, factor
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.o = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        B, L, _ = x.shape
        q = self.q(x).view(B, L, self.h, self.dk).transpose(1, 2)
        k = self.k(x).view(B, L, self.h, self.dk).transpose(1, 2)
        v = self.v(x).view(B, L, self.h, self.dk).transpose(1, 2)
        u = min(L, int(self.factor * math.ceil(math.log(L + 1))))
        idx = torch.randint(L, (L, u), device=x.device)
        k_s = k[:, :, idx, :]                                     # (B, h, L, u, dk)
        qk_s = (q.unsqueeze(-2) * k_s).sum(-1)                    # (B, h, L, u)
        M = qk_s.max(-1).values - qk_s.sum(-1) / L
        top = M.topk(u, dim=-1).indices                           # (B, h, u)
        ctx = v.mean(dim=2, keepdim=True).expand(B, self.h, L, self.dk).clone()
        q_top = torch.gather(q, 2, top.unsqueeze(-1).expand(-1, -1, -1, self.dk))
        attn = torch.softmax(q_top @ k.transpose(-2, -1) / math.sqrt(self.dk), -1)
        ctx.scatter_(2, top.unsqueeze(-1).expand(-1, -1, -1, self.dk), self.drop(attn) @ v)
        return self.o(ctx.transpose(1, 2).reshape(B, L, -1))


class EncoderLayer(nn.Module):
    def __init__(self, d, h, factor):
        super().__init__()
        self.attn = ProbAttention(d, h, factor)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.distil = nn.Sequential(nn.Conv1d(d, d, 3, padding=1), nn.ELU(), nn.MaxPool1d(3, 2, 1))

    def forward(self, x):
        x = self.n1(x + self.attn(x))
        x = self.n2(x + self.ff(x))
        return self.distil(x.transpose(1, 2)).transpose(1, 2)


class Informer(nn.Module):
    def __init__(self, c, a):
        super().__init__()
        self.pred_len, self.label_len = a.pred_len, a.label_len
        self.enc_in = nn.Linear(c, a.d_model)
        self.dec_in = nn.Linear(c, a.d_model)
        self.pos = nn.Parameter(torch.randn(1, a.seq_len + a.pred_len, a.d_model) * 0.02)
        self.encoder = nn.ModuleList([EncoderLayer(a.d_model, a.heads, a.factor) for _ in range(a.e_layers)])
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(a.d_model, a.heads, 4 * a.d_model, 0.05, batch_first=True), 2)
        self.out = nn.Linear(a.d_model, c)

    def forward(self, x, y_tok):
        h = self.enc_in(x) + self.pos[:, :x.size(1)]
        for layer in self.encoder:
            h = layer(h)
        dec = torch.cat([y_tok, torch.zeros_like(y_tok[:, :1]).expand(-1, self.pred_len, -1)], 1)
        d = self.dec_in(dec) + self.pos[:, :dec.size(1)]
        mask = nn.Transformer.generate_square_subsequent_mask(d.size(1), device=d.device)
        return self.out(self.decoder(d, h, tgt_mask=mask))[:, -self.pred_len:]


def save_checkpoint(state, is_best, ckpt_dir):
    path = os.path.join(ckpt_dir, "checkpoint.pth.tar")
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(ckpt_dir, "model_best.pth.tar"))


@torch.no_grad()
def evaluate(model, loader, a, dev):
    model.eval()
    acc = torch.zeros(3, device=dev)
    for x, y in loader:
        x, y = x.to(dev), y.to(dev)
        p = model(x, y[:, :a.label_len])
        t = y[:, -a.pred_len:]
        acc += torch.stack([F.mse_loss(p, t, reduction="sum"), F.l1_loss(p, t, reduction="sum"),
                            torch.tensor(float(t.numel()), device=dev)])
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    a = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    raw = np.load(os.path.join(a.data_root, f"{a.dataset}.npy")).astype(np.float32)  # (T, C)
    n = len(raw)
    n_tr, n_te = int(0.7 * n), int(0.2 * n)
    mu, sd = raw[:n_tr].mean(0), raw[:n_tr].std(0) + 1e-6
    data = (raw - mu) / sd
    tr = SeriesWindows(data[:n_tr], a.seq_len, a.label_len, a.pred_len)
    va = SeriesWindows(data[n_tr - a.seq_len:n - n_te], a.seq_len, a.label_len, a.pred_len)

    tr_s = DistributedSampler(tr, shuffle=True, drop_last=True)
    va_s = DistributedSampler(va, shuffle=False, drop_last=True)
    tr_dl = DataLoader(tr, a.batch_size, sampler=tr_s, num_workers=6, pin_memory=True, drop_last=True)
    va_dl = DataLoader(va, 64, sampler=va_s, num_workers=4, pin_memory=True)

    model = DDP(Informer(data.shape[1], a).to(dev), device_ids=[local_rank])
    # lr tuned for 16 GPUs x 16 per GPU; sqrt-scale if the world size differs
    lr = a.lr * math.sqrt(world / 16)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    start, best = 0, float("inf")
    resume_path = os.path.join(a.ckpt_dir, "checkpoint.pth.tar")
    if a.resume and os.path.exists(resume_path):
        ck = torch.load(resume_path, map_location=dev)
        model.module.load_state_dict(ck["state_dict"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        start, best = ck["epoch"] + 1, ck["best_mse"]
        if rank == 0:
            print(f"resumed from epoch {ck['epoch']}")
    os.makedirs(a.ckpt_dir, exist_ok=True)

    for epoch in range(start, a.epochs):
        tr_s.set_epoch(epoch)
        tic = time.time()
        for it, (x, y) in enumerate(tr_dl):
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            loss = F.mse_loss(model(x, y[:, :a.label_len]), y[:, -a.pred_len:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} iter {it}/{len(tr_dl)} loss {loss.item():.4f}", flush=True)
        sched.step()
        mse, mae = evaluate(model, va_dl, a, dev)
        is_best = mse < best
        best = min(mse, best)
        if rank == 0:
            print(f"epoch {epoch} val mse {mse:.4f} mae {mae:.4f} time {time.time() - tic:.0f}s")
        save_checkpoint({"epoch": epoch, "state_dict": model.module.state_dict(),
                         "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                         "best_mse": best, "norm": {"mu": mu, "sd": sd}}, is_best, a.ckpt_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
