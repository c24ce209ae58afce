"""
Concept extraction (problem / test / treatment) on i2b2-2010 with Bio_ClinicalBERT.
Token classification with BIO tags; entity-level F1 via seqeval.

Launch (one node, 4 GPUs):
    torchrun --standalone --nproc_per_node=4 02_ner_clinicalbert.py --data_dir data/i2b2_2010
"""
import argparse
import json
import os
import random
from itertools import chain

import numpy as np
import torch
import torch.distributed as dist
from seqeval.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from transformers import (AutoModelForTokenClassification, AutoTokenizer,
                          DataCollatorForTokenClassification, get_linear_schedule_with_warmup)

LABELS = ["O", "B-problem", "I-problem", "B-test", "I-test", "B-treatment", "I-treatment"]
LABEL2ID = {l: i for i, l in enumerate(LABELS)}


def read_conll(path):
    sents, toks, tags = [], [], []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                if toks:
                    sents.append((toks, tags))
                    toks, tags = [], []
                continue
            tok, tag = line.split("\t")
            toks.append(tok)
            tags.append(tag)
    if toks:
        sents.append((toks, tags))
    return sents


class NerDataset(Dataset):
    def __init__(self, sents, tokenizer, max_len):
        self.features = []
        for words, tags in sents:
            enc = tokenizer(words, is_split_into_words=True, truncation=True, max_length=max_len)
            word_ids = enc.word_ids()
            labels, prev = [], None
            for wid in word_ids:
                if wid is None or wid == prev:
                    labels.append(-100)          # only the first sub-token of a word is scored
                else:
                    labels.append(LABEL2ID[tags[wid]])
                prev = wid
            enc["labels"] = labels
            self.features.append(dict(enc))

    def __len__(self):
        return len(self.features)

    def __getitem__(self, i):
        return self.features[i]


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    y_true, y_pred = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        pred = logits.argmax(-1).cpu().tolist()
        gold = batch["labels"].cpu().tolist()
        for p_seq, g_seq in zip(pred, gold):
            y_true.append([LABELS[g] for g in g_seq if g != -100])
            y_pred.append([LABELS[p] for p, g in zip(p_seq, g_seq) if g != -100])
    # every rank scored a disjoint slice of the dev set -> collect all sentences before scoring
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (y_true, y_pred))
    all_true = list(chain.from_iterable(g[0] for g in gathered))
    all_pred = list(chain.from_iterable(g[1] for g in gathered))
    return f1_score(all_true, all_pred), all_true, all_pred


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--model_name", default="emilyalsentzer/Bio_ClinicalBERT")
    ap.add_argument("--output_dir", default="checkpoints/i2b2_2010_ner")
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    train_sents = read_conll(os.path.join(args.data_dir, "train.tsv"))
    dev_sents = read_conll(os.path.join(args.data_dir, "dev.tsv"))
    train_ds = NerDataset(train_sents, tokenizer, args.max_len)
    dev_ds = NerDataset(dev_sents, tokenizer, args.max_len)
    dev_shard = Subset(dev_ds, list(range(rank, len(dev_ds), world)))

    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True,
                              collate_fn=collator, num_workers=2, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_shard, batch_size=64, shuffle=False, collate_fn=collator, num_workers=2)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model_name, num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)), label2id=LABEL2ID,
    ).to(device)
    model = DDP(model, device_ids=[local_rank])

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"train sentences {len(train_ds)}, dev {len(dev_ds)}, world {world}, steps {total_steps}")

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        running = torch.zeros(2, device=device)
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}")
        dist.all_reduce(running)

        f1, y_true, y_pred = evaluate(model.module, dev_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: train loss {(running[0] / running[1]).item():.4f}  dev F1 {f1:.4f}")
            if f1 > best:
                best = f1
                model.module.save_pretrained(args.output_dir)
                tokenizer.save_pretrained(args.output_dir)
                with open(os.path.join(args.output_dir, "dev_report.txt"), "w") as f:
                    f.write(classification_report(y_true, y_pred, digits=4))
                with open(os.path.join(args.output_dir, "train_args.json"), "w") as f:
                    json.dump(vars(args), f, indent=2)
        dist.barrier()

    if rank == 0:
        print(f"best dev F1 {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
