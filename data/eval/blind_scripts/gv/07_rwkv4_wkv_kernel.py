"""
RWKV-4 pretraining with the custom WKV CUDA kernel (JIT-compiled from cuda/wkv_op.cpp,
cuda/wkv_cuda.cu), ctx_len 4096 on pre-packed token rows.

    torchrun --nproc_per_node=8 07_rwkv4_wkv_kernel.py --data data/enwik_packed_4097.npy
"""
import argparse
import contextlib
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.cpp_extension import load
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

wkv_cuda = None


def load_wkv(ctx_len):
    return load(name=f"wkv_{ctx_len}", sources=["cuda/wkv_op.cpp", "cuda/wkv_cuda.cu"],
                verbose=False,
                extra_cuda_cflags=["-res-usage", "--maxrregcount 60", "--use_fast_math", "-O3",
                                   "-Xptxas -O3", f"-DTmax={ctx_len}"])


class WKV(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, w, u, k, v):
        B, T, C = k.shape
        w = -torch.exp(w.contiguous())
        u, k, v = u.contiguous(), k.contiguous(), v.contiguous()
        y = torch.empty((B, T, C), device=k.device, dtype=torch.float32)
        wkv_cuda.forward(B, T, C, w, u, k, v, y)
        ctx.save_for_backward(w, u, k, v, y)
        return y

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, gy):
        w, u, k, v, y = ctx.saved_tensors
        B, T, C = k.shape
        gw = torch.empty((B, C), device=gy.device, dtype=torch.float32)
        gu = torch.empty((B, C), device=gy.device, dtype=torch.float32)
        gk = torch.empty((B, T, C), device=gy.device, dtype=torch.float32)
        gv = torch.empty((B, T, C), device=gy.device, dtype=torch.float32)
        wkv_cuda.backward(B, T, C, w, u, k, v, y, gy.contiguous().float(), gw, gu, gk, gv)
        return gw.sum(0), gu.sum(0), gk, gv


class TimeMix(nn.Module):
    def __init__(self, C, layer_id, n_layer):
        super().__init__()
        r01 = layer_id / (n_layer - 1)
        r10 = 1.0 - layer_id / n_layer
        x = torch.arange(C, dtype=torch.float32) / C
        decay = torch.tensor([-5 + 8 * (h / (C - 1)) ** (0.7 + 1.3 * r01) for h in range(C)])
        zigzag = torch.tensor([(i + 1) % 3 - 1 for i in range(C)]) * 0.5
        self.time_decay = nn.Parameter(decay)
        self.time_first = nn.Parameter(torch.ones(C) * math.log(0.3) + zigzag)
        self.time_mix_k = nn.Parameter(torch.pow(x, r10))
        self.time_mix_v = nn.Parameter(torch.pow(x, r10) + 0.3 * r01)
        self.time_mix_r = nn.Parameter(torch.pow(x, 0.5 * r10))
        self.shift = nn.ZeroPad2d((0, 0, 1, -1))
        self.key = nn.Linear(C, C, bias=False)
        self.value = nn.Linear(C, C, bias=False)
        self.receptance = nn.Linear(C, C, bias=False)
        self.output = nn.Linear(C, C, bias=False)

    def forward(self, x):
        xx = self.shift(x)
        k = self.key(x * self.time_mix_k + xx * (1 - self.time_mix_k))
        v = self.value(x * self.time_mix_v + xx * (1 - self.time_mix_v))
        r = self.receptance(x * self.time_mix_r + xx * (1 - self.time_mix_r))
        y = WKV.apply(self.time_decay, self.time_first, k, v)
        return self.output(torch.sigmoid(r) * y.to(r.dtype))


class ChannelMix(nn.Module):
    def __init__(self, C, layer_id, n_layer):
        super().__init__()
        x = torch.arange(C, dtype=torch.float32) / C
        r10 = 1.0 - layer_id / n_layer
        self.time_mix_k = nn.Parameter(torch.pow(x, r10))
        self.time_mix_r = nn.Parameter(torch.pow(x, r10))
        self.shift = nn.ZeroPad2d((0, 0, 1, -1))
        self.key = nn.Linear(C, 4 * C, bias=False)
        self.receptance = nn.Linear(C, C, bias=False)
        self.value = nn.Linear(4 * C, C, bias=False)

    def forward(self, x):
        xx = self.shift(x)
        k = torch.square(torch.relu(self.key(x * self.time_mix_k + xx * (1 - self.time_mix_k))))
        r = torch.sigmoid(self.receptance(x * self.time_mix_r + xx * (1 - self.time_mix_r)))
        return r * self.value(k)


class Block(nn.Module):
    def __init__(self, C, layer_id, n_layer):
        super().__init__()
        self.ln0 = nn.LayerNorm(C) if layer_id == 0 else nn.Identity()
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.att = TimeMix(C, layer_id, n_layer)
        self.ffn = ChannelMix(C, layer_id, n_layer)

    def forward(self, x):
        x = self.ln0(x)
        x = x + self.att(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class RWKV(nn.Module):
    def __init__(self, vocab, C, n_layer, grad_ckpt):
        super().__init__()
        self.grad_ckpt = grad_ckpt
        self.emb = nn.Embedding(vocab, C)
        self.blocks = nn.ModuleList([Block(C, i, n_layer) for i in range(n_layer)])
        self.ln_out = nn.LayerNorm(C)
        self.head = nn.Linear(C, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_out(x))


class Rows(Dataset):
    def __init__(self, arr):
        self.arr = arr

    def __len__(self):
        return self.arr.shape[0]

    def __getitem__(self, i):
        return torch.from_numpy(self.arr[i].astype(np.int64))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ctx_len", type=int, default=4096)
    ap.add_argument("--n_layer", type=int, default=24)
    ap.add_argument("--n_embd", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50277)
    ap.add_argument("--micro_bsz", type=int, default=4)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr_init", type=float, default=6e-4)
    ap.add_argument("--lr_final", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--grad_ckpt", action="store_true")
    ap.add_argument("--proj_dir", default="out/rwkv4_1b5")
    args = ap.parse_args()

    global wkv_cuda
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    # one process per node compiles, the rest pick the built .so up from the cache
    if local_rank == 0:
        wkv_cuda = load_wkv(args.ctx_len)
    dist.barrier()
    if local_rank != 0:
        wkv_cuda = load_wkv(args.ctx_len)

    arr = np.load(args.data, mmap_mode="r")
    n_val = 256
    train_ds, val_ds = Rows(arr[n_val:]), Rows(arr[:n_val])
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.micro_bsz, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_idx = list(range(rank, n_val, world))
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=args.micro_bsz)

    torch.manual_seed(42)
    model = RWKV(args.vocab, args.n_embd, args.n_layer, args.grad_ckpt).to(device)
    ckpt_path = os.path.join(args.proj_dir, "rwkv-last.pth")
    start_epoch = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ck["model"])
        start_epoch = ck["epoch"] + 1
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    opt = torch.optim.Adam(model.parameters(), lr=args.lr_init, betas=(0.9, 0.99), eps=1e-8)
    if os.path.exists(ckpt_path):
        opt.load_state_dict(ck["opt"])
    updates_per_epoch = len(loader) // args.accum
    total_updates = updates_per_epoch * args.epochs

    def lr_at(u):
        frac = min(u / total_updates, 1.0)
        return args.lr_init * math.exp(math.log(args.lr_final / args.lr_init) * frac)

    if rank == 0:
        os.makedirs(args.proj_dir, exist_ok=True)
    upd = start_epoch * updates_per_epoch
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, rows in enumerate(loader):
            rows = rows.to(device, non_blocking=True)
            boundary = (i + 1) % args.accum == 0
            with (contextlib.nullcontext() if boundary else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(rows[:, :-1])
                loss = F.cross_entropy(logits.float().view(-1, args.vocab), rows[:, 1:].reshape(-1))
                (loss / args.accum).backward()
            if not boundary:
                continue
            for g in opt.param_groups:
                g["lr"] = lr_at(upd)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            upd += 1
            if upd % 20 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} upd {upd} loss {l.item():.4f} lr {lr_at(upd):.2e} "
                          f"{(time.time() - t0) / 20:.2f}s/upd", flush=True)
                    t0 = time.time()

        model.eval()
        s = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for rows in val_loader:
                rows = rows.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model.module(rows[:, :-1])
                s[0] += F.cross_entropy(logits.float().view(-1, args.vocab), rows[:, 1:].reshape(-1),
                                        reduction="sum")
                s[1] += rows[:, 1:].numel()
        dist.all_reduce(s)
        if rank == 0:
            print(f"epoch {epoch} val loss {(s[0] / s[1]).item():.4f}", flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.proj_dir, f"rwkv-{epoch}.pth"))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
