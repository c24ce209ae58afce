#!/usr/bin/env python
"""Quantization-aware fine-tuning of a Llama-style decoder with FSDP.

The linear layers inside every decoder block are swapped for fake-quant
versions (group-wise int4 weights, per-token int8 activations, straight-through
estimator) and the model is fine-tuned on a small instruction mix so it
recovers from the quantization error before it is packed for deployment.
"""
import argparse
import functools
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_cosine_schedule_with_warmup
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

QUANT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="TinyLlama/TinyLlama_v1.1")
    p.add_argument("--dataset", default="teknium/OpenHermes-2.5")
    p.add_argument("--output_dir", default="checkpoints/qat-w4a8")
    p.add_argument("--w_bits", type=int, default=4)
    p.add_argument("--a_bits", type=int, default=8)
    p.add_argument("--group_size", type=int, default=128)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--warmup_steps", type=int, default=100)
    p.add_argument("--max_steps", type=int, default=2000)
    p.add_argument("--eval_every", type=int, default=250)
    p.add_argument("--save_every", type=int, default=500)
    p.add_argument("--num_eval_samples", type=int, default=512)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


class FakeQuantLinear(nn.Linear):
    def __init__(self, in_features, out_features, bias=True, w_bits=4, a_bits=8, group_size=128):
        super().__init__(in_features, out_features, bias=bias)
        self.w_bits = w_bits
        self.a_bits = a_bits
        self.group_size = group_size

    @classmethod
    def from_linear(cls, lin, **kw):
        new = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, **kw)
        new.weight.data.copy_(lin.weight.data)
        if lin.bias is not None:
            new.bias.data.copy_(lin.bias.data)
        return new

    def _fq_weight(self):
        w = self.weight
        out_f, in_f = w.shape
        g = self.group_size if self.group_size > 0 else in_f
        wg = w.reshape(out_f, in_f // g, g)
        qmax = 2 ** (self.w_bits - 1) - 1
        scale = wg.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5) / qmax
        wq = torch.clamp(torch.round(wg / scale), -qmax - 1, qmax) * scale
        wq = wq.reshape(out_f, in_f)
        return w + (wq - w).detach()

    def _fq_act(self, x):
        qmax = 2 ** (self.a_bits - 1) - 1
        scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5) / qmax
        xq = torch.clamp(torch.round(x / scale), -qmax - 1, qmax) * scale
        return x + (xq - x).detach()

    def forward(self, x):
        return F.linear(self._fq_act(x), self._fq_weight(), self.bias)


def swap_linears(model, args):
    n = 0
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if name in QUANT_TARGETS and isinstance(child, nn.Linear):
                    setattr(parent, name, FakeQuantLinear.from_linear(
                        child, w_bits=args.w_bits, a_bits=args.a_bits, group_size=args.group_size))
                    n += 1
    return n


def build_datasets(args, tokenizer):
    raw = load_dataset(args.dataset, split="train")

    def to_text(ex):
        turns = ex["conversations"]
        text = ""
        for t in turns:
            role = "### User:\n" if t["from"] == "human" else "### Assistant:\n"
            text += role + t["value"].strip() + "\n\n"
        return {"text": text}

    def tok(batch):
        out = tokenizer(batch["text"], truncation=True, max_length=args.seq_len, padding="max_length")
        out["labels"] = [[t if m == 1 else -100 for t, m in zip(ids, mask)]
                         for ids, mask in zip(out["input_ids"], out["attention_mask"])]
        return out

    raw = raw.map(to_text, remove_columns=raw.column_names, num_proc=8)
    ds = raw.map(tok, batched=True, remove_columns=["text"], num_proc=8)
    split = ds.train_test_split(test_size=args.num_eval_samples, seed=args.seed)
    return split["train"], split["test"]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        ntok = (batch["labels"][:, 1:] != -100).sum()
        totals[0] += out.loss.double() * ntok
        totals[1] += ntok
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def save_checkpoint(model, tokenizer, args, step, rank):
    path = os.path.join(args.output_dir, f"step_{step}")
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save(state, os.path.join(path, "pytorch_model.bin"))
        tokenizer.save_pretrained(path)
        with open(os.path.join(path, "quant_config.json"), "w") as f:
            json.dump({"w_bits": args.w_bits, "a_bits": args.a_bits, "group_size": args.group_size,
                       "targets": list(QUANT_TARGETS), "step": step}, f, indent=2)
    dist.barrier()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.pad_token = tokenizer.eos_token

    # let rank 0 run the (cached) preprocessing first
    if rank != 0:
        dist.barrier()
    train_ds, eval_ds = build_datasets(args, tokenizer)
    if rank == 0:
        dist.barrier()
    train_ds.set_format("torch")
    eval_ds.set_format("torch")

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    n_swapped = swap_linears(model, args)
    model.config.use_cache = False

    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=wrap_policy, mixed_precision=mp,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=device,
                 limit_all_gathers=True)

    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=default_data_collator, num_workers=4, pin_memory=True, drop_last=True)
    eval_sampler = DistributedSampler(eval_ds, num_replicas=world, rank=rank, shuffle=False)
    eval_loader = DataLoader(eval_ds, batch_size=args.batch_size, sampler=eval_sampler,
                             collate_fn=default_data_collator, num_workers=2)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                  betas=(0.9, 0.95))
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"swapped {n_swapped} linears to W{args.w_bits}A{args.a_bits}, world={world}", flush=True)

    step, epoch, micro = 0, 0, 0
    model.train()
    t0 = time.time()
    running = torch.zeros(1, device=device)
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss / args.grad_accum
            loss.backward()
            running += loss.detach()
            micro += 1
            if micro % args.grad_accum != 0:
                continue

            grad_norm = model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                dist.all_reduce(running)
                if rank == 0:
                    avg = running.item() / (10 * world)
                    print(f"step {step} loss {avg:.4f} ppl {math.exp(avg):.2f} "
                          f"gnorm {grad_norm.item():.3f} lr {scheduler.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 10:.2f}s/it", flush=True)
                running.zero_()
                t0 = time.time()

            if step % args.eval_every == 0:
                val = evaluate(model, eval_loader, device)
                if rank == 0:
                    print(f"[eval] step {step} loss {val:.4f} ppl {math.exp(val):.2f}", flush=True)

            if step % args.save_every == 0 or step == args.max_steps:
                save_checkpoint(model, tokenizer, args, step, rank)

            if step >= args.max_steps:
                break
        epoch += 1

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
