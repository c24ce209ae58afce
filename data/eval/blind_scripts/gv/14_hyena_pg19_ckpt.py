"""
Hyena-355M on PG-19 at 32k context. Activation checkpointing per block keeps the
32k-long activations within memory.

    torchrun --nproc_per_node=8 14_hyena_pg19_ckpt.py --train data/pg19/train.u16 --val data/pg19/val.u16
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
from einops import rearrange
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def fftconv(u, k, D):
    """Causal long convolution of u (B, H, L) with k (H, L) via FFT, plus skip D."""
    L = u.shape[-1]
    n = 2 * L
    k_f = torch.fft.rfft(k.float(), n=n) / n
    u_f = torch.fft.rfft(u.float(), n=n)
    y = torch.fft.irfft(u_f * k_f, n=n, norm="forward")[..., :L]
    return (y + u.float() * D.unsqueeze(-1)).to(u.dtype)


class PositionalEmbedding(nn.Module):
    def __init__(self, emb_dim, max_len):
        super().__init__()
        t = torch.linspace(0, 1, max_len)[None, :, None]
        bands = (emb_dim - 1) // 2
        t_rescaled = torch.linspace(0, max_len - 1, max_len)[None, :, None]
        w = 2 * math.pi * t_rescaled / max_len
        f = torch.linspace(1e-4, bands - 1, bands)[None, None]
        z = torch.exp(-1j * f * w)
        z = torch.cat([t, z.real, z.imag], dim=-1)
        self.register_buffer("z", z)
        self.register_buffer("t", t)

    def forward(self, L):
        return self.z[:, :L], self.t[:, :L]


class ImplicitFilter(nn.Module):
    def __init__(self, d_model, max_len, emb_dim=33, order=64, modulate=True):
        super().__init__()
        self.pos = PositionalEmbedding(emb_dim, max_len)
        self.net = nn.Sequential(nn.Linear(emb_dim, order), nn.SiLU(),
                                 nn.Linear(order, order), nn.SiLU(),
                                 nn.Linear(order, d_model, bias=False))
        self.modulate = modulate
        self.decay = nn.Parameter(torch.linspace(math.log(1e-2) / 1.5, math.log(1e-2) / 0.3, d_model))
        self.bias = nn.Parameter(torch.randn(d_model))

    def forward(self, L):
        z, t = self.pos(L)
        h = self.net(z)
        if self.modulate:
            h = h * torch.exp(-t * self.decay.abs())
        return rearrange(h, "1 l d -> d l")


class Hyena(nn.Module):
    def __init__(self, d_model, max_len, order=2, short_k=3, modulate=True):
        super().__init__()
        self.d_model, self.order = d_model, order
        inner = d_model * (order + 1)
        self.in_proj = nn.Linear(d_model, inner)
        self.short_conv = nn.Conv1d(inner, inner, short_k, padding=short_k - 1, groups=inner)
        self.filters = nn.ModuleList([ImplicitFilter(d_model, max_len, modulate=modulate)
                                      for _ in range(order - 1)])
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        L = x.size(1)
        u = self.short_conv(self.in_proj(x).transpose(1, 2))[..., :L]
        *gates, v = u.split(self.d_model, dim=1)
        for i, filt in enumerate(self.filters):
            v = fftconv(v * gates[i + 1], filt(L), filt.bias)
        y = v * gates[0]
        return self.out_proj(y.transpose(1, 2))


class Block(nn.Module):
    def __init__(self, d_model, max_len, order, modulate):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.mixer = Hyena(d_model, max_len, order=order, modulate=modulate)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.mixer(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class HyenaLM(nn.Module):
    def __init__(self, vocab, d_model, n_layer, max_len, order=2, modulate=True, ckpt=True):
        super().__init__()
        self.ckpt = ckpt
        self.wte = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList([Block(d_model, max_len, order, modulate) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx)
        for blk in self.blocks:
            if self.ckpt and self.training:
                x = checkpoint(blk, x)
            else:
                x = blk(x)
        return self.lm_head(self.ln_f(x))


class Windows(Dataset):
    def __init__(self, path, L):
        self.d = np.memmap(path, dtype=np.uint16, mode="r")
        self.L = L

    def __len__(self):
        return (len(self.d) - 1) // self.L

    def __getitem__(self, i):
        return torch.from_numpy(self.d[i * self.L: (i + 1) * self.L + 1].astype(np.int64))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--seq_len", type=int, default=32768)
    ap.add_argument("--d_model", type=int, default=1024)
    ap.add_argument("--n_layer", type=int, default=18)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--order", type=int, default=2)
    ap.add_argument("--no_modulate", action="store_true")
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--max_iters", type=int, default=30000)
    ap.add_argument("--eval_interval", type=int, default=1000)
    ap.add_argument("--out_dir", default="out/hyena_pg19_32k")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = f"cuda:{local_rank}"
    torch.manual_seed(1337)

    model = HyenaLM(args.vocab, args.d_model, args.n_layer, args.seq_len, order=args.order,
                    modulate=not args.no_modulate).to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda it: min((it + 1) / args.warmup, 0.5 * (1 + math.cos(math.pi * it / args.max_iters))))

    train_ds, val_ds = Windows(args.train, args.seq_len), Windows(args.val, args.seq_len)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=args.bs)
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)

    it, epoch = 0, 0
    t0 = time.time()
    while it < args.max_iters:
        sampler.set_epoch(epoch)
        for seq in loader:
            seq = seq.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(seq[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, args.vocab), seq[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            it += 1

            if it % 20 == 0:
                lt = loss.detach()
                dist.all_reduce(lt, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"iter {it} loss {lt.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 20 * 1000:.0f}ms/iter", flush=True)
                t0 = time.time()

            if it % args.eval_interval == 0:
                model.eval()
                acc = torch.zeros(2, device=device, dtype=torch.float64)
                with torch.no_grad():
                    for j, vs in enumerate(val_loader):
                        if j == 16:
                            break
                        vs = vs.to(device)
                        with torch.autocast("cuda", dtype=torch.bfloat16):
                            vl = model.module(vs[:, :-1])
                        acc[0] += F.cross_entropy(vl.float().view(-1, args.vocab), vs[:, 1:].reshape(-1),
                                                  reduction="sum")
                        acc[1] += vs[:, 1:].numel()
                dist.all_reduce(acc)
                model.train()
                if rank == 0:
                    vloss = (acc[0] / acc[1]).item()
                    print(f"iter {it} val loss {vloss:.4f} ppl {math.exp(vloss):.1f}", flush=True)
                    torch.save({"model": model.module.state_dict(), "iter": it, "args": vars(args)},
                               os.path.join(args.out_dir, "ckpt.pt"))
            if it >= args.max_iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
