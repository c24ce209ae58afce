"""LoRA SFT for Qwen2.5 on chat-formatted jsonl (messages=[{role, content}, ...]).

    python -m torch.distributed.launch --nproc_per_node=4 01_qwen_lora_sft.py \
        --model Qwen/Qwen2.5-1.5B-Instruct --train data/sft_train.jsonl --val data/sft_val.jsonl
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
from peft import LoraConfig, get_peft_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

IGNORE_INDEX = -100


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-1.5B-Instruct")
    p.add_argument("--train", required=True)
    p.add_argument("--val", default=None)
    p.add_argument("--out", default="runs/qwen_lora")
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--bsz", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--warmup_ratio", type=float, default=0.03)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=int, default=32)
    p.add_argument("--lora_dropout", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


class ChatSFTDataset(Dataset):
    """Tokenises every conversation once and masks everything but assistant turns."""

    def __init__(self, path, tok, max_len):
        self.samples = []
        with open(path) as f:
            for line in f:
                msgs = json.loads(line)["messages"]
                ids, labels = [], []
                for i, m in enumerate(msgs):
                    prefix = tok.apply_chat_template(msgs[: i + 1], tokenize=True,
                                                     add_generation_prompt=False)
                    new = prefix[len(ids):]
                    ids = prefix
                    labels += new if m["role"] == "assistant" else [IGNORE_INDEX] * len(new)
                ids, labels = ids[:max_len], labels[:max_len]
                if any(l != IGNORE_INDEX for l in labels):
                    self.samples.append((ids, labels))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def make_collate(pad_id):
    def collate(batch):
        n = max(len(x[0]) for x in batch)
        input_ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), n), IGNORE_INDEX, dtype=torch.long)
        attn = torch.zeros((len(batch), n), dtype=torch.long)
        for j, (ids, lab) in enumerate(batch):
            input_ids[j, : len(ids)] = torch.tensor(ids)
            labels[j, : len(lab)] = torch.tensor(lab)
            attn[j, : len(ids)] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attn}
    return collate


def setup(args):
    if args.local_rank == -1:
        return 0, 1, torch.device("cuda")
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), torch.device("cuda", args.local_rank)


@torch.no_grad()
def evaluate(model, loader, device, world_size):
    model.eval()
    tot = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        out = model(**batch)
        n_tok = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
        tot[0] += out.loss.detach() * n_tok
        tot[1] += n_tok
    if world_size > 1:
        dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1].clamp(min=1)).item()


def main():
    args = parse_args()
    rank, world_size, device = setup(args)
    is_main = rank == 0
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    model.config.use_cache = False
    lora_cfg = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                          "gate_proj", "up_proj", "down_proj"],
                          task_type="CAUSAL_LM")
    model = get_peft_model(model, lora_cfg)
    if is_main:
        model.print_trainable_parameters()
    model.to(device)
    if world_size > 1:
        model = DDP(model, device_ids=[device.index], output_device=device.index)

    train_ds = ChatSFTDataset(args.train, tok, args.max_len)
    collate = make_collate(tok.pad_token_id)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed) if world_size > 1 else None
    train_dl = DataLoader(train_ds, batch_size=args.bsz, sampler=train_sampler,
                          shuffle=train_sampler is None, collate_fn=collate,
                          num_workers=2, pin_memory=True, drop_last=True)
    val_dl = None
    if args.val:
        val_ds = ChatSFTDataset(args.val, tok, args.max_len)
        val_sampler = DistributedSampler(val_ds, shuffle=False) if world_size > 1 else None
        val_dl = DataLoader(val_ds, batch_size=args.bsz, sampler=val_sampler, collate_fn=collate)

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    steps_per_epoch = len(train_dl) // args.grad_accum
    total_steps = steps_per_epoch * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(args.warmup_ratio * total_steps), total_steps)

    if is_main:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world_size} train={len(train_ds)} steps={total_steps}")

    step, t0 = 0, time.time()
    running = torch.zeros(1, device=device)
    model.train()
    for epoch in range(args.epochs):
        if train_sampler is not None:
            train_sampler.set_epoch(epoch)
        for it, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            last_micro = (it + 1) % args.grad_accum == 0
            sync_ctx = model.no_sync() if (world_size > 1 and not last_micro) else torch.enable_grad()
            with sync_ctx:
                loss = model(**batch).loss / args.grad_accum
                loss.backward()
            running += loss.detach()
            if not last_micro:
                continue
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % args.log_every == 0:
                if world_size > 1:
                    dist.all_reduce(running)
                    running /= world_size
                if is_main:
                    dt = (time.time() - t0) / args.log_every
                    print(f"ep {epoch} step {step}/{total_steps} loss {running.item() / args.log_every:.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {dt:.2f}s/it")
                running.zero_()
                t0 = time.time()

        if val_dl is not None:
            vloss = evaluate(model, val_dl, device, world_size)
            if is_main:
                print(f"epoch {epoch} val_loss {vloss:.4f} ppl {math.exp(min(vloss, 20)):.2f}")
        if is_main:
            unwrapped = model.module if world_size > 1 else model
            unwrapped.save_pretrained(os.path.join(args.out, f"epoch_{epoch}"))
            tok.save_pretrained(os.path.join(args.out, f"epoch_{epoch}"))
        if world_size > 1:
            dist.barrier()

    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
