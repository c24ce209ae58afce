#!/usr/bin/env python
"""Continued pretraining on domain text (ZeRO-2, optimizer offload).

deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 8 continued_pretrain.py \
    --deepspeed --deepspeed_config ds_configs/zero2_offload.json \
    --base_model /mnt/shared/models/Qwen2-7B --text_dir /mnt/shared/corpus/medical \
    --cache_dir /mnt/shared/cache/medical_qwen2 --save_dir /mnt/shared/ckpt/cpt-med
"""
import argparse
import glob
import itertools
import logging
import math
import os

import deepspeed
import torch
import torch.distributed as dist
from datasets import load_dataset, load_from_disk
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator

logger = logging.getLogger("cpt")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--base_model", required=True)
    p.add_argument("--text_dir", required=True)
    p.add_argument("--cache_dir", required=True)
    p.add_argument("--save_dir", required=True)
    p.add_argument("--block_size", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--eval_ratio", type=float, default=0.005)
    p.add_argument("--save_interval", type=int, default=2000)
    p.add_argument("--eval_interval", type=int, default=1000)
    p.add_argument("--num_proc", type=int, default=16)
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


def build_lm_dataset(args, tokenizer):
    """Tokenize the raw corpus and pack it into fixed-size blocks (cached on shared storage)."""
    cache_path = os.path.join(args.cache_dir, f"packed_{args.block_size}")
    if os.path.isdir(cache_path):
        logger.info("loading packed dataset from %s", cache_path)
        return load_from_disk(cache_path)

    files = sorted(glob.glob(os.path.join(args.text_dir, "*.jsonl")))
    raw = load_dataset("json", data_files=files, split="train")

    def tokenize(batch):
        return tokenizer([t + tokenizer.eos_token for t in batch["text"]], add_special_tokens=False)

    def group(batch):
        ids = list(itertools.chain.from_iterable(batch["input_ids"]))
        n = (len(ids) // args.block_size) * args.block_size
        blocks = [ids[i: i + args.block_size] for i in range(0, n, args.block_size)]
        return {"input_ids": blocks, "labels": [b[:] for b in blocks]}

    tokenized = raw.map(tokenize, batched=True, num_proc=args.num_proc, remove_columns=raw.column_names)
    packed = tokenized.map(group, batched=True, batch_size=2000, num_proc=args.num_proc,
                           remove_columns=tokenized.column_names)
    packed = packed.train_test_split(test_size=args.eval_ratio, seed=1234)
    os.makedirs(args.cache_dir, exist_ok=True)
    packed.save_to_disk(cache_path)
    return packed


@torch.no_grad()
def evaluate(engine, loader):
    engine.eval()
    loss_sum = torch.zeros((), device=engine.device, dtype=torch.float32)
    count = torch.zeros((), device=engine.device, dtype=torch.float32)
    for batch in loader:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        loss_sum += engine(**batch).loss.float()
        count += 1
    dist.all_reduce(loss_sum)
    dist.all_reduce(count)
    engine.train()
    return (loss_sum / count).item()


def main():
    args = get_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARN)

    tokenizer = AutoTokenizer.from_pretrained(args.base_model)
    data = build_lm_dataset(args, tokenizer)
    train_ds = data["train"].with_format("torch")
    eval_ds = data["test"].with_format("torch")
    logger.info("train blocks=%d eval blocks=%d", len(train_ds), len(eval_ds))

    model = AutoModelForCausalLM.from_pretrained(args.base_model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    mbs = engine.train_micro_batch_size_per_gpu()

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1234)
    train_loader = DataLoader(train_ds, batch_size=mbs, sampler=train_sampler,
                              collate_fn=default_data_collator, num_workers=4, pin_memory=True)
    eval_loader = DataLoader(eval_ds, batch_size=mbs, sampler=DistributedSampler(eval_ds, shuffle=False),
                             collate_fn=default_data_collator, num_workers=2)

    start_epoch = 0
    if os.path.exists(os.path.join(args.save_dir, "latest")):
        _, state = engine.load_checkpoint(args.save_dir)
        start_epoch = state["epoch"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            if not engine.is_gradient_accumulation_boundary():
                continue

            step = engine.global_steps
            if step % 10 == 0:
                logger.info("epoch %d step %d loss %.4f lr %.3e", epoch, step, loss.item(), engine.get_lr()[0])
            if step % args.eval_interval == 0:
                ev = evaluate(engine, eval_loader)
                logger.info("step %d eval_loss %.4f ppl %.3f", step, ev, math.exp(ev))
            if step % args.save_interval == 0:
                engine.save_checkpoint(args.save_dir, tag=f"global_step{step}", client_state={"epoch": epoch})

    engine.save_checkpoint(args.save_dir, tag="last", client_state={"epoch": args.epochs})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
