#!/usr/bin/env python
"""Continued pre-training of a 7B decoder under ZeRO-3 with DeepSpeed activation checkpointing.

Weights are initialised from a consolidated bf16 state dict, streamed into the
partitioned model one module at a time. The final model is exported with
save_16bit_model so the eval harness can load it without DeepSpeed.

    deepspeed --num_gpus 8 12_zero3_continued_pretrain.py \
        --init /shared/models/base7b/consolidated.pt --corpus /shared/data/domain_mix.bin \
        --output /shared/exp/cpt7b_domain
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
import deepspeed.comm as dist
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--init", required=True)
    p.add_argument("--corpus", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--n-layers", type=int, default=32)
    p.add_argument("--n-heads", type=int, default=32)
    p.add_argument("--ffn", type=int, default=11008)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--val-frac", type=float, default=0.002)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    return p.parse_args()


class Packed(Dataset):
    def __init__(self, path, seq_len):
        self.buf = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return len(self.buf) // (self.seq_len + 1)

    def __getitem__(self, i):
        s = i * (self.seq_len + 1)
        return torch.from_numpy(self.buf[s:s + self.seq_len + 1].astype(np.int64))


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Block(nn.Module):
    def __init__(self, dim, n_heads, ffn):
        super().__init__()
        self.n_heads = n_heads
        self.attention_norm = RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = RMSNorm(dim)
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(B, T, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Transformer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok_embeddings = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleList([Block(a.dim, a.n_heads, a.ffn) for _ in range(a.n_layers)])
        self.norm = RMSNorm(a.dim)
        self.output = nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens[:, :-1])
        for layer in self.layers:
            x = deepspeed.checkpointing.checkpoint(layer, x)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def load_consolidated(model, path, rank):
    # Only rank 0 reads the file; GatheredParameters broadcasts its edits on exit.
    state = torch.load(path, map_location="cpu", mmap=True) if rank == 0 else None
    for prefix, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            if rank == 0:
                for name, p in module.named_parameters(recurse=False):
                    key = f"{prefix}.{name}" if prefix else name
                    p.data.copy_(state[key])
    del state


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_batch * args.grad_accum * world,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": 100, "total_num_steps": args.steps}},
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                     "contiguous_memory_optimization": False},
        "steps_per_print": 50,
    }
    deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)

    torch.manual_seed(args.seed)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = Transformer(args)
    load_consolidated(model, args.init, rank)

    full = Packed(args.corpus, args.seq_len)
    n_val = max(int(len(full) * args.val_frac), world)
    train_ds, val_ds = random_split(full, [len(full) - n_val, n_val],
                                    generator=torch.Generator().manual_seed(args.seed))
    # dropout / sampling noise may differ per rank; the split above has its own generator
    torch.manual_seed(args.seed + rank)

    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                           config=ds_config)

    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=sampler,
                              num_workers=2, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.micro_batch,
                            sampler=DistributedSampler(val_ds, num_replicas=world, rank=rank,
                                                       shuffle=False, drop_last=True))

    def validate():
        engine.eval()
        tot = torch.zeros(2, device=engine.device)
        with torch.no_grad():
            for tokens in val_loader:
                tot[0] += engine(tokens.to(engine.device)).float()
                tot[1] += 1
        dist.all_reduce(tot)
        engine.train()
        return (tot[0] / tot[1]).item()

    epoch, micro = 0, 0
    t0 = time.time()
    while engine.global_steps < args.steps:
        sampler.set_epoch(epoch)
        for tokens in train_loader:
            loss = engine(tokens.to(engine.device, non_blocking=True))
            engine.backward(loss)
            engine.step()
            micro += 1
            if micro % args.grad_accum:
                continue
            step = engine.global_steps
            if step % 20 == 0:
                with deepspeed.zero.GatheredParameters([engine.module.tok_embeddings.weight]):
                    emb_norm = engine.module.tok_embeddings.weight.float().norm().item()
                if rank == 0:
                    print(f"step {step} loss {loss.item():.4f} emb_norm {emb_norm:.2f} "
                          f"lr {engine.get_lr()[0]:.2e} {(time.time() - t0) / 20:.2f}s/step", flush=True)
                    t0 = time.time()
            if step % 500 == 0:
                vl = validate()
                if rank == 0:
                    print(f"step {step} val loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
                engine.save_checkpoint(args.output, tag=f"step{step}")
            if step >= args.steps:
                break
        epoch += 1

    engine.save_16bit_model(os.path.join(args.output, "export"), "pytorch_model.bin")
    dist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
