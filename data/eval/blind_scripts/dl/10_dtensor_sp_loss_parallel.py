"""FSDP2 x tensor parallel + sequence parallel with loss_parallel (DTensor APIs).

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \
        10_dtensor_sp_loss_parallel.py --tp 8 --data /fsx/tokens/fineweb_4k --out /fsx/ckpt/run42
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def rope(x, theta=10000.0):
    # x: (B, H, T, D)
    T, D = x.shape[-2], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, device=x.device).float() / D))
    ang = torch.outer(torch.arange(T, device=x.device).float(), inv)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (w(x).view(B, T, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, T, -1))


class FFN(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, n_heads, hidden):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FFN(dim, hidden)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, vocab, dim, n_layers, n_heads, hidden):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, hidden) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def parallelize(model, tp_mesh, dp_mesh):
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # logits stay sharded over the vocab; loss_parallel computes the loss on the shards
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    return model


class PackedTokens(Dataset):
    def __init__(self, path, seq):
        self.tok = np.load(path, mmap_mode="r")
        self.seq = seq

    def __len__(self):
        return len(self.tok) // (self.seq + 1)

    def __getitem__(self, i):
        s = i * (self.seq + 1)
        return torch.from_numpy(np.asarray(self.tok[s:s + self.seq + 1], dtype=np.int64))


def scalar(t):
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=14336)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--local-batch", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--steps", type=int, default=50000)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--ckpt-every", type=int, default=500)
    args = ap.parse_args()

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    torch.manual_seed(0)  # same init everywhere before the weights are sharded
    main_proc = dist.get_rank() == 0

    model = Transformer(args.vocab, args.dim, args.layers, args.heads, args.hidden).cuda()
    model = parallelize(model, tp_mesh, dp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, 0.5 * (1 + math.cos(math.pi * min(s / args.steps, 1.0)))))

    ds = PackedTokens(os.path.join(args.data, "train.npy"), args.seq)
    # tensor-parallel peers must see the same sequence -> shard by the dp coordinate only
    sampler = DistributedSampler(ds, num_replicas=dp_mesh.size(), rank=dp_mesh.get_local_rank(), seed=0)
    dl = DataLoader(ds, batch_size=args.local_batch, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    step, epoch = 0, 0
    latest = os.path.join(args.out, "latest.txt")
    if os.path.exists(latest):
        with open(latest) as f:
            step = int(f.read())
        m_sd, o_sd = get_state_dict(model, opt)
        state = {"model": m_sd, "optim": o_sd, "sched": sched.state_dict()}
        dcp.load(state, checkpoint_id=os.path.join(args.out, f"step{step:07d}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["sched"])
        epoch = step // len(dl)

    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in dl:
            batch = batch.cuda(non_blocking=True)
            inp, tgt = batch[:, :-1], batch[:, 1:]
            with loss_parallel():
                pred = model(inp)
                loss = F.cross_entropy(pred.flatten(0, 1), tgt.flatten())
                loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1

            if step % 10 == 0:
                l = scalar(loss).float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG, group=dp_mesh.get_group())
                if main_proc:
                    tps = 10 * args.local_batch * dp_mesh.size() * args.seq / (time.time() - t0)
                    print(f"step {step} loss {l.item():.4f} gnorm {scalar(gnorm).item():.2f} "
                          f"lr {sched.get_last_lr()[0]:.2e} tok/s {tps:,.0f}", flush=True)
                t0 = time.time()

            if step % args.ckpt_every == 0:
                # every rank writes its own shards; dcp.save coordinates the metadata
                m_sd, o_sd = get_state_dict(model, opt)
                dcp.save({"model": m_sd, "optim": o_sd, "sched": sched.state_dict()},
                         checkpoint_id=os.path.join(args.out, f"step{step:07d}"))
                if main_proc:
                    with open(latest + ".tmp", "w") as f:
                        f.write(str(step))
                    os.replace(latest + ".tmp", latest)
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
