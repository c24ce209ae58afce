"""Llama pretraining with PP (1F1B) x FSDP2 x TP+SP, optional warm start, and a
consolidated-weights export at the end for the eval harness.

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 \
        train_llama_sp.py --pp 2 --tp 4 --init /shared/models/tinyllama_1b/consolidated.pt
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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_model_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VOCAB, DIM, LAYERS, HEADS, KV_HEADS, HIDDEN = 32000, 2048, 22, 32, 4, 5632


def rope(x, theta=10000.0):
    s, d = x.shape[1], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device).float() / d))
    f = torch.outer(torch.arange(s, device=x.device).float(), inv)
    cis = torch.polar(torch.ones_like(f), f)[None, :, None, :]
    return torch.view_as_real(torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * cis).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.hd, self.rep = DIM // HEADS, HEADS // KV_HEADS
        self.wq = nn.Linear(DIM, HEADS * self.hd, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * self.hd, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * self.hd, bias=False)
        self.wo = nn.Linear(HEADS * self.hd, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = rope(self.wq(x).view(b, s, -1, self.hd))
        k = rope(self.wk(x).view(b, s, -1, self.hd)).repeat_interleave(self.rep, 2)
        v = self.wv(x).view(b, s, -1, self.hd).repeat_interleave(self.rep, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(DIM, eps=1e-5), Attention()
        self.ffn_norm, self.feed_forward = nn.RMSNorm(DIM, eps=1e-5), MLP()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Layer() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, h):
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers.values():
            h = layer(h)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


def stage_bounds(pp_rank, pp):
    # 22 layers over pp stages: give the extra layers to the early stages (last stage holds the big head)
    base, extra = divmod(LAYERS, pp)
    lo = pp_rank * base + min(pp_rank, extra)
    return lo, lo + base + (1 if pp_rank < extra else 0)


def build_stage(pp_rank, pp, mesh):
    with torch.device("meta"):
        m = Llama()
    lo, hi = stage_bounds(pp_rank, pp)
    for k in list(m.layers):
        if not lo <= int(k) < hi:
            del m.layers[k]
    if pp_rank > 0:
        m.tok_embeddings = None
    if pp_rank < pp - 1:
        m.norm = m.output = None

    tp = mesh["tp"]
    top = {}
    if m.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if m.output is not None:
        top["norm"] = SequenceParallel()
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if top:
        parallelize_module(m, tp, top)
    for layer in m.layers.values():
        parallelize_module(layer, tp, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in m.layers.values():
        fully_shard(layer, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    fully_shard(m, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    return m


class Windows(Dataset):
    def __init__(self, path, seq):
        self.a, self.seq = np.memmap(path, dtype=np.uint16, mode="r"), seq

    def __len__(self):
        return (len(self.a) - 1) // self.seq

    def __getitem__(self, i):
        w = torch.from_numpy(self.a[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
        return w[:-1], w[1:]


@torch.no_grad()
def export_consolidated(model, out_dir, pp_rank, is_writer):
    """Every rank takes part in gathering its stage's weights; one rank per stage writes them."""
    full = {}
    for name, t in model.state_dict().items():
        t = t.full_tensor() if isinstance(t, DTensor) else t
        if is_writer:
            full[name] = t.to(torch.bfloat16).cpu()
    if is_writer:
        os.makedirs(out_dir, exist_ok=True)
        torch.save(full, os.path.join(out_dir, f"consolidated.stage{pp_rank:02d}.pt"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", default="/shared/data/slimpj_llama/train.bin")
    ap.add_argument("--val", default="/shared/data/slimpj_llama/val.bin")
    ap.add_argument("--init", default=None)
    ap.add_argument("--out", default="/shared/runs/tinyllama_sp")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--n-mb", type=int, default=4)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--steps", type=int, default=30_000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--ckpt-every", type=int, default=2000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    dp = int(os.environ["WORLD_SIZE"]) // (args.pp * args.tp)
    mesh = init_device_mesh("cuda", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    rank = dist.get_rank()
    pp_rank, dp_rank, tp_rank = (mesh[n].get_local_rank() for n in ("pp", "dp", "tp"))
    first, last = pp_rank == 0, pp_rank == args.pp - 1

    torch.manual_seed(42)
    model = build_stage(pp_rank, args.pp, mesh)
    model.to_empty(device=dev)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.fill_(1.0) if n.endswith("norm.weight") else nn.init.trunc_normal_(p, std=0.02)
    if args.init:
        # mmap on CPU: every rank only touches the tensors of its own stage
        full_sd = torch.load(args.init, map_location="cpu", mmap=True, weights_only=True)
        set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, strict=False))
        del full_sd

    stage = PipelineStage(model, pp_rank, args.pp, dev, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, args.n_mb,
                            loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1).float(), t.flatten(0, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))

    train_ds, val_ds = Windows(args.train, args.seq), Windows(args.val, args.seq)
    smp = DistributedSampler(train_ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=42, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=smp, num_workers=4, pin_memory=True, drop_last=True)
    vsmp = DistributedSampler(val_ds, num_replicas=dp, rank=dp_rank, shuffle=False, drop_last=True)
    vloader = DataLoader(val_ds, batch_size=args.bs, sampler=vsmp, num_workers=2, drop_last=True)

    ckpt = os.path.join(args.out, "dcp_latest")
    step = 0
    if os.path.exists(os.path.join(ckpt, ".metadata")):
        m, o = get_state_dict(model, opt)
        sd = {"model": m, "optim": o, "step": 0}
        dcp.load(sd, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        step = sd["step"]
        sch.last_epoch = step - 1
        sch.step()

    def forward_backward(fn, x, y):
        losses = [] if last else None
        tgt = y.to(dev, non_blocking=True) if last else None
        if first:
            fn(x.to(dev, non_blocking=True), target=tgt, losses=losses)
        else:
            fn(target=tgt, losses=losses)
        return torch.stack(losses).mean().detach() if last else torch.tensor(-1.0, device=dev)

    def global_value(t):
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh["pp"].get_group())
        return t.item()

    epoch = step // len(loader)
    smp.set_epoch(epoch)
    it = iter(loader)
    t0 = time.time()
    while step < args.steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            smp.set_epoch(epoch)
            it = iter(loader)
            x, y = next(it)
        opt.zero_grad(set_to_none=True)
        loss = forward_backward(schedule.step, x, y)
        opt.step()
        sch.step()
        step += 1

        if step % 10 == 0:
            v = global_value(loss)
            if rank == 0:
                print(f"step {step:6d} | loss {v:.4f} | lr {sch.get_last_lr()[0]:.2e} | "
                      f"{(time.time() - t0) / 10:.2f}s/it", flush=True)
            t0 = time.time()

        if step % args.eval_every == 0:
            model.eval()
            acc = torch.zeros((), device=dev)
            with torch.no_grad():
                for vx, vy in vloader:
                    acc += forward_backward(schedule.eval, vx, vy)
            model.train()
            v = global_value(acc / len(vloader))
            if rank == 0:
                print(f"step {step:6d} | val_loss {v:.4f} | val_ppl {math.exp(v):.1f}", flush=True)

        if step % args.ckpt_every == 0:
            m, o = get_state_dict(model, opt)
            dcp.save({"model": m, "optim": o, "step": step}, checkpoint_id=ckpt)

    export_consolidated(model, os.path.join(args.out, "export"), pp_rank, is_writer=(dp_rank == 0 and tp_rank == 0))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
