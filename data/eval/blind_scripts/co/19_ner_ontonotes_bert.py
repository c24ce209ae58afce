#!/usr/bin/env python
"""OntoNotes 5.0 (CoNLL-2012, 18 entity types) NER with BERT-large.

Sentences are bucketed by length so dynamic padding wastes little compute.

    torchrun --nproc_per_node=8 19_ner_ontonotes_bert.py --output_dir runs/onto-bert-large
"""
import argparse
import logging
import math
import os
import time

import torch
import torch.distributed as dist
from datasets import Dataset, load_dataset
from seqeval.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification, get_linear_schedule_with_warmup

logger = logging.getLogger("onto")


class LengthBucketBatchSampler(Sampler):
    """Shuffle, cut into mega-batches of `bucket` batches, sort each mega-batch by length, shuffle batches."""

    def __init__(self, lengths, batch_size, bucket=50, seed=0):
        self.lengths = lengths
        self.batch_size = batch_size
        self.bucket = bucket
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        perm = torch.randperm(len(self.lengths), generator=g).tolist()
        mega = self.batch_size * self.bucket
        batches = []
        for i in range(0, len(perm), mega):
            chunk = sorted(perm[i:i + mega], key=lambda j: self.lengths[j], reverse=True)
            batches.extend(chunk[k:k + self.batch_size] for k in range(0, len(chunk), self.batch_size))
        order = torch.randperm(len(batches), generator=g).tolist()
        return iter([batches[i] for i in order])

    def __len__(self):
        return math.ceil(len(self.lengths) / self.batch_size)


def flatten_documents(split):
    tokens, tags = [], []
    for doc in split:
        for sent in doc["sentences"]:
            if sent["words"]:
                tokens.append(sent["words"])
                tags.append(sent["named_entities"])
    return {"tokens": tokens, "ner_tags": tags}


def tokenize(batch, tokenizer, max_length):
    enc = tokenizer(batch["tokens"], is_split_into_words=True, truncation=True, max_length=max_length)
    labels = []
    for i, tags in enumerate(batch["ner_tags"]):
        prev, row = None, []
        for w in enc.word_ids(i):
            row.append(-100 if w is None or w == prev else tags[w])
            prev = w
        labels.append(row)
    enc["labels"] = labels
    return enc


@torch.no_grad()
def evaluate(model, loader, names, device):
    model.eval()
    local = []
    for batch in loader:
        sid = batch.pop("sid").tolist()
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(**batch).logits
        preds = logits.argmax(-1).cpu()
        gold = batch["labels"].cpu()
        for s, p, g in zip(sid, preds, gold):
            m = g != -100
            local.append((s, [names[x] for x in p[m].tolist()], [names[x] for x in g[m].tolist()]))
    allparts = [None] * dist.get_world_size()
    dist.all_gather_object(allparts, local)
    model.train()
    merged = {s: (p, g) for part in allparts for s, p, g in part}
    keys = sorted(merged)
    y_pred = [merged[k][0] for k in keys]
    y_true = [merged[k][1] for k in keys]
    return f1_score(y_true, y_pred), classification_report(y_true, y_pred, digits=4)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_name", default="bert-large-cased")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--max_length", type=int, default=256)
    ap.add_argument("--seed", type=int, default=99)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    raw = load_dataset("conll2012_ontonotesv5", "english_v4")
    names = raw["train"].features["sentences"][0]["named_entities"].feature.names
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)

    if rank != 0:
        dist.barrier()
    splits = {}
    for split in ("train", "validation", "test"):
        flat = Dataset.from_dict(flatten_documents(raw[split]))
        splits[split] = flat.map(tokenize, batched=True, remove_columns=flat.column_names,
                                 fn_kwargs={"tokenizer": tokenizer, "max_length": args.max_length})
    if rank == 0:
        dist.barrier()

    train_ds = splits["train"]
    dev_ds = splits["validation"].add_column("sid", list(range(len(splits["validation"]))))
    test_ds = splits["test"].add_column("sid", list(range(len(splits["test"]))))

    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)
    lengths = [len(x) for x in train_ds["input_ids"]]
    batch_sampler = LengthBucketBatchSampler(lengths, args.batch_size, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_sampler=batch_sampler, collate_fn=collator, num_workers=4,
                              pin_memory=True)
    dev_loader = DataLoader(dev_ds, batch_size=64, sampler=DistributedSampler(dev_ds, shuffle=False),
                            collate_fn=collator)
    test_loader = DataLoader(test_ds, batch_size=64, sampler=DistributedSampler(test_ds, shuffle=False),
                             collate_fn=collator)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model_name, num_labels=len(names), id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)},
    ).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)
    logger.info("%d train sentences, %d GPUs, %d steps", len(train_ds), world, total)

    best = -1.0
    for epoch in range(args.epochs):
        batch_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 200 == 0:
                logger.info("epoch %d step %d/%d loss %.4f (%.1f it/s)", epoch, step, len(train_loader),
                            loss.item(), (step + 1) / (time.time() - t0))

        f1, report = evaluate(model, dev_loader, names, device)
        logger.info("epoch %d dev F1 %.4f", epoch, f1)
        if rank == 0 and f1 > best:
            best = f1
            model.module.save_pretrained(args.output_dir)
            tokenizer.save_pretrained(args.output_dir)
            with open(os.path.join(args.output_dir, "dev_report.txt"), "w") as fh:
                fh.write(report)
        dist.barrier()

    f1, report = evaluate(model, test_loader, names, device)
    logger.info("test F1 (last epoch) %.4f\n%s", f1, report)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
