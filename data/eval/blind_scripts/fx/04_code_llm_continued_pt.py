"""Continued pretraining of a 7B code model on packed repository data.

Parallelism: FSDP2 over dp_shard x tensor parallel (tp) on a 2D DeviceMesh.
Mixed precision: bf16 params, fp32 reduce-scatter.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=node01:29500 \
        code_cpt.py --tp 4 --dataset /shared/datasets/stack-v2-packed-8k --init /shared/ckpt/base-7b-dcp \
        --run-dir /shared/runs/code-cpt-7b
"""
import argparse
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_from_disk
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler


@dataclass
class ParallelDims:
    dp: int
    tp: int

    def build_mesh(self) -> DeviceMesh:
        return init_device_mesh("cuda", (self.dp, self.tp), mesh_dim_names=("dp", "tp"))


@dataclass
class LlamaConfig:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    hidden: int = 14336
    vocab_size: int = 49152
    max_seq_len: int = 8192
    rope_theta: float = 1e6


def rope_cache(cfg: LlamaConfig):
    hd = cfg.dim // cfg.n_heads
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
    t = torch.arange(cfg.max_seq_len).float()
    return torch.polar(torch.ones(cfg.max_seq_len, hd // 2), torch.outer(t, inv))


def apply_rope(x, cache):
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    z = z * cache[: x.shape[1]].unsqueeze(0).unsqueeze(2)
    return torch.view_as_real(z).flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.hd = cfg.dim // cfg.n_heads
        self.groups = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.hd, cfg.dim, bias=False)

    def forward(self, x, cache):
        b, s, _ = x.shape
        q = apply_rope(self.wq(x).view(b, s, -1, self.hd), cache).transpose(1, 2)
        k = apply_rope(self.wk(x).view(b, s, -1, self.hd), cache).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.hd).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, cfg: LlamaConfig, use_ac: bool):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = SwiGLU(cfg.dim, cfg.hidden)
        self.use_ac = use_ac

    def _forward(self, x, cache):
        h = x + self.attention(self.attention_norm(x), cache)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x, cache):
        if self.use_ac and self.training:
            return checkpoint(self._forward, x, cache, use_reentrant=False)
        return self._forward(x, cache)


class CodeLlama(nn.Module):
    def __init__(self, cfg: LlamaConfig, use_ac=True):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([Layer(cfg, use_ac) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("rope", rope_cache(cfg), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(h))


def parallelize(model: CodeLlama, mesh: DeviceMesh):
    tp = mesh["tp"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    layer_plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    for layer in model.layers:
        parallelize_module(layer, tp, layer_plan)
        layer.compile()  # in place, keeps parameter names free of _orig_mod

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, layer in enumerate(model.layers):
        fully_shard(layer, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=i < len(model.layers) - 1)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    return model


class Trainer(Stateful):
    def __init__(self, model, optim, sched):
        self.model, self.optim, self.sched, self.step = model, optim, sched, 0

    def state_dict(self):
        m, o = get_state_dict(self.model, self.optim)
        return {"model": m, "optim": o, "lr_sched": self.sched.state_dict(), "step": self.step}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.sched.load_state_dict(sd["lr_sched"])
        self.step = sd["step"]


def build_loader(ds, batch_size, shuffle, seed):
    sampler = DistributedSampler(ds, shuffle=shuffle, seed=seed, drop_last=True)
    return DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=4,
                      pin_memory=True, persistent_workers=True), sampler


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--init", required=True, help="DCP directory with base model weights")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--max-steps", type=int, default=20000)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--save-every", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=17)
    args = ap.parse_args()

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = ParallelDims(dp=world // args.tp, tp=args.tp)
    mesh = dims.build_mesh()
    ckpt_group = dist.new_group(backend="gloo")
    is_main = rank == 0

    cfg = LlamaConfig()
    with torch.device("meta"):
        model = CodeLlama(cfg)
    parallelize(model, mesh)
    model.to_empty(device="cuda")
    model.rope = rope_cache(cfg).cuda()

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / args.warmup)
        * max(0.1, 0.5 * (1 + math.cos(math.pi * s / args.max_steps))))
    trainer = Trainer(model, optim, sched)

    ckpt_root = os.path.join(args.run_dir, "ckpt")
    done = sorted(d for d in os.listdir(ckpt_root) if os.path.exists(os.path.join(ckpt_root, d, ".metadata"))) \
        if os.path.isdir(ckpt_root) else []
    if done:
        dcp.load({"trainer": trainer}, checkpoint_id=os.path.join(ckpt_root, done[-1]))
    else:
        # base weights only; fresh optimizer
        base = {"model": get_model_state_dict(model)}
        dcp.load(base, checkpoint_id=args.init)
        set_model_state_dict(model, base["model"])
    if is_main:
        print(f"starting at step {trainer.step}", flush=True)

    ds = load_from_disk(args.dataset).with_format("torch")
    train_loader, train_sampler = build_loader(ds["train"], args.batch_size, True, args.seed)
    val_loader, _ = build_loader(ds["validation"], args.batch_size, False, args.seed)

    epoch = 0
    train_sampler.set_epoch(epoch)
    data_it = iter(train_loader)
    pending = None
    dp_group = mesh["dp"].get_group()
    tick = time.time()
    while trainer.step < args.max_steps:
        try:
            batch = next(data_it)
        except StopIteration:
            epoch += 1
            train_sampler.set_epoch(epoch)
            data_it = iter(train_loader)
            batch = next(data_it)
        ids = batch["input_ids"].cuda(non_blocking=True)
        inp, tgt = ids[:, :-1], ids[:, 1:]

        logits = model(inp)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.reshape(-1))
        loss.backward()
        gnorm = nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        optim.step()
        optim.zero_grad(set_to_none=True)
        sched.step()
        trainer.step += 1

        if trainer.step % 25 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG, group=dp_group)
            if is_main:
                el = time.time() - tick
                print(f"[{trainer.step}] loss={l.item():.4f} gnorm={gnorm.item():.2f} "
                      f"lr={sched.get_last_lr()[0]:.2e} step_time={el / 25:.2f}s", flush=True)
            tick = time.time()

        if trainer.step % args.eval_every == 0:
            model.eval()
            acc = torch.zeros(2, device="cuda")
            with torch.no_grad():
                for j, vb in enumerate(val_loader):
                    if j == 50:
                        break
                    vids = vb["input_ids"].cuda()
                    vlog = model(vids[:, :-1])
                    acc[0] += F.cross_entropy(vlog.float().flatten(0, 1), vids[:, 1:].flatten(), reduction="sum")
                    acc[1] += vids[:, 1:].numel()
            dist.all_reduce(acc, group=dp_group)
            if is_main:
                vl = (acc[0] / acc[1]).item()
                print(f"[{trainer.step}] val_loss={vl:.4f} val_ppl={math.exp(vl):.2f}", flush=True)
            model.train()

        if trainer.step % args.save_every == 0:
            if pending is not None:
                pending.result()
            pending = dcp.async_save({"trainer": trainer}, process_group=ckpt_group,
                                     checkpoint_id=os.path.join(ckpt_root, f"{trainer.step:08d}"))

    if pending is not None:
        pending.result()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
