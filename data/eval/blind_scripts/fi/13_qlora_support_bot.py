#!/usr/bin/env python
"""QLoRA fine-tune of the support assistant on resolved ticket threads.

    torchrun --nproc_per_node=8 13_qlora_support_bot.py \
        --model_name_or_path mistralai/Mistral-7B-Instruct-v0.2 \
        --dataset_dir data/tickets --output_dir runs/support-qlora
"""
import argparse
import contextlib
import functools
import json
import logging
import math
import os
import sys

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
import wandb

logger = logging.getLogger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name_or_path", default="mistralai/Mistral-7B-Instruct-v0.2")
    p.add_argument("--dataset_dir", required=True)
    p.add_argument("--output_dir", default="runs/support-qlora")
    p.add_argument("--max_seq_length", type=int, default=2048)
    p.add_argument("--per_device_train_batch_size", type=int, default=2)
    p.add_argument("--per_device_eval_batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=8)
    p.add_argument("--learning_rate", type=float, default=2e-4)
    p.add_argument("--num_train_epochs", type=int, default=3)
    p.add_argument("--warmup_ratio", type=float, default=0.03)
    p.add_argument("--gradient_checkpointing", action="store_true", default=True)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=int, default=32)
    p.add_argument("--lora_dropout", type=float, default=0.05)
    p.add_argument("--logging_steps", type=int, default=10)
    p.add_argument("--eval_steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--run_name", default=None)
    return p.parse_args()


class TicketDataset(Dataset):
    """Each line: {"messages": [{"role": "user"|"assistant", "content": ...}, ...]}.
    Only assistant turns are supervised."""

    def __init__(self, path, tokenizer, max_len):
        self.samples = []
        with open(path) as f:
            for line in f:
                msgs = json.loads(line)["messages"]
                ids, labels = [], []
                for i, m in enumerate(msgs):
                    prefix = tokenizer.apply_chat_template(msgs[: i + 1], tokenize=True)
                    new = prefix[len(ids):]
                    ids.extend(new)
                    labels.extend(new if m["role"] == "assistant" else [-100] * len(new))
                self.samples.append((ids[:max_len], labels[:max_len]))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def collate(batch, pad_id):
    width = max(len(x) for x, _ in batch)
    out = {"input_ids": [], "attention_mask": [], "labels": []}
    for x, y in batch:
        pad = width - len(x)
        out["input_ids"].append(x + [pad_id] * pad)
        out["attention_mask"].append([1] * len(x) + [0] * pad)
        out["labels"].append(y + [-100] * pad)
    return {k: torch.tensor(v) for k, v in out.items()}


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    num, den = torch.zeros((), device=device), torch.zeros((), device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch).loss
        n = (batch["labels"][:, 1:] != -100).sum()
        num += loss.float() * n
        den += n
    dist.all_reduce(num)
    dist.all_reduce(den)
    model.train()
    return (num / den.clamp(min=1)).item()


def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s")
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    tokenizer.pad_token = tokenizer.unk_token
    tokenizer.padding_side = "right"

    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True,
    )
    model = AutoModelForCausalLM.from_pretrained(
        args.model_name_or_path,
        quantization_config=bnb_config,
        torch_dtype=torch.bfloat16,
        device_map={"": local_rank},
    )
    model.config.use_cache = False
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing)

    peft_config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        bias="none",
        task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    model = get_peft_model(model, peft_config)
    if rank == 0:
        model.print_trainable_parameters()
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    train_ds = TicketDataset(os.path.join(args.dataset_dir, "train.jsonl"), tokenizer, args.max_seq_length)
    eval_ds = TicketDataset(os.path.join(args.dataset_dir, "eval.jsonl"), tokenizer, args.max_seq_length)
    col = functools.partial(collate, pad_id=tokenizer.pad_token_id)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.per_device_train_batch_size, sampler=train_sampler,
                              collate_fn=col, num_workers=2, pin_memory=True)
    eval_loader = DataLoader(Subset(eval_ds, range(rank, len(eval_ds), world_size)),
                             batch_size=args.per_device_eval_batch_size, collate_fn=col)

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, weight_decay=0.0)
    num_update_steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    max_steps = num_update_steps_per_epoch * args.num_train_epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, math.ceil(args.warmup_ratio * max_steps), max_steps)

    if rank == 0:
        wandb.init(project="support-assistant", name=args.run_name, config=vars(args))

    global_step = 0
    for epoch in range(args.num_train_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            do_step = (step + 1) % args.gradient_accumulation_steps == 0 or step + 1 == len(train_loader)
            with contextlib.nullcontext() if do_step else model.no_sync():
                loss = model(**batch).loss / args.gradient_accumulation_steps
                loss.backward()
            if not do_step:
                continue
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, 0.3)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            if rank == 0 and global_step % args.logging_steps == 0:
                wandb.log({"train/loss": loss.item() * args.gradient_accumulation_steps,
                           "train/grad_norm": grad_norm.item(),
                           "train/lr": scheduler.get_last_lr()[0],
                           "train/epoch": epoch + step / len(train_loader)}, step=global_step)

            if global_step % args.eval_steps == 0:
                eval_loss = evaluate(model.module, eval_loader, device)
                logger.info("step %d eval_loss %.4f", global_step, eval_loss)
                if rank == 0:
                    wandb.log({"eval/loss": eval_loss, "eval/ppl": math.exp(eval_loss)}, step=global_step)

        if rank == 0:
            ckpt = os.path.join(args.output_dir, f"checkpoint-epoch{epoch}")
            model.module.save_pretrained(ckpt)
            tokenizer.save_pretrained(ckpt)
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
