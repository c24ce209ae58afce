#!/usr/bin/env python
"""Multilingual ALiBi decoder (BLOOM-style) trained with the DeepSpeed pipeline engine.

PP=2 x DP=4 on one 8-GPU node, fp16 with dynamic loss scaling.

    deepspeed --num_gpus 8 18_pipe_alibi_multilingual.py --deepspeed_config configs/bloom_pp2.json \
        --pp 2 --train /shared/data/ml_mix/train.npy --valid /shared/data/ml_mix/valid.npy \
        --outdir /shared/exp/bloom3b_pp2
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
from deepspeed.pipe import LayerSpec, PipelineModule
from torch.utils.data import DataLoader, Dataset


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--outdir", required=True)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=250880)
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--n-layer", type=int, default=30)
    p.add_argument("--n-head", type=int, default=32)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--eval-iters", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--save-every", type=int, default=1000)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


class TokenFile(Dataset):
    def __init__(self, path, seq):
        self.arr = np.load(path, mmap_mode="r")
        self.seq = seq

    def __len__(self):
        return (len(self.arr) - 1) // self.seq

    def __getitem__(self, i):
        w = torch.from_numpy(self.arr[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
        return w[:-1], w[1:]


def alibi_slopes(n_head):
    start = 2 ** (-(2 ** -(math.log2(n_head) - 3)))
    return torch.tensor([start * (start ** i) for i in range(n_head)])


class WordEmbeddings(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.word_embeddings_layernorm = nn.LayerNorm(hidden)

    def forward(self, ids):
        return self.word_embeddings_layernorm(self.word_embeddings(ids))


class BloomBlock(nn.Module):
    def __init__(self, hidden, n_head):
        super().__init__()
        self.n_head = n_head
        self.input_layernorm = nn.LayerNorm(hidden)
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.dense_h_to_4h = nn.Linear(hidden, 4 * hidden)
        self.dense_4h_to_h = nn.Linear(4 * hidden, hidden)
        self.register_buffer("slopes", alibi_slopes(n_head), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.query_key_value(self.input_layernorm(x)).view(B, T, self.n_head, 3, -1).permute(3, 0, 2, 1, 4)
        pos = torch.arange(T, device=x.device)
        bias = -(pos[None, :] - pos[:, None]).abs().to(x.dtype) * self.slopes.to(x.dtype)[:, None, None]
        bias = bias.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.unsqueeze(0))
        x = x + self.dense(a.transpose(1, 2).reshape(B, T, C))
        return x + self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(self.post_attention_layernorm(x))))


class LMHead(nn.Module):
    def __init__(self, hidden, vocab):
        super().__init__()
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


def ce_loss(logits, labels):
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1))


def main():
    args = get_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed()
    torch.manual_seed(args.seed)
    rank = dist.get_rank()

    specs = [LayerSpec(WordEmbeddings, args.vocab, args.hidden)]
    specs += [LayerSpec(BloomBlock, args.hidden, args.n_head) for _ in range(args.n_layer)]
    specs += [LayerSpec(LMHead, args.hidden, args.vocab)]
    net = PipelineModule(layers=specs, num_stages=args.pp, loss_fn=ce_loss,
                         partition_method="type:BloomBlock", activation_checkpoint_interval=1,
                         checkpointable_layers=["BloomBlock"])
    engine, _, _, _ = deepspeed.initialize(args=args, model=net,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])

    train_ds, valid_ds = TokenFile(args.train, args.seq), TokenFile(args.valid, args.seq)
    mbs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    # The first and last stage must see the same micro-batches (inputs vs. labels),
    # so shuffling uses a generator seeded identically on every rank.
    gen = torch.Generator()
    train_loader = DataLoader(train_ds, batch_size=mbs, shuffle=True, generator=gen, drop_last=True,
                              num_workers=4, pin_memory=True)
    valid_loader = DataLoader(valid_ds, batch_size=mbs, shuffle=False, drop_last=True, num_workers=2)

    start_epoch = 0
    if os.path.exists(os.path.join(args.outdir, "latest")):
        _, cs = engine.load_checkpoint(args.outdir)
        start_epoch = cs.get("epoch", 0)

    steps_per_epoch = len(train_loader) // gas
    if rank == 0:
        print(f"pp={engine.num_stages} dp={engine.grid.get_data_parallel_world_size()} "
              f"global batch={engine.train_batch_size()} steps/epoch={steps_per_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        gen.manual_seed(args.seed + epoch)
        it = iter(train_loader)
        t0 = time.time()
        for s in range(steps_per_epoch):
            loss = engine.train_batch(data_iter=it)
            step = engine.global_steps
            if rank == 0 and step % 10 == 0:
                tok_s = engine.train_batch_size() * args.seq * 10 / (time.time() - t0)
                t0 = time.time()
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} tok/s {tok_s:.0f}", flush=True)
            if step % args.eval_every == 0:
                vit = iter(valid_loader)
                n = min(args.eval_iters, len(valid_loader) // gas)
                vloss = sum(engine.eval_batch(vit).item() for _ in range(n)) / max(n, 1)
                if rank == 0:
                    print(f"step {step} valid loss {vloss:.4f} ppl {math.exp(vloss):.2f}", flush=True)
            if step % args.save_every == 0:
                engine.save_checkpoint(args.outdir, client_state={"epoch": epoch})
        engine.save_checkpoint(args.outdir, client_state={"epoch": epoch + 1})

    dist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
