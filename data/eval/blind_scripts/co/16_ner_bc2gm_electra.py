"""BC2GM gene mention recognition with BioELECTRA, multi-GPU DDP training.

torchrun --nproc_per_node=4 16_ner_bc2gm_electra.py --output_dir runs/bc2gm-bioelectra

Keeps the best-dev weights in <output_dir>/best_model.pt and scores them on the test split at the end.
"""
import argparse
import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from seqeval.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification, get_linear_schedule_with_warmup

logger = logging.getLogger("bc2gm")


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name", default="kamalkraj/bioelectra-base-discriminator-pubmed")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--warmup_ratio", type=float, default=0.1)
    parser.add_argument("--max_length", type=int, default=256)
    parser.add_argument("--seed", type=int, default=13)
    return parser.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def tokenize_and_align(examples, tokenizer, max_length):
    tokenized = tokenizer(examples["tokens"], truncation=True, max_length=max_length, is_split_into_words=True)
    labels = []
    for i, tags in enumerate(examples["ner_tags"]):
        prev = None
        label_ids = []
        for word_id in tokenized.word_ids(batch_index=i):
            if word_id is None or word_id == prev:
                label_ids.append(-100)
            else:
                label_ids.append(tags[word_id])
            prev = word_id
        labels.append(label_ids)
    tokenized["labels"] = labels
    return tokenized


def decode(logits, labels, id2label):
    preds = logits.argmax(-1).cpu().tolist()
    labels = labels.cpu().tolist()
    y_pred, y_true = [], []
    for p_row, l_row in zip(preds, labels):
        y_pred.append([id2label[p] for p, l in zip(p_row, l_row) if l != -100])
        y_true.append([id2label[l] for l in l_row if l != -100])
    return y_pred, y_true


@torch.no_grad()
def evaluate_distributed(model, loader, id2label, device):
    model.eval()
    local = []
    for batch in loader:
        keys = batch.pop("key").tolist()
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(**batch).logits
        y_pred, y_true = decode(logits, batch["labels"], id2label)
        local.extend(zip(keys, y_pred, y_true))
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, local)
    model.train()
    by_key = {k: (p, t) for shard in shards for k, p, t in shard}
    order = sorted(by_key)
    return [by_key[k][1] for k in order], [by_key[k][0] for k in order]


@torch.no_grad()
def evaluate_single(model, loader, id2label, device):
    model.eval()
    y_true, y_pred = [], []
    for batch in loader:
        batch.pop("key")
        batch = {k: v.to(device) for k, v in batch.items()}
        p, t = decode(model(**batch).logits, batch["labels"], id2label)
        y_pred.extend(p)
        y_true.extend(t)
    return y_true, y_pred


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    set_seed(args.seed)

    raw = load_dataset("bc2gm_corpus")
    label_names = raw["train"].features["ner_tags"].feature.names
    id2label = dict(enumerate(label_names))
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)

    if rank != 0:
        dist.barrier()
    data = raw.map(tokenize_and_align, batched=True, remove_columns=raw["train"].column_names,
                   fn_kwargs={"tokenizer": tokenizer, "max_length": args.max_length})
    if rank == 0:
        dist.barrier()
    train_ds = data["train"]
    val_ds = data["validation"].add_column("key", list(range(len(data["validation"]))))
    test_ds = data["test"].add_column("key", list(range(len(data["test"]))))

    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collator,
                              num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=DistributedSampler(val_ds, shuffle=False),
                            collate_fn=collator)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model_name, num_labels=len(label_names), id2label=id2label,
        label2id={v: k for k, v in id2label.items()},
    ).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    num_training_steps = args.epochs * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * num_training_steps),
                                                num_training_steps)

    os.makedirs(args.output_dir, exist_ok=True)
    best_path = os.path.join(args.output_dir, "best_model.pt")
    best_f1 = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        total_loss = 0.0
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            total_loss += loss.item()
        logger.info("epoch %d train loss %.4f", epoch, total_loss / len(train_loader))

        y_true, y_pred = evaluate_distributed(model, val_loader, id2label, device)
        f1 = f1_score(y_true, y_pred)
        logger.info("epoch %d val F1 %.4f", epoch, f1)
        if f1 > best_f1:
            best_f1 = f1
            if rank == 0:
                torch.save(model.state_dict(), best_path)
                logger.info("new best, saved to %s", best_path)
        dist.barrier()

    if rank == 0:
        # score the best checkpoint on the test split with a fresh single-GPU model
        test_model = AutoModelForTokenClassification.from_pretrained(
            args.model_name, num_labels=len(label_names), id2label=id2label,
            label2id={v: k for k, v in id2label.items()},
        )
        test_model.load_state_dict(torch.load(best_path, map_location="cpu"))
        test_model.to(device)
        test_loader = DataLoader(test_ds, batch_size=64, shuffle=False, collate_fn=collator)
        y_true, y_pred = evaluate_single(test_model, test_loader, id2label, device)
        report = classification_report(y_true, y_pred, digits=4)
        logger.info("best val F1 %.4f\n%s", best_f1, report)
        with open(os.path.join(args.output_dir, "test_results.json"), "w") as f:
            json.dump({"best_val_f1": best_f1, "test_f1": f1_score(y_true, y_pred)}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
