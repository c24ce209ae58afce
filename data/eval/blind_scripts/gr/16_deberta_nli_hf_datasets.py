#!/usr/bin/env python3
"""
NLI fine-tuning (premise/hypothesis -> entailment/neutral/contradiction) with
DeBERTa-v3-base, plain PyTorch DDP loop instead of the HF Trainer.

    torchrun --nproc_per_node=4 16_deberta_nli_hf_datasets.py \
        --train-file data/nli_train.jsonl --dev-file data/nli_dev.jsonl
"""
import argparse
import logging
import os
import random
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm.auto import tqdm
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_linear_schedule_with_warmup,
)

LABELS = ["entailment", "neutral", "contradiction"]
logger = logging.getLogger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-file", required=True)
    p.add_argument("--dev-file", required=True)
    p.add_argument("--model", default="microsoft/deberta-v3-base")
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16, help="per device")
    p.add_argument("--lr", type=float, default=2e-5, help="for a global batch of 64")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup-ratio", type=float, default=0.06)
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--output-dir", default="outputs/deberta_nli")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return local_rank


def cleanup():
    dist.destroy_process_group()


def is_main_process():
    return dist.get_rank() == 0


@contextmanager
def main_process_first():
    """Rank 0 runs the block first (and fills the datasets cache), the others then reuse it."""
    if not is_main_process():
        dist.barrier()
    try:
        yield
    finally:
        if is_main_process():
            dist.barrier()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def load_and_tokenize(args, tokenizer):
    label2id = {l: i for i, l in enumerate(LABELS)}

    def preprocess(batch):
        enc = tokenizer(batch["premise"], batch["hypothesis"], truncation=True, max_length=args.max_len)
        enc["labels"] = [label2id[l] for l in batch["label"]]
        return enc

    with main_process_first():
        raw = load_dataset("json", data_files={"train": args.train_file, "dev": args.dev_file})
        raw = raw.filter(lambda ex: ex["label"] in label2id)
        tokenized = raw.map(preprocess, batched=True, num_proc=8,
                            remove_columns=raw["train"].column_names, desc="tokenize")
    return tokenized["train"], tokenized["dev"]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        stats[0] += out.loss.double() * batch["labels"].numel()
        stats[1] += (out.logits.argmax(-1) == batch["labels"]).sum()
        stats[2] += batch["labels"].numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse_args()
    local_rank = setup()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if is_main_process() else logging.ERROR,
                        format="%(asctime)s %(name)s %(message)s")
    seed_everything(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_ds, dev_ds = load_and_tokenize(args, tokenizer)
    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, pin_memory=True)
    # every dev example exactly once; shard sizes may differ by one
    dev_shard = Subset(dev_ds, list(range(rank, len(dev_ds), world_size)))
    dev_loader = DataLoader(dev_shard, batch_size=64, collate_fn=collator, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)), label2id={l: i for i, l in enumerate(LABELS)})
    if args.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * (args.batch_size * world_size) / 64
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    num_update_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * num_update_steps),
                                                num_update_steps)
    logger.info("train=%d dev=%d world=%d lr=%.2e steps/rank=%d",
                len(train_ds), len(dev_ds), world_size, lr, num_update_steps)

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in tqdm(train_loader, disable=not is_main_process(), desc=f"epoch {epoch}"):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

        # shards are uneven, so run the bare module (no DDP hooks) for eval
        dev_loss, dev_acc = evaluate(model.module, dev_loader, device)
        logger.info("epoch %d: dev_loss=%.4f dev_acc=%.4f", epoch, dev_loss, dev_acc)

        if is_main_process() and dev_acc > best_acc:
            best_acc = dev_acc
            model.module.save_pretrained(args.output_dir)
            tokenizer.save_pretrained(args.output_dir)
            logger.info("new best %.4f saved to %s", best_acc, args.output_dir)
        dist.barrier()

    cleanup()


if __name__ == "__main__":
    main()
