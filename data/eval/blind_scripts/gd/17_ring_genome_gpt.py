"""Single-nucleotide autoregressive genome model (1 Mb context) with causal ring attention.

Layout: ranks are split into context-parallel rings of --cp consecutive ranks (one
window per ring) and data-parallel replicas across rings. DDP averages gradients
over all ranks.

    torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29400 \
        17_ring_genome_gpt.py --genomes /shared/genomes/plants --cp 16 --out /shared/runs/genome1m
"""
import argparse
import glob
import math
import os
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

NUC = np.full(256, 4, dtype=np.uint8)
for _i, _c in enumerate(b"ACGT"):
    NUC[_c] = _i
    NUC[_c + 32] = _i  # soft-masked lower case


def build_cache(fasta_dir, cache):
    chunks = []
    for path in sorted(glob.glob(os.path.join(fasta_dir, "*.fa"))):
        with open(path, "rb") as f:
            for line in f:
                if not line.startswith(b">"):
                    chunks.append(NUC[np.frombuffer(line.rstrip(), dtype=np.uint8)])
    tmp = cache + ".tmp.npy"
    np.save(tmp, np.concatenate(chunks))
    os.replace(tmp, cache)


class Windows(Dataset):
    def __init__(self, cache, window, split):
        self.seq = np.load(cache, mmap_mode="r")
        n = (len(self.seq) - 1) // window
        n_val = max(8, n // 200)
        self.ids = np.arange(n - n_val, n) if split == "val" else np.arange(n - n_val)
        self.window = window

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        s = int(self.ids[i]) * self.window
        return torch.from_numpy(self.seq[s:s + self.window + 1].astype(np.int64))


class P2PRing:
    def __init__(self, group, members):
        self.group, self.n = group, len(members)
        self.pos = members.index(dist.get_rank())
        self.to, self.frm = members[(self.pos + 1) % self.n], members[(self.pos - 1) % self.n]

    def start(self, ts):
        recv = [torch.empty_like(t) for t in ts]
        ops = []
        for t, r in zip(ts, recv):
            ops.append(dist.P2POp(dist.isend, t, self.to, self.group))
            ops.append(dist.P2POp(dist.irecv, r, self.frm, self.group))
        return dist.batch_isend_irecv(ops), recv


def _wait(works):
    for w in works:
        w.wait()


class RingCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring):
        sc = q.size(-1) ** -0.5
        qf = q.float()
        acc = torch.zeros_like(qf)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        cur = [k.contiguous(), v.contiguous()]
        causal = torch.ones(q.size(2), q.size(2), dtype=torch.bool, device=q.device).triu(1)
        for i in range(ring.n):
            if i < ring.n - 1:
                works, nxt = ring.start(cur)
            src = (ring.pos - i) % ring.n
            if src <= ring.pos:
                s = qf @ cur[0].float().transpose(-1, -2) * sc
                if src == ring.pos:
                    s = s.masked_fill(causal, float("-inf"))
                bl = torch.logsumexp(s, -1)
                m = torch.logaddexp(lse, bl)
                acc = acc * torch.exp(lse - m)[..., None] + (torch.exp(s - bl[..., None]) @ cur[1].float()) * torch.exp(bl - m)[..., None]
                lse = m
            if i < ring.n - 1:
                _wait(works)
                cur = nxt
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, acc, lse, causal)
        return acc.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, causal = ctx.saved_tensors
        ring = ctx.ring
        sc = q.size(-1) ** -0.5
        qf, do = q.float(), do.float()
        delta = (do * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)
        cur = [k.contiguous(), v.contiguous()]
        grads = [torch.zeros_like(qf), torch.zeros_like(qf)]
        for i in range(ring.n):
            if i < ring.n - 1:
                works, nxt = ring.start(cur)
            src = (ring.pos - i) % ring.n
            if src <= ring.pos:
                kf, vf = cur[0].float(), cur[1].float()
                s = qf @ kf.transpose(-1, -2) * sc
                if src == ring.pos:
                    s = s.masked_fill(causal, float("-inf"))
                p = torch.exp(s - lse[..., None])
                grads[1] += p.transpose(-1, -2) @ do
                ds = p * (do @ vf.transpose(-1, -2) - delta)
                dq += ds @ kf * sc
                grads[0] += ds.transpose(-1, -2) @ qf * sc
            gworks, grads = ring.start(grads)
            _wait(gworks)
            if i < ring.n - 1:
                _wait(works)
                cur = nxt
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, cos, sin, ring):
        B, S, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, S, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        rot = lambda t: torch.cat([-t[..., t.size(-1) // 2:], t[..., :t.size(-1) // 2]], -1)
        q, k = (q * cos + rot(q) * sin).to(v.dtype), (k * cos + rot(k) * sin).to(v.dtype)
        a = RingCausalAttention.apply(q, k, v, ring)
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, C))
        return x + self.mlp(self.ln2(x))


class GenomeGPT(nn.Module):
    def __init__(self, d, depth, h):
        super().__init__()
        self.emb = nn.Embedding(5, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(depth))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 5)
        self.hd = d // h

    def forward(self, ids, positions, ring):
        inv = 1.0 / 1e6 ** (torch.arange(0, self.hd, 2, device=ids.device).float() / self.hd)
        ang = torch.outer(positions.float(), inv).repeat(1, 2)
        cos, sin = ang.cos()[None, None], ang.sin()[None, None]
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x, cos, sin, ring)
        return self.head(self.ln(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--genomes", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cp", type=int, default=16)
    ap.add_argument("--window", type=int, default=1 << 20)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    # long timeout: on the first run rank 0 builds the nucleotide cache while the others wait
    dist.init_process_group("nccl", timeout=timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)

    rings = []
    for b in range(0, world, args.cp):
        members = list(range(b, b + args.cp))
        rings.append((dist.new_group(members), members))
    grp, members = rings[rank // args.cp]
    ring = P2PRing(grp, members)
    dp_rank, dp_size = rank // args.cp, world // args.cp
    L = args.window // args.cp

    cache = os.path.join(args.genomes, "nuc_u8.npy")
    if rank == 0 and not os.path.exists(cache):
        build_cache(args.genomes, cache)
    dist.barrier()
    train_ds, val_ds = Windows(cache, args.window, "train"), Windows(cache, args.window, "val")
    train_s = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=1)
    val_s = DistributedSampler(val_ds, num_replicas=dp_size, rank=dp_rank, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=1, sampler=train_s, num_workers=3, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=1, sampler=val_s, num_workers=2, pin_memory=True)

    torch.manual_seed(1)
    model = GenomeGPT(args.d, args.depth, args.heads).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location=f"cuda:{local_rank}")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch = ck["epoch"] + 1
    model = DDP(model, device_ids=[local_rank])
    total = args.epochs * len(train_dl)
    positions = torch.arange(ring.pos * L, (ring.pos + 1) * L, device="cuda")

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step = start_epoch * len(train_dl)
    for epoch in range(start_epoch, args.epochs):
        train_s.set_epoch(epoch)
        model.train()
        tic = time.time()
        for seq in train_dl:
            seq = seq.cuda(non_blocking=True)
            x, y = seq[:, ring.pos * L:(ring.pos + 1) * L], seq[:, ring.pos * L + 1:(ring.pos + 1) * L + 1]
            for g in opt.param_groups:
                g["lr"] = args.lr * min(1.0, step / 500) * 0.5 * (1 + math.cos(math.pi * step / total))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x, positions, ring)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            # skip the step everywhere if any rank produced a non-finite loss
            bad = torch.tensor([0.0 if torch.isfinite(loss) else 1.0], device="cuda")
            dist.all_reduce(bad)
            opt.zero_grad(set_to_none=True)
            if bad.item() > 0:
                if rank == 0:
                    print(f"step {step}: non-finite loss on {int(bad.item())} rank(s), skipped", flush=True)
                step += 1
                continue
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 20 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {l.item():.4f} {(time.time() - tic) / 20:.2f}s/it", flush=True)
                tic = time.time()

        model.eval()
        acc = torch.zeros(3, device="cuda", dtype=torch.float64)
        with torch.no_grad():
            for seq in val_dl:
                seq = seq.cuda(non_blocking=True)
                x, y = seq[:, ring.pos * L:(ring.pos + 1) * L], seq[:, ring.pos * L + 1:(ring.pos + 1) * L + 1]
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(x, positions, ring)
                acc[0] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
                acc[1] += (logits.argmax(-1) == y).sum()
                acc[2] += y.numel()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} val nll/bp {acc[0].item() / acc[2].item():.4f} "
                  f"acc {acc[1].item() / acc[2].item():.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
