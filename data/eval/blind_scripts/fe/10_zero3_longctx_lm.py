#!/usr/bin/env python
"""Long-context (16k) decoder pre-training with ZeRO-3 and DeepSpeed activation checkpointing.

    deepspeed --hostfile hostfile --num_nodes 4 --num_gpus 8 10_zero3_longctx_lm.py \
        --deepspeed_config configs/zero3_longctx.json --data /lustre/data/longctx_16k \
        --output /lustre/exp/lc16k_3b
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
import deepspeed.comm as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dim", type=int, default=3072)
    parser.add_argument("--layers", type=int, default=26)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--train-iters", type=int, default=30000)
    parser.add_argument("--eval-interval", type=int, default=1000)
    parser.add_argument("--save-interval", type=int, default=1000)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Shards(Dataset):
    def __init__(self, root, split, seq):
        self.tokens = np.memmap(os.path.join(root, f"{split}.bin"), dtype=np.uint16, mode="r")
        self.seq = seq

    def __len__(self):
        return len(self.tokens) // (self.seq + 1)

    def __getitem__(self, i):
        s = i * (self.seq + 1)
        return torch.from_numpy(self.tokens[s:s + self.seq + 1].astype(np.int64))


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class DecoderLayer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = RMSNorm(dim)
        hidden = int(8 * dim / 3 / 256 + 1) * 256
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).chunk(3, -1)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(B, T, C))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class LongLM(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.dim)
        self.layers = nn.ModuleList([DecoderLayer(args.dim, args.heads) for _ in range(args.layers)])
        self.norm = RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab, bias=False)

    def forward(self, tokens):
        inp, tgt = tokens[:, :-1], tokens[:, 1:]
        h = self.embed(inp)
        for layer in self.layers:
            h = deepspeed.checkpointing.checkpoint(layer, h)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tgt.reshape(-1))


@torch.no_grad()
def evaluate(engine, loader, max_batches=25):
    engine.eval()
    acc = torch.zeros(2, device=engine.device)
    for i, tokens in enumerate(loader):
        if i == max_batches:
            break
        acc[0] += engine(tokens.to(engine.device)).float()
        acc[1] += 1
    dist.all_reduce(acc)
    engine.train()
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    with open(args.deepspeed_config) as f:
        ds_cfg = json.load(f)
    deepspeed.checkpointing.configure(None, deepspeed_config=ds_cfg,
                                      partition_activations=False,
                                      contiguous_checkpointing=False,
                                      checkpoint_in_cpu=ds_cfg.get("activation_checkpointing", {})
                                      .get("cpu_checkpointing", False),
                                      num_checkpoints=args.layers)

    torch.manual_seed(1)
    with deepspeed.zero.Init(config_dict_or_path=ds_cfg):
        model = LongLM(args)

    engine, optimizer, _, scheduler = deepspeed.initialize(args=args, model=model,
                                                           model_parameters=model.parameters())

    train_ds, val_ds = Shards(args.data, "train", args.seq), Shards(args.data, "val", args.seq)
    mbs = engine.train_micro_batch_size_per_gpu()
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=1)
    train_loader = DataLoader(train_ds, batch_size=mbs, sampler=sampler, num_workers=2,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=mbs,
                            sampler=DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False),
                            num_workers=2)

    load_path, client = engine.load_checkpoint(args.output)
    epoch = client["epoch"] if load_path else 0

    gas = engine.gradient_accumulation_steps()
    done = False
    while not done:
        sampler.set_epoch(epoch)
        t0 = time.time()
        for micro, tokens in enumerate(train_loader):
            loss = engine(tokens.to(engine.device, non_blocking=True))
            engine.backward(loss)
            engine.step()
            if (micro + 1) % gas:
                continue
            it = engine.global_steps
            if rank == 0 and it % 10 == 0:
                tps = engine.train_batch_size() * args.seq * 10 / (time.time() - t0)
                t0 = time.time()
                print(f"iter {it} loss {loss.item():.4f} lr {engine.get_lr()[0]:.2e} tok/s {tps:.0f}", flush=True)
            if it % args.eval_interval == 0:
                vl = evaluate(engine, val_loader)
                if rank == 0:
                    print(f"iter {it} val {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
            if it % args.save_interval == 0:
                engine.save_checkpoint(args.output, client_state={"epoch": epoch})
            if it >= args.train_iters:
                done = True
                break
        epoch += 1

    engine.save_checkpoint(args.output, client_state={"epoch": epoch})
    if rank == 0:
        os.makedirs(os.path.join(args.output, "hf"), exist_ok=True)
        torch.save(engine.module.state_dict(), os.path.join(args.output, "hf", "pytorch_model.bin"))
        with open(os.path.join(args.output, "hf", "config.json"), "w") as f:
            json.dump({"vocab_size": args.vocab, "dim": args.dim, "n_layers": args.layers,
                       "n_heads": args.heads, "max_seq_len": args.seq}, f, indent=2)
    dist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
