"""
2-D parallel pretraining (tensor parallel inside a node x FSDP2 across the
data-parallel dimension) of a 1B Llama-style model, with loss_parallel on the
vocab-sharded logits and DCP checkpoints.

Slurm (2 nodes x 8 GPUs, tp=4 -> dp=4):

    #!/bin/bash
    #SBATCH --job-name=tp2d-1b
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=1
    #SBATCH --gpus-per-node=8
    #SBATCH --cpus-per-task=96
    #SBATCH --time=24:00:00
    head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=8 \
        --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d --rdzv_endpoint=$head:29500 \
        17_tp_fsdp_2d_pretrain.py --tp 4 --data /scratch/tokens/fwedu_llama3.bin --ckpt /scratch/ckpt/tp2d
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
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                               parallelize_module)
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Tokens(Dataset):
    def __init__(self, path, seq_len):
        self.arr = np.memmap(path, dtype=np.uint32, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.arr) - 1) // self.seq_len

    def __getitem__(self, i):
        x = torch.from_numpy(self.arr[i * self.seq_len: (i + 1) * self.seq_len + 1].astype(np.int64))
        return x[:-1], x[1:]


class Attention(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.hd = d // n_heads
        self.wq, self.wk, self.wv = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x, freqs):
        B, T, _ = x.shape
        # -1 heads: under TP each rank holds n_heads / tp of them
        q, k, v = (w(x).view(B, T, -1, self.hd) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, T, -1))


class FFN(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d, n_heads, hidden):
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attn, self.ffn = Attention(d, n_heads), FFN(d, hidden)

    def forward(self, x, freqs):
        x = x + self.attn(self.attn_norm(x), freqs)
        return x + self.ffn(self.ffn_norm(x))


def apply_rope(x, freqs):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs[None, :, None, :]).flatten(-2).type_as(x)


class Transformer(nn.Module):
    def __init__(self, vocab=128256, d=2048, layers=16, n_heads=16, hidden=5632, max_len=2048):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d, n_heads, hidden) for _ in range(layers)])
        self.norm = nn.RMSNorm(d)
        self.output = nn.Linear(d, vocab, bias=False)
        self.hd, self.max_len = d // n_heads, max_len
        self.register_buffer("freqs", self._freqs(), persistent=False)

    def _freqs(self):
        inv = 1.0 / (500000.0 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        return torch.polar(torch.ones(self.max_len, self.hd // 2), torch.outer(torch.arange(self.max_len).float(), inv))

    def init_weights(self):
        self.freqs = self._freqs().to(self.norm.weight.device)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(m.weight, std=0.02)
            elif isinstance(m, nn.RMSNorm):
                nn.init.ones_(m.weight)

    def forward(self, idx):
        h = self.tok_embeddings(idx)
        freqs = self.freqs[: idx.shape[1]]
        for layer in self.layers:
            h = layer(h, freqs)
        return self.output(self.norm(h))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--micro_bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=50000)
    ap.add_argument("--save_every", type=int, default=1000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    dp = world // args.tp
    mesh = init_device_mesh("cuda", (dp, args.tp), mesh_dim_names=("dp", "tp"))
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    dp_rank = dp_mesh.get_local_rank()
    is_log_rank = dist.get_rank() == 0

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(max_len=args.seq_len)

    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    for blk in model.layers:
        parallelize_module(blk, tp_mesh, {
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(),
            "ffn.w1": ColwiseParallel(), "ffn.w3": ColwiseParallel(), "ffn.w2": RowwiseParallel(),
        })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.layers:
        fully_shard(blk, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    model.to_empty(device="cuda")
    with torch.no_grad():
        model.init_weights()

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / args.warmup, 0.5 * (1 + math.cos(
        math.pi * min(1.0, max(0, s - args.warmup) / (args.steps - args.warmup))))))

    # data is split over the dp dimension only: the tp ranks of one group must see the same batch
    ds = Tokens(args.data, args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=0, drop_last=True)
    dl = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, num_workers=4, pin_memory=True)

    step = 0
    marker = os.path.join(args.ckpt, "LATEST")
    if os.path.exists(marker):
        tag = open(marker).read().strip()
        msd, osd = get_state_dict(model, opt)
        st = {"model": msd, "optim": osd, "sched": sched.state_dict(), "step": 0}
        dcp.load(st, checkpoint_id=os.path.join(args.ckpt, tag))
        set_state_dict(model, opt, model_state_dict=st["model"], optim_state_dict=st["optim"])
        sched.load_state_dict(st["sched"])
        step = st["step"]

    epoch = step // len(dl)
    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(dl):
            if epoch * len(dl) + i < step:
                continue
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            logits = model(x)
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if isinstance(gnorm, DTensor):
                gnorm = gnorm.full_tensor()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                l = loss.detach()
                l = l.full_tensor() if isinstance(l, DTensor) else l
                dist.all_reduce(l, op=dist.ReduceOp.AVG, group=dp_mesh.get_group())
                if is_log_rank:
                    tps = 10 * args.micro_bs * args.seq_len * dp / (time.time() - t0)
                    t0 = time.time()
                    print(f"step {step} loss {l.item():.4f} gnorm {gnorm.item():.2f} "
                          f"lr {sched.get_last_lr()[0]:.2e} tok/s {tps:,.0f}", flush=True)

            if step % args.save_every == 0:
                tag = f"step{step:06d}"
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd, "sched": sched.state_dict(), "step": step},
                         checkpoint_id=os.path.join(args.ckpt, tag))
                dist.barrier()
                if is_log_rank:
                    with open(marker, "w") as f:
                        f.write(tag)
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
