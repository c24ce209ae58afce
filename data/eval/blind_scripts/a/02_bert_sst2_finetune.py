#!/usr/bin/env python
# Fine-tune bert-base-uncased on SST-2 (GLUE) with plain PyTorch DDP.
#
#   torchrun --nproc_per_node=4 finetune_sst2.py \
#       --train_file data/SST-2/train.tsv --dev_file data/SST-2/dev.tsv
import argparse
import csv
import logging
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                          get_linear_schedule_with_warmup)

logger = logging.getLogger(__name__)


class SSTDataset(Dataset):
    """Reads the GLUE SST-2 tsv: `sentence<TAB>label` with a header row."""

    def __init__(self, path):
        self.examples = []
        with open(path, encoding="utf-8") as f:
            reader = csv.reader(f, delimiter="\t", quotechar=None)
            next(reader)
            for row in reader:
                self.examples.append((row[0], int(row[1])))

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, idx):
        return self.examples[idx]


class Collator:
    def __init__(self, tokenizer, max_len):
        self.tokenizer = tokenizer
        self.max_len = max_len

    def __call__(self, batch):
        texts, labels = zip(*batch)
        enc = self.tokenizer(list(texts), padding=True, truncation=True,
                             max_length=self.max_len, return_tensors="pt")
        enc["labels"] = torch.tensor(labels, dtype=torch.long)
        return enc


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name_or_path", default="bert-base-uncased")
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--dev_file", required=True)
    parser.add_argument("--output_dir", default="outputs/sst2")
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument("--per_device_train_batch_size", type=int, default=32)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=128)
    parser.add_argument("--learning_rate", type=float, default=2e-5)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--warmup_ratio", type=float, default=0.06)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--logging_steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--fp16", action="store_true")
    return parser.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss_sum, correct, count
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        n = batch["labels"].size(0)
        stats[0] += out.loss * n
        stats[1] += (out.logits.argmax(-1) == batch["labels"]).sum()
        stats[2] += n
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARN)
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(args.model_name_or_path, num_labels=2)
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    collate = Collator(tokenizer, args.max_seq_length)
    train_ds = SSTDataset(args.train_file)
    dev_ds = SSTDataset(args.dev_file)
    dev_ds = Subset(dev_ds, list(range(rank, len(dev_ds), world_size)))

    train_loader = DataLoader(train_ds, batch_size=args.per_device_train_batch_size, shuffle=True,
                              collate_fn=collate, num_workers=2, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=args.per_device_eval_batch_size,
                            collate_fn=collate, num_workers=2)

    no_decay = ["bias", "LayerNorm.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.learning_rate)
    total_steps = len(train_loader) * args.num_train_epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, math.ceil(total_steps * args.warmup_ratio),
                                                total_steps)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    logger.info("***** Running training *****")
    logger.info("  Num examples = %d", len(train_ds))
    logger.info("  Num processes = %d", world_size)
    logger.info("  Total optimization steps = %d", total_steps)

    global_step, best_acc = 0, 0.0
    model.train()
    for epoch in range(args.num_train_epochs):
        running = torch.zeros(1, device=device)
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            running += loss.detach()
            if global_step % args.logging_steps == 0:
                dist.all_reduce(running)
                avg = running.item() / (args.logging_steps * world_size)
                logger.info("epoch %d step %d loss %.4f lr %.2e", epoch, global_step,
                            avg, scheduler.get_last_lr()[0])
                running.zero_()

        dev_loss, dev_acc = evaluate(model, dev_loader, device)
        logger.info("epoch %d dev_loss %.4f dev_acc %.4f", epoch, dev_loss, dev_acc)
        if rank == 0 and dev_acc > best_acc:
            best_acc = dev_acc
            os.makedirs(args.output_dir, exist_ok=True)
            model.module.save_pretrained(args.output_dir)
            tokenizer.save_pretrained(args.output_dir)
            torch.save(args, os.path.join(args.output_dir, "training_args.bin"))
        dist.barrier()

    logger.info("best dev acc %.4f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
