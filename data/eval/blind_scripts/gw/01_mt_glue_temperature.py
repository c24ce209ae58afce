#!/usr/bin/env python
"""Multi-task fine-tuning of a shared BERT encoder on several GLUE tasks.

One classification / regression head per task. Every optimisation step draws a
single task (temperature-scaled sampling over dataset sizes, the same draw on
every rank) and trains on a batch of that task only.

    torchrun --nproc_per_node=8 train_mt_glue.py --tasks sst2,mnli,qqp,stsb
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("mt_glue")

TASK_INFO = {
    "sst2": dict(keys=("sentence", None), num_labels=2, val="validation"),
    "mnli": dict(keys=("premise", "hypothesis"), num_labels=3, val="validation_matched"),
    "qqp": dict(keys=("question1", "question2"), num_labels=2, val="validation"),
    "qnli": dict(keys=("question", "sentence"), num_labels=2, val="validation"),
    "rte": dict(keys=("sentence1", "sentence2"), num_labels=2, val="validation"),
    "stsb": dict(keys=("sentence1", "sentence2"), num_labels=1, val="validation"),
}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bert-base-uncased")
    p.add_argument("--tasks", default="sst2,mnli,qqp,stsb")
    p.add_argument("--max_len", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--steps_per_epoch", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--warmup_ratio", type=float, default=0.06)
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--output_dir", default="checkpoints/mt_glue")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log_every", type=int, default=50)
    return p.parse_args()


class MultiTaskModel(nn.Module):
    def __init__(self, name, tasks):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name, add_pooling_layer=False)
        hidden = self.encoder.config.hidden_size
        self.dropout = nn.Dropout(0.1)
        self.heads = nn.ModuleDict({
            t: nn.Sequential(
                nn.Linear(hidden, hidden), nn.Tanh(), nn.Dropout(0.1),
                nn.Linear(hidden, TASK_INFO[t]["num_labels"]),
            )
            for t in tasks
        })

    def forward(self, task, input_ids, attention_mask, token_type_ids=None):
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                           token_type_ids=token_type_ids)
        cls = self.dropout(out.last_hidden_state[:, 0])
        return self.heads[task](cls)


def build_datasets(tasks, tokenizer, max_len):
    train, val = {}, {}
    for t in tasks:
        raw = load_dataset("glue", t)
        k1, k2 = TASK_INFO[t]["keys"]

        def tok(batch):
            texts = (batch[k1],) if k2 is None else (batch[k1], batch[k2])
            return tokenizer(*texts, truncation=True, max_length=max_len, padding="max_length")

        raw = raw.map(tok, batched=True, desc=f"tokenize {t}")
        raw.set_format("torch", columns=["input_ids", "attention_mask", "token_type_ids", "label"])
        train[t] = raw["train"]
        val[t] = raw[TASK_INFO[t]["val"]]
    return train, val


def task_loss(task, logits, labels):
    if TASK_INFO[task]["num_labels"] == 1:
        return F.mse_loss(logits.squeeze(-1), labels.float())
    return F.cross_entropy(logits, labels)


@torch.no_grad()
def evaluate(model, val_sets, batch_size, rank, world, device):
    model.eval()
    results = {}
    for t, ds in val_sets.items():
        # contiguous shard per rank, no padding so every example counts once
        shard = Subset(ds, list(range(rank, len(ds), world)))
        loader = DataLoader(shard, batch_size=batch_size, num_workers=2)
        if TASK_INFO[t]["num_labels"] == 1:
            # sums for Pearson: n, x, y, xx, yy, xy
            acc = torch.zeros(6, device=device, dtype=torch.float64)
        else:
            acc = torch.zeros(2, device=device, dtype=torch.float64)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            logits = model(t, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
            y = batch["label"]
            if TASK_INFO[t]["num_labels"] == 1:
                x = logits.squeeze(-1).double()
                y = y.double()
                acc += torch.stack([torch.tensor(float(len(x)), device=device, dtype=torch.float64),
                                    x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum()])
            else:
                acc[0] += (logits.argmax(-1) == y).sum()
                acc[1] += len(y)
        dist.all_reduce(acc)
        if TASK_INFO[t]["num_labels"] == 1:
            n, sx, sy, sxx, syy, sxy = acc.tolist()
            cov = sxy / n - (sx / n) * (sy / n)
            vx = sxx / n - (sx / n) ** 2
            vy = syy / n - (sy / n) ** 2
            results[t] = cov / max((vx * vy) ** 0.5, 1e-12)
        else:
            results[t] = (acc[0] / acc[1]).item()
    model.train()
    return results


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    tasks = args.tasks.split(",")
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    # rank 0 downloads and tokenises first, the others then hit its cache
    if rank != 0:
        dist.barrier()
    train_sets, val_sets = build_datasets(tasks, tokenizer, args.max_len)
    if rank == 0:
        dist.barrier()

    samplers = {t: DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
                for t, ds in train_sets.items()}
    loaders = {t: DataLoader(ds, batch_size=args.batch_size, sampler=samplers[t],
                             num_workers=2, pin_memory=True, drop_last=True)
               for t, ds in train_sets.items()}

    sizes = np.array([len(train_sets[t]) for t in tasks], dtype=np.float64)
    probs = sizes ** (1.0 / args.temperature)
    probs /= probs.sum()
    logger.info("task sampling probs: %s", dict(zip(tasks, probs.round(3).tolist())))

    model = MultiTaskModel(args.model, tasks).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total_steps = args.epochs * args.steps_per_epoch
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    iters = {t: iter(loaders[t]) for t in tasks}
    passes = {t: 0 for t in tasks}

    def next_batch(t):
        try:
            return next(iters[t])
        except StopIteration:
            passes[t] += 1
            samplers[t].set_epoch(passes[t])
            iters[t] = iter(loaders[t])
            return next(iters[t])

    os.makedirs(args.output_dir, exist_ok=True)
    best = -1.0
    model.train()
    for epoch in range(args.epochs):
        # same generator on every rank -> every rank trains the same task at a step
        rng = np.random.RandomState(args.seed * 1000 + epoch)
        schedule = rng.choice(len(tasks), size=args.steps_per_epoch, p=probs)
        running = torch.zeros(2, device=device)
        t0 = time.time()
        for step, ti in enumerate(schedule):
            task = tasks[ti]
            batch = next_batch(task)
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            logits = model(task, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
            loss = task_loss(task, logits, batch["label"])

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()

            running[0] += loss.detach()
            running[1] += 1
            if (step + 1) % args.log_every == 0:
                dist.all_reduce(running)
                logger.info("epoch %d step %d loss %.4f lr %.2e (%.1fs)", epoch, step + 1,
                            (running[0] / running[1]).item(), scheduler.get_last_lr()[0], time.time() - t0)
                running.zero_()

        scores = evaluate(model.module, val_sets, args.batch_size * 2, rank, world, device)
        mean_score = float(np.mean(list(scores.values())))
        logger.info("epoch %d eval %s mean %.4f", epoch, json.dumps(scores), mean_score)

        if rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "scores": scores}
            torch.save(state, os.path.join(args.output_dir, "last.pt"))
            if mean_score > best:
                best = mean_score
                torch.save(model.module.state_dict(), os.path.join(args.output_dir, "best_model.pt"))
        dist.barrier()

    logger.info("done, best mean score %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
