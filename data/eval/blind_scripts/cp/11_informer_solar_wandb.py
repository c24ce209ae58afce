"""Informer-style encoder/decoder for Solar-Energy (137 plants, 10-min data).

Activation checkpointing on the encoder layers lets us run seq_len=720 with a
wide model.  Logs to W&B from rank 0.

    torchrun --nproc_per_node=8 11_informer_solar_wandb.py --seq_len 720 --pred_len 144
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--txt", default="/data/solar/solar_AL.txt")
    p.add_argument("--out", default="runs/informer_solar")
    p.add_argument("--seq_len", type=int, default=336)
    p.add_argument("--label_len", type=int, default=72)
    p.add_argument("--pred_len", type=int, default=144)
    p.add_argument("--d_model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--e_layers", type=int, default=4)
    p.add_argument("--d_layers", type=int, default=2)
    p.add_argument("--per_gpu_batch", type=int, default=32)
    p.add_argument("--base_lr", type=float, default=1e-4, help="lr for a global batch of 32")
    p.add_argument("--warmup_steps", type=int, default=500)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--patience", type=int, default=4)
    p.add_argument("--no_grad_ckpt", dest="grad_ckpt", action="store_false")
    p.add_argument("--project", default="ltsf-solar")
    return p.parse_args()


class Windows(Dataset):
    def __init__(self, arr, s, l, p):
        self.arr, self.s, self.l, self.p = arr, s, l, p

    def __len__(self):
        return len(self.arr) - self.s - self.p + 1

    def __getitem__(self, i):
        return (torch.from_numpy(self.arr[i:i + self.s]),
                torch.from_numpy(self.arr[i + self.s - self.l:i + self.s + self.p]))


class Informer(nn.Module):
    def __init__(self, c, a):
        super().__init__()
        d = a.d_model
        self.pred_len, self.label_len, self.grad_ckpt = a.pred_len, a.label_len, a.grad_ckpt
        self.enc_emb = nn.Linear(c, d)
        self.dec_emb = nn.Linear(c, d)
        self.pos = nn.Embedding(a.seq_len + a.pred_len, d)
        self.encoder = nn.ModuleList([
            nn.TransformerEncoderLayer(d, a.heads, 4 * d, 0.05, "gelu", batch_first=True, norm_first=True)
            for _ in range(a.e_layers)])
        self.enc_norm = nn.LayerNorm(d)
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(d, a.heads, 4 * d, 0.05, "gelu", batch_first=True, norm_first=True),
            a.d_layers, norm=nn.LayerNorm(d))
        self.proj = nn.Linear(d, c)

    def forward(self, x, y_tok):
        pos = torch.arange(x.size(1), device=x.device)
        h = self.enc_emb(x) + self.pos(pos)
        for layer in self.encoder:
            if self.grad_ckpt and self.training:
                h = checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        mem = self.enc_norm(h)
        dec = torch.cat([y_tok, y_tok.new_zeros(y_tok.size(0), self.pred_len, y_tok.size(2))], 1)
        d = self.dec_emb(dec) + self.pos(torch.arange(dec.size(1), device=x.device))
        mask = nn.Transformer.generate_square_subsequent_mask(d.size(1), device=d.device)
        return self.proj(self.decoder(d, mem, tgt_mask=mask))[:, -self.pred_len:]


@torch.no_grad()
def evaluate(model, loader, a, dev, n_plants):
    """Per-plant MSE/MAE over the whole split (sums reduced across ranks)."""
    model.eval()
    sse = torch.zeros(n_plants, device=dev, dtype=torch.float64)
    sae = torch.zeros_like(sse)
    n = torch.zeros(1, device=dev, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(dev), y.to(dev)
        p = model(x, y[:, :a.label_len])
        t = y[:, -a.pred_len:]
        sse += ((p - t) ** 2).sum((0, 1)).double()
        sae += (p - t).abs().sum((0, 1)).double()
        n += t.shape[0] * t.shape[1]
    for t in (sse, sae, n):
        dist.all_reduce(t)
    model.train()
    return (sse / n).cpu(), (sae / n).cpu()


class ExactShard(torch.utils.data.Sampler):
    def __init__(self, n, rank, world):
        self.ids = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.ids)

    def __len__(self):
        return len(self.ids)


def main():
    a = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    run = None
    if rank == 0:
        run = wandb.init(project=a.project, config=vars(a) | {"world_size": world})

    raw = np.loadtxt(a.txt, delimiter=",", dtype=np.float32)  # (T, 137)
    T, C = raw.shape
    n_tr, n_va = int(0.7 * T), int(0.1 * T)
    mu, sd = raw[:n_tr].mean(0), raw[:n_tr].std(0) + 1e-5
    data = (raw - mu) / sd
    tr = Windows(data[:n_tr], a.seq_len, a.label_len, a.pred_len)
    va = Windows(data[n_tr - a.seq_len:n_tr + n_va], a.seq_len, a.label_len, a.pred_len)
    te = Windows(data[n_tr + n_va - a.seq_len:], a.seq_len, a.label_len, a.pred_len)

    tr_s = DistributedSampler(tr, shuffle=True, drop_last=True)
    tr_dl = DataLoader(tr, a.per_gpu_batch, sampler=tr_s, num_workers=6, pin_memory=True, drop_last=True)
    va_dl = DataLoader(va, 128, sampler=ExactShard(len(va), rank, world), num_workers=4)
    te_dl = DataLoader(te, 128, sampler=ExactShard(len(te), rank, world), num_workers=4)

    model = DDP(Informer(C, a).to(dev), device_ids=[local_rank])
    # linear scaling rule from the single-GPU base lr, with warmup
    global_batch = a.per_gpu_batch * world
    peak_lr = a.base_lr * global_batch / 32
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.01)
    total = a.epochs * len(tr_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / a.warmup_steps) * 0.5 * (1 + math.cos(math.pi * s / total)))
    if rank == 0:
        n_enc = sum(p.numel() for p in model.module.encoder.parameters())
        print(f"encoder params {n_enc / 1e6:.1f}M, global batch {global_batch}, peak lr {peak_lr:.2e}")
        os.makedirs(a.out, exist_ok=True)

    best, bad, step = float("inf"), 0, 0
    for ep in range(a.epochs):
        tr_s.set_epoch(ep)
        t0 = time.time()
        for x, y in tr_dl:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x, y[:, :a.label_len])
            loss = F.mse_loss(pred.float(), y[:, -a.pred_len:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if run is not None and step % 50 == 0:
                run.log({"train/mse": loss.item(), "lr": sched.get_last_lr()[0]}, step=step)

        mse_c, mae_c = evaluate(model, va_dl, a, dev, C)
        stop = torch.zeros(1, device=dev)
        if rank == 0:
            v = mse_c.mean().item()
            run.log({"val/mse": v, "val/mae": mae_c.mean().item(), "epoch": ep}, step=step)
            print(f"ep {ep} val mse {v:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if v < best:
                best, bad = v, 0
                torch.save(model.module.state_dict(), os.path.join(a.out, "best.pt"))
            else:
                bad += 1
            stop[0] = float(bad >= a.patience)
        # rank 0 owns the early-stopping decision; everyone follows it
        dist.broadcast(stop, src=0)
        if stop.item():
            break

    dist.barrier()
    model.module.load_state_dict(torch.load(os.path.join(a.out, "best.pt"), map_location=dev))
    mse_c, mae_c = evaluate(model, te_dl, a, dev, C)
    if rank == 0:
        print(f"test mse {mse_c.mean():.4f} mae {mae_c.mean():.4f}")
        run.summary.update({"test/mse": mse_c.mean().item(), "test/mae": mae_c.mean().item()})
        table = wandb.Table(columns=["plant", "mse", "mae"],
                            data=[[i, float(m), float(e)] for i, (m, e) in enumerate(zip(mse_c, mae_c))])
        run.log({"test/per_plant": table})
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
