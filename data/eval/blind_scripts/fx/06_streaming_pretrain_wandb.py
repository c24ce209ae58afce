"""Pretraining from a streamed HF dataset with on-the-fly packing.

Config comes from a TOML file (see configs/llama_1b.toml). FSDP2 + TP on a 2D mesh,
bf16 mixed precision, compiled + checkpointed blocks, async DCP saves.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        stream_pretrain.py configs/llama_1b.toml
"""
import math
import os
import sys
import time
import tomllib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
import wandb
from datasets import load_dataset
from datasets.distributed import split_dataset_by_node
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, IterableDataset
from transformers import AutoTokenizer


class Packed(IterableDataset):
    def __init__(self, hf_ds, tokenizer, seq_len):
        self.ds, self.tok, self.seq_len = hf_ds, tokenizer, seq_len

    def __iter__(self):
        buf = []
        for ex in self.ds:
            buf.extend(self.tok(ex["text"], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id])
            while len(buf) >= self.seq_len + 1:
                chunk = torch.tensor(buf[: self.seq_len + 1])
                buf = buf[self.seq_len + 1:]
                yield chunk[:-1], chunk[1:]


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        n = x.float().pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt()
        return (x.float() * n).type_as(x) * self.weight


def rope_freqs(hd, n, theta):
    f = torch.outer(torch.arange(n).float(), 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd))
    return torch.polar(torch.ones_like(f), f)


def rope(x, fc):
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * fc[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class Block(nn.Module):
    def __init__(self, m):
        super().__init__()
        d, self.hd = m["dim"], m["dim"] // m["n_heads"]
        self.rep = m["n_heads"] // m["n_kv_heads"]
        self.attention_norm = RMSNorm(d)
        self.ffn_norm = RMSNorm(d)
        self.attention = nn.ModuleDict(dict(
            wq=nn.Linear(d, d, bias=False),
            wk=nn.Linear(d, m["n_kv_heads"] * self.hd, bias=False),
            wv=nn.Linear(d, m["n_kv_heads"] * self.hd, bias=False),
            wo=nn.Linear(d, d, bias=False)))
        self.feed_forward = nn.ModuleDict(dict(
            w1=nn.Linear(d, m["ffn_dim"], bias=False),
            w3=nn.Linear(d, m["ffn_dim"], bias=False),
            w2=nn.Linear(m["ffn_dim"], d, bias=False)))

    def forward(self, x, fc):
        a = self.attention
        h = self.attention_norm(x)
        b, t, _ = h.shape
        q = rope(a["wq"](h).view(b, t, -1, self.hd), fc).transpose(1, 2)
        k = rope(a["wk"](h).view(b, t, -1, self.hd), fc).transpose(1, 2)
        v = a["wv"](h).view(b, t, -1, self.hd).transpose(1, 2)
        k, v = k.repeat_interleave(self.rep, 1), v.repeat_interleave(self.rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + a["wo"](o)
        f = self.feed_forward
        h = self.ffn_norm(x)
        return x + f["w2"](F.silu(f["w1"](h)) * f["w3"](h))


class LM(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m
        self.tok_embeddings = nn.Embedding(m["vocab_size"], m["dim"])
        self.layers = nn.ModuleList(Block(m) for _ in range(m["n_layers"]))
        self.norm = RMSNorm(m["dim"])
        self.output = nn.Linear(m["dim"], m["vocab_size"], bias=False)
        self.register_buffer("fc", rope_freqs(m["dim"] // m["n_heads"], m["seq_len"], m["rope_theta"]), persistent=False)

    @torch.no_grad()
    def init_weights(self):
        self.fc = rope_freqs(self.m["dim"] // self.m["n_heads"], self.m["seq_len"], self.m["rope_theta"]).cuda()
        for n, p in self.named_parameters():
            if n.endswith("norm.weight"):
                nn.init.ones_(p)
            elif "tok_embeddings" in n:
                nn.init.normal_(p, std=1.0)
            else:
                nn.init.trunc_normal_(p, std=0.02, a=-0.06, b=0.06)

    def forward(self, idx):
        h = self.tok_embeddings(idx)
        for blk in self.layers:
            h = blk(h, self.fc)
        return self.output(self.norm(h))


def shard(model, mesh, tcfg):
    tp = mesh["tp"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for i, blk in enumerate(model.layers):
        parallelize_module(blk, tp, {
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            "attention.wq": ColwiseParallel(input_layouts=Shard(1)),
            "attention.wk": ColwiseParallel(input_layouts=Shard(1)),
            "attention.wv": ColwiseParallel(input_layouts=Shard(1)),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w1": ColwiseParallel(input_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(input_layouts=Shard(1)),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
        if tcfg["activation_checkpoint"]:
            blk = checkpoint_wrapper(blk, preserve_rng_state=False)
        model.layers[i] = torch.compile(blk, dynamic=False)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.layers:
        fully_shard(blk, mesh=mesh["dp"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)


def main():
    with open(sys.argv[1], "rb") as f:
        cfg = tomllib.load(f)
    mcfg, tcfg = cfg["model"], cfg["training"]

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world // tcfg["tp"], tcfg["tp"]), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    ckpt_pg = dist.new_group(backend="gloo")

    run = wandb.init(project=cfg["wandb"]["project"], name=cfg["wandb"]["run_name"],
                     config=cfg, resume="allow")

    tok = AutoTokenizer.from_pretrained(tcfg["tokenizer"])
    raw = load_dataset(tcfg["dataset"], name=tcfg.get("subset"), split="train", streaming=True)
    raw = raw.shuffle(seed=tcfg["seed"], buffer_size=10_000)
    raw = split_dataset_by_node(raw, rank=dp.get_local_rank(), world_size=dp.size())
    loader = DataLoader(Packed(raw, tok, mcfg["seq_len"]), batch_size=tcfg["micro_batch"],
                        num_workers=2, pin_memory=True)

    torch.manual_seed(tcfg["seed"])
    with torch.device("meta"):
        model = LM(mcfg)
    shard(model, mesh, tcfg)
    model.to_empty(device="cuda")
    model.init_weights()

    opt = torch.optim.AdamW(model.parameters(), lr=tcfg["lr"], betas=(0.9, 0.95),
                            weight_decay=tcfg["weight_decay"], fused=True)
    total, warm = tcfg["steps"], tcfg["warmup"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    step = 0
    ckpt_dir = tcfg["ckpt_dir"]
    tags = sorted(t for t in os.listdir(ckpt_dir)
                  if t.startswith("step") and os.path.isfile(os.path.join(ckpt_dir, t, ".metadata"))) \
        if os.path.isdir(ckpt_dir) else []
    if tags:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd, "sched": sched.state_dict(), "step": 0}
        dcp.load(sd, checkpoint_id=os.path.join(ckpt_dir, tags[-1]))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        sched.load_state_dict(sd["sched"])
        step = sd["step"]

    epoch = 0
    it = iter(loader)
    future = None
    t0 = time.time()
    while step < total:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            raw.set_epoch(epoch)
            it = iter(loader)
            x, y = next(it)
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg["clip"]).full_tensor()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        step += 1

        if step % tcfg["log_every"] == 0:
            stats = torch.stack([loss.detach(), gnorm])
            dist.all_reduce(stats, op=dist.ReduceOp.AVG, group=dp.get_group())
            elapsed = time.time() - t0
            run.log({"train/loss": stats[0].item(), "train/grad_norm": stats[1].item(),
                     "train/lr": sched.get_last_lr()[0],
                     "perf/tokens_per_s": tcfg["log_every"] * x.numel() * dp.size() / elapsed}, step=step)
            t0 = time.time()

        if step % tcfg["ckpt_every"] == 0:
            if future is not None:
                future.result()
            msd, osd = get_state_dict(model, opt)
            future = dcp.async_save({"model": msd, "optim": osd, "sched": sched.state_dict(), "step": step},
                                    checkpoint_id=os.path.join(ckpt_dir, f"step{step:08d}"),
                                    process_group=ckpt_pg)

    if future is not None:
        future.result()
    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
