"""Bidirectional DNA language model on 131 kb windows with ring attention.

Each window is cut into `cp` contiguous chunks, one per rank of a context-parallel
group. Key/value chunks travel around the ring with isend/irecv while every rank
accumulates attention for its own queries (online softmax). Gradients of K/V
travel the same ring in backward.

torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \
    02_ring_dna_mlm.py --genome /lustre/ref/hg38 --cp 8
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VOCAB = {"A": 0, "C": 1, "G": 2, "T": 3, "N": 4}
MASK_ID = 5
VOCAB_SIZE = 6


class RingComm:
    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group)
        self.send_to = ranks[(self.rank + 1) % self.world]
        self.recv_from = ranks[(self.rank - 1) % self.world]
        self.reqs = []

    def exchange(self, tensors):
        ops, bufs = [], []
        for t in tensors:
            buf = torch.empty_like(t)
            ops.append(dist.P2POp(dist.isend, t.contiguous(), self.send_to, self.group))
            ops.append(dist.P2POp(dist.irecv, buf, self.recv_from, self.group))
            bufs.append(buf)
        self.reqs = dist.batch_isend_irecv(ops)
        return bufs

    def wait(self):
        for r in self.reqs:
            r.wait()
        self.reqs = []


class RingAttention(torch.autograd.Function):
    """Non-causal ring attention. q, k, v: [B, H, S_local, D]."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        comm = RingComm(group)
        scale = q.size(-1) ** -0.5
        out = torch.zeros_like(q, dtype=torch.float32)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device, dtype=torch.float32)
        kc, vc = k, v
        for step in range(comm.world):
            if step + 1 < comm.world:
                kn, vn = comm.exchange([kc, vc])
            s = torch.matmul(q.float(), kc.float().transpose(-1, -2)) * scale
            blse = torch.logsumexp(s, dim=-1)
            bout = torch.matmul(torch.exp(s - blse[..., None]), vc.float())
            new_lse = torch.logaddexp(lse, blse)
            out = out * torch.exp(lse - new_lse)[..., None] + bout * torch.exp(blse - new_lse)[..., None]
            lse = new_lse
            if step + 1 < comm.world:
                comm.wait()
                kc, vc = kn, vn
        ctx.group = group
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        kv_comm, dkv_comm = RingComm(ctx.group), RingComm(ctx.group)
        scale = q.size(-1) ** -0.5
        dout = dout.float()
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        kc, vc = k, v
        for step in range(kv_comm.world):
            if step + 1 < kv_comm.world:
                kn, vn = kv_comm.exchange([kc, vc])
            s = torch.matmul(q.float(), kc.float().transpose(-1, -2)) * scale
            p = torch.exp(s - lse[..., None])
            dv += torch.matmul(p.transpose(-1, -2), dout)
            ds = p * (torch.matmul(dout, vc.float().transpose(-1, -2)) - delta)
            dq += torch.matmul(ds, kc.float()) * scale
            dk += torch.matmul(ds.transpose(-1, -2), q.float()) * scale
            # dk/dv belong to the chunk we just used; pass them on with it
            dk, dv = dkv_comm.exchange([dk, dv])
            dkv_comm.wait()
            if step + 1 < kv_comm.world:
                kv_comm.wait()
                kc, vc = kn, vn
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


class Layer(nn.Module):
    def __init__(self, dim, heads, cp_group):
        super().__init__()
        self.heads, self.cp_group = heads, cp_group
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, S, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        a = RingAttention.apply(q, k, v, self.cp_group)
        x = x + self.out(a.transpose(1, 2).reshape(B, S, C))
        return x + self.ff(self.norm2(x))


class DNAEncoder(nn.Module):
    def __init__(self, dim, depth, heads, seq_len, cp_group):
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, dim))
        nn.init.normal_(self.pos, std=0.02)
        self.layers = nn.ModuleList(Layer(dim, heads, cp_group) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, 5)

    def forward(self, tokens, offset):
        S = tokens.size(1)
        x = self.embed(tokens) + self.pos[:, offset:offset + S]
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class GenomeWindows(Dataset):
    def __init__(self, genome_dir, bed, seq_len):
        self.seq_len = seq_len
        self.chroms = {}
        for name in os.listdir(genome_dir):
            if name.endswith(".u8.npy"):
                self.chroms[name[:-7]] = np.load(os.path.join(genome_dir, name), mmap_mode="r")
        self.windows = []
        with open(bed) as f:
            for line in f:
                chrom, start, _ = line.split()[:3]
                if chrom in self.chroms:
                    self.windows.append((chrom, int(start)))

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        chrom, start = self.windows[i]
        seq = torch.from_numpy(np.asarray(self.chroms[chrom][start:start + self.seq_len], dtype=np.int64))
        labels = seq.clone()
        mask = (torch.rand(self.seq_len) < 0.15) & (seq != VOCAB["N"])
        inputs = seq.masked_fill(mask, MASK_ID)
        labels[~mask] = -100
        return inputs, labels


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--genome", required=True)
    ap.add_argument("--train-bed", default="windows_train_131k.bed")
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--ckpt-dir", default="/lustre/ckpt/dna_ring")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    cp_group = None
    for g in range(world // args.cp):
        ranks = list(range(g * args.cp, (g + 1) * args.cp))
        pg = dist.new_group(ranks)
        if rank in ranks:
            cp_group = pg
    cp_rank = dist.get_rank(cp_group)
    dp_rank, dp_size = rank // args.cp, world // args.cp
    chunk = args.seq_len // args.cp

    torch.manual_seed(0)
    model = DNAEncoder(args.dim, args.depth, args.heads, args.seq_len, cp_group).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)

    ds = GenomeWindows(args.genome, os.path.join(args.genome, args.train_bed), args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True)
    loader = DataLoader(ds, batch_size=1, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)
    total_steps = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total_steps, pct_start=0.05)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        with open(os.path.join(args.ckpt_dir, "config.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        run_loss, run_correct, run_masked = 0.0, 0, 0
        tic = time.time()
        for inputs, labels in loader:
            inputs = inputs[:, cp_rank * chunk:(cp_rank + 1) * chunk].to(device, non_blocking=True)
            labels = labels[:, cp_rank * chunk:(cp_rank + 1) * chunk].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inputs, cp_rank * chunk)
            loss_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
            n_masked = (labels != -100).sum()
            # normalise by the masked count of the whole window, not just this chunk
            n_total = n_masked.clone().float()
            dist.all_reduce(n_total, group=cp_group)
            loss = loss_sum / n_total.clamp(min=1) * args.cp
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            with torch.no_grad():
                run_loss += loss_sum.item()
                run_correct += ((logits.argmax(-1) == labels) & (labels != -100)).sum().item()
                run_masked += n_masked.item()

            if step % args.log_every == 0:
                stats = torch.tensor([run_loss, run_correct, run_masked], dtype=torch.float64)
                dist.all_reduce(stats)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total_steps} loss {stats[0] / stats[2]:.4f} "
                          f"acc {stats[1] / stats[2]:.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - tic) / args.log_every:.2f}s/it", flush=True)
                run_loss, run_correct, run_masked = 0.0, 0, 0
                tic = time.time()

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "epoch": epoch},
                       os.path.join(args.ckpt_dir, f"epoch{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
