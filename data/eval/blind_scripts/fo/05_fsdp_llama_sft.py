"""Supervised fine-tuning of a Llama-family model with FSDP (bf16), activation checkpointing
and gradient accumulation. Plain PyTorch, no Trainer.

torchrun --nnodes=1 --nproc_per_node=8 05_fsdp_llama_sft.py \
    --model_name meta-llama/Llama-3.2-1B --train_file data/sft_train.jsonl --val_file data/sft_val.jsonl
"""
import argparse
import contextlib
import functools
import json
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

IGNORE = -100
PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", default="meta-llama/Llama-3.2-1B")
    p.add_argument("--train_file", required=True)
    p.add_argument("--val_file", required=True)
    p.add_argument("--output_dir", default="ckpts/llama_sft")
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--micro_batch", type=int, default=2)
    p.add_argument("--grad_accum", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--save_every", type=int, default=500)
    return p.parse_args()


class SFTDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        prompt = PROMPT.format(instruction=r["instruction"])
        p_ids = self.tok(prompt, add_special_tokens=True)["input_ids"]
        a_ids = self.tok(r["output"], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        ids = (p_ids + a_ids)[: self.max_len]
        labels = ([IGNORE] * len(p_ids) + a_ids)[: self.max_len]
        return torch.tensor(ids), torch.tensor(labels)


def collate(batch, pad_id):
    n = max(x.size(0) for x, _ in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), n), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, : x.size(0)] = x
        labels[i, : y.size(0)] = y
        mask[i, : x.size(0)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def save_model(model, tokenizer, out_dir, rank):
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            cpu_state = model.state_dict()
        torch.save(cpu_state, os.path.join(out_dir, "pytorch_model.bin"))
        model.module.config.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    dist.barrier()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        n = (batch["labels"][:, 1:] != IGNORE).sum()
        acc[0] += out.loss.float() * n
        acc[1] += n
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model_name, torch_dtype=torch.float32)
    model.config.use_cache = False

    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    model = FSDP(
        model,
        auto_wrap_policy=wrap,
        mixed_precision=bf16,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.cuda.current_device(),
        limit_all_gathers=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    )

    pad = tokenizer.pad_token_id
    train_ds = SFTDataset(args.train_file, tokenizer, args.max_len)
    val_ds = SFTDataset(args.val_file, tokenizer, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    col = functools.partial(collate, pad_id=pad)
    train_loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=train_sampler,
                              collate_fn=col, num_workers=2, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.micro_batch, sampler=val_sampler,
                            collate_fn=col, num_workers=2, drop_last=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total_updates = args.epochs * (len(train_loader) // args.grad_accum)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / args.warmup)
        * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, total_updates)))),
    )
    if rank == 0:
        print(f"{len(train_ds)} train examples, {total_updates} optimizer updates on {world} GPUs", flush=True)

    device = torch.device("cuda", local_rank)
    update = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        running = 0.0
        for i, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            accumulate = (i + 1) % args.grad_accum != 0
            with model.no_sync() if accumulate else contextlib.nullcontext():
                loss = model(**batch).loss / args.grad_accum
                loss.backward()
            running += loss.item()
            if accumulate:
                continue
            gnorm = model.clip_grad_norm_(args.clip)
            optimizer.step()
            sched.step()
            optimizer.zero_grad(set_to_none=True)
            update += 1
            if rank == 0 and update % 10 == 0:
                print(f"epoch {epoch} update {update}/{total_updates} loss {running:.4f} "
                      f"gnorm {gnorm.item():.3f} lr {sched.get_last_lr()[0]:.2e}", flush=True)
            running = 0.0
            if update % args.save_every == 0:
                save_model(model, tokenizer, os.path.join(args.output_dir, f"step_{update}"), rank)

        val_loss = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)
        save_model(model, tokenizer, os.path.join(args.output_dir, f"epoch_{epoch}"), rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
