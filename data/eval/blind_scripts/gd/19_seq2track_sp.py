"""Sequence-to-coverage model (196 kb DNA -> 1536 x 128 bp bins x N tracks) with a
sequence-parallel transformer trunk.

A kernel = stride = 8 conv stem gives 24,576 tokens per window. Tokens are sharded over
an SP group (Ulysses all-to-all in attention); every 16 tokens are pooled into one 128 bp bin,
so shards never split a bin.

    torchrun --nproc_per_node=8 19_seq2track_sp.py --data /shared/basenji_like/human --sp 8 --out /shared/runs/s2t
"""
import argparse
import math
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

WINDOW = 196_608
STEM = 8
BIN = 128
TOK_PER_BIN = BIN // STEM


class H5Windows(Dataset):
    def __init__(self, path):
        self.path = path
        with h5py.File(path, "r") as f:
            self.n = f["seq"].shape[0]
            self.n_tracks = f["cov"].shape[-1]
        self.f = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        seq = torch.from_numpy(self.f["seq"][i].astype(np.int64))  # [WINDOW] in 0..4
        cov = torch.from_numpy(self.f["cov"][i].astype(np.float32))  # [WINDOW // BIN, n_tracks]
        return seq, cov


class A2A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, s, g):
        ctx.cfg = (group, s, g)
        n = dist.get_world_size(group)
        ins = [t.contiguous() for t in x.chunk(n, s)]
        outs = [torch.empty_like(ins[0]) for _ in range(n)]
        dist.all_to_all(outs, ins, group=group)
        return torch.cat(outs, g)

    @staticmethod
    def backward(ctx, dy):
        group, s, g = ctx.cfg
        return A2A.apply(dy, group, g, s), None, None, None


class TrunkLayer(nn.Module):
    def __init__(self, d, h, group):
        super().__init__()
        self.h, self.group = h, group
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Dropout(0.1), nn.Linear(2 * d, d))
        self.drop = nn.Dropout(0.1)

    def forward(self, x, cos, sin):
        B, S, C = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, S, 3, self.h, C // self.h).unbind(2)
        half = C // self.h // 2
        q = q * cos + torch.cat([-q[..., half:], q[..., :half]], -1) * sin
        k = k * cos + torch.cat([-k[..., half:], k[..., :half]], -1) * sin
        q, k, v = (A2A.apply(t.to(v.dtype), self.group, 2, 1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.05 if self.training else 0.0)
        a = A2A.apply(a.transpose(1, 2), self.group, 1, 2).reshape(B, S, C)
        x = x + self.drop(self.o(a))
        return x + self.drop(self.ff(self.n2(x)))


class Seq2Track(nn.Module):
    def __init__(self, d, depth, h, n_tracks, group):
        super().__init__()
        self.embed = nn.Embedding(5, 96)
        self.stem = nn.Sequential(nn.Conv1d(96, d, kernel_size=STEM, stride=STEM), nn.GELU())
        self.layers = nn.ModuleList(TrunkLayer(d, h, group) for _ in range(depth))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, n_tracks), nn.Softplus())
        self.hd = d // h

    def forward(self, bases, tok0):
        x = self.stem(self.embed(bases).transpose(1, 2)).transpose(1, 2)
        inv = 1.0 / 10000 ** (torch.arange(0, self.hd, 2, device=x.device).float() / self.hd)
        ang = torch.outer(torch.arange(tok0, tok0 + x.size(1), device=x.device).float(), inv).repeat(1, 2)
        cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = self.norm(x)
        B, S, C = x.shape
        x = x.view(B, S // TOK_PER_BIN, TOK_PER_BIN, C).mean(2)  # pool tokens -> 128 bp bins
        return self.head(x)


def pearson_stats(pred, tgt):
    p, t = pred.flatten(0, 1).double(), tgt.flatten(0, 1).double()
    return torch.stack([p.sum(0), t.sum(0), (p * t).sum(0), (p * p).sum(0), (t * t).sum(0),
                        torch.full_like(p[0], p.size(0))])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sp", type=int, default=8)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--depth", type=int, default=11)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=30)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    sp = args.sp

    groups = [dist.new_group(list(range(b, b + sp))) for b in range(0, world, sp)]
    sp_group, sp_src = groups[rank // sp], (rank // sp) * sp
    sp_rank, dp_rank, dp_size = rank % sp, rank // sp, world // sp
    n_tok = WINDOW // STEM
    tok_loc = n_tok // sp
    assert tok_loc % TOK_PER_BIN == 0 and args.heads % sp == 0
    base_loc, bin_loc = tok_loc * STEM, tok_loc // TOK_PER_BIN

    train_ds = H5Windows(os.path.join(args.data, "train.h5"))
    valid_ds = H5Windows(os.path.join(args.data, "valid.h5"))
    train_sampler = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=0)
    valid_sampler = DistributedSampler(valid_ds, num_replicas=dp_size, rank=dp_rank, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=train_sampler, num_workers=6,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    valid_dl = DataLoader(valid_ds, batch_size=args.batch, sampler=valid_sampler, num_workers=4, pin_memory=True)

    torch.manual_seed(0)
    model = DDP(Seq2Track(args.d, args.depth, args.heads, train_ds.n_tracks, sp_group).cuda(),
                device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.02)
    torch.manual_seed(100 + rank)  # dropout differs across ranks

    comp = torch.tensor([3, 2, 1, 0, 4], device="cuda")  # A<->T, C<->G, N
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    def shard(seq, cov):
        return seq[:, sp_rank * base_loc:(sp_rank + 1) * base_loc], cov[:, sp_rank * bin_loc:(sp_rank + 1) * bin_loc]

    best_r = -1.0
    for epoch in range(args.epochs):
        model.train()
        tic = time.time()
        for it, (seq, cov) in enumerate(train_dl):
            seq, cov = seq.cuda(non_blocking=True), cov.cuda(non_blocking=True)
            # reverse-complement augmentation: one decision per window, shared by the SP group
            flip = torch.randint(0, 2, (1,), device="cuda")
            dist.broadcast(flip, src=sp_src, group=sp_group)
            if flip.item():
                seq, cov = comp[seq.flip(1)], cov.flip(1)
            seq, cov = shard(seq, cov)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(seq, sp_rank * tok_loc)
            loss = F.poisson_nll_loss(pred.float(), cov, log_input=False)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2)
            opt.step()
            sched.step()
            if it % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} it {it}/{len(train_dl)} poisson {l.item():.4f} "
                          f"{(time.time() - tic) / max(it, 1):.2f}s/it", flush=True)

        model.eval()
        stats = torch.zeros(6, train_ds.n_tracks, device="cuda", dtype=torch.float64)
        with torch.no_grad():
            for seq, cov in valid_dl:
                seq, cov = shard(seq.cuda(non_blocking=True), cov.cuda(non_blocking=True))
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model(seq, sp_rank * tok_loc)
                stats += pearson_stats(pred.float(), cov)
        dist.all_reduce(stats)
        sp_, st, spt, spp, stt, n = stats
        r = (n * spt - sp_ * st) / torch.sqrt((n * spp - sp_ ** 2) * (n * stt - st ** 2)).clamp(min=1e-12)
        mean_r = r.mean().item()
        if rank == 0:
            print(f"epoch {epoch} valid pearson_r {mean_r:.4f}", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "r": mean_r}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if mean_r > best_r:
                best_r = mean_r
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
