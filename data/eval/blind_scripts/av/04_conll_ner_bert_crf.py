#!/usr/bin/env python
# BERT + CRF tagger for CoNLL-2003 NER, multi-GPU with torchrun.
#
#   torchrun --standalone --nproc_per_node=4 04_conll_ner_bert_crf.py \
#       --data_dir data/conll2003 --out_dir runs/ner_bert_crf --fp16
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from seqeval.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchcrf import CRF
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup


def read_conll(path):
    sents, words, tags = [], [], []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("-DOCSTART-"):
                if words:
                    sents.append((words, tags))
                    words, tags = [], []
                continue
            cols = line.split()
            words.append(cols[0])
            tags.append(cols[-1])
    if words:
        sents.append((words, tags))
    return sents


class NerDataset(Dataset):
    def __init__(self, sents, tokenizer, label2id, max_len):
        self.items = []
        for words, tags in sents:
            enc = tokenizer(words, is_split_into_words=True, truncation=True, max_length=max_len)
            word_ids = enc.word_ids()
            first, seen = [], set()
            for pos, w in enumerate(word_ids):
                if w is not None and w not in seen:
                    seen.add(w)
                    first.append(pos)
            n = len(first)
            self.items.append({
                "input_ids": enc["input_ids"],
                "first_subword": first,
                "labels": [label2id[t] for t in tags[:n]],
            })

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def make_collate(pad_id):
    def collate(batch):
        max_tok = max(len(b["input_ids"]) for b in batch)
        max_w = max(len(b["labels"]) for b in batch)
        ids = torch.full((len(batch), max_tok), pad_id, dtype=torch.long)
        attn = torch.zeros((len(batch), max_tok), dtype=torch.long)
        first = torch.zeros((len(batch), max_w), dtype=torch.long)
        labels = torch.zeros((len(batch), max_w), dtype=torch.long)
        wmask = torch.zeros((len(batch), max_w), dtype=torch.bool)
        for i, b in enumerate(batch):
            ids[i, :len(b["input_ids"])] = torch.tensor(b["input_ids"])
            attn[i, :len(b["input_ids"])] = 1
            n = len(b["labels"])
            first[i, :n] = torch.tensor(b["first_subword"])
            labels[i, :n] = torch.tensor(b["labels"])
            wmask[i, :n] = True
        return {"input_ids": ids, "attention_mask": attn, "first_subword": first, "labels": labels, "word_mask": wmask}
    return collate


class BertCrfTagger(nn.Module):
    def __init__(self, encoder_name, num_tags, dropout=0.1):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(encoder_name, add_pooling_layer=False)
        self.dropout = nn.Dropout(dropout)
        self.emissions = nn.Linear(self.encoder.config.hidden_size, num_tags)
        self.crf = CRF(num_tags, batch_first=True)

    def _word_emissions(self, input_ids, attention_mask, first_subword):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        idx = first_subword.unsqueeze(-1).expand(-1, -1, h.size(-1))
        h = torch.gather(h, 1, idx)
        return self.emissions(self.dropout(h)).float()

    def forward(self, input_ids, attention_mask, first_subword, word_mask, labels=None):
        em = self._word_emissions(input_ids, attention_mask, first_subword)
        if labels is not None:
            return -self.crf(em, labels, mask=word_mask, reduction="mean")
        return self.crf.decode(em, mask=word_mask)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--encoder", default="bert-base-cased")
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--crf_lr", type=float, default=5e-3)
    ap.add_argument("--warmup", type=float, default=0.1)
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--seed", type=int, default=13)
    return ap.parse_args()


@torch.no_grad()
def evaluate(model, sents, dataset, collate, id2label, device, rank, world):
    model.eval()
    shard = list(range(rank, len(dataset), world))
    local = []
    for s in range(0, len(shard), 64):
        idx = shard[s:s + 64]
        batch = {k: v.to(device) for k, v in collate([dataset[i] for i in idx]).items()}
        batch.pop("labels")
        paths = model(**batch)
        for i, path in zip(idx, paths):
            local.append((i, [id2label[t] for t in path]))
    parts = [None] * world
    dist.all_gather_object(parts, local)
    model.train()
    if rank != 0:
        return None, None
    preds = dict(p for part in parts for p in part)
    y_pred = [preds[i] for i in range(len(dataset))]
    y_true = [sents[i][1][:len(y_pred[i])] for i in range(len(dataset))]
    return f1_score(y_true, y_pred), classification_report(y_true, y_pred, digits=4)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    train_sents = read_conll(os.path.join(args.data_dir, "train.txt"))
    dev_sents = read_conll(os.path.join(args.data_dir, "valid.txt"))
    test_sents = read_conll(os.path.join(args.data_dir, "test.txt"))
    label_list = list({t for _, tags in train_sents for t in tags})
    label2id = {l: i for i, l in enumerate(label_list)}
    id2label = {i: l for l, i in label2id.items()}

    tokenizer = AutoTokenizer.from_pretrained(args.encoder)
    train_ds = NerDataset(train_sents, tokenizer, label2id, args.max_len)
    dev_ds = NerDataset(dev_sents, tokenizer, label2id, args.max_len)
    test_ds = NerDataset(test_sents, tokenizer, label2id, args.max_len)
    collate = make_collate(tokenizer.pad_token_id)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=2, pin_memory=True, drop_last=True)

    model = BertCrfTagger(args.encoder, len(label_list)).to(device)
    model = DDP(model, device_ids=[local_rank])
    enc_params = [p for n, p in model.named_parameters() if n.startswith("module.encoder.")]
    head_params = [p for n, p in model.named_parameters() if not n.startswith("module.encoder.")]
    optimizer = torch.optim.AdamW([
        {"params": enc_params, "lr": args.lr},
        {"params": head_params, "lr": args.crf_lr},
    ], weight_decay=0.01)
    total = len(loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup * total), total)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "labels.json"), "w") as f:
            json.dump(id2label, f)
        print(f"{len(train_ds)} train / {len(dev_ds)} dev sentences, {len(label_list)} tags, world={world}")

    best_f1 = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, tot = time.time(), torch.zeros(2, device=device)
        for step, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                loss = model(**batch)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        dev_f1, _ = evaluate(model.module, dev_sents, dev_ds, collate, id2label, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch}: train loss {(tot[0] / tot[1]).item():.4f} dev F1 {dev_f1 * 100:.2f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if dev_f1 > best_f1:
                best_f1 = dev_f1
                torch.save(model.module.state_dict(), os.path.join(args.out_dir, "best.pt"))
        dist.barrier()

    # test with the best dev checkpoint
    model.module.load_state_dict(torch.load(os.path.join(args.out_dir, "best.pt"), map_location="cpu"))
    test_f1, report = evaluate(model.module, test_sents, test_ds, collate, id2label, device, rank, world)
    if rank == 0:
        print(f"test F1 {test_f1 * 100:.2f}\n{report}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
