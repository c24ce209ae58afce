#!/usr/bin/env python
"""Fine-tune BERT-large on MNLI, multi-node.

Launched with one torchrun agent per node:

    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=1
    #SBATCH --gres=gpu:4
    #SBATCH --cpus-per-task=32

    head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=4 \
        --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d --rdzv_endpoint=$head:29500 \
        finetune_mnli.py --output_dir /proj/nlp/runs/mnli_$SLURM_JOB_ID
"""
import argparse
import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                          DataCollatorWithPadding, get_linear_schedule_with_warmup)

logger = logging.getLogger("mnli")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_name", default="/proj/nlp/hf_models/bert-large-uncased")
    ap.add_argument("--dataset_dir", default="/proj/nlp/data/glue_mnli_tokenized")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--per_device_batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup_ratio", type=float, default=0.06)
    ap.add_argument("--weight_decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--log_every", type=int, default=50)
    return ap.parse_args()


def get_dist_info():
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("SLURM_LOCALID", os.environ.get("LOCAL_RANK", 0)))
    return rank, world_size, local_rank


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def evaluate(model, loader, device):
    model.eval()
    totals = torch.zeros(3, device=device)  # loss sum, correct, count
    with torch.no_grad():
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            out = model(**batch)
            n = batch["labels"].size(0)
            totals[0] += out.loss.float() * n
            totals[1] += (out.logits.argmax(-1) == batch["labels"]).sum()
            totals[2] += n
    dist.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def main():
    args = get_args()
    rank, world_size, local_rank = get_dist_info()
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group(backend="nccl")

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(message)s")
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    ds = load_from_disk(args.dataset_dir)
    cols = ["input_ids", "token_type_ids", "attention_mask", "labels"]
    train_ds = ds["train"].with_format("torch", columns=cols)
    val_ds = ds["validation_matched"].with_format("torch", columns=cols)
    collate = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch_size,
                              sampler=train_sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=val_sampler,
                            collate_fn=collate, num_workers=4)

    model = AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=3)
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(
        optimizer, int(args.warmup_ratio * total_steps), total_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        logger.info("world_size=%d global_batch=%d steps=%d", world_size,
                    args.per_device_batch_size * world_size, total_steps)

    history = []
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % args.log_every == 0:
                logger.info("epoch %d step %d loss %.4f lr %.2e", epoch, step,
                            loss.item(), scheduler.get_last_lr()[0])

        val_loss, val_acc = evaluate(model, val_loader, device)
        logger.info("epoch %d val_loss %.4f val_acc %.4f", epoch, val_loss, val_acc)
        history.append({"epoch": epoch, "val_loss": val_loss, "val_acc": val_acc})

        if rank == 0:
            save_dir = os.path.join(args.output_dir, f"epoch_{epoch}")
            model.module.save_pretrained(save_dir)
            tokenizer.save_pretrained(save_dir)
            with open(os.path.join(args.output_dir, "history.json"), "w") as f:
                json.dump(history, f, indent=2)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
