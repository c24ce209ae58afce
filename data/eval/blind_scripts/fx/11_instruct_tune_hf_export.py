"""Instruction tuning of a Mistral-7B-style model, exported as HF safetensors.

2D mesh (dp_shard x tp), FSDP2 with bf16 params and fp32 reduce, TP with sequence
parallel, compiled + checkpointed decoder layers, async DCP for resumable state.
At the end of every epoch the weights are exported in HF layout for evaluation.

    torchrun --nproc_per_node=8 instruct_tune.py --data /data/sft/packed.parquet \
        --base /ckpt/mistral7b-dcp --out /ckpt/mistral7b-instruct --tp 2
"""
import argparse
import json
import math
import os
import time

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
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
from torch.utils.data import DataLoader, Dataset, DistributedSampler

CFG = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
           intermediate_size=14336, vocab_size=32768, rope_theta=1_000_000.0, max_position_embeddings=8192)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_table(n):
    hd = CFG["hidden_size"] // CFG["num_attention_heads"]
    a = torch.outer(torch.arange(n).float(), CFG["rope_theta"] ** (-torch.arange(0, hd, 2).float() / hd))
    return torch.polar(torch.ones_like(a), a)


def rope(x, tab):
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * tab[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class SelfAttn(nn.Module):
    def __init__(self):
        super().__init__()
        d, h, kv = CFG["hidden_size"], CFG["num_attention_heads"], CFG["num_key_value_heads"]
        self.hd = d // h
        self.q_proj = nn.Linear(d, h * self.hd, bias=False)
        self.k_proj = nn.Linear(d, kv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, kv * self.hd, bias=False)
        self.o_proj = nn.Linear(h * self.hd, d, bias=False)

    def forward(self, x, tab):
        b, t, _ = x.shape
        q = rope(self.q_proj(x).view(b, t, -1, self.hd), tab).transpose(1, 2)
        k = rope(self.k_proj(x).view(b, t, -1, self.hd), tab).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        d, i = CFG["hidden_size"], CFG["intermediate_size"]
        self.gate_proj, self.up_proj = nn.Linear(d, i, bias=False), nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = RMSNorm(CFG["hidden_size"])
        self.self_attn = SelfAttn()
        self.post_attention_layernorm = RMSNorm(CFG["hidden_size"])
        self.mlp = MLP()

    def forward(self, x, tab):
        x = x + self.self_attn(self.input_layernorm(x), tab)
        return x + self.mlp(self.post_attention_layernorm(x))


class MistralLM(nn.Module):
    """Parameter names follow the HF layout so export is a prefix change."""

    def __init__(self, seq_len):
        super().__init__()
        self.embed_tokens = nn.Embedding(CFG["vocab_size"], CFG["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(CFG["num_hidden_layers"]))
        self.norm = RMSNorm(CFG["hidden_size"])
        self.lm_head = nn.Linear(CFG["hidden_size"], CFG["vocab_size"], bias=False)
        self.register_buffer("tab", rope_table(seq_len), persistent=False)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = layer(h, self.tab)
        return self.lm_head(self.norm(h))


class PackedSFT(Dataset):
    """Rows: input_ids (seq_len+1) and loss_mask (seq_len+1), already packed."""

    def __init__(self, path):
        t = pq.read_table(path, columns=["input_ids", "loss_mask"])
        self.ids = t.column("input_ids").to_pylist()
        self.mask = t.column("loss_mask").to_pylist()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids, m = torch.tensor(self.ids[i]), torch.tensor(self.mask[i], dtype=torch.bool)
        labels = ids[1:].masked_fill(~m[1:], -100)
        return ids[:-1], labels


def parallelize(model, mesh):
    tp, dp = mesh["tp"], mesh["dp"]
    parallelize_module(model, tp, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, layer in enumerate(model.layers):
        parallelize_module(layer, tp, {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
        layer = torch.compile(checkpoint_wrapper(layer, preserve_rng_state=False))
        fully_shard(layer, mesh=dp, mp_policy=mp)
        model.layers[i] = layer
    fully_shard(model, mesh=dp, mp_policy=mp)


def export_hf(model, out_dir, rank):
    os.makedirs(out_dir, exist_ok=True)
    if rank == 0:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        hf = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v.to(torch.bfloat16).contiguous()
              for k, v in full.items()}
        save_file(hf, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump({**CFG, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                       "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}, f, indent=2)
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--base", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    ckpt_pg = dist.new_group(backend="gloo")

    with torch.device("meta"):
        model = MistralLM(args.seq_len)
    parallelize(model, mesh)
    model.to_empty(device="cuda")
    model.tab = rope_table(args.seq_len).cuda()
    base = {"model": get_model_state_dict(model)}
    dcp.load(base, checkpoint_id=args.base)
    set_model_state_dict(model, base["model"])
    del base

    ds = PackedSFT(args.data)
    sampler = DistributedSampler(ds, num_replicas=dp.size(), rank=dp.get_local_rank(), shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=2, pin_memory=True, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / total)))

    start_epoch, step = 0, 0
    done = [e for e in range(args.epochs)
            if os.path.exists(os.path.join(args.out, f"state-epoch{e}", ".metadata"))]
    if done:
        resume = os.path.join(args.out, f"state-epoch{done[-1]}")
        m, o = get_state_dict(model, opt)
        sd = {"model": m, "optim": o, "epoch": 0, "step": 0}
        dcp.load(sd, checkpoint_id=resume)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        start_epoch, step = sd["epoch"] + 1, sd["step"]
        for _ in range(step):
            sched.step()

    fut = None
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for ids, labels in loader:
            ids, labels = ids.cuda(non_blocking=True), labels.cuda(non_blocking=True)
            loss = F.cross_entropy(model(ids).flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            if step % 10 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG, group=dp.get_group())
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {l.item():.4f} gn {gn.item():.2f} "
                          f"{(time.time() - t0) / 10:.2f}s/it", flush=True)
                t0 = time.time()

        if fut is not None:
            fut.result()
        m, o = get_state_dict(model, opt)
        fut = dcp.async_save({"model": m, "optim": o, "epoch": epoch, "step": step},
                             checkpoint_id=os.path.join(args.out, f"state-epoch{epoch}"), process_group=ckpt_pg)
        export_hf(model, os.path.join(args.out, f"hf-epoch{epoch}"), rank)

    if fut is not None:
        fut.result()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
