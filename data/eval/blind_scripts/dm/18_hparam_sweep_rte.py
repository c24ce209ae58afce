"""Grid sweep of fine-tuning hyper-parameters for RoBERTa-base on GLUE RTE.

The grid (lr x batch size x warmup x seed) is dealt round-robin over the ranks;
each rank fine-tunes its share of the grid points one after another on its own
GPU.  At the end the per-point results are gathered and the best setting
(averaged over seeds) is reported and written to ``sweep_results.json``.

    torchrun --nproc_per_node=8 sweep_rte.py --task rte --out runs/sweep_rte
"""
import argparse
import itertools
import json
import os
import statistics
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                          DataCollatorWithPadding, get_linear_schedule_with_warmup, set_seed)

TASK_KEYS = {"rte": ("sentence1", "sentence2"), "mrpc": ("sentence1", "sentence2"),
             "cola": ("sentence", None), "stsb": ("sentence1", "sentence2")}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--task", default="rte", choices=list(TASK_KEYS))
    p.add_argument("--model", default="roberta-base")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-5, 2e-5, 3e-5])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32])
    p.add_argument("--warmups", type=float, nargs="+", default=[0.06, 0.1])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--out", default="runs/sweep_rte")
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


def build_datasets(args, tok):
    raw = load_dataset("glue", args.task)
    k1, k2 = TASK_KEYS[args.task]

    def enc(batch):
        texts = (batch[k1],) if k2 is None else (batch[k1], batch[k2])
        return tok(*texts, truncation=True, max_length=args.max_len)

    ds = raw.map(enc, batched=True, remove_columns=[c for c in raw["train"].column_names if c != "label"])
    ds = ds.rename_column("label", "labels")
    ds.set_format("torch")
    return ds["train"], ds["validation"]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    hits = n = 0
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(**batch).logits
        hits += (logits.argmax(-1) == batch["labels"]).sum().item()
        n += batch["labels"].numel()
    model.train()
    return hits / n


def run_point(point, args, train_ds, val_ds, collator, device):
    lr, bs, warmup, seed = point
    set_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2).to(device)
    train_loader = DataLoader(train_ds, batch_size=bs, shuffle=True, collate_fn=collator,
                              num_workers=2, drop_last=False)
    val_loader = DataLoader(val_ds, batch_size=64, collate_fn=collator)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-6)
    total = args.epochs * len(train_loader)
    sched = get_linear_schedule_with_warmup(opt, int(warmup * total), total)

    best = 0.0
    for _ in range(args.epochs):
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        best = max(best, evaluate(model, val_loader, device))
    del model, opt
    torch.cuda.empty_cache()
    return best


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    # rank 0 fills the datasets / hub caches, the others then read them
    if rank == 0:
        build_datasets(args, tok)
        AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2)
    dist.barrier()
    train_ds, val_ds = build_datasets(args, tok)
    collator = DataCollatorWithPadding(tok, pad_to_multiple_of=8)

    grid = list(itertools.product(args.lrs, args.batch_sizes, args.warmups, args.seeds))
    mine = grid[rank::world]
    results = []
    for point in mine:
        t0 = time.time()
        acc = run_point(point, args, train_ds, val_ds, collator, device)
        results.append({"lr": point[0], "batch_size": point[1], "warmup": point[2],
                        "seed": point[3], "acc": acc})
        print(f"[rank {rank}] lr={point[0]:.0e} bs={point[1]} warmup={point[2]} "
              f"seed={point[3]}: acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)

    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        all_results = [r for part in gathered for r in part]
        by_setting = defaultdict(list)
        for r in all_results:
            by_setting[(r["lr"], r["batch_size"], r["warmup"])].append(r["acc"])
        table = sorted(({"lr": k[0], "batch_size": k[1], "warmup": k[2],
                         "mean_acc": statistics.mean(v), "std_acc": float(np.std(v)), "n": len(v)}
                        for k, v in by_setting.items()), key=lambda d: -d["mean_acc"])
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sweep_results.json"), "w") as f:
            json.dump({"runs": all_results, "table": table}, f, indent=2)
        print("best setting:", table[0], flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
