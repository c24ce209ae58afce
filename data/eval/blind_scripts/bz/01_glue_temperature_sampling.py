#!/usr/bin/env python
"""Multi-task fine-tuning of a shared encoder on several GLUE tasks.

Tasks are mixed with temperature sampling (p_i ~ n_i ** (1 / T)); each step
draws one task and runs a batch of that task only.

    torchrun --nproc_per_node=8 01_glue_temperature_sampling.py \
        --tasks sst2,mnli,qqp,rte --temperature 2.0 --output_dir runs/glue_mt
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModel, AutoTokenizer, DataCollatorWithPadding,
                          get_linear_schedule_with_warmup)

logger = logging.getLogger("glue_mt")

TASKS = {
    "sst2": {"keys": ("sentence", None), "num_labels": 2, "val": "validation"},
    "mnli": {"keys": ("premise", "hypothesis"), "num_labels": 3, "val": "validation_matched"},
    "qqp": {"keys": ("question1", "question2"), "num_labels": 2, "val": "validation"},
    "rte": {"keys": ("sentence1", "sentence2"), "num_labels": 2, "val": "validation"},
    "qnli": {"keys": ("question", "sentence"), "num_labels": 2, "val": "validation"},
}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", default="bert-base-uncased")
    p.add_argument("--tasks", default="sst2,mnli,qqp,rte")
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--batch_size", type=int, default=32, help="per GPU")
    p.add_argument("--max_len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--total_steps", type=int, default=60000)
    p.add_argument("--warmup_steps", type=int, default=3000)
    p.add_argument("--eval_every", type=int, default=5000)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--output_dir", default="runs/glue_mt")
    p.add_argument("--resume", default=None)
    return p.parse_args()


class MultiTaskModel(nn.Module):
    def __init__(self, model_name, task_labels, dropout=0.1):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(model_name)
        hidden = self.encoder.config.hidden_size
        self.dropout = nn.Dropout(dropout)
        self.heads = nn.ModuleDict({t: nn.Linear(hidden, n) for t, n in task_labels.items()})

    def forward(self, task, input_ids, attention_mask, token_type_ids=None):
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                           token_type_ids=token_type_ids)
        pooled = self.dropout(out.last_hidden_state[:, 0])
        return self.heads[task](pooled)


def build_datasets(tasks, tokenizer, max_len):
    train, val = {}, {}
    for task in tasks:
        spec = TASKS[task]
        raw = load_dataset("glue", task)
        k1, k2 = spec["keys"]

        def tok(batch):
            if k2 is None:
                return tokenizer(batch[k1], truncation=True, max_length=max_len)
            return tokenizer(batch[k1], batch[k2], truncation=True, max_length=max_len)

        cols = [c for c in raw["train"].column_names if c != "label"]
        train[task] = raw["train"].map(tok, batched=True, remove_columns=cols)
        val[task] = raw[spec["val"]].map(tok, batched=True, remove_columns=cols)
        train[task].set_format("torch")
        val[task].set_format("torch")
    return train, val


def infinite_loader(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
        epoch += 1


@torch.no_grad()
def evaluate(model, val_sets, collate, args, rank, world, device):
    model.eval()
    results = {}
    for task, ds in val_sets.items():
        shard = Subset(ds, list(range(rank, len(ds), world)))
        loader = DataLoader(shard, batch_size=128, collate_fn=collate,
                            num_workers=args.num_workers)
        stats = torch.zeros(2, device=device)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            logits = model(task, **batch)
            stats[0] += (logits.argmax(-1) == labels).sum()
            stats[1] += labels.numel()
        dist.all_reduce(stats)
        results[task] = (stats[0] / stats[1]).item()
    model.train()
    return results


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    # dropout / init noise may differ per rank, but task sampling must not
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    tasks = args.tasks.split(",")
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)

    # rank 0 builds the datasets cache first, the others then read it
    if rank != 0:
        dist.barrier()
    train_sets, val_sets = build_datasets(tasks, tokenizer, args.max_len)
    if rank == 0:
        dist.barrier()

    collate = DataCollatorWithPadding(tokenizer)
    samplers, streams = {}, {}
    for task in tasks:
        samplers[task] = DistributedSampler(train_sets[task], shuffle=True, seed=args.seed)
        loader = DataLoader(train_sets[task], batch_size=args.batch_size,
                            sampler=samplers[task], collate_fn=collate,
                            num_workers=args.num_workers, pin_memory=True, drop_last=True)
        streams[task] = infinite_loader(loader, samplers[task])

    sizes = np.array([len(train_sets[t]) for t in tasks], dtype=np.float64)
    probs = sizes ** (1.0 / args.temperature)
    probs = probs / probs.sum()
    logger.info("task probs: %s", dict(zip(tasks, probs.round(4).tolist())))

    model = MultiTaskModel(args.model_name, {t: TASKS[t]["num_labels"] for t in tasks}).to(device)
    # only the head of the sampled task takes part in a step
    model = DDP(model, device_ids=[local_rank], output_device=local_rank,
                find_unused_parameters=True)

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, args.total_steps)

    # same seed on every rank -> every rank draws the same task at each step
    task_rng = random.Random(args.seed)
    start_step = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        task_rng.setstate(ckpt["task_rng"])
        start_step = ckpt["step"]
        logger.info("resumed from %s at step %d", args.resume, start_step)

    os.makedirs(args.output_dir, exist_ok=True)
    model.train()
    running = {t: [] for t in tasks}
    t0 = time.time()
    for step in range(start_step, args.total_steps):
        task = task_rng.choices(tasks, weights=probs)[0]
        batch = next(streams[task])
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        labels = batch.pop("labels")

        logits = model(task, **batch)
        loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        running[task].append(loss.item())

        if rank == 0 and (step + 1) % 100 == 0:
            msg = " ".join(f"{t}={np.mean(v):.3f}" for t, v in running.items() if v)
            logger.info("step %d lr %.2e %s (%.1fs)", step + 1, scheduler.get_last_lr()[0],
                        msg, time.time() - t0)
            running = {t: [] for t in tasks}
            t0 = time.time()

        if (step + 1) % args.eval_every == 0 or step + 1 == args.total_steps:
            res = evaluate(model.module, val_sets, collate, args, rank, world, device)
            if rank == 0:
                logger.info("eval step %d: %s avg=%.4f", step + 1, res,
                            float(np.mean(list(res.values()))))
                torch.save({
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "task_rng": task_rng.getstate(),
                    "step": step + 1,
                    "args": vars(args),
                }, os.path.join(args.output_dir, f"step_{step + 1}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
