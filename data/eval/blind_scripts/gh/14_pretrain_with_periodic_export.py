# LLM pretraining with PP x FSDP2 x TP (torch >= 2.6).
# Besides the resumable DCP checkpoints, every --export-every steps each pipeline stage writes
# plain consolidated weights that the offline eval harness stitches together.
#
#   torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 \
#       pretrain_export.py --pp 2 --tp 2 --out /shared/exp/llama1b_export
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
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler

D, L, H, FF, V = 2048, 16, 16, 5632, 32000


def rotary(x):
    s, hd = x.shape[1], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, device=x.device).float() / hd))
    f = torch.outer(torch.arange(s, device=x.device).float(), inv)
    c = torch.polar(torch.ones_like(f), f).view(1, s, 1, -1)
    return torch.view_as_real(torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * c).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q = rotary(self.wq(x).view(b, s, -1, D // H)).transpose(1, 2)
        k = rotary(self.wk(x).view(b, s, -1, D // H)).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, D // H).transpose(1, 2)
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False), nn.Linear(FF, D, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(D), Attention()
        self.ffn_norm, self.feed_forward = nn.RMSNorm(D), FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, D)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(L)})
        self.norm = nn.RMSNorm(D)
        self.output = nn.Linear(D, V, bias=False)

    def forward(self, h):
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for blk in self.layers.values():
            h = blk(h)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


def make_stage_model(pp_rank, pp, tp_mesh, dp_mesh, device):
    with torch.device("meta"):
        m = Transformer()
    n = L // pp
    for k in list(m.layers):
        if int(k) // n != pp_rank:
            del m.layers[k]
    if pp_rank:
        m.tok_embeddings = None
    if pp_rank != pp - 1:
        m.norm = m.output = None
    plan = {}
    if m.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if m.output is not None:
        plan["output"] = ColwiseParallel(output_layouts=Replicate())
    for k in m.layers:
        plan.update({f"layers.{k}.attention.wq": ColwiseParallel(), f"layers.{k}.attention.wk": ColwiseParallel(),
                     f"layers.{k}.attention.wv": ColwiseParallel(), f"layers.{k}.attention.wo": RowwiseParallel(),
                     f"layers.{k}.feed_forward.w1": ColwiseParallel(),
                     f"layers.{k}.feed_forward.w3": ColwiseParallel(),
                     f"layers.{k}.feed_forward.w2": RowwiseParallel()})
    parallelize_module(m, tp_mesh, plan)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in m.layers.values():
        fully_shard(blk, mesh=dp_mesh, mp_policy=mp)
    fully_shard(m, mesh=dp_mesh, mp_policy=mp)
    m.to_empty(device=device)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    return m


class TokenBin(Dataset):
    def __init__(self, path, seq):
        self.arr, self.seq = np.memmap(path, dtype=np.uint16, mode="r"), seq

    def __len__(self):
        return (len(self.arr) - 1) // self.seq

    def __getitem__(self, i):
        t = torch.from_numpy(self.arr[i * self.seq: (i + 1) * self.seq + 1].astype(np.int64))
        return t[:-1], t[1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/shared/data/c4_llama_tok/train.bin")
    ap.add_argument("--out", default="/shared/exp/llama1b_export")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--n-micro", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=40_000)
    ap.add_argument("--ckpt-every", type=int, default=1000)
    ap.add_argument("--export-every", type=int, default=5000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dp = int(os.environ["WORLD_SIZE"]) // (args.pp * args.tp)
    mesh = init_device_mesh("cuda", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    rank = dist.get_rank()
    pp_rank, dp_rank, tp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    first, last = pp_rank == 0, pp_rank == args.pp - 1
    torch.manual_seed(0)

    model = make_stage_model(pp_rank, args.pp, mesh["tp"], mesh["dp"], device)
    stage = PipelineStage(model, pp_rank, args.pp, device, group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, args.n_micro,
                             loss_fn=lambda out, tgt: F.cross_entropy(out.flatten(0, 1).float(), tgt.flatten(0, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))))

    ds = TokenBin(args.data, args.seq)
    sampler = DistributedSampler(ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    ckpt_dir = os.path.join(args.out, "dcp")
    step = 0
    if os.path.exists(os.path.join(ckpt_dir, ".metadata")):
        m, o = get_state_dict(model, opt)
        sd = {"model": m, "optim": o, "sched": sched.state_dict(), "step": 0}
        dcp.load(sd, checkpoint_id=ckpt_dir)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        sched.load_state_dict(sd["sched"])
        step = sd["step"]

    def export_weights(step):
        if dp_rank == 0 and tp_rank == 0:
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            out = os.path.join(args.out, "export", f"step{step:07d}")
            os.makedirs(out, exist_ok=True)
            torch.save({k: v.to(torch.bfloat16).cpu() for k, v in full.items()}, os.path.join(out, f"stage{pp_rank}.pt"))
            print(f"[stage {pp_rank}] exported {len(full)} tensors to {out}", flush=True)

    epoch = step // len(loader)
    sampler.set_epoch(epoch)
    it = iter(loader)
    t0 = time.time()
    while step < args.steps:
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
        opt.step()
        sched.step()
        step += 1

        if step % 10 == 0:
            loss = torch.stack(losses).mean().detach() if last else torch.tensor(-1.0, device=device)
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
            dist.all_reduce(loss, op=dist.ReduceOp.MAX, group=mesh["pp"].get_group())
            if rank == 0:
                print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 10:.2f}s/it", flush=True)
            t0 = time.time()

        if step % args.ckpt_every == 0:
            m, o = get_state_dict(model, opt)
            dcp.save({"model": m, "optim": o, "sched": sched.state_dict(), "step": step}, checkpoint_id=ckpt_dir)
        if step % args.export_every == 0:
            export_weights(step)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
