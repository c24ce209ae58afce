#!/usr/bin/env python
"""WikiANN NER: BERT encoder + token-level softmax tagger, trained with DDP.

Launch on one node:
    torchrun --nproc_per_node=4 05_ner_wikiann_bert_tagger.py --lang en --save_dir ckpt/wikiann-en
"""
import argparse
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from datasets import load_dataset
from seqeval.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, DataCollatorForTokenClassification, get_cosine_schedule_with_warmup

logger = logging.getLogger(__name__)


@dataclass
class Config:
    encoder: str = "bert-base-multilingual-cased"
    lang: str = "en"
    save_dir: str = "ckpt"
    max_len: int = 128
    batch_size: int = 32
    lr: float = 5e-5
    head_lr: float = 1e-3
    epochs: int = 3
    warmup: float = 0.1
    dropout: float = 0.1
    seed: int = 0


class Tagger(nn.Module):
    def __init__(self, encoder_name, num_labels, dropout):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(encoder_name)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(self.encoder.config.hidden_size, num_labels)
        self.loss_fn = nn.CrossEntropyLoss(ignore_index=-100)

    def forward(self, input_ids, attention_mask, token_type_ids=None, labels=None):
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        logits = self.classifier(self.dropout(out.last_hidden_state))
        loss = None
        if labels is not None:
            loss = self.loss_fn(logits.view(-1, logits.size(-1)), labels.view(-1))
        return loss, logits


def parse() -> Config:
    cfg = Config()
    ap = argparse.ArgumentParser()
    for name, value in vars(cfg).items():
        ap.add_argument(f"--{name}", type=type(value), default=value)
    return Config(**vars(ap.parse_args()))


def encode(batch, tokenizer, max_len):
    enc = tokenizer(batch["tokens"], is_split_into_words=True, truncation=True, max_length=max_len)
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
    pairs = []
    for batch in loader:
        uid = batch.pop("uid").tolist()
        batch = {k: v.to(device) for k, v in batch.items()}
        _, logits = model(**batch)
        pred = logits.argmax(-1).cpu()
        gold = batch["labels"].cpu()
        for u, p, g in zip(uid, pred, gold):
            m = g.ne(-100)
            pairs.append((u, [names[x] for x in p[m].tolist()], [names[x] for x in g[m].tolist()]))
    buckets = [None] * dist.get_world_size()
    dist.all_gather_object(buckets, pairs)
    model.train()
    uniq = {u: (p, g) for b in buckets for u, p, g in b}
    keys = sorted(uniq)
    return f1_score([uniq[k][1] for k in keys], [uniq[k][0] for k in keys])


def main():
    cfg = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [rank%(process)d] %(message)s")
    torch.manual_seed(cfg.seed)

    ds = load_dataset("wikiann", cfg.lang)
    names = ds["train"].features["ner_tags"].feature.names
    tokenizer = AutoTokenizer.from_pretrained(cfg.encoder)

    if rank != 0:
        dist.barrier()
    ds = ds.map(encode, batched=True, fn_kwargs={"tokenizer": tokenizer, "max_len": cfg.max_len},
                remove_columns=ds["train"].column_names)
    if rank == 0:
        dist.barrier()
    val = ds["validation"].add_column("uid", list(range(len(ds["validation"]))))
    test = ds["test"].add_column("uid", list(range(len(ds["test"]))))

    collator = DataCollatorForTokenClassification(tokenizer)
    train_sampler = DistributedSampler(ds["train"], shuffle=True, seed=cfg.seed)
    train_loader = DataLoader(ds["train"], batch_size=cfg.batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val, batch_size=128, sampler=DistributedSampler(val, shuffle=False),
                            collate_fn=collator)
    test_loader = DataLoader(test, batch_size=128, sampler=DistributedSampler(test, shuffle=False),
                             collate_fn=collator)

    model = Tagger(cfg.encoder, len(names), cfg.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])

    enc_params = [p for n, p in model.named_parameters() if n.startswith("module.encoder.")]
    head_params = [p for n, p in model.named_parameters() if not n.startswith("module.encoder.")]
    optimizer = torch.optim.AdamW([
        {"params": enc_params, "lr": cfg.lr},
        {"params": head_params, "lr": cfg.head_lr},
    ], weight_decay=0.01)
    steps = cfg.epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(cfg.warmup * steps), steps)

    best = -1.0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _ = model(**batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if i % 200 == 0:
                logger.info("epoch %d it %d/%d loss %.4f", epoch, i, len(train_loader), loss.item())

        val_f1 = evaluate(model, val_loader, names, device)
        logger.info("epoch %d val F1 %.4f", epoch, val_f1)
        if val_f1 > best:
            best = val_f1
            if rank == 0:
                os.makedirs(cfg.save_dir, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "labels": names, "config": vars(cfg)},
                           os.path.join(cfg.save_dir, "best.pt"))
        dist.barrier()

    ckpt = torch.load(os.path.join(cfg.save_dir, "best.pt"), map_location=device)
    model.module.load_state_dict(ckpt["model"])
    test_f1 = evaluate(model, test_loader, names, device)
    logger.info("best val F1 %.4f -> test F1 %.4f", best, test_f1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
