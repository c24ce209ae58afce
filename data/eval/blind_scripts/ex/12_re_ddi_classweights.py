"""
Drug-drug interaction classification (DDI-2013: mechanism / effect / advise / int / negative) with
PubMedBERT on entity-blinded sentences (@DRUG1$, @DRUG2$, @DRUGN$). Class-weighted cross-entropy because
~85% of the candidate pairs are negative. Reported metric: micro-F1 over the four positive classes.

    torchrun --nproc_per_node=2 12_re_ddi_classweights.py --data_dir data/ddi2013 --output_dir runs/ddi_pubmedbert
"""
import argparse
import csv
import logging
import os
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import classification_report, precision_recall_fscore_support
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

LABELS = ["DDI-false", "DDI-mechanism", "DDI-effect", "DDI-advise", "DDI-int"]
log = logging.getLogger("ddi")


class PairDataset(Dataset):
    def __init__(self, tsv, tokenizer, max_len):
        self.rows = []
        with open(tsv, newline="") as f:
            for r in csv.DictReader(f, delimiter="\t"):
                self.rows.append((r["sentence"], LABELS.index(r["label"])))
        self.tokenizer, self.max_len = tokenizer, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        text, y = self.rows[i]
        enc = self.tokenizer(text, truncation=True, max_length=self.max_len, padding="max_length",
                             return_tensors="pt")
        return {"input_ids": enc["input_ids"][0], "attention_mask": enc["attention_mask"][0],
                "labels": torch.tensor(y), "index": torch.tensor(i)}


def class_weights(labels, n_classes, smoothing=0.5):
    counts = Counter(labels)
    freq = np.array([counts.get(c, 1) for c in range(n_classes)], dtype=np.float64)
    w = (freq.sum() / freq) ** smoothing
    return torch.tensor(w / w.mean(), dtype=torch.float)


@torch.no_grad()
def evaluate(model, loader, device, n_examples):
    model.eval()
    idx, pred, gold = [], [], []
    for batch in loader:
        logits = model(input_ids=batch["input_ids"].to(device),
                       attention_mask=batch["attention_mask"].to(device)).logits
        idx += batch["index"].tolist()
        pred += logits.argmax(-1).tolist()
        gold += batch["labels"].tolist()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, list(zip(idx, pred, gold)))
    merged = {}
    for part in parts:
        for i, p, g in part:
            merged[i] = (p, g)          # padded duplicates collapse onto the same key
    assert len(merged) == n_examples
    pred = [merged[i][0] for i in sorted(merged)]
    gold = [merged[i][1] for i in sorted(merged)]
    p, r, f, _ = precision_recall_fscore_support(gold, pred, labels=[1, 2, 3, 4], average="micro", zero_division=0)
    return p, r, f, classification_report(gold, pred, labels=[1, 2, 3, 4], target_names=LABELS[1:],
                                          digits=4, zero_division=0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--model", default="microsoft/BiomedNLP-PubMedBERT-base-uncased-abstract")
    ap.add_argument("--max_len", type=int, default=192)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--warmup", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    is_main = dist.get_rank() == 0
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.add_tokens(["@DRUG1$", "@DRUG2$", "@DRUGN$"])
    train_ds = PairDataset(os.path.join(args.data_dir, "train.tsv"), tokenizer, args.max_len)
    dev_ds = PairDataset(os.path.join(args.data_dir, "dev.tsv"), tokenizer, args.max_len)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=64, sampler=DistributedSampler(dev_ds, shuffle=False),
                            num_workers=4)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=len(LABELS))
    model.resize_token_embeddings(len(tokenizer))
    model = DDP(model.to(device), device_ids=[local_rank])

    weights = class_weights([y for _, y in train_ds.rows], len(LABELS)).to(device)
    criterion = nn.CrossEntropyLoss(weight=weights)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup * total), total)
    log.info("class weights %s", [round(w, 3) for w in weights.tolist()])

    best_f = 0.0
    for epoch in range(args.epochs):
        model.train()
        epoch_loss = torch.zeros(2, device=device)
        for step, batch in enumerate(train_loader):
            logits = model(input_ids=batch["input_ids"].to(device, non_blocking=True),
                           attention_mask=batch["attention_mask"].to(device, non_blocking=True)).logits
            loss = criterion(logits, batch["labels"].to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            epoch_loss[0] += loss.detach()
            epoch_loss[1] += 1
        dist.all_reduce(epoch_loss)

        p, r, f, report = evaluate(model.module, dev_loader, device, len(dev_ds))
        log.info("epoch %d loss %.4f | dev P %.4f R %.4f F1 %.4f", epoch,
                 (epoch_loss[0] / epoch_loss[1]).item(), p, r, f)
        if is_main and f > best_f:
            best_f = f
            log.info("\n%s", report)
            model.module.save_pretrained(args.output_dir)
            tokenizer.save_pretrained(args.output_dir)
        dist.barrier()

    log.info("best dev micro-F1 %.4f", best_f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
