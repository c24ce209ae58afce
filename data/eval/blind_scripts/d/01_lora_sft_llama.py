#!/usr/bin/env python
"""LoRA instruction tuning (Alpaca-style JSON) with a plain PyTorch loop.

    torchrun --nproc_per_node=4 01_lora_sft_llama.py --data data/alpaca_cleaned.json
"""
import argparse
import json
import math
import os
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
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


@dataclass
class TrainConfig:
    model_name: str = "meta-llama/Llama-2-7b-hf"
    data: str = "data/alpaca_cleaned.json"
    output_dir: str = "out/llama2-7b-lora"
    max_len: int = 1024
    micro_batch_size: int = 4
    global_batch_size: int = 128
    lr: float = 2e-4
    weight_decay: float = 0.0
    epochs: int = 3
    warmup_ratio: float = 0.03
    val_size: int = 1000
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    eval_every: int = 100
    log_every: int = 10
    seed: int = 1234
    device: str = "cuda:0"
    wandb_project: str = ""


def parse_config() -> TrainConfig:
    parser = argparse.ArgumentParser()
    for f in fields(TrainConfig):
        parser.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
    return TrainConfig(**vars(parser.parse_args()))


class InstructionDataset(Dataset):
    def __init__(self, records, tokenizer, max_len):
        self.records = records
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.records)

    def __getitem__(self, idx):
        ex = self.records[idx]
        if ex.get("input"):
            prompt = PROMPT_WITH_INPUT.format(instruction=ex["instruction"], input=ex["input"])
        else:
            prompt = PROMPT_NO_INPUT.format(instruction=ex["instruction"])
        prompt_ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = self.tok(ex["output"], add_special_tokens=False)["input_ids"]
        ids = [self.tok.bos_token_id] + prompt_ids + answer_ids + [self.tok.eos_token_id]
        labels = [-100] * (1 + len(prompt_ids)) + answer_ids + [self.tok.eos_token_id]
        return torch.tensor(ids[: self.max_len]), torch.tensor(labels[: self.max_len])


def collate(batch, pad_id):
    ids, labels = zip(*batch)
    longest = max(x.size(0) for x in ids)
    input_ids = torch.full((len(ids), longest), pad_id, dtype=torch.long)
    label_ids = torch.full((len(ids), longest), -100, dtype=torch.long)
    attn = torch.zeros((len(ids), longest), dtype=torch.long)
    for i, (x, y) in enumerate(zip(ids, labels)):
        input_ids[i, : x.size(0)] = x
        label_ids[i, : y.size(0)] = y
        attn[i, : x.size(0)] = 1
    return {"input_ids": input_ids, "attention_mask": attn, "labels": label_ids}


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    totals = torch.zeros(2, device=device)  # summed token loss, token count
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        shift_logits = logits[:, :-1].float()
        shift_labels = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(
            shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
            ignore_index=-100, reduction="sum")
        totals[0] += loss
        totals[1] += (shift_labels != -100).sum()
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1].clamp(min=1)).item()


def main():
    cfg = parse_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0
    device = torch.device(cfg.device)

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    grad_accum = cfg.global_batch_size // (cfg.micro_batch_size * world_size)
    assert grad_accum >= 1, "global_batch_size too small for this many GPUs"

    tokenizer = AutoTokenizer.from_pretrained(cfg.model_name)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.unk_token

    with open(cfg.data) as f:
        records = json.load(f)
    random.Random(cfg.seed).shuffle(records)
    val_records, train_records = records[: cfg.val_size], records[cfg.val_size:]
    train_ds = InstructionDataset(train_records, tokenizer, cfg.max_len)
    val_ds = InstructionDataset(val_records, tokenizer, cfg.max_len)
    val_ds = Subset(val_ds, list(range(rank, len(val_ds), world_size)))

    collate_fn = lambda b: collate(b, tokenizer.pad_token_id)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.micro_batch_size, sampler=sampler,
                              collate_fn=collate_fn, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=cfg.micro_batch_size, shuffle=False,
                            collate_fn=collate_fn, num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(cfg.model_name, torch_dtype=torch.bfloat16)
    lora_cfg = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(model, lora_cfg)
    if is_main:
        model.print_trainable_parameters()
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    steps_per_epoch = len(train_loader) // grad_accum
    total_steps = steps_per_epoch * cfg.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * total_steps), total_steps)

    if is_main and cfg.wandb_project:
        import wandb
        wandb.init(project=cfg.wandb_project, config=vars(cfg))

    step = 0
    best_val = math.inf
    model.train()
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        running = torch.zeros(1, device=device)
        t0 = time.time()
        for i, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            last_micro = (i + 1) % grad_accum == 0
            ctx = nullcontext() if last_micro else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / grad_accum
                loss.backward()
            running += loss.detach()
            if not last_micro:
                continue

            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % cfg.log_every == 0:
                dist.all_reduce(running, op=dist.ReduceOp.AVG)
                if is_main:
                    avg = running.item() / cfg.log_every
                    dt = (time.time() - t0) / cfg.log_every
                    print(f"epoch {epoch} step {step}/{total_steps} loss {avg:.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {dt:.2f}s/step")
                    if cfg.wandb_project:
                        wandb.log({"train/loss": avg, "lr": scheduler.get_last_lr()[0]}, step=step)
                running.zero_()
                t0 = time.time()

            if step % cfg.eval_every == 0:
                val_loss = evaluate(model.module, val_loader, device)
                if is_main:
                    print(f"step {step}: val loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}")
                    if cfg.wandb_project:
                        wandb.log({"val/loss": val_loss}, step=step)
                    if val_loss < best_val:
                        best_val = val_loss
                        model.module.save_pretrained(os.path.join(cfg.output_dir, "best"))
                dist.barrier()

    if is_main:
        model.module.save_pretrained(os.path.join(cfg.output_dir, "final"))
        tokenizer.save_pretrained(os.path.join(cfg.output_dir, "final"))
        if cfg.wandb_project:
            wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
