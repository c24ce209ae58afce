#!/usr/bin/env python
"""3D-parallel pretraining (PP 1F1B x FSDP2 x TP) with per-block torch.compile,
pipeline-aware gradient clipping and resharding-friendly DCP checkpoints.

DCP stores tensors by FQN with their global shapes, so a run can be resumed on a
different number of nodes (different dp) as long as pp/tp layouts are rebuilt.

    torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 \
        train_3d.py --pp 2 --tp 4 --run-dir /lustre/runs/llama3b_3d
"""
import argparse
import math
import os
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

MODEL = dict(dim=3072, layers=28, heads=24, ffn=8192, vocab=128256)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        d, f = MODEL["dim"], MODEL["ffn"]
        self.hd = d // MODEL["heads"]
        self.attention_norm, self.ffn_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1, self.w3, self.w2 = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(b, s, -1, self.hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class StageModel(nn.Module):
    def __init__(self, pp_rank, pp):
        super().__init__()
        per = MODEL["layers"] // pp
        self.tok_embeddings = nn.Embedding(MODEL["vocab"], MODEL["dim"]) if pp_rank == 0 else None
        self.layers = nn.ModuleDict({str(i): Block() for i in range(pp_rank * per, (pp_rank + 1) * per)})
        self.norm = nn.RMSNorm(MODEL["dim"]) if pp_rank == pp - 1 else None
        self.output = nn.Linear(MODEL["dim"], MODEL["vocab"], bias=False) if pp_rank == pp - 1 else None

    def forward(self, h):
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for blk in self.layers.values():
            h = blk(h)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


class Tokens(Dataset):
    def __init__(self, path, seq):
        self.t, self.seq = np.memmap(path, dtype=np.uint32, mode="r"), seq

    def __len__(self):
        return (len(self.t) - 1) // self.seq

    def __getitem__(self, i):
        w = torch.from_numpy(self.t[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
        return w[:-1], w[1:]


class Checkpointable(Stateful):
    def __init__(self, model, opt, sched):
        self.model, self.opt, self.sched = model, opt, sched
        self.step = 0

    def state_dict(self):
        m, o = get_state_dict(self.model, self.opt)
        return {"model": m, "optim": o, "sched": self.sched.state_dict(), "step": self.step}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.sched.load_state_dict(sd["sched"])
        self.step = sd["step"]


@torch.no_grad()
def clip_grads(model, max_norm, pp_group):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total_sq = torch.zeros((), device=grads[0].device)
    for g in grads:
        n = torch.linalg.vector_norm(g)
        total_sq += (n.full_tensor() if isinstance(n, DTensor) else n) ** 2
    dist.all_reduce(total_sq, group=pp_group)  # stages hold disjoint params
    norm = total_sq.sqrt().item()
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return norm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/lustre/data/dolma_llama3tok/train.u32")
    ap.add_argument("--run-dir", default="/lustre/runs/llama3b_3d")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--local-bs", type=int, default=16)
    ap.add_argument("--n-micro", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--save-every", type=int, default=1000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=20))
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world % (args.pp * args.tp) == 0, f"world {world} not divisible by pp*tp"
    dp = world // (args.pp * args.tp)
    mesh = init_device_mesh("cuda", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank, tp_rank = (mesh[n].get_local_rank() for n in ("pp", "dp", "tp"))
    first, last = pp_rank == 0, pp_rank == args.pp - 1
    assert args.local_bs % args.n_micro == 0, "local batch must split evenly into microbatches"
    is_logger = last and dp_rank == 0 and tp_rank == 0

    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
    dist.barrier()

    torch.manual_seed(0)
    with torch.device("meta"):
        model = StageModel(pp_rank, args.pp)
    tp_mesh = mesh["tp"]
    top = {}
    if first:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if last:
        top["output"] = ColwiseParallel(output_layouts=Replicate())
    if top:
        parallelize_module(model, tp_mesh, top)
    for k, blk in list(model.layers.items()):
        parallelize_module(blk, tp_mesh, {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
                                          "wo": RowwiseParallel(), "w1": ColwiseParallel(), "w3": ColwiseParallel(),
                                          "w2": RowwiseParallel()})
        if args.compile:
            model.layers[k] = torch.compile(blk, fullgraph=True)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.layers.values():
        fully_shard(blk, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    model.to_empty(device=device)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                nn.init.trunc_normal_(p, std=0.02)

    stage = PipelineStage(model, pp_rank, args.pp, device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=args.n_micro,
                            loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1).float(), t.flatten(0, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(
        0.1, 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))
    state = Checkpointable(model, opt, sched)

    ckpt_root = os.path.join(args.run_dir, "checkpoints")
    candidates = sorted(d for d in os.listdir(ckpt_root)) if os.path.isdir(ckpt_root) else []
    candidates = [d for d in candidates if os.path.exists(os.path.join(ckpt_root, d, ".metadata"))]
    if candidates:
        # may have been written with another dp size; DCP reshards on load
        dcp.load({"state": state}, checkpoint_id=os.path.join(ckpt_root, candidates[-1]))

    ds = Tokens(args.data, args.seq)
    sampler = DistributedSampler(ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=args.local_bs, sampler=sampler, num_workers=4, pin_memory=True,
                        drop_last=True)
    writer = SummaryWriter(os.path.join(args.run_dir, "tb")) if is_logger else None

    epoch = 0
    sampler.set_epoch(epoch)
    it = iter(loader)
    t0 = time.time()
    while state.step < args.steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(loader)
            x, y = next(it)
        opt.zero_grad(set_to_none=True)
        losses = [] if last else None
        if first:
            schedule.step(x.to(device, non_blocking=True))
        elif last:
            schedule.step(target=y.to(device, non_blocking=True), losses=losses)
        else:
            schedule.step()
        gnorm = clip_grads(model, args.clip, mesh["pp"].get_group())
        opt.step()
        sched.step()
        state.step += 1

        if state.step % 10 == 0:
            loss = torch.stack(losses).mean().detach() if last else torch.zeros((), device=device)
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
            if is_logger:
                dt = (time.time() - t0) / 10
                writer.add_scalar("train/loss", loss.item(), state.step)
                writer.add_scalar("train/grad_norm", gnorm, state.step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], state.step)
                writer.add_scalar("perf/tokens_per_s", args.local_bs * dp * args.seq / dt, state.step)
                print(f"step {state.step} loss {loss.item():.4f} gnorm {gnorm:.2f}", flush=True)
            t0 = time.time()

        if state.step % args.save_every == 0:
            dcp.save({"state": state}, checkpoint_id=os.path.join(ckpt_root, f"step_{state.step:08d}"))

    if writer is not None:
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
