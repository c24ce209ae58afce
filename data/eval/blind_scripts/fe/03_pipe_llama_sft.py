#!/usr/bin/env python
# Supervised fine-tuning of a LLaMA-style decoder with DeepSpeed pipeline parallelism.
#
#   deepspeed --num_gpus 8 03_pipe_llama_sft.py --config configs/llama_pp.json \
#       --pp 4 --mbs 2 --gas 32 --train-data /mnt/shared/sft/train --eval-data /mnt/shared/sft/eval
#
import argparse
import json
import logging
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
import torch.distributed as dist
from datasets import load_from_disk
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.utils import RepeatingLoader
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("sft")
IGNORE_INDEX = -100


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="model + optimizer json")
    ap.add_argument("--train-data", required=True)
    ap.add_argument("--eval-data", required=True)
    ap.add_argument("--out", default="/mnt/shared/ckpt/llama_sft")
    ap.add_argument("--init-from", default=None, help="deepspeed checkpoint dir to start from")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--gas", type=int, default=32)
    ap.add_argument("--train-steps", type=int, default=3000)
    ap.add_argument("--eval-interval", type=int, default=250)
    ap.add_argument("--save-interval", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap.parse_args()


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).type_as(x) * self.weight


def rotary(x, base=10000.0):
    B, H, T, D = x.shape
    inv = 1.0 / (base ** (torch.arange(0, D, 2, device=x.device).float() / D))
    t = torch.arange(T, device=x.device).float()
    freqs = torch.outer(t, inv)
    cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class EmbedPipe(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)

    def forward(self, input_ids):
        return self.embed_tokens(input_ids)


class DecoderLayerPipe(nn.Module):
    def __init__(self, dim, n_heads, ffn_dim):
        super().__init__()
        self.n_heads = n_heads
        self.input_layernorm = RMSNorm(dim)
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.post_attention_layernorm = RMSNorm(dim)
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, h):
        B, T, C = h.shape
        x = self.input_layernorm(h)
        q = self.q_proj(x).view(B, T, self.n_heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_heads, -1).transpose(1, 2)
        q, k = rotary(q), rotary(k)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.o_proj(a.transpose(1, 2).reshape(B, T, C))
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LMHeadPipe(nn.Module):
    def __init__(self, dim, vocab):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, h):
        return self.lm_head(self.norm(h))


def sft_loss(logits, labels):
    # labels already shifted by the collator; prompt tokens are IGNORE_INDEX
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1),
                           ignore_index=IGNORE_INDEX)


def collate(batch, seq_len):
    ids = torch.full((len(batch), seq_len), 0, dtype=torch.long)
    labels = torch.full((len(batch), seq_len), IGNORE_INDEX, dtype=torch.long)
    for i, ex in enumerate(batch):
        toks = ex["input_ids"][:seq_len + 1]
        lab = ex["labels"][:seq_len + 1]
        n = len(toks) - 1
        ids[i, :n] = torch.tensor(toks[:-1])
        labels[i, :n] = torch.tensor(lab[1:])
    return ids, labels


def main():
    args = get_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    with open(args.config) as f:
        cfg = json.load(f)
    mcfg, ds_config = cfg["model"], cfg["deepspeed"]

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    deepspeed.runtime.utils.set_random_seed(args.seed)

    ds_config["train_micro_batch_size_per_gpu"] = args.mbs
    ds_config["gradient_accumulation_steps"] = args.gas
    ds_config["train_batch_size"] = args.mbs * args.gas * world_size

    layers = [LayerSpec(EmbedPipe, mcfg["vocab_size"], mcfg["dim"])]
    layers += [LayerSpec(DecoderLayerPipe, mcfg["dim"], mcfg["n_heads"], mcfg["ffn_dim"])
               for _ in range(mcfg["n_layers"])]
    layers.append(LayerSpec(LMHeadPipe, mcfg["dim"], mcfg["vocab_size"]))
    model = PipelineModule(layers=layers, num_stages=args.pp, loss_fn=sft_loss,
                           partition_method="type:DecoderLayerPipe",
                           activation_checkpoint_interval=mcfg.get("ckpt_interval", 1),
                           checkpointable_layers=["DecoderLayerPipe"])

    grid = model.mpu()
    seq_len = mcfg["seq_len"]
    train_ds = load_from_disk(args.train_data)
    eval_ds = load_from_disk(args.eval_data)
    train_sampler = DistributedSampler(train_ds, num_replicas=grid.get_data_parallel_world_size(),
                                       rank=grid.get_data_parallel_rank(), shuffle=True,
                                       seed=args.seed, drop_last=True)
    eval_sampler = DistributedSampler(eval_ds, num_replicas=grid.get_data_parallel_world_size(),
                                      rank=grid.get_data_parallel_rank(), shuffle=False,
                                      drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.mbs, sampler=train_sampler, drop_last=True,
                              num_workers=2, collate_fn=lambda b: collate(b, seq_len))
    eval_loader = DataLoader(eval_ds, batch_size=args.mbs, sampler=eval_sampler, drop_last=True,
                             num_workers=2, collate_fn=lambda b: collate(b, seq_len))

    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config,
                                           model_parameters=[p for p in model.parameters()
                                                             if p.requires_grad])
    if args.init_from:
        engine.load_checkpoint(args.init_from, load_optimizer_states=False,
                               load_lr_scheduler_states=False, load_module_only=True)

    epoch = 0
    train_sampler.set_epoch(epoch)
    train_iter = iter(train_loader)
    steps_per_epoch = len(train_loader) // args.gas

    for step in range(1, args.train_steps + 1):
        if (step - 1) % steps_per_epoch == 0 and step > 1:
            epoch += 1
            train_sampler.set_epoch(epoch)
            train_iter = iter(train_loader)
        loss = engine.train_batch(data_iter=train_iter)
        if rank == 0 and step % 10 == 0:
            logger.info("step %d epoch %d loss %.4f lr %.3e", step, epoch, loss.item(),
                        engine.get_lr()[0])

        if step % args.eval_interval == 0:
            engine.eval()
            it = RepeatingLoader(eval_loader)
            n = max(1, min(20, len(eval_loader) // args.gas))
            val = sum(engine.eval_batch(it).item() for _ in range(n)) / n
            engine.train()
            if rank == 0:
                logger.info("step %d eval loss %.4f ppl %.2f", step, val, math.exp(min(val, 20)))

        if step % args.save_interval == 0:
            engine.save_checkpoint(args.out, tag=f"step{step}")

    engine.save_checkpoint(args.out, tag="final")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
