"""
Disorder mention recognition (ShARe/CLEF eHealth 2013 task 1 style) with a clinical RoBERTa and BIOES
tags. Contiguous mentions only; discontiguous spans are flattened by the preprocessing step.

    torchrun --nproc_per_node=4 --master_port=29622 10_ner_disorder_bioes.py \
        --train data/share_clef/train.jsonl --dev data/share_clef/dev.jsonl --out runs/disorder_bioes
"""
import argparse
import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification,
                          get_polynomial_decay_schedule_with_warmup)

TAGS = ["O", "B-Disorder", "I-Disorder", "E-Disorder", "S-Disorder"]
logger = logging.getLogger(__name__)


def bio_to_bioes(tags):
    out = []
    for i, t in enumerate(tags):
        nxt = tags[i + 1] if i + 1 < len(tags) else "O"
        if t.startswith("B-"):
            out.append(t if nxt.startswith("I-") else "S-" + t[2:])
        elif t.startswith("I-"):
            out.append(t if nxt.startswith("I-") else "E-" + t[2:])
        else:
            out.append(t)
    return out


def bioes_spans(seq):
    spans, start = set(), None
    for i, t in enumerate(seq):
        t = TAGS[t] if isinstance(t, int) else t
        if t.startswith("S-"):
            spans.add((i, i))
            start = None
        elif t.startswith("B-"):
            start = i
        elif t.startswith("E-") and start is not None:
            spans.add((start, i))
            start = None
        elif t == "O":
            start = None
    return spans


class DisorderDataset(Dataset):
    def __init__(self, path, tokenizer, max_length):
        self.examples = []
        for line in open(path, encoding="utf-8"):
            ex = json.loads(line)
            tags = bio_to_bioes(ex["tags"])
            enc = tokenizer(ex["tokens"], is_split_into_words=True, truncation=True, max_length=max_length)
            labels, prev = [], None
            for w in enc.word_ids():
                labels.append(-100 if w is None or w == prev else TAGS.index(tags[w]))
                prev = w
            self.examples.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                                  "labels": labels})

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, idx):
        return self.examples[idx]


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    preds, golds = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        keep = batch["labels"] != -100
        pred = logits.argmax(-1)
        for i in range(pred.size(0)):
            preds.append(pred[i][keep[i]])
            golds.append(batch["labels"][i][keep[i]])
    lengths = torch.tensor([len(p) for p in preds], device=device)
    flat_pred, flat_gold = torch.cat(preds), torch.cat(golds)

    world = dist.get_world_size()
    all_len = [torch.zeros_like(lengths) for _ in range(world)]
    all_pred = [torch.zeros_like(flat_pred) for _ in range(world)]
    all_gold = [torch.zeros_like(flat_gold) for _ in range(world)]
    dist.all_gather(all_len, lengths)
    dist.all_gather(all_pred, flat_pred)
    dist.all_gather(all_gold, flat_gold)

    tp = fp = fn = 0
    tok_correct = tok_total = 0
    for lens, p, g in zip(all_len, all_pred, all_gold):
        for ps, gs in zip(torch.split(p, lens.tolist()), torch.split(g, lens.tolist())):
            P, G = bioes_spans(ps.tolist()), bioes_spans(gs.tolist())
            tp += len(P & G)
            fp += len(P - G)
            fn += len(G - P)
            tok_correct += int((ps == gs).sum())
            tok_total += len(gs)
    prec = tp / max(tp + fp, 1)
    rec = tp / max(tp + fn, 1)
    f1 = 2 * prec * rec / max(prec + rec, 1e-12)
    return {"precision": prec, "recall": rec, "f1": f1, "token_acc": tok_correct / max(tok_total, 1)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--dev", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="roberta-base-clinical")
    parser.add_argument("--max_length", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--eval_batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--warmup_steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=2013)
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")
    seed_everything(args.seed)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)

    tokenizer = AutoTokenizer.from_pretrained(args.model, add_prefix_space=True)
    train_ds = DisorderDataset(args.train, tokenizer, args.max_length)
    dev_ds = DisorderDataset(args.dev, tokenizer, args.max_length)
    collator = DataCollatorForTokenClassification(tokenizer)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    # each rank scores every world_size-th dev sentence, results are gathered below
    dev_shard = Subset(dev_ds, range(rank, len(dev_ds), dist.get_world_size()))
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=2, pin_memory=True)
    dev_loader = DataLoader(dev_shard, batch_size=args.eval_batch_size, shuffle=False,
                            collate_fn=collator, num_workers=2)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model, num_labels=len(TAGS), id2label=dict(enumerate(TAGS)),
        label2id={t: i for i, t in enumerate(TAGS)})
    model = DDP(model.to(device), device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_polynomial_decay_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)

    best_f1 = 0.0
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        tot_loss = torch.zeros(1, device=device)
        for step, batch in enumerate(train_loader, 1):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            tot_loss += loss.detach()
        dist.all_reduce(tot_loss, op=dist.ReduceOp.AVG)
        logger.info("epoch %d mean train loss %.4f", epoch, tot_loss.item() / len(train_loader))

        scores = evaluate(model.module, dev_loader, device)
        logger.info("epoch %d dev P %.4f R %.4f F1 %.4f (token acc %.4f)", epoch, scores["precision"],
                    scores["recall"], scores["f1"], scores["token_acc"])
        if rank == 0 and scores["f1"] > best_f1:
            best_f1 = scores["f1"]
            model.module.save_pretrained(args.out)
            tokenizer.save_pretrained(args.out)
        dist.barrier()

    logger.info("best dev F1 %.4f", best_f1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
