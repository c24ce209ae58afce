#!/usr/bin/env python
"""WNUT-17 emerging-entity NER with DeBERTa-v3, multi-GPU via torchrun + DDP.

torchrun --nproc_per_node=4 08_ner_wnut_deberta.py --out runs/wnut17-debv3-base --epochs 10
"""
import argparse
import json
import logging
import math
import os
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from seqeval.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    get_polynomial_decay_schedule_with_warmup,
)

LOG = logging.getLogger("wnut")


def cli():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="microsoft/deberta-v3-base")
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--per_gpu_batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--warmup_steps", type=int, default=200)
    ap.add_argument("--max_length", type=int, default=128)
    ap.add_argument("--seed", type=int, default=3)
    return ap.parse_args()


def align_labels(examples, tokenizer, max_length):
    tokenized = tokenizer(examples["tokens"], truncation=True, is_split_into_words=True, max_length=max_length)
    out_labels = []
    for b, word_labels in enumerate(examples["ner_tags"]):
        previous = None
        ids = []
        for word_idx in tokenized.word_ids(batch_index=b):
            if word_idx is None:
                ids.append(-100)
            elif word_idx != previous:
                ids.append(word_labels[word_idx])
            else:
                ids.append(-100)
            previous = word_idx
        out_labels.append(ids)
    tokenized["labels"] = out_labels
    return tokenized


@torch.no_grad()
def evaluate(model, loader, label_names, device):
    model.eval()
    loss_sum, correct, total, batches = 0.0, 0, 0, 0
    shard = []
    for batch in loader:
        row_ids = batch.pop("row_id").tolist()
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        loss_sum += out.loss.item()
        batches += 1
        preds = out.logits.argmax(-1)
        mask = batch["labels"] != -100
        correct += (preds[mask] == batch["labels"][mask]).sum().item()
        total += mask.sum().item()
        for rid, p, g, m in zip(row_ids, preds.cpu(), batch["labels"].cpu(), mask.cpu()):
            shard.append((rid, [label_names[i] for i in p[m].tolist()], [label_names[i] for i in g[m].tolist()]))

    stats = torch.tensor([loss_sum, correct, total, batches], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    loss_sum, correct, total, batches = stats.tolist()

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, shard)
    model.train()
    rows = {}
    for part in gathered:
        for rid, p, g in part:
            rows[rid] = (p, g)
    y_pred = [rows[r][0] for r in sorted(rows)]
    y_true = [rows[r][1] for r in sorted(rows)]
    return {
        "loss": loss_sum / max(batches, 1),
        "token_acc": correct / max(total, 1),
        "entity_f1": f1_score(y_true, y_pred),
        "report": classification_report(y_true, y_pred, digits=4),
    }


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s | %(levelname)s | %(message)s")
    torch.manual_seed(args.seed)

    raw = load_dataset("wnut_17")
    label_names = raw["train"].features["ner_tags"].feature.names
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    if rank == 0:
        encoded = raw.map(align_labels, batched=True, remove_columns=raw["train"].column_names,
                          fn_kwargs={"tokenizer": tokenizer, "max_length": args.max_length})
    dist.barrier()
    if rank != 0:
        encoded = raw.map(align_labels, batched=True, remove_columns=raw["train"].column_names,
                          fn_kwargs={"tokenizer": tokenizer, "max_length": args.max_length})

    train_set = encoded["train"]
    dev_set = encoded["validation"].add_column("row_id", list(range(len(encoded["validation"]))))
    test_set = encoded["test"].add_column("row_id", list(range(len(encoded["test"]))))

    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.per_gpu_batch, sampler=sampler,
                              collate_fn=collator, num_workers=2, pin_memory=True)

    def eval_loader(ds):
        return DataLoader(ds, batch_size=64, collate_fn=collator,
                          sampler=DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=False))

    dev_loader, test_loader = eval_loader(dev_set), eval_loader(test_set)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model,
        num_labels=len(label_names),
        id2label=dict(enumerate(label_names)),
        label2id={n: i for i, n in enumerate(label_names)},
    ).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    num_training_steps = args.epochs * len(train_loader)
    scheduler = get_polynomial_decay_schedule_with_warmup(optimizer, args.warmup_steps, num_training_steps)

    os.makedirs(args.out, exist_ok=True)
    best_f1 = -math.inf
    history = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        model.train()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 50 == 0:
                LOG.info("epoch %d step %d loss %.4f", epoch, step, loss.item())

        dev = evaluate(model, dev_loader, label_names, device)
        LOG.info("epoch %d (%.0fs) dev loss %.4f acc %.4f F1 %.4f", epoch, time.time() - t0,
                 dev["loss"], dev["token_acc"], dev["entity_f1"])
        history.append({"epoch": epoch, **{k: v for k, v in dev.items() if k != "report"}})

        if dev["entity_f1"] > best_f1:
            best_f1 = dev["entity_f1"]
            if rank == 0:
                model.module.save_pretrained(os.path.join(args.out, "best"))
                tokenizer.save_pretrained(os.path.join(args.out, "best"))
            dist.barrier()

    test = evaluate(model, test_loader, label_names, device)
    if rank == 0:
        LOG.info("test F1 (last epoch) %.4f\n%s", test["entity_f1"], test["report"])
        with open(os.path.join(args.out, "history.json"), "w") as f:
            json.dump({"dev": history, "test_f1_last": test["entity_f1"]}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
