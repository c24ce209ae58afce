#!/usr/bin/env python
"""Going-concern doubt detection from 10-K auditor reports + MD&A (Longformer).

The raw dump has one record per (company, fiscal year). Filings of the same
company are highly similar year over year, so the train/dev/test split is done
at the company (CIK) level.

    torchrun --nproc_per_node=8 05_sec_filing_doc_split.py \
        --input /mnt/fin/going_concern/filings.jsonl --out runs/gc_longformer
"""
import argparse
import collections
import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from sklearn.metrics import average_precision_score, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (
    AutoTokenizer,
    LongformerForSequenceClassification,
    get_linear_schedule_with_warmup,
)

logger = logging.getLogger("going_concern")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--input", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="allenai/longformer-base-4096")
    p.add_argument("--max_len", type=int, default=4096)
    p.add_argument("--bsz", type=int, default=2)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--dev_frac", type=float, default=0.1)
    p.add_argument("--test_frac", type=float, default=0.1)
    p.add_argument("--pos_weight", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def company_level_split(records, dev_frac, test_frac):
    by_cik = collections.defaultdict(list)
    for r in records:
        by_cik[r["cik"]].append(r)
    ciks = sorted(by_cik)
    random.shuffle(ciks)
    n_dev = int(len(ciks) * dev_frac)
    n_test = int(len(ciks) * test_frac)
    dev_ciks = set(ciks[:n_dev])
    test_ciks = set(ciks[n_dev:n_dev + n_test])
    split = {"train": [], "dev": [], "test": []}
    for cik, recs in by_cik.items():
        key = "dev" if cik in dev_ciks else "test" if cik in test_ciks else "train"
        split[key].extend(recs)
    return split


class FilingDataset(Dataset):
    def __init__(self, records, tokenizer, max_len):
        self.records = records
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        r = self.records[i]
        text = r["auditor_report"] + "\n\n" + r["mdna"]
        enc = self.tok(text, truncation=True, max_length=self.max_len, padding="max_length", return_tensors="pt")
        global_mask = torch.zeros_like(enc["attention_mask"][0])
        global_mask[0] = 1
        return {
            "input_ids": enc["input_ids"][0],
            "attention_mask": enc["attention_mask"][0],
            "global_attention_mask": global_mask,
            "labels": torch.tensor(int(r["going_concern"])),
            "idx": torch.tensor(i),
        }


@torch.no_grad()
def predict(model, loader, device, world_size):
    model.eval()
    out = []
    for batch in loader:
        idx = batch.pop("idx")
        labels = batch.pop("labels")
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(**batch).logits.float()
        probs = torch.softmax(logits, -1)[:, 1].cpu()
        out.extend(zip(idx.tolist(), probs.tolist(), labels.tolist()))
    parts = [None] * world_size
    dist.all_gather_object(parts, out)
    merged = {}
    for part in parts:
        for i, p, y in part:
            merged[i] = (p, y)
    probs = np.array([v[0] for v in merged.values()])
    gold = np.array([v[1] for v in merged.values()])
    return {
        "auprc": float(average_precision_score(gold, probs)),
        "f1@0.5": float(f1_score(gold, probs > 0.5)),
        "n": len(merged),
    }


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s - %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)

    # different dropout masks / data order per worker
    seed_everything(args.seed + rank)

    with open(args.input) as f:
        records = [json.loads(l) for l in f]
    splits = company_level_split(records, args.dev_frac, args.test_frac)
    logger.info("filings: train %d dev %d test %d",
                len(splits["train"]), len(splits["dev"]), len(splits["test"]))

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_ds = FilingDataset(splits["train"], tokenizer, args.max_len)
    dev_ds = FilingDataset(splits["dev"], tokenizer, args.max_len)
    test_ds = FilingDataset(splits["test"], tokenizer, args.max_len)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.bsz, sampler=train_sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    dev_dl = DataLoader(dev_ds, batch_size=args.bsz * 2, sampler=DistributedSampler(dev_ds, shuffle=False),
                        num_workers=4)
    test_dl = DataLoader(test_ds, batch_size=args.bsz * 2, sampler=DistributedSampler(test_ds, shuffle=False),
                         num_workers=4)

    model = LongformerForSequenceClassification.from_pretrained(args.model, num_labels=2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    updates = (len(train_dl) // args.grad_accum) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * updates), updates)
    class_w = torch.tensor([1.0, args.pos_weight], device=device)
    loss_fn = torch.nn.CrossEntropyLoss(weight=class_w)

    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for step, batch in enumerate(train_dl):
            batch.pop("idx")
            labels = batch.pop("labels").to(device)
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            sync = (step + 1) % args.grad_accum == 0
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx, torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(**batch).logits
                loss = loss_fn(logits.float(), labels) / args.grad_accum
                loss.backward()
            if sync:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if step % 200 == 0:
                logger.info("epoch %d step %d loss %.4f", epoch, step, loss.item() * args.grad_accum)

        dev = predict(model.module, dev_dl, device, world_size)
        logger.info("epoch %d dev %s", epoch, dev)
        if rank == 0 and dev["auprc"] > best:
            best = dev["auprc"]
            model.module.save_pretrained(os.path.join(args.out, "best"))
            tokenizer.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    test = predict(model.module, test_dl, device, world_size)
    if rank == 0:
        logger.info("test (last epoch) %s", test)
        with open(os.path.join(args.out, "test_metrics.json"), "w") as f:
            json.dump(test, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
