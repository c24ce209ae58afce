#!/usr/bin/env python
"""GPT pre-training with DeepSpeed pipeline parallelism (+ data parallel).

Input/output embeddings are tied across the first and last stage with
TiedLayerSpec; transformer blocks are checkpointed one at a time.

    deepspeed --num_gpus 8 02_pipe_gpt_tied.py --ds-config configs/pipe_bf16.json \
        --pipe-parallel-size 4 --micro-batch-size 4 --grad-accum-steps 16 \
        --dataset-dir /shared/data/pile_subset --save-dir /shared/ckpt/gpt_pp4
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
import deepspeed.comm as dist
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ds-config", type=str, required=True)
    p.add_argument("--dataset-dir", type=str, required=True)
    p.add_argument("--save-dir", type=str, required=True)
    p.add_argument("--log-dir", type=str, default="runs/gpt_pp")
    p.add_argument("--pipe-parallel-size", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--grad-accum-steps", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=500)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--save-every", type=int, default=2000)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


class PackedTokens(Dataset):
    def __init__(self, path, seq_len):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, idx):
        s = idx * self.seq_len
        buf = torch.from_numpy(self.data[s:s + self.seq_len + 1].astype(np.int64))
        return buf[:-1], buf[1:]


class EmbeddingPipe(nn.Module):
    def __init__(self, vocab_size, hidden, max_len, dropout):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden)
        self.position_embeddings = nn.Embedding(max_len, hidden)
        self.drop = nn.Dropout(dropout)
        nn.init.normal_(self.word_embeddings.weight, std=0.02)
        nn.init.normal_(self.position_embeddings.weight, std=0.01)

    def forward(self, input_ids):
        pos = torch.arange(input_ids.size(1), device=input_ids.device).unsqueeze(0)
        return self.drop(self.word_embeddings(input_ids) + self.position_embeddings(pos))


def lm_head_forward(embedding, hidden):
    return F.linear(hidden, embedding.word_embeddings.weight)


class TransformerBlockPipe(nn.Module):
    def __init__(self, hidden, heads, dropout):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)
        self.attn_dropout = dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.attn_dropout if self.training else 0.0)
        x = x + self.drop(self.out(a.transpose(1, 2).reshape(B, T, C)))
        x = x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))
        return x


def lm_loss(logits, labels):
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1))


def build_pipeline(args):
    specs = [TiedLayerSpec("embed", EmbeddingPipe, args.vocab_size, args.hidden, args.seq_len,
                           args.dropout, tied_weight_attr="word_embeddings.weight")]
    specs += [LayerSpec(TransformerBlockPipe, args.hidden, args.heads, args.dropout)
              for _ in range(args.layers)]
    specs += [LayerSpec(nn.LayerNorm, args.hidden),
              TiedLayerSpec("embed", EmbeddingPipe, args.vocab_size, args.hidden, args.seq_len,
                            args.dropout, forward_fn=lm_head_forward,
                            tied_weight_attr="word_embeddings.weight")]
    return PipelineModule(layers=specs, num_stages=args.pipe_parallel_size, loss_fn=lm_loss,
                          partition_method="type:TransformerBlockPipe",
                          activation_checkpoint_interval=1,
                          checkpointable_layers=["TransformerBlockPipe"])


def main():
    args = parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl")
    torch.manual_seed(args.seed)
    rank = dist.get_rank()

    model = build_pipeline(args)
    grid = model.mpu()
    dp_rank = grid.get_data_parallel_rank()
    dp_size = grid.get_data_parallel_world_size()

    train_set = PackedTokens(os.path.join(args.dataset_dir, "train.bin"), args.seq_len)
    val_set = PackedTokens(os.path.join(args.dataset_dir, "val.bin"), args.seq_len)
    # Samplers follow the data-parallel coordinates so that the first and last
    # stage of a pipeline draw identical micro-batches.
    train_sampler = DistributedSampler(train_set, num_replicas=dp_size, rank=dp_rank,
                                       shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_set, num_replicas=dp_size, rank=dp_rank,
                                     shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.micro_batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.micro_batch_size, sampler=val_sampler,
                            num_workers=2, pin_memory=True, drop_last=True)

    steps_per_epoch = len(train_loader) // args.grad_accum_steps
    total_steps = steps_per_epoch * args.epochs

    with open(args.ds_config) as f:
        ds_config = json.load(f)
    ds_config["train_micro_batch_size_per_gpu"] = args.micro_batch_size
    ds_config["gradient_accumulation_steps"] = args.grad_accum_steps
    ds_config["train_batch_size"] = args.micro_batch_size * args.grad_accum_steps * dp_size
    ds_config["optimizer"] = {"type": "AdamW",
                              "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}}
    ds_config["scheduler"] = {"type": "WarmupDecayLR",
                              "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                         "warmup_num_steps": args.warmup_steps,
                                         "total_num_steps": total_steps}}

    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config)

    start_epoch, start_step = 0, 0
    if os.path.exists(os.path.join(args.save_dir, "latest")):
        _, client_state = engine.load_checkpoint(args.save_dir)
        start_epoch = client_state["epoch"]
        start_step = client_state["step_in_epoch"]

    writer = SummaryWriter(args.log_dir) if rank == 0 else None
    if rank == 0:
        print(f"pp={args.pipe_parallel_size} dp={dp_size} global_batch={engine.train_batch_size()} "
              f"steps/epoch={steps_per_epoch} total={total_steps}")

    def run_eval():
        n_batches = len(val_loader) // engine.gradient_accumulation_steps()
        val_iter = iter(val_loader)
        losses = []
        for _ in range(n_batches):
            # eval_batch averages over micro-batches and DP ranks and broadcasts
            # the result to every stage.
            losses.append(engine.eval_batch(val_iter).item())
        return sum(losses) / max(len(losses), 1)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train_iter = iter(train_loader)
        first = start_step if epoch == start_epoch else 0
        for _ in range(first * args.grad_accum_steps):
            next(train_iter)
        t0 = time.time()
        for step in range(first, steps_per_epoch):
            loss = engine.train_batch(data_iter=train_iter)
            gstep = engine.global_steps

            if rank == 0 and gstep % 10 == 0:
                elapsed = time.time() - t0
                t0 = time.time()
                writer.add_scalar("train/loss", loss.item(), gstep)
                writer.add_scalar("train/lr", engine.get_lr()[0], gstep)
                writer.add_scalar("perf/sec_per_step", elapsed / 10, gstep)
                print(f"epoch {epoch} step {gstep} loss {loss.item():.4f}")

            if gstep % args.eval_every == 0:
                val_loss = run_eval()
                if rank == 0:
                    writer.add_scalar("val/loss", val_loss, gstep)
                    print(f"  val loss {val_loss:.4f}")

            if gstep % args.save_every == 0:
                engine.save_checkpoint(args.save_dir,
                                       client_state={"epoch": epoch, "step_in_epoch": step + 1})

        engine.save_checkpoint(args.save_dir, client_state={"epoch": epoch + 1, "step_in_epoch": 0})

    if writer is not None:
        writer.close()
    dist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
