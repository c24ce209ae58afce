"""Supervised fine-tuning of an 8B Llama-style model on chat data.

FSDP2 over the "dp" mesh dim, tensor parallel over "tp", bf16 params / fp32 reduce,
per-block compile + activation checkpointing, async distributed checkpoints.

    torchrun --nproc_per_node=8 sft_chat.py --config configs/sft_8b.yaml
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
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
from transformers import AutoTokenizer

IGNORE = -100


def rope_table(head_dim, max_len, theta=500000.0):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    ang = torch.outer(torch.arange(max_len).float(), inv)
    return torch.polar(torch.ones_like(ang), ang)


def rope(x, table):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * table[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3)
    return out.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attn(nn.Module):
    def __init__(self, d, n_heads, n_kv):
        super().__init__()
        self.hd, self.rep = d // n_heads, n_heads // n_kv
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, table):
        b, t, _ = x.shape
        q = rope(self.q_proj(x).view(b, t, -1, self.hd), table).transpose(1, 2)
        k = rope(self.k_proj(x).view(b, t, -1, self.hd), table).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.hd).transpose(1, 2)
        k, v = k.repeat_interleave(self.rep, 1), v.repeat_interleave(self.rep, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["dim"])
        self.self_attn = Attn(cfg["dim"], cfg["n_heads"], cfg["n_kv_heads"])
        self.post_attention_layernorm = RMSNorm(cfg["dim"])
        self.mlp = MLP(cfg["dim"], cfg["ffn_dim"])

    def forward(self, x, table):
        x = x + self.self_attn(self.input_layernorm(x), table)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["dim"])
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg["n_layers"])])
        self.norm = RMSNorm(cfg["dim"])
        self.lm_head = nn.Linear(cfg["dim"], cfg["vocab_size"], bias=False)
        self.register_buffer("rope", rope_table(cfg["dim"] // cfg["n_heads"], cfg["max_len"]), persistent=False)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        for blk in self.layers:
            h = blk(h, self.rope)
        return self.lm_head(self.norm(h))


class ChatJsonl(Dataset):
    def __init__(self, path, tok, max_len):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        msgs = self.rows[i]["messages"]
        prompt = self.tok.apply_chat_template(msgs[:-1], add_generation_prompt=True)
        answer = self.tok.encode(msgs[-1]["content"], add_special_tokens=False) + [self.tok.eos_token_id]
        ids = (prompt + answer)[: self.max_len + 1]
        labels = ([IGNORE] * len(prompt) + answer)[: self.max_len + 1]
        pad = self.max_len + 1 - len(ids)
        ids = ids + [self.tok.pad_token_id] * pad
        labels = labels + [IGNORE] * pad
        ids, labels = torch.tensor(ids), torch.tensor(labels)
        return ids[:-1], labels[1:]


def shard_model(model, mesh):
    tp, dp = mesh["tp"], mesh["dp"]
    parallelize_module(model, tp, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for blk in model.layers:
        parallelize_module(blk, tp, {
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
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i in range(len(model.layers)):
        blk = checkpoint_wrapper(model.layers[i], preserve_rng_state=False)
        blk = torch.compile(blk)
        fully_shard(blk, mesh=dp, mp_policy=mp)
        model.layers[i] = blk
    fully_shard(model, mesh=dp, mp_policy=mp)
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))
    mcfg, tcfg = cfg["model"], cfg["train"]

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp_size = tcfg.get("tp", 2)
    mesh = init_device_mesh("cuda", (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    ckpt_pg = dist.new_group(backend="gloo")

    tok = AutoTokenizer.from_pretrained(tcfg["tokenizer"])
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token

    torch.manual_seed(tcfg.get("seed", 0))
    with torch.device("meta"):
        model = LlamaLM(mcfg)
    model = shard_model(model, mesh)
    model.to_empty(device="cuda")
    model.rope = rope_table(mcfg["dim"] // mcfg["n_heads"], mcfg["max_len"]).cuda()

    # base weights: consolidated file, read on rank 0 and broadcast shard-by-shard
    full_sd = torch.load(tcfg["base_weights"], map_location="cpu", mmap=True, weights_only=True) if rank == 0 else {}
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full_sd

    train_ds = ChatJsonl(tcfg["train_file"], tok, mcfg["max_len"])
    val_ds = ChatJsonl(tcfg["val_file"], tok, mcfg["max_len"])
    sampler = DistributedSampler(train_ds, num_replicas=dp.size(), rank=dp.get_local_rank(), shuffle=True, seed=tcfg.get("seed", 0))
    val_sampler = DistributedSampler(val_ds, num_replicas=dp.size(), rank=dp.get_local_rank(), shuffle=False)
    loader = DataLoader(train_ds, batch_size=tcfg["micro_batch"], sampler=sampler, num_workers=2, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=tcfg["micro_batch"], sampler=val_sampler, num_workers=2)

    opt = torch.optim.AdamW(model.parameters(), lr=tcfg["lr"], weight_decay=0.0, betas=(0.9, 0.95))
    total = tcfg["epochs"] * len(loader)
    warm = max(1, int(0.03 * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    out_dir = tcfg["output_dir"]
    pending = None
    step = 0
    for epoch in range(tcfg["epochs"]):
        model.train()
        t0 = time.time()
        for ids, labels in loader:
            ids, labels = ids.cuda(non_blocking=True), labels.cuda(non_blocking=True)
            logits = model(ids)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1

            if step % 20 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG, group=dp.get_group())
                gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {l.item():.4f} gnorm {gn.item():.2f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 20:.2f}s/it", flush=True)
                t0 = time.time()

        # validation: every dp rank evaluates its shard, sums are reduced
        model.eval()
        tot = torch.zeros(2, device="cuda")
        with torch.no_grad():
            for ids, labels in val_loader:
                ids, labels = ids.cuda(), labels.cuda()
                logits = model(ids)
                tot[0] += F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                          ignore_index=IGNORE, reduction="sum")
                tot[1] += (labels != IGNORE).sum()
        dist.all_reduce(tot, group=dp.get_group())
        if rank == 0:
            print(f"epoch {epoch} val_loss {(tot[0] / tot[1]).item():.4f}", flush=True)

        if pending is not None:
            pending.result()
        msd, osd = get_state_dict(model, opt)
        pending = dcp.async_save({"model": msd, "optim": osd, "epoch": epoch},
                                 checkpoint_id=os.path.join(out_dir, f"epoch{epoch}"), process_group=ckpt_pg)

    if pending is not None:
        pending.result()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
