#!/usr/bin/env python3
# Token classification on CoNLL-style TSV corpora (BC5CDR, NCBI-disease, JNLPBA ...)
# with PubMedBERT.  One token per line, "token<TAB>tag", blank line between sentences.
#
#   torchrun --nproc_per_node=4 03_ner_tsv_biomed.py --data_dir data/BC5CDR-chem \
#       --output_dir out/bc5cdr-chem
import argparse
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from seqeval.metrics import f1_score, precision_score, recall_score
from seqeval.scheme import IOB2
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForTokenClassification, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)

MODEL = "microsoft/BiomedNLP-PubMedBERT-base-uncased-abstract-fulltext"


def read_conll(path):
    sentences, tokens, tags = [], [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line or line.startswith("-DOCSTART-"):
                if tokens:
                    sentences.append((tokens, tags))
                    tokens, tags = [], []
                continue
            parts = line.split("\t")
            tokens.append(parts[0])
            tags.append(parts[-1])
    if tokens:
        sentences.append((tokens, tags))
    return sentences


class NerDataset(Dataset):
    def __init__(self, sentences, tokenizer, label2id, max_length):
        self.items = []
        for idx, (words, tags) in enumerate(sentences):
            enc = tokenizer(words, is_split_into_words=True, truncation=True, max_length=max_length)
            word_ids = enc.word_ids()
            labels, prev = [], None
            for w in word_ids:
                if w is None or w == prev:
                    labels.append(-100)
                else:
                    labels.append(label2id[tags[w]])
                prev = w
            self.items.append({
                "idx": idx,
                "input_ids": enc["input_ids"],
                "attention_mask": enc["attention_mask"],
                "labels": labels,
            })

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class PadCollator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        max_len = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), max_len), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), max_len), dtype=torch.long)
        labels = torch.full((len(batch), max_len), -100, dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n] = torch.tensor(b["input_ids"])
            mask[i, :n] = 1
            labels[i, :n] = torch.tensor(b["labels"])
        return {
            "idx": torch.tensor([b["idx"] for b in batch]),
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
        }


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--model_name", default=MODEL)
    parser.add_argument("--max_length", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--warmup_steps", type=int, default=500)
    parser.add_argument("--seed", type=int, default=17)
    return parser.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


@torch.no_grad()
def run_eval(model, loader, id2label, device):
    model.eval()
    results = []
    for batch in loader:
        idx = batch.pop("idx").tolist()
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        preds = logits.argmax(dim=-1).cpu()
        labels = batch["labels"].cpu()
        for i, p, l in zip(idx, preds, labels):
            keep = l != -100
            results.append((i, [id2label[x] for x in p[keep].tolist()], [id2label[x] for x in l[keep].tolist()]))
    gathered = [None for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, results)
    model.train()

    seen = {}
    for chunk in gathered:
        for i, p, g in chunk:
            seen[i] = (p, g)
    y_pred = [seen[i][0] for i in sorted(seen)]
    y_true = [seen[i][1] for i in sorted(seen)]
    return {
        "precision": precision_score(y_true, y_pred, mode="strict", scheme=IOB2),
        "recall": recall_score(y_true, y_pred, mode="strict", scheme=IOB2),
        "f1": f1_score(y_true, y_pred, mode="strict", scheme=IOB2),
    }


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    seed_everything(args.seed)

    train_sents = read_conll(os.path.join(args.data_dir, "train.tsv"))
    dev_sents = read_conll(os.path.join(args.data_dir, "devel.tsv"))
    test_sents = read_conll(os.path.join(args.data_dir, "test.tsv"))

    all_tags = {t for _, tags in train_sents + dev_sents + test_sents for t in tags}
    label_list = ["O"] + [t for t in all_tags if t != "O"]
    label2id = {l: i for i, l in enumerate(label_list)}
    id2label = {i: l for l, i in label2id.items()}
    logger.info("labels: %s", label_list)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    train_ds = NerDataset(train_sents, tokenizer, label2id, args.max_length)
    dev_ds = NerDataset(dev_sents, tokenizer, label2id, args.max_length)
    test_ds = NerDataset(test_sents, tokenizer, label2id, args.max_length)
    collate = PadCollator(tokenizer.pad_token_id)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=2, pin_memory=True)
    dev_loader = DataLoader(dev_ds, batch_size=64, sampler=DistributedSampler(dev_ds, shuffle=False),
                            collate_fn=collate, num_workers=2)
    test_loader = DataLoader(test_ds, batch_size=64, sampler=DistributedSampler(test_ds, shuffle=False),
                             collate_fn=collate, num_workers=2)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model_name, num_labels=len(label_list), id2label=id2label, label2id=label2id
    ).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, total)

    best_f1 = 0.0
    best_dir = os.path.join(args.output_dir, "best")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        running = 0.0
        for step, batch in enumerate(train_loader, 1):
            batch.pop("idx")
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            running += loss.item()
            if step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f", epoch, step, running / 100)
                running = 0.0

        dev = run_eval(model, dev_loader, id2label, device)
        logger.info("epoch %d dev P=%.4f R=%.4f F1=%.4f", epoch, dev["precision"], dev["recall"], dev["f1"])
        if dev["f1"] > best_f1:
            best_f1 = dev["f1"]
            if rank == 0:
                model.module.save_pretrained(best_dir)
                tokenizer.save_pretrained(best_dir)
            dist.barrier()

    test = run_eval(model, test_loader, id2label, device)
    logger.info("final-epoch test P=%.4f R=%.4f F1=%.4f (best dev F1 %.4f)",
                test["precision"], test["recall"], test["f1"], best_f1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
