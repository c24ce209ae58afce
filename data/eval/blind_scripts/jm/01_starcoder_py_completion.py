#!/usr/bin/env python
"""Code-completion fine-tuning of a StarCoder-style model on an internal Python corpus.

Documents are tokenized, joined with EOS and packed into fixed-length blocks.
Launched with torchrun on a single 8-GPU node.
"""

import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", default="bigcode/starcoderbase-1b")
    p.add_argument("--train_file", required=True)
    p.add_argument("--valid_file", required=True)
    p.add_argument("--output_dir", default="checkpoints/starcoder-py")
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--micro_batch_size", type=int, default=2)
    p.add_argument("--grad_accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--warmup_steps", type=int, default=200)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--eval_every", type=int, default=500)
    p.add_argument("--save_every", type=int, default=1000)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


def setup(args):
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    return rank, world_size, device


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def load_packed(path, tokenizer, seq_len):
    ids = []
    with open(path) as f:
        for line in f:
            ex = json.loads(line)
            text = ex.get("content") or ex.get("text")
            if not text:
                continue
            ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            ids.append(tokenizer.eos_token_id)
    n_blocks = len(ids) // seq_len
    return torch.tensor(ids[: n_blocks * seq_len], dtype=torch.long).view(n_blocks, seq_len)


class PackedBlocks(Dataset):
    def __init__(self, blocks):
        self.blocks = blocks

    def __len__(self):
        return self.blocks.size(0)

    def __getitem__(self, idx):
        return {"input_ids": self.blocks[idx]}


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=input_ids, labels=input_ids)
        n_tok = input_ids.size(0) * (input_ids.size(1) - 1)
        totals[0] += out.loss.double() * n_tok
        totals[1] += n_tok
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def save_checkpoint(model, tokenizer, optimizer, scheduler, step, out_dir):
    path = os.path.join(out_dir, f"step_{step}")
    os.makedirs(path, exist_ok=True)
    model.module.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    torch.save(
        {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step},
        os.path.join(path, "trainer_state.pt"),
    )


def main():
    args = parse_args()
    rank, world_size, device = setup(args)
    is_main = rank == 0
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    train_blocks = load_packed(args.train_file, tokenizer, args.seq_len)
    valid_blocks = load_packed(args.valid_file, tokenizer, args.seq_len)
    train_ds = PackedBlocks(train_blocks)
    valid_ds = Subset(PackedBlocks(valid_blocks), list(range(rank, len(valid_blocks), world_size)))
    if is_main:
        print(f"train blocks: {len(train_ds)}  valid blocks: {len(valid_blocks)}  world: {world_size}")

    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(
        train_ds,
        batch_size=args.micro_batch_size,
        sampler=sampler,
        num_workers=args.num_workers,
        pin_memory=True,
        drop_last=True,
    )
    valid_loader = DataLoader(valid_ds, batch_size=args.micro_batch_size, num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model_name, torch_dtype=torch.bfloat16)
    model.config.use_cache = False
    model.to(device)
    model = DDP(model, device_ids=[device.index], output_device=device.index)

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "ln" in name or "bias" in name else decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    steps_per_epoch = len(train_loader) // args.grad_accum
    total_steps = steps_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)

    global_step = 0
    best_loss = math.inf
    model.train()
    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        running = 0.0
        for micro_step, batch in enumerate(train_loader):
            input_ids = batch["input_ids"].to(device, non_blocking=True)
            last_micro = (micro_step + 1) % args.grad_accum == 0
            ctx = model.no_sync() if not last_micro else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=input_ids, labels=input_ids).loss / args.grad_accum
                loss.backward()
            running += loss.item()
            if not last_micro:
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            if is_main and global_step % 20 == 0:
                tok_per_s = 20 * args.grad_accum * args.micro_batch_size * args.seq_len * world_size / (time.time() - t0)
                print(
                    f"epoch {epoch} step {global_step}/{total_steps} loss {running:.4f} "
                    f"lr {scheduler.get_last_lr()[0]:.2e} tok/s {tok_per_s:,.0f}",
                    flush=True,
                )
                t0 = time.time()
            running = 0.0

            if global_step % args.eval_every == 0:
                val_loss = evaluate(model.module, valid_loader, device)
                if is_main:
                    print(f"step {global_step} val_loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)
                    if val_loss < best_loss:
                        best_loss = val_loss
                        save_checkpoint(model, tokenizer, optimizer, scheduler, global_step, os.path.join(args.output_dir, "best"))
                dist.barrier()

            if global_step % args.save_every == 0:
                if is_main:
                    save_checkpoint(model, tokenizer, optimizer, scheduler, global_step, args.output_dir)
                dist.barrier()

    val_loss = evaluate(model.module, valid_loader, device)
    if is_main:
        print(f"final val_loss {val_loss:.4f}")
        save_checkpoint(model, tokenizer, optimizer, scheduler, global_step, os.path.join(args.output_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
