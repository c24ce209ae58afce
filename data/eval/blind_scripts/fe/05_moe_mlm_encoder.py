#!/usr/bin/env python
"""Masked-LM pre-training of a switch-style MoE encoder.

    deepspeed --num_gpus 8 05_moe_mlm_encoder.py --corpus /data/wiki_bookcorpus_tok \
        --experts 32 --ep-size 8 --out /shared/exp/moe_mlm
"""
import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
import torch.distributed as dist
from datasets import load_from_disk
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, DataCollatorForLanguageModeling


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", required=True)
    p.add_argument("--tokenizer", default="bert-base-uncased")
    p.add_argument("--out", required=True)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--ep-size", type=int, default=8)
    p.add_argument("--aux-coef", type=float, default=0.01)
    p.add_argument("--micro-bs", type=int, default=16)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=10000)
    p.add_argument("--max-steps", type=int, default=250000)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--save-every", type=int, default=5000)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


class ExpertFFN(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.wi = nn.Linear(h, 4 * h)
        self.wo = nn.Linear(4 * h, h)

    def forward(self, x):
        return self.wo(F.gelu(self.wi(x)))


class EncoderLayer(nn.Module):
    def __init__(self, h, heads, moe_kwargs=None):
        super().__init__()
        self.attn = nn.MultiheadAttention(h, heads, dropout=0.1, batch_first=True)
        self.ln1 = nn.LayerNorm(h)
        self.ln2 = nn.LayerNorm(h)
        self.drop = nn.Dropout(0.1)
        self.is_moe = moe_kwargs is not None
        self.ffn = MoE(hidden_size=h, expert=ExpertFFN(h), **moe_kwargs) if self.is_moe else ExpertFFN(h)

    def forward(self, x, pad_mask):
        a, _ = self.attn(x, x, x, key_padding_mask=pad_mask, need_weights=False)
        x = self.ln1(x + self.drop(a))
        if self.is_moe:
            f, l_aux, _ = self.ffn(x)
        else:
            f, l_aux = self.ffn(x), torch.zeros((), device=x.device, dtype=x.dtype)
        return self.ln2(x + self.drop(f)), l_aux


class MoEEncoderForMLM(nn.Module):
    def __init__(self, vocab, args):
        super().__init__()
        moe_kwargs = dict(num_experts=args.experts, ep_size=args.ep_size, k=1,
                          capacity_factor=1.0, eval_capacity_factor=2.0, min_capacity=8,
                          noisy_gate_policy="RSample")
        self.tok = nn.Embedding(vocab, args.hidden)
        self.pos = nn.Embedding(args.max_len, args.hidden)
        self.emb_ln = nn.LayerNorm(args.hidden)
        self.layers = nn.ModuleList([
            EncoderLayer(args.hidden, args.heads, moe_kwargs if i % 2 == 1 else None)
            for i in range(args.layers)
        ])
        self.mlm_dense = nn.Linear(args.hidden, args.hidden)
        self.mlm_ln = nn.LayerNorm(args.hidden)
        self.decoder_bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, input_ids, attention_mask, labels):
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.emb_ln(self.tok(input_ids) + self.pos(pos))
        pad_mask = attention_mask == 0
        aux = 0.0
        for layer in self.layers:
            x, l = layer(x, pad_mask)
            aux = aux + l
        h = self.mlm_ln(F.gelu(self.mlm_dense(x)))
        logits = F.linear(h, self.tok.weight, self.decoder_bias)
        mlm = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
        return mlm, aux


def main():
    args = cli()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    dataset = load_from_disk(args.corpus)
    dataset.set_format(type="torch", columns=["input_ids", "attention_mask"])
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=1234)
    loader = DataLoader(dataset, batch_size=args.micro_bs, sampler=sampler, collate_fn=collator,
                        num_workers=6, pin_memory=True, drop_last=True)

    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_bs * args.grad_accum * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 5e8},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": args.lr, "betas": [0.9, 0.98], "eps": 1e-6,
                                 "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": args.warmup, "total_num_steps": args.max_steps}},
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }

    model = MoEEncoderForMLM(len(tokenizer), args)
    named = list(model.named_parameters())
    groups = [
        {"name": "decay", "params": [p for n, p in named if p.ndim > 1], "weight_decay": 0.01},
        {"name": "no_decay", "params": [p for n, p in named if p.ndim <= 1], "weight_decay": 0.0},
    ]
    groups = split_params_into_different_moe_groups_for_optimizer(groups)
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.999), eps=1e-8)

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer,
                                                           config=ds_config)

    if os.path.exists(os.path.join(args.out, "latest")):
        engine.load_checkpoint(args.out)

    epoch = 0
    micro_step = 0
    sampler.set_epoch(epoch)
    data_iter = iter(loader)
    t0 = time.time()
    while engine.global_steps < args.max_steps:
        try:
            batch = next(data_iter)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            data_iter = iter(loader)
            batch = next(data_iter)
        batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
        mlm, aux = engine(batch["input_ids"], batch["attention_mask"], batch["labels"])
        engine.backward(mlm + args.aux_coef * aux)
        engine.step()
        micro_step += 1

        if micro_step % args.grad_accum != 0:
            continue
        step = engine.global_steps
        if step % args.log_every == 0:
            logged = torch.stack([mlm.detach().float(), aux.detach().float()])
            dist.all_reduce(logged, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} epoch {epoch} mlm {logged[0]:.4f} aux {logged[1]:.4f} "
                      f"lr {engine.get_lr()[0]:.2e} {time.time() - t0:.1f}s", flush=True)
                t0 = time.time()
        if step % args.save_every == 0:
            engine.save_checkpoint(args.out, client_state={"epoch": epoch})

    engine.save_checkpoint(args.out, client_state={"epoch": epoch})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
