#!/usr/bin/env python
"""Domain-adaptive pre-training (legal corpus) with the DeepSpeed pipeline engine.

Raw JSONL is tokenized once into a flat uint32 token file next to the corpus,
then read through a memmap.

    deepspeed --num_gpus 8 14_pipe_domain_adapt.py --deepspeed_config configs/dapt_pp2.json \
        --corpus-dir /shared/corpora/legal --tokenizer /shared/models/base3b \
        --num-stages 2 --save-dir /shared/exp/dapt_legal
"""
import argparse
import glob
import json
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
import deepspeed.comm as dist
from deepspeed.pipe import LayerSpec, PipelineModule
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus-dir", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--num-stages", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--save-interval", type=int, default=1000)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def build_token_cache(corpus_dir, tokenizer_path):
    cache = os.path.join(corpus_dir, "tokens.u32.npy")
    if not os.path.exists(cache):
        tok = AutoTokenizer.from_pretrained(tokenizer_path)
        pieces = []
        for path in sorted(glob.glob(os.path.join(corpus_dir, "*.jsonl"))):
            with open(path) as f:
                for line in f:
                    text = json.loads(line)["text"]
                    pieces.append(np.asarray(tok(text)["input_ids"] + [tok.eos_token_id], dtype=np.uint32))
        np.save(cache, np.concatenate(pieces))
    return np.load(cache, mmap_mode="r")


class Windows(Dataset):
    def __init__(self, tokens, seq_len, start, stop):
        self.tokens = tokens
        self.seq_len = seq_len
        self.offsets = np.arange(start, stop - seq_len - 1, seq_len)

    def __len__(self):
        return len(self.offsets)

    def __getitem__(self, i):
        o = self.offsets[i]
        w = torch.from_numpy(self.tokens[o:o + self.seq_len + 1].astype(np.int64))
        return w[:-1], w[1:]


class InputLayer(nn.Module):
    def __init__(self, vocab, hidden, max_len):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(max_len, hidden)

    def forward(self, ids):
        return self.tokens(ids) + self.positions(torch.arange(ids.size(1), device=ids.device))


class TransformerLayer(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln_attn = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.ln_mlp = nn.LayerNorm(hidden)
        self.h_to_4h = nn.Linear(hidden, 4 * hidden)
        self.four_h_to_h = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(self.ln_attn(x)).view(B, T, 3, self.heads, C // self.heads)
        q, k, v = qkv.unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        # parallel residual (GPT-J / NeoX style)
        return x + self.dense(a.transpose(1, 2).reshape(B, T, C)) + \
            self.four_h_to_h(F.gelu(self.h_to_4h(self.ln_mlp(x))))


class OutputLayer(nn.Module):
    def __init__(self, hidden, vocab):
        super().__init__()
        self.final_norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x):
        return self.lm_head(self.final_norm(x))


def loss_fn(logits, labels):
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))


def main():
    args = parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(1234)

    tokens = build_token_cache(args.corpus_dir, args.tokenizer)
    vocab = len(AutoTokenizer.from_pretrained(args.tokenizer))
    vocab = (vocab + 127) // 128 * 128
    n_val = 2_000_000
    train_ds = Windows(tokens, args.seq_len, 0, len(tokens) - n_val)
    val_ds = Windows(tokens, args.seq_len, len(tokens) - n_val, len(tokens))

    specs = ([LayerSpec(InputLayer, vocab, args.hidden, args.seq_len)]
             + [LayerSpec(TransformerLayer, args.hidden, args.heads) for _ in range(args.layers)]
             + [LayerSpec(OutputLayer, args.hidden, vocab)])
    pipe = PipelineModule(layers=specs, num_stages=args.num_stages, loss_fn=loss_fn,
                          partition_method="type:TransformerLayer",
                          activation_checkpoint_interval=1, checkpointable_layers=["TransformerLayer"])

    engine, _, _, _ = deepspeed.initialize(args=args, model=pipe,
                                           model_parameters=[p for p in pipe.parameters() if p.requires_grad])
    dp_rank = engine.grid.get_data_parallel_rank()
    dp_size = engine.grid.get_data_parallel_world_size()
    mbs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()

    sampler = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=1234)
    loader = DataLoader(train_ds, batch_size=mbs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=mbs, drop_last=True, num_workers=2,
                            sampler=DistributedSampler(val_ds, num_replicas=dp_size, rank=dp_rank,
                                                       shuffle=False, drop_last=True))

    if os.path.exists(os.path.join(args.save_dir, "latest")):
        engine.load_checkpoint(args.save_dir)

    steps_per_epoch = len(loader) // gas
    first_epoch = engine.global_steps // steps_per_epoch
    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        it = iter(loader)
        for _ in range(steps_per_epoch):
            loss = engine.train_batch(data_iter=it)
            step = engine.global_steps
            if rank == 0 and step % args.log_interval == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} lr {engine.get_lr()[0]:.2e}", flush=True)
            if step % args.save_interval == 0:
                engine.save_checkpoint(args.save_dir, tag=f"step{step}")

        vit = iter(val_loader)
        n = len(val_loader) // gas
        vloss = sum(engine.eval_batch(vit).item() for _ in range(n)) / max(n, 1)
        if rank == 0:
            print(f"epoch {epoch} val loss {vloss:.4f}", flush=True)
        engine.save_checkpoint(args.save_dir, tag=f"epoch{epoch}")

    dist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
