#!/usr/bin/env python
"""RoBERTa-base on GLUE/SST-2, 8x AMD Instinct MI300X (ROCm 6, RCCL).

    torchrun --standalone --nproc_per_node=8 10_rocm_roberta_sst2.py \
        --output_dir /mnt/shared/exp/roberta_sst2 --bf16
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from datasets import load_dataset
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_linear_schedule_with_warmup,
)

logger = logging.getLogger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="roberta-base")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_length", type=int, default=128)
    p.add_argument("--train_batch_size", type=int, default=4, help="per GPU (global 32 on 8 GPUs)")
    p.add_argument("--eval_batch_size", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup_ratio", type=float, default=0.06)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def init_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)  # HIP device under ROCm
    dist.init_process_group(backend="nccl")
    return local_rank, dist.get_rank(), dist.get_world_size()


def evaluate(model, loader, device, bf16):
    model.eval()
    correct = 0
    total = 0
    loss_sum = 0.0
    with torch.no_grad():
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=bf16):
                out = model(**batch)
            loss_sum += out.loss.item() * batch["labels"].size(0)
            correct += (out.logits.argmax(-1) == batch["labels"]).sum().item()
            total += batch["labels"].size(0)
    stats = torch.tensor([loss_sum, correct, total], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    loss_sum, correct, total = stats.tolist()
    return loss_sum / total, correct / total


def main():
    args = parse_args()
    local_rank, rank, world_size = init_distributed()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)

    def tokenize(batch):
        return tokenizer(batch["sentence"], truncation=True, max_length=args.max_length)

    # rank 0 downloads and tokenizes first so the others only read the datasets cache
    if rank != 0:
        dist.barrier()
    raw = load_dataset("glue", "sst2")
    data = raw.map(tokenize, batched=True, remove_columns=["sentence", "idx"])
    data = data.rename_column("label", "labels")
    if rank == 0:
        dist.barrier()

    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(data["train"], shuffle=True, seed=args.seed)
    eval_sampler = DistributedSampler(data["validation"], shuffle=False, drop_last=True)
    train_loader = DataLoader(data["train"], batch_size=args.train_batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, pin_memory=True)
    eval_loader = DataLoader(data["validation"], batch_size=args.eval_batch_size, sampler=eval_sampler,
                             collate_fn=collator, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ["bias", "LayerNorm.weight"]
    params = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    num_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * num_steps), num_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        logger.info("global batch %d, %d optimizer steps", args.train_batch_size * world_size, num_steps)

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=args.bf16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 200 == 0:
                logger.info("epoch %d step %d loss %.4f", epoch, step, loss.item())

        val_loss, val_acc = evaluate(model.module, eval_loader, device, args.bf16)
        logger.info("epoch %d val_loss %.4f val_acc %.4f (%.0fs)", epoch, val_loss, val_acc, time.time() - start)
        if rank == 0 and val_acc > best_acc:
            best_acc = val_acc
            model.module.save_pretrained(args.output_dir)
            tokenizer.save_pretrained(args.output_dir)
        dist.barrier()

    logger.info("best val acc %.4f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
