"""Temporal Fusion Transformer on the UCI electricity load data (370 clients).

Hourly consumption, one column per client. Each sample is a 168h encoder
window plus a 24h decoder window; the known future inputs are calendar
features and the static input is the client id.

    torchrun --nproc_per_node=4 01_tft_electricity.py --data data/electricity_hourly.parquet
"""
import argparse
import json
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

QUANTILES = (0.1, 0.5, 0.9)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/electricity_hourly.parquet")
    p.add_argument("--out-dir", default="runs/tft_electricity")
    p.add_argument("--encoder-len", type=int, default=168)
    p.add_argument("--decoder-len", type=int, default=24)
    p.add_argument("--stride", type=int, default=24)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--output-mode", choices=["quantile", "point"], default="quantile")
    p.add_argument("--global-batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


class GLU(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.fc = nn.Linear(d_in, 2 * d_out)

    def forward(self, x):
        return F.glu(self.fc(x), dim=-1)


class GRN(nn.Module):
    """Gated residual network (Lim et al., eq. 2-4)."""

    def __init__(self, d_in, d_hidden, d_out=None, d_context=None, dropout=0.1):
        super().__init__()
        d_out = d_out or d_in
        self.skip = nn.Linear(d_in, d_out) if d_in != d_out else nn.Identity()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.ctx = nn.Linear(d_context, d_hidden, bias=False) if d_context else None
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.drop = nn.Dropout(dropout)
        self.glu = GLU(d_hidden, d_out)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x, context=None):
        h = self.fc1(x)
        if self.ctx is not None:
            h = h + self.ctx(context)
        h = self.fc2(F.elu(h))
        h = self.glu(self.drop(h))
        return self.norm(self.skip(x) + h)


class VariableSelection(nn.Module):
    def __init__(self, n_vars, d_model, d_context, dropout):
        super().__init__()
        self.var_grns = nn.ModuleList(GRN(d_model, d_model, dropout=dropout) for _ in range(n_vars))
        self.weight_grn = GRN(n_vars * d_model, d_model, n_vars, d_context=d_context, dropout=dropout)

    def forward(self, x, context):
        # x: (B, T, n_vars, d_model), context: (B, 1, d_model)
        w = torch.softmax(self.weight_grn(x.flatten(-2), context), dim=-1).unsqueeze(-1)
        h = torch.stack([g(x[..., i, :]) for i, g in enumerate(self.var_grns)], dim=-2)
        return (w * h).sum(-2)


class TFT(nn.Module):
    def __init__(self, n_series, n_known, d_model, n_heads, n_quantiles, dropout, output_mode):
        super().__init__()
        self.output_mode = output_mode
        self.series_emb = nn.Embedding(n_series, d_model)
        self.target_proj = nn.Linear(1, d_model)
        self.known_proj = nn.ModuleList(nn.Linear(1, d_model) for _ in range(n_known))
        self.ctx_varsel = GRN(d_model, d_model, dropout=dropout)
        self.ctx_enrich = GRN(d_model, d_model, dropout=dropout)
        self.ctx_h = GRN(d_model, d_model, dropout=dropout)
        self.ctx_c = GRN(d_model, d_model, dropout=dropout)
        self.enc_vsn = VariableSelection(1 + n_known, d_model, d_model, dropout)
        self.dec_vsn = VariableSelection(n_known, d_model, d_model, dropout)
        self.encoder = nn.LSTM(d_model, d_model, batch_first=True)
        self.decoder = nn.LSTM(d_model, d_model, batch_first=True)
        self.lstm_gate = GLU(d_model, d_model)
        self.lstm_norm = nn.LayerNorm(d_model)
        self.enrichment = GRN(d_model, d_model, d_context=d_model, dropout=dropout)
        self.attn = nn.MultiheadAttention(d_model, n_heads, dropout=dropout, batch_first=True)
        self.attn_gate = GLU(d_model, d_model)
        self.attn_norm = nn.LayerNorm(d_model)
        self.pos_wise = GRN(d_model, d_model, dropout=dropout)
        self.out_gate = GLU(d_model, d_model)
        self.out_norm = nn.LayerNorm(d_model)
        self.quantile_head = nn.Linear(d_model, n_quantiles)
        self.point_head = nn.Linear(d_model, 1)

    def forward(self, past_target, known, series_id):
        # past_target: (B, Te), known: (B, Te + Td, n_known)
        te = past_target.shape[1]
        s = self.series_emb(series_id)
        c_sel = self.ctx_varsel(s).unsqueeze(1)
        c_enr = self.ctx_enrich(s).unsqueeze(1)
        h0, c0 = self.ctx_h(s).unsqueeze(0), self.ctx_c(s).unsqueeze(0)

        known_emb = [proj(known[..., i:i + 1]) for i, proj in enumerate(self.known_proj)]
        enc_in = torch.stack([self.target_proj(past_target.unsqueeze(-1))] + [k[:, :te] for k in known_emb], dim=-2)
        dec_in = torch.stack([k[:, te:] for k in known_emb], dim=-2)
        enc_x = self.enc_vsn(enc_in, c_sel)
        dec_x = self.dec_vsn(dec_in, c_sel)

        enc_out, state = self.encoder(enc_x, (h0.contiguous(), c0.contiguous()))
        dec_out, _ = self.decoder(dec_x, state)
        lstm_in = torch.cat([enc_x, dec_x], dim=1)
        temporal = self.lstm_norm(lstm_in + self.lstm_gate(torch.cat([enc_out, dec_out], dim=1)))

        enriched = self.enrichment(temporal, c_enr)
        t = enriched.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=enriched.device), diagonal=1)
        attn_out, _ = self.attn(enriched, enriched, enriched, attn_mask=causal, need_weights=False)
        x = self.attn_norm(enriched + self.attn_gate(attn_out))
        x = self.out_norm(temporal + self.out_gate(self.pos_wise(x)))[:, te:]
        if self.output_mode == "quantile":
            return self.quantile_head(x)
        return self.point_head(x).squeeze(-1)


class ElectricityWindows(Dataset):
    def __init__(self, values, calendar, start, end, enc_len, dec_len, stride):
        self.values = values  # (N, T) normalised, float32
        self.calendar = calendar  # (T, n_known)
        self.enc_len, self.dec_len = enc_len, dec_len
        starts = np.arange(start, end - enc_len - dec_len + 1, stride)
        sids = np.arange(values.shape[0])
        self.index = np.stack(np.meshgrid(sids, starts, indexing="ij"), -1).reshape(-1, 2)

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        sid, t0 = self.index[i]
        t1 = t0 + self.enc_len
        t2 = t1 + self.dec_len
        return (torch.from_numpy(self.values[sid, t0:t1]),
                torch.from_numpy(self.calendar[t0:t2]),
                torch.tensor(sid, dtype=torch.long),
                torch.from_numpy(self.values[sid, t1:t2]))


def load_data(path):
    df = pd.read_parquet(path)
    df["timestamp"] = pd.to_datetime(df["timestamp"])
    df = df.set_index("timestamp").sort_index()
    values = df.to_numpy(dtype=np.float32).T  # (N, T)
    idx = df.index
    calendar = np.stack([idx.hour / 23.0 - 0.5, idx.dayofweek / 6.0 - 0.5,
                         (idx.month - 1) / 11.0 - 0.5], axis=1).astype(np.float32)
    return values, calendar


def quantile_loss(pred, target, quantiles):
    q = torch.tensor(quantiles, device=pred.device, dtype=pred.dtype)
    err = target.unsqueeze(-1) - pred
    return torch.maximum(q * err, (q - 1) * err).mean(dim=(1, 2))


def compute_loss(out, target, mode):
    if mode == "quantile":
        return quantile_loss(out, target, QUANTILES)
    return F.mse_loss(out, target, reduction="none").mean(dim=1)


@torch.no_grad()
def evaluate(model, loader, device, mode):
    model.eval()
    stats = torch.zeros(2, device=device)
    for past, known, sid, target in loader:
        past, known = past.to(device, non_blocking=True), known.to(device, non_blocking=True)
        sid, target = sid.to(device, non_blocking=True), target.to(device, non_blocking=True)
        per_sample = compute_loss(model(past, known, sid), target, mode)
        stats[0] += per_sample.sum()
        stats[1] += per_sample.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    values, calendar = load_data(args.data)
    n_series, T = values.shape
    train_end, val_end = int(T * 0.7), int(T * 0.8)
    mean = values[:, :train_end].mean(axis=1, keepdims=True)
    std = values[:, :train_end].std(axis=1, keepdims=True) + 1e-6
    values = np.ascontiguousarray((values - mean) / std, dtype=np.float32)

    enc, dec = args.encoder_len, args.decoder_len
    train_ds = ElectricityWindows(values, calendar, 0, train_end, enc, dec, args.stride)
    val_ds = ElectricityWindows(values, calendar, train_end - enc, val_end, enc, dec, dec)
    val_shard = Subset(val_ds, range(rank, len(val_ds), world))

    per_gpu_batch = args.global_batch_size // world
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=per_gpu_batch, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_shard, batch_size=per_gpu_batch * 2, num_workers=2, pin_memory=True)

    model = TFT(n_series, calendar.shape[1], args.hidden, args.heads, len(QUANTILES),
                args.dropout, args.output_mode).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=2)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "config.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
        np.savez(os.path.join(args.out_dir, "scaler.npz"), mean=mean, std=std)
        print(f"{n_series} series, {len(train_ds)} train windows, {len(val_ds)} val windows, "
              f"world={world}, batch/gpu={per_gpu_batch}", flush=True)

    best, bad_epochs = float("inf"), 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running, n = 0.0, 0
        for past, known, sid, target in train_loader:
            past, known = past.to(device, non_blocking=True), known.to(device, non_blocking=True)
            sid, target = sid.to(device, non_blocking=True), target.to(device, non_blocking=True)
            loss = compute_loss(model(past, known, sid), target, args.output_mode).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            running += loss.item()
            n += 1

        val_loss = evaluate(model, val_loader, device, args.output_mode)
        sched.step(val_loss)
        if rank == 0:
            print(f"epoch {epoch:3d} train {running / max(n, 1):.4f} val {val_loss:.4f} "
                  f"lr {opt.param_groups[0]['lr']:.2e} ({time.time() - t0:.0f}s)", flush=True)
        if val_loss < best - 1e-4:
            best, bad_epochs = val_loss, 0
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_loss": val_loss},
                           os.path.join(args.out_dir, "best.pt"))
        else:
            bad_epochs += 1
            if bad_epochs >= args.patience:
                if rank == 0:
                    print(f"early stopping at epoch {epoch}, best val {best:.4f}")
                break
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
