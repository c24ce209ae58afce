#!/usr/bin/env python
"""Fine-tune a cross-encoder reranker with LoRA (query, passage) -> relevance.

Training pairs come from search logs: one positive and several hard negatives per query,
flattened into pointwise examples.

    torchrun --nproc_per_node=4 12_lora_reranker.py --model BAAI/bge-reranker-large \
        --train data/rerank/train.jsonl --dev data/rerank/dev.jsonl --out runs/reranker-lora
"""
import argparse
import json
import logging
import os
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup
from peft import LoraConfig, TaskType, get_peft_model
import wandb

logger = logging.getLogger("reranker")


class PairDataset(Dataset):
    """Flattens {"query", "pos", "negs": [...]} into (query, passage, label) rows."""

    def __init__(self, path, max_negs):
        self.rows = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                self.rows.append((ex["query"], ex["pos"], 1.0))
                for neg in ex["negs"][:max_negs]:
                    self.rows.append((ex["query"], neg, 0.0))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, idx):
        return self.rows[idx]


class PairCollator:
    def __init__(self, tokenizer, max_len):
        self.tok = tokenizer
        self.max_len = max_len

    def __call__(self, batch):
        queries, passages, labels = zip(*batch)
        enc = self.tok(list(queries), list(passages), padding=True, truncation="only_second",
                       max_length=self.max_len, return_tensors="pt")
        enc["labels"] = torch.tensor(labels, dtype=torch.float)
        return enc


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # bce sum, correct, count
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        logits = model(**batch).logits.squeeze(-1).float()
        stats[0] += F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
        stats[1] += ((logits > 0).float() == labels).sum()
        stats[2] += labels.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="BAAI/bge-reranker-large")
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--out", default="runs/reranker-lora")
    ap.add_argument("--max_len", type=int, default=384)
    ap.add_argument("--max_negs", type=int, default=7)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--wandb_project", default="reranker")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1)
    model = get_peft_model(model, LoraConfig(
        task_type=TaskType.SEQ_CLS, r=args.r, lora_alpha=2 * args.r, lora_dropout=0.1,
        target_modules=["query", "key", "value"]))
    if rank == 0:
        model.print_trainable_parameters()
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    train_ds = PairDataset(args.train, args.max_negs)
    dev_ds = PairDataset(args.dev, args.max_negs)
    collator = PairCollator(tok, args.max_len)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True,
                              collate_fn=collator, num_workers=4, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(Subset(dev_ds, range(rank, len(dev_ds), world)),
                            batch_size=args.batch_size * 2, collate_fn=collator, num_workers=2)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total), total)

    if rank == 0:
        wandb.init(project=args.wandb_project, config=vars(args) | {"world_size": world})

    best_acc = 0.0
    step = 0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(**batch).logits.squeeze(-1)
            loss = F.binary_cross_entropy_with_logits(logits.float(), labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, step=step)

        dev_loss, dev_acc = evaluate(model.module, dev_loader, device)
        logger.info("epoch %d dev loss %.4f acc %.4f", epoch, dev_loss, dev_acc)
        if rank == 0:
            wandb.log({"dev/loss": dev_loss, "dev/acc": dev_acc, "epoch": epoch}, step=step)
        if dev_acc > best_acc:
            best_acc = dev_acc
            if rank == 0:
                model.module.save_pretrained(os.path.join(args.out, "best"))
                tok.save_pretrained(os.path.join(args.out, "best"))
            dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "last"))
        wandb.summary["best_dev_acc"] = best_acc
        wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
