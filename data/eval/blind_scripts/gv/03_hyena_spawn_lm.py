"""
Hyena LM (order-2 implicit long convolutions) on packed byte-level text.

Single-node launcher: the script spawns one process per visible GPU itself.

    python 03_hyena_spawn_lm.py --shards "/data/books3_bytes/*.bin" --seq_len 8192
"""
import argparse
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from flashfftconv import FlashFFTConv


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--shards", required=True)
    p.add_argument("--val_shard", default=None)
    p.add_argument("--seq_len", type=int, default=8192)
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--n_layer", type=int, default=12)
    p.add_argument("--filter_dim", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--save_dir", default="ckpt/hyena_bytes")
    p.add_argument("--port", default="29511")
    p.add_argument("--seed", type=int, default=17)
    return p


# ------------------------------------------------------------------- Hyena layers

class Sin(nn.Module):
    def __init__(self, dim, w=10.0):
        super().__init__()
        self.freq = nn.Parameter(w * torch.ones(1, dim))

    def forward(self, x):
        return torch.sin(self.freq * x)


class HyenaFilter(nn.Module):
    """Implicit filter: positional features -> small MLP -> exponential decay window."""

    def __init__(self, d_model, l_max, emb_dim=33, filter_dim=64, fast_decay=0.3, slow_decay=1.5):
        super().__init__()
        t = torch.linspace(0, 1, l_max)[None, :, None]
        bands = (emb_dim - 1) // 2
        w = 2 * math.pi * t * torch.linspace(1e-4, bands - 1, bands)[None, None]
        z = torch.cat([t, torch.cos(w), torch.sin(w)], dim=-1)
        self.register_buffer("z", z, persistent=False)
        self.register_buffer("t", t, persistent=False)
        self.mlp = nn.Sequential(
            nn.Linear(emb_dim, filter_dim), Sin(filter_dim),
            nn.Linear(filter_dim, filter_dim), Sin(filter_dim),
            nn.Linear(filter_dim, d_model, bias=False),
        )
        max_decay = math.log(1e-2) / fast_decay
        min_decay = math.log(1e-2) / slow_decay
        self.register_buffer("deltas", torch.linspace(min_decay, max_decay, d_model)[None, None],
                             persistent=False)
        self.bias = nn.Parameter(torch.randn(d_model))

    def forward(self, L):
        h = self.mlp(self.z[:, :L])
        h = h * torch.exp(-self.t[:, :L] * self.deltas.abs())
        return h[0].transpose(0, 1).contiguous()  # (D, L)


class HyenaOperator(nn.Module):
    def __init__(self, d_model, l_max, filter_dim, fftconv):
        super().__init__()
        self.d_model = d_model
        self.in_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.short_filter = nn.Conv1d(3 * d_model, 3 * d_model, 3, padding=2, groups=3 * d_model)
        self.filter_fn = HyenaFilter(d_model, l_max, filter_dim=filter_dim)
        self.fftconv = fftconv

    def forward(self, u):
        L = u.size(1)
        z = self.in_proj(u).transpose(1, 2)
        z = self.short_filter(z)[..., :L]
        x0, x1, v = z.split(self.d_model, dim=1)
        k = self.filter_fn(L).float()
        v = (v * x1).to(torch.bfloat16).contiguous()
        y = self.fftconv(v, k) + v * self.filter_fn.bias[None, :, None]
        y = (y * x0).transpose(1, 2)
        return self.out_proj(y)


class HyenaBlock(nn.Module):
    def __init__(self, d_model, l_max, filter_dim, fftconv):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.mixer = HyenaOperator(d_model, l_max, filter_dim, fftconv)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.mixer(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class HyenaLM(nn.Module):
    def __init__(self, d_model, n_layer, l_max, filter_dim, vocab=256):
        super().__init__()
        # FlashFFTConv holds precomputed DFT matrices; shared by all layers
        fftconv = FlashFFTConv(2 * l_max, dtype=torch.bfloat16)
        self.emb = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList([HyenaBlock(d_model, l_max, filter_dim, fftconv) for _ in range(n_layer)])
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


# ------------------------------------------------------------------- data

def pack_shards(files, seq_len):
    """Concatenate byte shards (documents separated by 0x00) into rows of seq_len + 1."""
    buf = np.concatenate([np.fromfile(f, dtype=np.uint8) for f in files]) if files else np.zeros(0, np.uint8)
    n = (len(buf) - 1) // seq_len
    rows = np.lib.stride_tricks.sliding_window_view(buf[: n * seq_len + 1], seq_len + 1)[::seq_len]
    return torch.from_numpy(rows.astype(np.int64))


def batches(rows, bs, shuffle, gen):
    order = torch.randperm(len(rows), generator=gen) if shuffle else torch.arange(len(rows))
    for i in range(0, len(order) - bs + 1, bs):
        yield rows[order[i:i + bs]]


def worker(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = args.port
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    files = sorted(glob.glob(args.shards))
    my_files = files[rank::world_size]
    train_rows = pack_shards(my_files, args.seq_len)
    # every rank packs a different set of shards; trim to the smallest so all ranks step together
    n_batches = torch.tensor([len(train_rows) // args.batch_size], device=device)
    dist.all_reduce(n_batches, op=dist.ReduceOp.MIN)
    n_batches = int(n_batches.item())
    train_rows = train_rows[: n_batches * args.batch_size]

    val_rows = None
    if args.val_shard:
        all_val = pack_shards([args.val_shard], args.seq_len)
        val_rows = all_val[rank::world_size]

    model = HyenaLM(args.d_model, args.n_layer, args.seq_len, args.filter_dim).to(device)
    # the only buffers are constant positional features / DFT matrices
    model = DDP(model, device_ids=[rank], broadcast_buffers=False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.wd)
    total = n_batches * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s / total, 1.0))))

    start_epoch = 0
    ckpt_path = os.path.join(args.save_dir, "last.pt")
    if os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start_epoch = state["epoch"] + 1

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"{len(files)} shards, {n_batches} batches/epoch/rank, world {world_size}")

    for epoch in range(start_epoch, args.epochs):
        gen = torch.Generator().manual_seed(args.seed * 1000 + epoch * world_size + rank)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(batches(train_rows, args.batch_size, True, gen)):
            batch = batch.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if it % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    bpb = l.item() / math.log(2)
                    print(f"ep {epoch} it {it}/{n_batches} loss {l.item():.4f} bpb {bpb:.3f} "
                          f"({time.time() - t0:.0f}s)")

        if val_rows is not None:
            model.eval()
            acc = torch.zeros(2, device=device, dtype=torch.float64)
            with torch.no_grad():
                for batch in batches(val_rows, args.batch_size, False, None):
                    batch = batch.to(device)
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        logits = model.module(batch[:, :-1])
                    acc[0] += F.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1),
                                              reduction="sum")
                    acc[1] += batch[:, 1:].numel()
            dist.all_reduce(acc)
            if rank == 0:
                print(f"epoch {epoch} val bpb {(acc[0] / acc[1]).item() / math.log(2):.4f}")

        if rank == 0:
            tmp = ckpt_path + ".tmp"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, tmp)
            os.replace(tmp, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_parser().parse_args()
    world_size = torch.cuda.device_count()
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)
