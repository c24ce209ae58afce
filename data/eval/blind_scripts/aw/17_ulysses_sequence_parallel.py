"""DeepSpeed-Ulysses style sequence parallelism, written directly on torch.distributed.

Activations are sharded along the sequence over an "sp" group. Around attention
an all_to_all switches from sequence sharding to head sharding (every rank sees
the full sequence for heads / sp heads) and back. Data parallelism over "dp";
all parameters are replicated and averaged by DDP over the whole world.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        17_ulysses_sequence_parallel.py --sp 8 --seq-len 65536 --data /fsx/data/arxiv_tok
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
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt-dir", default="/fsx/ckpt/ulysses")
    p.add_argument("--sp", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=65536)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--wandb-project", default="long-context")
    return p.parse_args()


class Docs(Dataset):
    def __init__(self, path, split, seq_len):
        self.arr = np.memmap(os.path.join(path, f"{split}.bin"), dtype=np.uint16, mode="r")
        self.n = seq_len + 1

    def __len__(self):
        return len(self.arr) // self.n

    def __getitem__(self, i):
        return torch.from_numpy(self.arr[i * self.n:(i + 1) * self.n].astype(np.int64))


class _A2A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return _A2A.apply(g.contiguous(), ctx.group), None


def seq_to_heads(x, group):
    """[B, T/P, H, d] -> [B, T, H/P, d]"""
    P = dist.get_world_size(group)
    B, Tl, H, d = x.shape
    x = x.reshape(B, Tl, P, H // P, d).permute(2, 0, 1, 3, 4).contiguous()
    x = _A2A.apply(x, group)
    return x.permute(1, 0, 2, 3, 4).reshape(B, P * Tl, H // P, d)


def heads_to_seq(x, group):
    """[B, T, H/P, d] -> [B, T/P, H, d]"""
    P = dist.get_world_size(group)
    B, T, Hp, d = x.shape
    x = x.reshape(B, P, T // P, Hp, d).permute(1, 0, 2, 3, 4).contiguous()
    x = _A2A.apply(x, group)
    return x.permute(1, 2, 0, 3, 4).reshape(B, T // P, P * Hp, d)


class UlyssesAttention(nn.Module):
    def __init__(self, dim, heads, sp_group):
        super().__init__()
        self.h, self.hd, self.g = heads, dim // heads, sp_group
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        B, Tl, D = x.shape
        q, k, v = (seq_to_heads(t.view(B, Tl, self.h, self.hd), self.g) for t in self.qkv(x).chunk(3, -1))
        # the full sequence is local now, in order, so plain causal attention is exact
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        o = heads_to_seq(o.transpose(1, 2), self.g)
        return self.proj(o.reshape(B, Tl, D))


class Block(nn.Module):
    def __init__(self, a, g):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(a.dim), nn.LayerNorm(a.dim)
        self.attn = UlyssesAttention(a.dim, a.heads, g)
        self.mlp = nn.Sequential(nn.Linear(a.dim, 4 * a.dim), nn.GELU(approximate="tanh"), nn.Linear(4 * a.dim, a.dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class SPTransformer(nn.Module):
    def __init__(self, a, g):
        super().__init__()
        self.emb = nn.Embedding(a.vocab, a.dim)
        self.pos = nn.Embedding(a.seq_len, a.dim)
        self.blocks = nn.ModuleList([Block(a, g) for _ in range(a.layers)])
        self.ln = nn.LayerNorm(a.dim)
        self.out = nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, ids, offset):
        pos = torch.arange(offset, offset + ids.size(1), device=ids.device)
        x = self.emb(ids) + self.pos(pos)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False)
        return self.out(self.ln(x))


def main():
    a = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cuda", (world // a.sp, a.sp), mesh_dim_names=("dp", "sp"))
    sp_group, sp_rank = mesh.get_group("sp"), mesh.get_local_rank("sp")
    dp_rank, dp_size = mesh.get_local_rank("dp"), mesh.size(0)
    device = torch.device("cuda", local_rank)
    assert a.heads % a.sp == 0 and a.seq_len % a.sp == 0
    Tl = a.seq_len // a.sp

    run = wandb.init(project=a.wandb_project, config=vars(a)) if rank == 0 else None

    torch.manual_seed(0)
    model = SPTransformer(a, sp_group).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)

    # sp peers must read the same document -> shard only across dp replicas
    train_ds, val_ds = Docs(a.data, "train", a.seq_len), Docs(a.data, "val", a.seq_len)
    sampler = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=3)
    loader = DataLoader(train_ds, batch_size=1, sampler=sampler, num_workers=2, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=2, drop_last=True,
                            sampler=DistributedSampler(val_ds, num_replicas=dp_size, rank=dp_rank, shuffle=False))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.epochs * len(loader), eta_min=a.lr / 10)

    start_epoch = 0
    ckpt_path = os.path.join(a.ckpt_dir, "last.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1

    def local_slice(seq):
        x, y = seq[:, :-1], seq[:, 1:]
        sl = slice(sp_rank * Tl, (sp_rank + 1) * Tl)
        return x[:, sl].to(device, non_blocking=True), y[:, sl].to(device, non_blocking=True)

    for epoch in range(start_epoch, a.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        for step, seq in enumerate(loader):
            x, y = local_slice(seq)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(x, sp_rank * Tl)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % 10 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if run is not None:
                    run.log({"train/loss": l.item(), "train/gnorm": gnorm.item(), "lr": sched.get_last_lr()[0],
                             "tokens_per_s": 10 * a.seq_len * dp_size / (time.time() - t0)})
                    t0 = time.time()

        ddp.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for i, seq in enumerate(val_loader):
                if i == a.eval_batches:
                    break
                x, y = local_slice(seq)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = ddp(x, sp_rank * Tl)
                tot += torch.stack([F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum"),
                                    torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(tot)
        val = (tot[0] / tot[1]).item()
        if rank == 0:
            run.log({"val/loss": val, "val/ppl": math.exp(val), "epoch": epoch})
            os.makedirs(a.ckpt_dir, exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
