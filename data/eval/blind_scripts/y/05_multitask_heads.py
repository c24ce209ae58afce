"""Multi-task fine-tuning on GLUE: one shared encoder, one head per task.

Each step draws a task (sampling proportional to sqrt(dataset size)) and runs
one batch of that task through the encoder and that task's head. The draw uses
a generator seeded identically on every rank, so all ranks run the same task.

    torchrun --nproc_per_node=4 mt_glue.py --model roberta-base --tasks sst2 mnli qqp stsb
"""
import argparse
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, DataCollatorWithPadding, get_linear_schedule_with_warmup

TASKS = {
    "sst2": {"keys": ("sentence", None), "num_labels": 2, "val": "validation"},
    "mnli": {"keys": ("premise", "hypothesis"), "num_labels": 3, "val": "validation_matched"},
    "qqp": {"keys": ("question1", "question2"), "num_labels": 2, "val": "validation"},
    "qnli": {"keys": ("question", "sentence"), "num_labels": 2, "val": "validation"},
    "stsb": {"keys": ("sentence1", "sentence2"), "num_labels": 1, "val": "validation"},
}


class MultiTaskModel(nn.Module):
    def __init__(self, name, tasks):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name, add_pooling_layer=False)
        h = self.encoder.config.hidden_size
        self.heads = nn.ModuleDict({
            t: nn.Sequential(nn.Dropout(0.1), nn.Linear(h, h), nn.Tanh(), nn.Dropout(0.1),
                             nn.Linear(h, TASKS[t]["num_labels"]))
            for t in tasks
        })

    def forward(self, task, input_ids, attention_mask):
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask)
        return self.heads[task](out.last_hidden_state[:, 0])


def task_loss(task, logits, labels):
    if TASKS[task]["num_labels"] == 1:
        return F.mse_loss(logits.squeeze(-1), labels.float())
    return F.cross_entropy(logits, labels)


def build_task_data(task, tokenizer, args):
    raw = load_dataset("glue", task)
    k1, k2 = TASKS[task]["keys"]

    def tok(batch):
        if k2 is None:
            return tokenizer(batch[k1], truncation=True, max_length=args.max_len)
        return tokenizer(batch[k1], batch[k2], truncation=True, max_length=args.max_len)

    keep = {"input_ids", "attention_mask", "label"}
    train = raw["train"].map(tok, batched=True)
    val = raw[TASKS[task]["val"]].map(tok, batched=True)
    train = train.remove_columns([c for c in train.column_names if c not in keep]).rename_column("label", "labels")
    val = val.remove_columns([c for c in val.column_names if c not in keep]).rename_column("label", "labels")
    return train, val


class Cycle:
    """Endless iterator over a DataLoader whose DistributedSampler is reseeded each pass."""

    def __init__(self, loader):
        self.loader, self.epoch = loader, 0
        self.it = None

    def next(self):
        if self.it is None:
            self.loader.sampler.set_epoch(self.epoch)
            self.it = iter(self.loader)
        try:
            return next(self.it)
        except StopIteration:
            self.epoch += 1
            self.it = None
            return self.next()


@torch.no_grad()
def evaluate(model, val_loaders, device):
    model.eval()
    results = {}
    for task, loader in val_loaders.items():
        stats = torch.zeros(2, device=device)
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            logits = model.module(task, batch["input_ids"], batch["attention_mask"])
            if TASKS[task]["num_labels"] == 1:
                stats[0] += -((logits.squeeze(-1) - batch["labels"]) ** 2).sum()
            else:
                stats[0] += (logits.argmax(-1) == batch["labels"]).sum()
            stats[1] += batch["labels"].numel()
        dist.all_reduce(stats)
        results[task] = (stats[0] / stats[1]).item()
    model.train()
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="roberta-base")
    ap.add_argument("--tasks", nargs="+", default=["sst2", "mnli", "qqp", "stsb"])
    ap.add_argument("--max_len", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--total_steps", type=int, default=60000)
    ap.add_argument("--eval_every", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--output_dir", default="out/mt_glue")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    collate = DataCollatorWithPadding(tokenizer)
    if rank != 0:
        dist.barrier()  # let rank 0 download and map first; others then hit the datasets cache
    data = {t: build_task_data(t, tokenizer, args) for t in args.tasks}
    if rank == 0:
        dist.barrier()

    train_iters, val_loaders, sizes = {}, {}, {}
    for t, (train, val) in data.items():
        train_loader = DataLoader(train, batch_size=args.batch_size, collate_fn=collate,
                                  sampler=DistributedSampler(train, shuffle=True, seed=args.seed),
                                  num_workers=2, drop_last=True)
        val_loaders[t] = DataLoader(val.shard(num_shards=world, index=rank, contiguous=True),
                                    batch_size=128, collate_fn=collate, num_workers=2)
        train_iters[t] = Cycle(train_loader)
        sizes[t] = len(train)

    names = list(args.tasks)
    weights = np.array([math.sqrt(sizes[t]) for t in names])
    weights /= weights.sum()
    if rank == 0:
        print({t: round(float(w), 3) for t, w in zip(names, weights)})

    model = MultiTaskModel(args.model, names).to(device)
    model = DDP(model, device_ids=[local_rank])

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * args.total_steps), args.total_steps)

    task_rng = random.Random(args.seed)  # same stream on all ranks
    running = torch.zeros(len(names), 2, device=device)
    for step in range(1, args.total_steps + 1):
        task = task_rng.choices(names, weights=weights)[0]
        batch = {k: v.to(device, non_blocking=True) for k, v in train_iters[task].next().items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(task, batch["input_ids"], batch["attention_mask"])
        loss = task_loss(task, logits.float(), batch["labels"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        running[names.index(task), 0] += loss.detach()
        running[names.index(task), 1] += 1

        if step % 200 == 0:
            dist.all_reduce(running)
            if rank == 0:
                msg = " ".join(f"{t}={(s / c.clamp(min=1)).item():.3f}" for t, (s, c) in zip(names, running))
                print(f"step {step} lr {scheduler.get_last_lr()[0]:.2e} {msg}")
            running.zero_()

        if step % args.eval_every == 0 or step == args.total_steps:
            res = evaluate(model, val_loaders, device)
            if rank == 0:
                print(f"[eval] step {step} " + " ".join(f"{t}={v:.4f}" for t, v in res.items()))
                os.makedirs(args.output_dir, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "step": step, "tasks": names},
                           os.path.join(args.output_dir, f"mt_step{step}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
