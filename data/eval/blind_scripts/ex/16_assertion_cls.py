# -*- coding: utf-8 -*-
"""
Assertion status classification of medical problems (i2b2-2010 assertion task):
present / absent / possible / conditional / hypothetical / associated_with_someone_else.

Input: the sentence with the problem wrapped in [entity] ... [/entity]; a BlueBERT encoder and a
softmax head over the [CLS] + mean-pooled entity tokens.

Usage:
    torchrun --nproc_per_node=4 16_assertion_cls.py --train data/assert/train.tsv --dev data/assert/dev.tsv
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

CLASSES = ["present", "absent", "possible", "conditional", "hypothetical", "associated_with_someone_else"]


def get_parser():
    parser = argparse.ArgumentParser(description="i2b2 assertion classifier")
    parser.add_argument("--train", type=str, required=True)
    parser.add_argument("--dev", type=str, required=True)
    parser.add_argument("--bert", type=str, default="bionlp/bluebert_pubmed_mimic_uncased_L-12_H-768_A-12")
    parser.add_argument("--save", type=str, default="models/assertion")
    parser.add_argument("--max_len", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


class AssertionData(Dataset):
    def __init__(self, path, tokenizer, max_len):
        self.samples = []
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                text, label = line.rstrip("\n").split("\t")
                enc = tokenizer(text, truncation=True, max_length=max_len, padding="max_length")
                ids = enc["input_ids"]
                start = tokenizer.convert_tokens_to_ids("[entity]")
                end = tokenizer.convert_tokens_to_ids("[/entity]")
                ent_mask = [0] * len(ids)
                if start in ids:
                    s = ids.index(start)
                    e = ids.index(end) if end in ids else len(ids) - 1
                    for k in range(s + 1, e):
                        ent_mask[k] = 1
                self.samples.append((ids, enc["attention_mask"], ent_mask, CLASSES.index(label)))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        ids, am, em, y = self.samples[idx]
        return torch.tensor(ids), torch.tensor(am), torch.tensor(em, dtype=torch.float), torch.tensor(y)


class AssertionModel(nn.Module):
    def __init__(self, bert_name, vocab_size, n_classes):
        super().__init__()
        self.bert = AutoModel.from_pretrained(bert_name, add_pooling_layer=False)
        self.bert.resize_token_embeddings(vocab_size)
        hid = self.bert.config.hidden_size
        self.dropout = nn.Dropout(0.1)
        self.classifier = nn.Linear(2 * hid, n_classes)

    def forward(self, ids, am, em):
        h = self.bert(input_ids=ids, attention_mask=am).last_hidden_state
        ent = (h * em.unsqueeze(-1)).sum(1) / em.sum(1, keepdim=True).clamp(min=1.0)
        return self.classifier(self.dropout(torch.cat([h[:, 0], ent], -1)))


def evaluate(model, loader, device):
    model.eval()
    preds, golds = [], []
    with torch.no_grad():
        for ids, am, em, y in loader:
            logits = model(ids.to(device), am.to(device), em.to(device))
            preds.append(logits.argmax(-1))
            golds.append(y.to(device))
    preds, golds = torch.cat(preds), torch.cat(golds)
    size = torch.tensor([preds.numel()], device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    max_n = int(max(s.item() for s in sizes))
    pad = lambda t: torch.cat([t, t.new_full((max_n - t.numel(),), -1)])
    all_p = [torch.empty(max_n, dtype=preds.dtype, device=device) for _ in sizes]
    all_g = [torch.empty(max_n, dtype=golds.dtype, device=device) for _ in sizes]
    dist.all_gather(all_p, pad(preds))
    dist.all_gather(all_g, pad(golds))
    p = torch.cat([t[: int(n)] for t, n in zip(all_p, sizes)]).cpu().numpy()
    g = torch.cat([t[: int(n)] for t, n in zip(all_g, sizes)]).cpu().numpy()
    return (f1_score(g, p, average="micro"), f1_score(g, p, average="macro"), (p == g).mean())


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s | %(message)s")
    log = logging.getLogger("assertion")
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.bert)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[entity]", "[/entity]"]})
    train_set = AssertionData(args.train, tokenizer, args.max_len)
    dev_set = AssertionData(args.dev, tokenizer, args.max_len)
    dev_idx = list(range(rank, len(dev_set), world_size))

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=2,
                              pin_memory=True)
    dev_loader = DataLoader(torch.utils.data.Subset(dev_set, dev_idx), batch_size=128, num_workers=2)

    model = AssertionModel(args.bert, len(tokenizer), len(CLASSES)).to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, steps // 10, steps)
    criterion = nn.CrossEntropyLoss()

    best_macro = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, (ids, am, em, y) in enumerate(train_loader):
            logits = model(ids.to(device), am.to(device), em.to(device))
            loss = criterion(logits, y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            if it % 200 == 0:
                log.info("epoch %d iter %d/%d loss %.4f", epoch, it, len(train_loader), loss.item())

        micro, macro, acc = evaluate(model.module, dev_loader, device)
        log.info("epoch %d: dev micro-F1 %.4f macro-F1 %.4f acc %.4f", epoch, micro, macro, acc)
        if rank == 0 and macro > best_macro:
            best_macro = macro
            os.makedirs(args.save, exist_ok=True)
            torch.save(model.module.state_dict(), os.path.join(args.save, "assertion_best.bin"))
            tokenizer.save_pretrained(args.save)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
