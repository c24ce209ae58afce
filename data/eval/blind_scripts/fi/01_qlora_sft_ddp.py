#!/usr/bin/env python
"""QLoRA supervised fine-tuning of a causal LM on instruction data (DDP).

    torchrun --nproc_per_node=4 01_qlora_sft_ddp.py \
        --model_name meta-llama/Llama-2-7b-hf \
        --train_file data/sft/train.jsonl --eval_file data/sft/eval.jsonl \
        --output_dir runs/qlora-sft
"""
import argparse
import contextlib
import json
import logging
import math
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    get_cosine_schedule_with_warmup,
    set_seed,
)
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

logger = logging.getLogger("qlora_sft")

PROMPT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n{context}### Response:\n"
)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", default="meta-llama/Llama-2-7b-hf")
    p.add_argument("--train_file", required=True)
    p.add_argument("--eval_file", required=True)
    p.add_argument("--output_dir", default="runs/qlora-sft")
    p.add_argument("--max_len", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup_ratio", type=float, default=0.03)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=int, default=32)
    p.add_argument("--lora_dropout", type=float, default=0.05)
    p.add_argument("--eval_every", type=int, default=200)
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


class InstructionDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        self.examples = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                ctx = f"### Input:\n{ex['input']}\n\n" if ex.get("input") else ""
                prompt = PROMPT.format(instruction=ex["instruction"], context=ctx)
                p_ids = tokenizer(prompt)["input_ids"]
                r_ids = tokenizer(ex["output"], add_special_tokens=False)["input_ids"]
                r_ids = r_ids + [tokenizer.eos_token_id]
                ids = (p_ids + r_ids)[:max_len]
                labels = ([-100] * len(p_ids) + r_ids)[:max_len]
                self.examples.append((ids, labels))

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, idx):
        return self.examples[idx]


def make_collate(pad_id):
    def collate(batch):
        longest = max(len(ids) for ids, _ in batch)
        input_ids, labels, mask = [], [], []
        for ids, lab in batch:
            pad = longest - len(ids)
            input_ids.append(ids + [pad_id] * pad)
            labels.append(lab + [-100] * pad)
            mask.append([1] * len(ids) + [0] * pad)
        return {
            "input_ids": torch.tensor(input_ids),
            "attention_mask": torch.tensor(mask),
            "labels": torch.tensor(labels),
        }
    return collate


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    loss_sum = torch.zeros(1, device=device)
    n_tok = torch.zeros(1, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        n = (batch["labels"][:, 1:] != -100).sum()
        loss_sum += out.loss.float() * n
        n_tok += n
    dist.all_reduce(loss_sum)
    dist.all_reduce(n_tok)
    model.train()
    return (loss_sum / n_tok.clamp(min=1)).item()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s",
    )
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True,
    )
    model = AutoModelForCausalLM.from_pretrained(
        args.model_name,
        quantization_config=bnb_config,
        torch_dtype=torch.bfloat16,
        device_map={"": args.local_rank},
    )
    model.config.use_cache = False
    model = prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    lora_config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                        "gate_proj", "up_proj", "down_proj"],
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora_config)
    if rank == 0:
        model.print_trainable_parameters()

    model = DDP(model, device_ids=[args.local_rank])

    train_ds = InstructionDataset(args.train_file, tokenizer, args.max_len)
    eval_ds = InstructionDataset(args.eval_file, tokenizer, args.max_len)
    eval_shard = Subset(eval_ds, list(range(rank, len(eval_ds), world_size)))
    collate = make_collate(tokenizer.pad_token_id)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=2, pin_memory=True)
    eval_loader = DataLoader(eval_shard, batch_size=args.batch_size, collate_fn=collate)

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    updates_per_epoch = math.ceil(len(train_loader) / args.grad_accum)
    total_updates = updates_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, int(args.warmup_ratio * total_updates), total_updates)

    logger.info("world_size=%d global batch=%d updates=%d",
                world_size, args.batch_size * args.grad_accum * world_size, total_updates)

    global_step = 0
    best_eval = float("inf")
    model.train()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = 0.0
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            boundary = (step + 1) % args.grad_accum == 0 or step + 1 == len(train_loader)
            ctx = contextlib.nullcontext() if boundary else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / args.grad_accum
                loss.backward()
            running += loss.item()
            if not boundary:
                continue

            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            if global_step % args.log_every == 0:
                logger.info("epoch %d step %d loss %.4f lr %.2e (%.1fs)", epoch, global_step,
                            running / args.log_every, scheduler.get_last_lr()[0], time.time() - t0)
                running = 0.0

            if global_step % args.eval_every == 0:
                eval_loss = evaluate(model.module, eval_loader, device)
                logger.info("eval loss %.4f ppl %.2f", eval_loss, math.exp(min(eval_loss, 20)))
                if eval_loss < best_eval:
                    best_eval = eval_loss
                    if rank == 0:
                        model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                    dist.barrier()

        if rank == 0:
            model.module.save_pretrained(os.path.join(args.output_dir, f"epoch-{epoch}"))
            tokenizer.save_pretrained(os.path.join(args.output_dir, f"epoch-{epoch}"))
        dist.barrier()

    eval_loss = evaluate(model.module, eval_loader, device)
    logger.info("final eval loss %.4f (best %.4f)", eval_loss, best_eval)
    if rank == 0:
        model.module.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
