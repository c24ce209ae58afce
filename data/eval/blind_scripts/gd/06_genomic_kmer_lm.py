"""Causal genomic LM over non-overlapping 6-mer tokens, 16k tokens (~98 kb) per sample.

Sequence parallel: Ulysses all-to-all inside each SP group. Data parallel over groups.
The FASTA files are tokenized once into a flat int16 array that is cached next to the data.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=node01:29500 \
        06_genomic_kmer_lm.py --fasta-dir /shared/genomes/ncbi_bacteria --sp 4
"""
import argparse
import glob
import gzip
import itertools
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

K = 6
KMER_ID = {"".join(p): i + 3 for i, p in enumerate(itertools.product("ACGT", repeat=K))}
PAD, UNK, SEP = 0, 1, 2
VOCAB = len(KMER_ID) + 3


def read_fasta(path):
    opener = gzip.open if path.endswith(".gz") else open
    seq = []
    with opener(path, "rt") as f:
        for line in f:
            if line.startswith(">"):
                if seq:
                    yield "".join(seq)
                    seq = []
            else:
                seq.append(line.strip().upper())
    if seq:
        yield "".join(seq)


def tokenize_dir(fasta_dir):
    out = []
    for path in sorted(glob.glob(os.path.join(fasta_dir, "*.fna*"))):
        for rec in read_fasta(path):
            ids = [KMER_ID.get(rec[i:i + K], UNK) for i in range(0, len(rec) - K + 1, K)]
            out.extend(ids)
            out.append(SEP)
    return np.asarray(out, dtype=np.int16)


class KmerCorpus(Dataset):
    def __init__(self, fasta_dir, seq_len, split, val_frac=0.005):
        cache = os.path.join(fasta_dir, f"tokens_k{K}.npy")
        if not os.path.exists(cache):
            tokens = tokenize_dir(fasta_dir)
            np.save(cache, tokens)
        tokens = np.load(cache, mmap_mode="r")
        n_seq = (len(tokens) - 1) // seq_len
        n_val = max(1, int(n_seq * val_frac))
        self.offset = 0 if split == "val" else n_val
        self.n = n_val if split == "val" else n_seq - n_val
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = (self.offset + i) * self.seq_len
        return torch.from_numpy(self.tokens[s:s + self.seq_len + 1].astype(np.int64))


def a2a(x, group, scatter, gather):
    p = dist.get_world_size(group)
    xs = [c.contiguous() for c in x.chunk(p, scatter)]
    ys = [torch.empty_like(xs[0]) for _ in range(p)]
    dist.all_to_all(ys, xs, group=group)
    return torch.cat(ys, gather)


class A2A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter, gather):
        ctx.meta = (group, scatter, gather)
        return a2a(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, dy):
        group, scatter, gather = ctx.meta
        return a2a(dy, group, gather, scatter), None, None, None


class Layer(nn.Module):
    def __init__(self, d, h, group):
        super().__init__()
        self.h, self.group = h, group
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, alibi_slopes):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.h, d // self.h).unbind(2)
        q, k, v = (A2A.apply(t, self.group, 2, 1).transpose(1, 2) for t in (q, k, v))
        S = q.size(2)
        pos = torch.arange(S, device=x.device)
        bias = -(pos[None, :, None] - pos[None, None, :]).clamp(min=0).float() * alibi_slopes[:, None, None]
        bias = bias.masked_fill(pos[None, None, :] > pos[None, :, None], float("-inf")).to(q.dtype)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None])
        a = A2A.apply(a.transpose(1, 2), self.group, 1, 2).reshape(b, s, d)
        x = x + self.o(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GenomeGPT(nn.Module):
    def __init__(self, d, n_layers, h, group):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d, padding_idx=PAD)
        self.layers = nn.ModuleList(Layer(d, h, group) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        # ALiBi slopes; each SP rank holds a contiguous slice of heads after all-to-all
        sp, r = dist.get_world_size(group), dist.get_rank(group)
        self.slopes = [2 ** (-8 * (i + 1) / h) for i in range(h)][r * h // sp:(r + 1) * h // sp]

    def forward(self, idx):
        x = self.emb(idx)
        alibi = torch.tensor(self.slopes, device=x.device)
        for layer in self.layers:
            x = layer(x, alibi)
        return self.head(self.ln(x))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fasta-dir", required=True)
    p.add_argument("--out-dir", default="/shared/runs/genome_gpt")
    p.add_argument("--sp", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=1000)
    args = p.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)

    sp_group = None
    for start in range(0, world, args.sp):
        ranks = list(range(start, start + args.sp))
        grp = dist.new_group(ranks)
        if rank in ranks:
            sp_group = grp
    sp_rank, dp_rank, dp_size = rank % args.sp, rank // args.sp, world // args.sp
    chunk = args.seq_len // args.sp

    train_ds = KmerCorpus(args.fasta_dir, args.seq_len, "train")
    val_ds = KmerCorpus(args.fasta_dir, args.seq_len, "val")
    train_sampler = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank, shuffle=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=dp_size, rank=dp_rank, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=1, sampler=train_sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=2)

    torch.manual_seed(1337)
    model = DDP(GenomeGPT(args.d_model, args.layers, args.heads, sp_group).cuda(), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup_steps, 0.5 * (1 + math.cos(math.pi * s / total))))
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)

    def local_xy(seq):
        seq = seq.cuda(non_blocking=True)
        x, y = seq[:, :-1], seq[:, 1:]
        return x[:, sp_rank * chunk:(sp_rank + 1) * chunk], y[:, sp_rank * chunk:(sp_rank + 1) * chunk]

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for seq in train_dl:
            x, y = local_xy(seq)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=PAD)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 100 == 0:
                rl = loss.detach()
                dist.all_reduce(rl, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"[{epoch}] {step}/{total} loss {rl.item():.4f} ({(time.time() - tic) / 100:.2f}s/it)")
                tic = time.time()

        model.eval()
        tot = torch.zeros(2, device="cuda")
        with torch.no_grad():
            for seq in val_dl:
                x, y = local_xy(seq)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(x)
                tot[0] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=PAD, reduction="sum")
                tot[1] += (y != PAD).sum()
        dist.all_reduce(tot)
        if rank == 0:
            vl = (tot[0] / tot[1]).item()
            print(f"epoch {epoch} val loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)},
                       os.path.join(args.out_dir, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
