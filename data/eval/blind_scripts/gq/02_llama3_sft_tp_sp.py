"""Supervised fine-tuning of Llama-3 style models with 2D parallelism.

FSDP2 over the "dp" mesh dimension, tensor + sequence parallel over "tp",
loss parallel on the vocab-sharded logits. Pretrained weights are expected
as a DCP checkpoint (converted offline from the HF safetensors).

    torchrun --nproc_per_node=8 02_llama3_sft_tp_sp.py --tp 4 \
        --init_ckpt /mnt/ckpt/llama3-8b-dcp --data /mnt/data/sft.jsonl
"""
import argparse
import json
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    loss_parallel, parallelize_module)
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoTokenizer

IGNORE_INDEX = -100


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256
    ffn_hidden: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192


def precompute_freqs_cis(dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs))


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.head_dim = a.dim // a.n_heads
        self.n_rep = a.n_heads // a.n_kv_heads
        self.wq = nn.Linear(a.dim, a.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * self.head_dim, a.dim, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        # -1 instead of n_heads: under TP each rank only holds its local heads
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        k = k.repeat_interleave(self.n_rep, dim=2)
        v = v.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attention = Attention(a)
        self.feed_forward = FeedForward(a.dim, a.ffn_hidden)
        self.attention_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.ffn_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(a) for i in range(a.n_layers)})
        self.norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.register_buffer("freqs_cis", self._rope(), persistent=False)

    def _rope(self):
        a = self.args
        return precompute_freqs_cis(a.dim // a.n_heads, a.max_seq_len * 2, a.rope_theta)

    def reset_buffers(self, device):
        with torch.device(device):
            self.freqs_cis = self._rope()

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def apply_tp(model, tp_mesh):
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                  use_local_output=False),
    })
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                            desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


def apply_ac_and_fsdp(model, dp_mesh):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    n = len(model.layers)
    for name, block in list(model.layers.items()):
        block = checkpoint_wrapper(block, preserve_rng_state=False)
        model.layers.register_module(name, block)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=int(name) < n - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


class SFTDataset(Dataset):
    def __init__(self, path, tokenizer, seq_len):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        self.tok, self.seq_len = tokenizer, seq_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        prompt = self.tok.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=True)
        answer = self.tok(r["response"] + self.tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = (prompt + answer)[: self.seq_len + 1]
        labels = ([IGNORE_INDEX] * len(prompt) + answer)[: self.seq_len + 1]
        pad = self.seq_len + 1 - len(ids)
        ids = ids + [self.tok.pad_token_id] * pad
        labels = labels + [IGNORE_INDEX] * pad
        return torch.tensor(ids[:-1]), torch.tensor(labels[1:])


class AppState(Stateful):
    def __init__(self, model, optimizer, scheduler):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.step = 0

    def state_dict(self):
        msd, osd = get_state_dict(self.model, self.optimizer)
        return {"model": msd, "optim": osd, "sched": self.scheduler.state_dict(),
                "step": torch.tensor(self.step)}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])
        self.scheduler.load_state_dict(sd["sched"])
        self.step = int(sd["step"])


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--init_ckpt", required=True)
    p.add_argument("--tokenizer", default="meta-llama/Meta-Llama-3-8B-Instruct")
    p.add_argument("--data", required=True)
    p.add_argument("--val_data", default=None)
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--micro_bs", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--eval_every", type=int, default=500)
    p.add_argument("--save_every", type=int, default=1000)
    p.add_argument("--out", default="/mnt/ckpt/llama3-8b-sft")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, dp_group, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        with loss_parallel():
            s = F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1), reduction="sum")
        s = s.full_tensor() if isinstance(s, DTensor) else s
        tot += torch.stack([s.float(), (y != IGNORE_INDEX).sum().float()])
    dist.all_reduce(tot, group=dp_group)
    model.train()
    return (tot[0] / tot[1].clamp(min=1)).item()


def main():
    args = parse_args()
    world = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cuda", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    rank, device = dist.get_rank(), torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    tok.pad_token = tok.pad_token or tok.eos_token
    train_ds = SFTDataset(args.data, tok, args.seq_len)
    # every tp rank of one dp replica must see the same batch -> shard on dp only
    sampler = DistributedSampler(train_ds, num_replicas=dp_mesh.size(),
                                 rank=dp_mesh.get_local_rank(), shuffle=True, seed=args.seed,
                                 drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.micro_bs, sampler=sampler, num_workers=4,
                        pin_memory=True)
    val_loader = None
    if args.val_data:
        val_ds = SFTDataset(args.val_data, tok, args.seq_len)
        val_loader = DataLoader(val_ds, batch_size=args.micro_bs, num_workers=2,
                                sampler=DistributedSampler(val_ds, dp_mesh.size(),
                                                           dp_mesh.get_local_rank(),
                                                           shuffle=False, drop_last=True))

    with torch.device("meta"):
        model = Transformer(ModelArgs())
    apply_tp(model, tp_mesh)
    apply_ac_and_fsdp(model, dp_mesh)
    model.to_empty(device=device)
    model.reset_buffers(device)
    dcp.load({"model": get_model_state_dict(model)}, checkpoint_id=args.init_ckpt)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, foreach=True)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    state = AppState(model, opt, sched)

    ckpt_root = os.path.join(args.out, "checkpoints")
    if os.path.isdir(ckpt_root) and os.listdir(ckpt_root):
        last = max(os.listdir(ckpt_root), key=lambda d: int(d.split("-")[-1]))
        dcp.load({"app": state}, checkpoint_id=os.path.join(ckpt_root, last))
        if rank == 0:
            print(f"resumed from {last} at step {state.step}", flush=True)

    model.train()
    t0, step = time.time(), state.step
    start_epoch = step // len(loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if epoch * len(loader) + i < step:
                continue
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with loss_parallel():
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1))
                loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            gnorm = gnorm.full_tensor() if isinstance(gnorm, DTensor) else gnorm
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            state.step = step

            if step % args.log_every == 0:
                l = loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG, group=dp_mesh.get_group())
                if rank == 0:
                    print(f"ep {epoch} step {step} loss {l.item():.4f} gnorm {gnorm.item():.2f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / args.log_every:.2f}s/it",
                          flush=True)
                t0 = time.time()
            if val_loader is not None and step % args.eval_every == 0:
                vl = evaluate(model, val_loader, dp_mesh.get_group(), device)
                if rank == 0:
                    print(f"step {step} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
            if step % args.save_every == 0:
                dcp.save({"app": state}, checkpoint_id=os.path.join(ckpt_root, f"step-{step}"))

    # consolidated bf16 weights for inference; every rank takes part in the gather
    full_sd = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({k: v.to(torch.bfloat16) for k, v in full_sd.items()},
                   os.path.join(args.out, "consolidated.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
