"""Long-context continued pretraining with context parallelism.

A (dp, cp) device mesh: each sequence of --seq-len tokens is cut into cp equal
chunks, one per rank of the cp group. Every rank keeps its queries local and
all-gathers keys / values over the cp group (autograd-aware all_gather), so the
attention over the full sequence is exact. Parameters are replicated on all
ranks and averaged by DDP over the whole world.

    torchrun --nproc_per_node=8 10_context_parallel_longctx.py --cp 4 --seq-len 32768 \
        --data /data/books_tok/train.bin --init /ckpt/base_4k/model.pt
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--val-data", default=None)
    p.add_argument("--init", default=None)
    p.add_argument("--out", default="ckpt/longctx_cp")
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rope-base", type=float, default=500000.0)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--log-every", type=int, default=10)
    return p.parse_args()


class LongDocs(Dataset):
    def __init__(self, path, seq_len):
        self.tok = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.tok) - 1) // self.seq_len

    def __getitem__(self, i):
        s = i * self.seq_len
        return torch.from_numpy(self.tok[s:s + self.seq_len + 1].astype(np.int64))


def rotary(x, pos, base):
    d = x.size(-1)
    inv = 1.0 / (base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos[:, None].float() * inv[None]
    cos, sin = ang.cos()[None, None], ang.sin()[None, None]
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return out.type_as(x)


class CPAttention(nn.Module):
    def __init__(self, dim, heads, cp_group, rope_base):
        super().__init__()
        self.h, self.hd = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.cp_group = cp_group
        self.rope_base = rope_base

    def forward(self, x, pos):
        B, Tl, D = x.shape
        q, k, v = (t.view(B, Tl, self.h, self.hd).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        q, k = rotary(q, pos, self.rope_base), rotary(k, pos, self.rope_base)
        k_full = torch.cat(dist_nn.all_gather(k.contiguous(), group=self.cp_group), dim=2)
        v_full = torch.cat(dist_nn.all_gather(v.contiguous(), group=self.cp_group), dim=2)
        kpos = torch.arange(k_full.size(2), device=x.device)
        mask = kpos[None, :] <= pos[:, None]
        y = F.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask)
        return self.o(y.transpose(1, 2).reshape(B, Tl, D))


class Block(nn.Module):
    def __init__(self, a, cp_group):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(a.dim), nn.RMSNorm(a.dim)
        self.attn = CPAttention(a.dim, a.heads, cp_group, a.rope_base)
        hidden = int(8 * a.dim / 3 / 64) * 64
        self.gate = nn.Linear(a.dim, hidden, bias=False)
        self.up = nn.Linear(a.dim, hidden, bias=False)
        self.down = nn.Linear(hidden, a.dim, bias=False)

    def forward(self, x, pos):
        x = x + self.attn(self.n1(x), pos)
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LM(nn.Module):
    def __init__(self, a, cp_group):
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.dim)
        self.blocks = nn.ModuleList([Block(a, cp_group) for _ in range(a.layers)])
        self.norm = nn.RMSNorm(a.dim)
        self.head = nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, ids, pos):
        x = self.embed(ids)
        for b in self.blocks:
            x = checkpoint(b, x, pos, use_reentrant=False)
        return self.head(self.norm(x))


def local_chunk(batch, cp_rank, cp):
    """Inputs and targets of this rank's slice of the sequence."""
    ids, tgt = batch[:, :-1], batch[:, 1:]
    Tl = ids.size(1) // cp
    sl = slice(cp_rank * Tl, (cp_rank + 1) * Tl)
    pos = torch.arange(sl.start, sl.stop)
    return ids[:, sl], tgt[:, sl], pos


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cuda", (world // a.cp, a.cp), mesh_dim_names=("dp", "cp"))
    cp_group = mesh.get_group("cp")
    cp_rank = mesh.get_local_rank("cp")
    dp_rank, dp_size = mesh.get_local_rank("dp"), mesh.size(0)
    device = torch.device("cuda", local_rank)
    assert a.seq_len % a.cp == 0

    model = LM(a, cp_group)
    if a.init:
        sd = torch.load(a.init, map_location="cpu")
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if rank == 0:
            print(f"loaded {a.init}: missing={missing} unexpected={unexpected}", flush=True)
    model = DDP(model.to(device, dtype=torch.bfloat16), device_ids=[local_rank])

    # every rank of a cp group must see the same sequence -> shard only over dp
    train_ds = LongDocs(a.data, a.seq_len)
    sampler = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=1234)
    loader = DataLoader(train_ds, batch_size=a.batch, sampler=sampler, num_workers=2, pin_memory=True, drop_last=True)
    val_loader = None
    if a.val_data:
        val_ds = LongDocs(a.val_data, a.seq_len)
        val_loader = DataLoader(val_ds, batch_size=a.batch, num_workers=2, drop_last=True,
                                sampler=DistributedSampler(val_ds, num_replicas=dp_size, rank=dp_rank, shuffle=False))

    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-6)
    total = a.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 200) * max(0.1, 1 - s / total))
    os.makedirs(a.out, exist_ok=True)

    step = 0
    for epoch in range(a.epochs):
        model.train()
        t0 = time.time()
        for batch in loader:
            ids, tgt, pos = local_chunk(batch, cp_rank, a.cp)
            ids, tgt, pos = ids.to(device), tgt.to(device), pos.to(device)
            logits = model(ids, pos)
            loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % a.log_every == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tps = a.log_every * a.batch * a.seq_len * dp_size / (time.time() - t0)
                    print(f"epoch {epoch} step {step}/{total} loss {l.item():.4f} tok/s {tps:,.0f}", flush=True)
                    t0 = time.time()

        if val_loader is not None:
            model.eval()
            acc = torch.zeros(2, device=device)
            with torch.no_grad():
                for batch in val_loader:
                    ids, tgt, pos = local_chunk(batch, cp_rank, a.cp)
                    logits = model(ids.to(device), pos.to(device))
                    acc[0] += F.cross_entropy(logits.float().flatten(0, 1), tgt.to(device).flatten(), reduction="sum")
                    acc[1] += tgt.numel()
            dist.all_reduce(acc)
            if rank == 0:
                vl = (acc[0] / acc[1]).item()
                print(f"epoch {epoch} val loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch},
                       os.path.join(a.out, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
