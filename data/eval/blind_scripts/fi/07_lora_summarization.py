#!/usr/bin/env python
"""LoRA fine-tuning of a decoder-only LM for meeting-notes summarisation.

    torchrun --standalone --nproc_per_node=4 07_lora_summarization.py \
        --model Qwen/Qwen2-7B --train data/meetings/train.jsonl --dev data/meetings/dev.jsonl
"""
import argparse
import contextlib
import functools
import json
import logging
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from peft import LoraConfig, TaskType, get_peft_model

log = logging.getLogger("summ")

TEMPLATE = "Summarise the following meeting transcript.\n\nTranscript:\n{doc}\n\nSummary:\n"


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2-7B")
    p.add_argument("--train", required=True)
    p.add_argument("--dev", required=True)
    p.add_argument("--out", default="runs/summ-lora")
    p.add_argument("--max_len", type=int, default=4096)
    p.add_argument("--bs", type=int, default=1)
    p.add_argument("--accum", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


class SummDataset(Dataset):
    def __init__(self, path, tok, max_len):
        self.data = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                src = tok(TEMPLATE.format(doc=ex["transcript"]))["input_ids"]
                tgt = tok(ex["summary"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                ids = (src + tgt)[:max_len]
                labels = ([-100] * len(src) + tgt)[:max_len]
                self.data.append({"input_ids": ids, "labels": labels})

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def pad_batch(features, pad_id):
    n = max(len(f["input_ids"]) for f in features)
    out = {"input_ids": [], "attention_mask": [], "labels": []}
    for f in features:
        k = n - len(f["input_ids"])
        out["input_ids"].append(f["input_ids"] + [pad_id] * k)
        out["attention_mask"].append([1] * len(f["input_ids"]) + [0] * k)
        out["labels"].append(f["labels"] + [-100] * k)
    return {k: torch.tensor(v) for k, v in out.items()}


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


@torch.no_grad()
def dev_loss(model, loader, device):
    model.eval()
    s = torch.zeros(2, dtype=torch.float64, device=device)
    for b in loader:
        b = {k: v.to(device) for k, v in b.items()}
        n = (b["labels"][:, 1:] != -100).sum()
        if n == 0:
            continue
        s[0] += model(**b).loss.double() * n
        s[1] += n
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1].clamp(min=1)).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="[%(asctime)s] %(message)s")

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(task_type=TaskType.CAUSAL_LM, r=args.r,
                                             lora_alpha=2 * args.r, lora_dropout=0.05,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    train_ds = SummDataset(args.train, tok, args.max_len)
    dev_ds = SummDataset(args.dev, tok, args.max_len)
    collate = functools.partial(pad_batch, pad_id=tok.pad_token_id)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=collate,
                          num_workers=2, pin_memory=True)
    dev_dl = DataLoader(Subset(dev_ds, range(rank, len(dev_ds), world)), batch_size=args.bs,
                        collate_fn=collate)

    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    updates = math.ceil(len(train_dl) / args.accum) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * updates), updates)

    tb = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    upd = 0
    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, batch in enumerate(train_dl):
            if (batch["labels"] != -100).sum() == 0:
                continue
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            last_micro = (i + 1) % args.accum == 0 or (i + 1) == len(train_dl)
            with (contextlib.nullcontext() if last_micro else model.no_sync()):
                loss = model(**batch).loss / args.accum
                loss.backward()
            if not last_micro:
                continue
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            upd += 1
            if tb is not None and upd % 10 == 0:
                tb.add_scalar("train/loss", loss.item() * args.accum, upd)
                tb.add_scalar("train/lr", sched.get_last_lr()[0], upd)

        dl = dev_loss(model.module, dev_dl, device)
        log.info("epoch %d dev loss %.4f", epoch, dl)
        if tb is not None:
            tb.add_scalar("dev/loss", dl, upd)
        if dl < best:
            best = dl
            if rank == 0:
                model.module.save_pretrained(os.path.join(args.out, "best"))
                tok.save_pretrained(os.path.join(args.out, "best"))
            dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "last"))
        tb.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
