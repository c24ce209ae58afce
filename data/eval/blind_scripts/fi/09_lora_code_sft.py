#!/usr/bin/env python
"""LoRA SFT of a code model on internal (instruction, solution) pairs.

Tokenised data is kept under --cache_dir so repeated sweeps skip preprocessing.

    torchrun --nproc_per_node=8 09_lora_code_sft.py \
        --model bigcode/starcoder2-7b --data data/code_pairs/*.jsonl \
        --cache_dir /scratch/$USER/tok_cache --output_dir runs/code-lora
"""
import argparse
import glob
import hashlib
import logging
import math
import os

import torch
import torch.distributed as dist
from datasets import load_dataset, load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    get_constant_schedule_with_warmup,
)
from peft import LoraConfig, get_peft_model
import mlflow

logger = logging.getLogger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bigcode/starcoder2-7b")
    p.add_argument("--data", nargs="+", required=True)
    p.add_argument("--cache_dir", default=os.path.expanduser("~/.cache/code_sft"))
    p.add_argument("--output_dir", default="runs/code-lora")
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--per_device_bs", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lora_r", type=int, default=32)
    p.add_argument("--val_size", type=int, default=2000)
    p.add_argument("--num_proc", type=int, default=16)
    p.add_argument("--experiment", default="code-lora-sft")
    return p.parse_args()


def cache_key(args):
    files = sorted(f for pattern in args.data for f in glob.glob(pattern))
    h = hashlib.sha1()
    for f in files:
        h.update(f.encode())
        h.update(str(os.path.getmtime(f)).encode())
    h.update(f"{args.model}|{args.max_len}".encode())
    return files, h.hexdigest()[:16]


def tokenize_fn(tokenizer, max_len):
    def fn(batch):
        out = {"input_ids": [], "attention_mask": [], "labels": []}
        for instr, sol in zip(batch["instruction"], batch["solution"]):
            prompt = f"<issue_start>{instr.strip()}\n<issue_comment>"
            p = tokenizer(prompt)["input_ids"]
            s = tokenizer(sol.rstrip() + "\n", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids = (p + s)[:max_len]
            out["input_ids"].append(ids)
            out["attention_mask"].append([1] * len(ids))
            out["labels"].append(([-100] * len(p) + s)[:max_len])
        return out
    return fn


def get_datasets(args, tokenizer):
    files, key = cache_key(args)
    path = os.path.join(args.cache_dir, key)
    if os.path.isdir(path):
        ds = load_from_disk(path)
    else:
        raw = load_dataset("json", data_files=files, split="train")
        raw = raw.filter(lambda ex: len(ex["solution"]) > 0)
        ds = raw.map(tokenize_fn(tokenizer, args.max_len), batched=True,
                     remove_columns=raw.column_names, num_proc=args.num_proc)
        ds = ds.train_test_split(test_size=args.val_size, seed=0)
        ds.save_to_disk(path)
    return ds["train"], ds["test"]


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch).loss
        n = (batch["labels"][:, 1:] != -100).sum()
        tot[0] += loss.float() * n
        tot[1] += n
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    torch.manual_seed(0)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    train_ds, val_ds = get_datasets(args, tokenizer)
    logger.info("train %d / val %d examples", len(train_ds), len(val_ds))

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_r * 2, lora_dropout=0.05,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"],
        task_type="CAUSAL_LM"))
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.per_device_bs, sampler=train_sampler,
                          collate_fn=collator, num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.per_device_bs, sampler=val_sampler, collate_fn=collator)

    opt = torch.optim.AdamW((p for p in model.parameters() if p.requires_grad), lr=args.lr)
    sched = get_constant_schedule_with_warmup(opt, num_warmup_steps=100)

    if rank == 0:
        mlflow.set_experiment(args.experiment)
        mlflow.start_run()
        mlflow.log_params({k: v for k, v in vars(args).items() if k != "data"})
        mlflow.log_param("world_size", world)

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 25 == 0:
                mlflow.log_metric("train_loss", loss.item(), step=step)

        val_loss = validate(model.module, val_dl, device)
        logger.info("epoch %d val loss %.4f", epoch, val_loss)
        if rank == 0:
            mlflow.log_metric("val_loss", val_loss, step=step)
            mlflow.log_metric("val_ppl", math.exp(val_loss), step=step)
            model.module.save_pretrained(os.path.join(args.output_dir, f"epoch{epoch}"))
        dist.barrier()

    if rank == 0:
        tokenizer.save_pretrained(os.path.join(args.output_dir, f"epoch{args.epochs - 1}"))
        mlflow.end_run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
