"""Pretraining with PP x FSDP2 x TP; checkpoint = DCP shards for model/optimizer plus a small
trainer_state.pt (step, scheduler, data position) and a `latest` pointer file.

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 \
        train.py --pp 2 --tp 4 --ckpt-dir /gpfs/proj/ckpt/mistral_like_3b
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
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/gpfs/proj/data/tok_mistral/train.bin")
    p.add_argument("--ckpt-dir", default="/gpfs/proj/ckpt/mistral_like_3b")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--dim", type=int, default=3072)
    p.add_argument("--n-layers", type=int, default=26)
    p.add_argument("--n-heads", type=int, default=24)
    p.add_argument("--n-kv-heads", type=int, default=8)
    p.add_argument("--ffn-dim", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--n-microbatches", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=2000)
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--save-steps", type=int, default=1000)
    return p.parse_args()


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.hd, self.rep = a.dim // a.n_heads, a.n_heads // a.n_kv_heads
        self.wq = nn.Linear(a.dim, a.n_heads * self.hd, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(a.n_heads * self.hd, a.dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.hd).transpose(1, 2).repeat_interleave(self.rep, 1)
        v = self.wv(x).view(b, s, -1, self.hd).transpose(1, 2).repeat_interleave(self.rep, 1)
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(a.dim), Attention(a)
        self.ffn_norm = nn.RMSNorm(a.dim)
        self.w1, self.w3 = nn.Linear(a.dim, a.ffn_dim, bias=False), nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Model(nn.Module):
    def __init__(self, a, pp_rank):
        super().__init__()
        # uneven split: 26 layers -> 13/13 for pp=2
        bounds = np.linspace(0, a.n_layers, a.pp + 1).round().astype(int)
        lo, hi = bounds[pp_rank], bounds[pp_rank + 1]
        self.tok_embeddings = nn.Embedding(a.vocab, a.dim) if pp_rank == 0 else None
        self.layers = nn.ModuleDict({str(i): Block(a) for i in range(lo, hi)})
        self.norm = nn.RMSNorm(a.dim) if pp_rank == a.pp - 1 else None
        self.output = nn.Linear(a.dim, a.vocab, bias=False) if pp_rank == a.pp - 1 else None

    def forward(self, x):
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for blk in self.layers.values():
            x = blk(x)
        return self.output(self.norm(x)) if self.output is not None else x


class Seqs(Dataset):
    def __init__(self, path, n):
        self.t, self.n = np.memmap(path, dtype=np.uint16, mode="r"), n

    def __len__(self):
        return (len(self.t) - 1) // self.n

    def __getitem__(self, i):
        w = torch.from_numpy(self.t[i * self.n:(i + 1) * self.n + 1].astype(np.int64))
        return w[:-1], w[1:]


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dp = int(os.environ["WORLD_SIZE"]) // (a.pp * a.tp)
    mesh = init_device_mesh("cuda", (a.pp, dp, a.tp), mesh_dim_names=("pp", "dp", "tp"))
    rank = dist.get_rank()
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    first, last = pp_rank == 0, pp_rank == a.pp - 1

    with torch.device("meta"):
        model = Model(a, pp_rank)
    tp = mesh["tp"]
    if first:
        parallelize_module(model, tp, {"tok_embeddings": RowwiseParallel(input_layouts=Replicate())})
    if last:
        parallelize_module(model, tp, {"output": ColwiseParallel(output_layouts=Replicate())})
    for blk in model.layers.values():
        parallelize_module(blk, tp, {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                                     "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                                     "w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.layers.values():
        fully_shard(blk, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    torch.manual_seed(7)
    model.to_empty(device=device)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.fill_(1.0) if n.endswith("norm.weight") else p.normal_(0.0, 0.02)

    stage = PipelineStage(model, pp_rank, a.pp, device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, a.n_microbatches,
                            loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1).float(), t.flatten(0, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / a.warmup_steps) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / a.max_steps)))))

    ds = Seqs(a.data, a.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=7, drop_last=True)
    loader = DataLoader(ds, batch_size=a.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    def save_checkpoint(step, epoch, batch_in_epoch):
        path = os.path.join(a.ckpt_dir, f"step_{step:07d}")
        m, o = get_state_dict(model, opt)
        dcp.save({"model": m, "optim": o}, checkpoint_id=path)
        torch.save({"step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
                    "sched": sched.state_dict(), "args": vars(a)},
                   os.path.join(path, "trainer_state.pt"))
        with open(os.path.join(a.ckpt_dir, "latest"), "w") as f:
            f.write(os.path.basename(path))
        if rank == 0:
            print(f"checkpoint -> {path}", flush=True)

    step, epoch, skip = 0, 0, 0
    latest_file = os.path.join(a.ckpt_dir, "latest")
    if os.path.exists(latest_file):
        with open(latest_file) as f:
            path = os.path.join(a.ckpt_dir, f.read().strip())
        m, o = get_state_dict(model, opt)
        sd = {"model": m, "optim": o}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        ts = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=False)
        sched.load_state_dict(ts["sched"])
        step, epoch, skip = ts["step"], ts["epoch"], ts["batch_in_epoch"]
        if rank == 0:
            print(f"resumed {path}: step {step} epoch {epoch} batch {skip}", flush=True)

    t0 = time.time()
    while step < a.max_steps:
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i < skip:
                continue
            opt.zero_grad(set_to_none=True)
            losses = [] if last else None
            if first:
                schedule.step(x.to(device, non_blocking=True))
            elif last:
                schedule.step(target=y.to(device, non_blocking=True), losses=losses)
            else:
                schedule.step()
            opt.step()
            sched.step()
            step += 1

            if step % 10 == 0:
                loss = torch.stack(losses).mean().detach() if last else torch.zeros((), device=device)
                dist.all_reduce(loss, group=mesh["pp"].get_group())
                dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
                if rank == 0:
                    print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 10:.2f}s/it", flush=True)
                t0 = time.time()
            if step % a.save_steps == 0:
                save_checkpoint(step, epoch, i + 1)
            if step >= a.max_steps:
                break
        skip = 0
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
