#!/usr/bin/env python
# MoE code-completion fine-tuning (fill-in-the-middle) with DeepSpeed MoE + ZeRO-1.
# Dense blocks are activation-checkpointed with deepspeed.checkpointing.
#
#   deepspeed --num_gpus 8 19_moe_code_finetune.py --deepspeed --deepspeed_config configs/moe_fim.json \
#       --data /shared/data/fim_py --init /shared/exp/moe_code_base --save-dir /shared/exp/moe_code_fim
import argparse
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
import deepspeed.comm as dist
from datasets import load_from_disk
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--init", default=None)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--n-layers", type=int, default=24)
    parser.add_argument("--n-heads", type=int, default=16)
    parser.add_argument("--num-experts", type=int, default=16)
    parser.add_argument("--ep-size", type=int, default=4)
    parser.add_argument("--aux-coef", type=float, default=0.01)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=500)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class FFN(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Attn(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln(x)).view(B, T, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        return x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))


class DenseBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.attn = Attn(d, h)
        self.ln = nn.LayerNorm(d)
        self.ffn = FFN(d)

    def forward(self, x):
        x = self.attn(x)
        return x + self.ffn(self.ln(x))


class SparseBlock(nn.Module):
    def __init__(self, d, h, args):
        super().__init__()
        self.attn = Attn(d, h)
        self.ln = nn.LayerNorm(d)
        self.moe = MoE(hidden_size=d, expert=FFN(d), num_experts=args.num_experts, ep_size=args.ep_size,
                       k=2, capacity_factor=1.25, eval_capacity_factor=2.0, min_capacity=4)

    def forward(self, x):
        x = self.attn(x)
        y, l_aux, _ = self.moe(self.ln(x))
        return x + y, l_aux


class CodeMoE(nn.Module):
    def __init__(self, args):
        super().__init__()
        d = args.d_model
        self.wte = nn.Embedding(args.vocab, d)
        self.wpe = nn.Embedding(args.ctx, d)
        self.blocks = nn.ModuleList([SparseBlock(d, args.n_heads, args) if i % 2 else DenseBlock(d, args.n_heads)
                                     for i in range(args.n_layers)])
        self.ln_f = nn.LayerNorm(d)

    def forward(self, ids, labels):
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1), device=ids.device))
        aux = 0.0
        for blk in self.blocks:
            if isinstance(blk, SparseBlock):
                x, l_aux = blk(x)
                aux = aux + l_aux
            else:
                x = deepspeed.checkpointing.checkpoint(blk, x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
        return loss, aux


def main():
    args = parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    deepspeed.checkpointing.configure(None, deepspeed_config=args.deepspeed_config)

    data = load_from_disk(args.data)
    data.set_format("torch", columns=["input_ids", "labels"])
    sampler = DistributedSampler(data["train"], num_replicas=world, rank=rank, shuffle=True, seed=1)

    model = CodeMoE(args)
    params = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters()], "name": "params"})
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=params)
    if args.init:
        engine.load_checkpoint(args.init, load_module_only=True)

    mbs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    loader = DataLoader(data["train"], batch_size=mbs, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(data["test"], batch_size=mbs, drop_last=True,
                            sampler=DistributedSampler(data["test"], num_replicas=world, rank=rank,
                                                       shuffle=False, drop_last=True))

    def evaluate():
        engine.eval()
        tot = torch.zeros(2, device=engine.device)
        with torch.no_grad():
            for b in val_loader:
                loss, _ = engine(b["input_ids"].to(engine.device), b["labels"].to(engine.device))
                tot += torch.stack([loss.float(), torch.ones((), device=engine.device)])
        dist.all_reduce(tot)
        engine.train()
        return (tot[0] / tot[1]).item()

    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, b in enumerate(loader):
            loss, aux = engine(b["input_ids"].to(engine.device, non_blocking=True),
                               b["labels"].to(engine.device, non_blocking=True))
            engine.backward(loss + args.aux_coef * aux)
            engine.step()
            if (i + 1) % gas:
                continue
            step = engine.global_steps
            if rank == 0:
                if step % args.log_every == 0:
                    print(f"epoch {epoch} step {step} loss {loss.item():.4f} aux {aux.item():.4f} "
                          f"lr {engine.get_lr()[0]:.2e} {(time.time() - t0) / args.log_every:.2f}s/step",
                          flush=True)
                    t0 = time.time()
                if step % args.save_every == 0:
                    engine.save_checkpoint(args.save_dir, tag=f"step{step}", client_state={"epoch": epoch})

        vl = evaluate()
        if rank == 0:
            print(f"epoch {epoch} val loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
        engine.save_checkpoint(args.save_dir, tag=f"epoch{epoch}", client_state={"epoch": epoch})

    dist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
