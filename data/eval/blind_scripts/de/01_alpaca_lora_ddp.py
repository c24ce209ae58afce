#!/usr/bin/env python
"""LoRA instruction tuning on Alpaca-style data with plain DDP.

Usage:
    torchrun --nproc_per_node=4 01_alpaca_lora_ddp.py \
        --model_name meta-llama/Llama-2-7b-hf --data_path data/alpaca_clean.json
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from peft import LoraConfig, get_peft_model

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", type=str, default="meta-llama/Llama-2-7b-hf")
    p.add_argument("--data_path", type=str, default="data/alpaca_clean.json")
    p.add_argument("--output_dir", type=str, default="out/alpaca-lora")
    p.add_argument("--max_len", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup_ratio", type=float, default=0.03)
    p.add_argument("--val_size", type=int, default=1000)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=int, default=32)
    p.add_argument("--lora_dropout", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


class AlpacaDataset(Dataset):
    def __init__(self, records, tokenizer, max_len):
        self.samples = []
        for rec in records:
            if rec.get("input"):
                prompt = PROMPT_WITH_INPUT.format(instruction=rec["instruction"], input=rec["input"])
            else:
                prompt = PROMPT_NO_INPUT.format(instruction=rec["instruction"])
            prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
            answer_ids = tokenizer(rec["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            input_ids = (prompt_ids + answer_ids)[:max_len]
            labels = ([-100] * len(prompt_ids) + answer_ids)[:max_len]
            if all(l == -100 for l in labels):
                continue
            self.samples.append((input_ids, labels))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        return self.samples[idx]


def make_collate(pad_id):
    def collate(batch):
        max_len = max(len(x[0]) for x in batch)
        ids = torch.full((len(batch), max_len), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), max_len), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), max_len), dtype=torch.long)
        for i, (inp, lab) in enumerate(batch):
            ids[i, : len(inp)] = torch.tensor(inp)
            labels[i, : len(lab)] = torch.tensor(lab)
            mask[i, : len(inp)] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return collate


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    total_loss = torch.zeros(1, device=device)
    total_tokens = torch.zeros(1, device=device)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        out = model(**batch)
        n = (batch["labels"][:, 1:] != -100).sum()
        total_loss += out.loss.float() * n
        total_tokens += n
    dist.all_reduce(total_loss)
    dist.all_reduce(total_tokens)
    model.train()
    return (total_loss / total_tokens).item()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    is_main = rank == 0
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token
    tokenizer.padding_side = "right"

    with open(args.data_path) as f:
        records = json.load(f)
    val_records = records[: args.val_size]
    train_records = records[args.val_size :]
    train_ds = AlpacaDataset(train_records, tokenizer, args.max_len)
    val_ds = AlpacaDataset(val_records, tokenizer, args.max_len)
    if is_main:
        print(f"train={len(train_ds)} val={len(val_ds)} world_size={world_size}")

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    collate = make_collate(tokenizer.pad_token_id)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=2, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                            collate_fn=collate, num_workers=2, pin_memory=True)

    model = AutoModelForCausalLM.from_pretrained(args.model_name, torch_dtype=torch.bfloat16)
    model.config.use_cache = False
    lora_cfg = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora_cfg)
    if is_main:
        model.print_trainable_parameters()
    model.to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.999))
    steps_per_epoch = len(train_loader) // args.grad_accum
    total_steps = steps_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    global_step = 0
    model.train()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(1, device=device)
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            out = model(**batch)
            loss = out.loss / args.grad_accum
            loss.backward()
            running += loss.detach()
            if (step + 1) % args.grad_accum != 0:
                continue
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            if global_step % args.log_every == 0:
                dist.all_reduce(running, op=dist.ReduceOp.AVG)
                if is_main:
                    dt = time.time() - t0
                    print(f"epoch {epoch} step {global_step}/{total_steps} loss {running.item() / args.log_every:.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {dt:.1f}s")
                running.zero_()
                t0 = time.time()

        val_loss = evaluate(model, val_loader, device)
        if is_main:
            print(f"epoch {epoch} val_loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}")
            save_dir = os.path.join(args.output_dir, f"epoch_{epoch}")
            model.module.save_pretrained(save_dir)
            tokenizer.save_pretrained(save_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
