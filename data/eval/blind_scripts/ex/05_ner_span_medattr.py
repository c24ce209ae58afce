"""
Medication / attribute NER for the n2c2-2018 ADE corpus: BERT encoder + linear-chain CRF.

Most sentences in discharge summaries contain no medication mention at all, so all-"O" batches are
down-sampled during training (--neg_keep).

    torchrun --nproc_per_node 4 05_ner_span_medattr.py --data data/n2c2_2018_ner --out runs/ade_ner_crf
"""
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from seqeval.metrics import f1_score
from seqeval.scheme import IOB2
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchcrf import CRF
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup

TYPES = ["Drug", "Strength", "Dosage", "Duration", "Frequency", "Form", "Route", "Reason", "ADE"]
TAGS = ["O"] + [f"{p}-{t}" for t in TYPES for p in ("B", "I")]
TAG2ID = {t: i for i, t in enumerate(TAGS)}


class SentDataset(Dataset):
    def __init__(self, path, tok, max_len):
        self.rows = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                enc = tok(ex["tokens"], is_split_into_words=True, truncation=True, max_length=max_len)
                first, prev = [], None
                for j, w in enumerate(enc.word_ids()):
                    if w is not None and w != prev:
                        first.append(j)
                    prev = w
                tags = [TAG2ID[t] for t in ex["tags"][: len(first)]]
                self.rows.append((enc["input_ids"], first, tags))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def make_collate(pad_id):
    def collate(batch):
        L = max(len(ids) for ids, _, _ in batch)
        W = max(len(first) for _, first, _ in batch)
        input_ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
        attn = torch.zeros((len(batch), L), dtype=torch.long)
        first_idx = torch.zeros((len(batch), W), dtype=torch.long)
        tags = torch.zeros((len(batch), W), dtype=torch.long)
        word_mask = torch.zeros((len(batch), W), dtype=torch.bool)
        for i, (ids, first, t) in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            attn[i, : len(ids)] = 1
            first_idx[i, : len(first)] = torch.tensor(first)
            tags[i, : len(t)] = torch.tensor(t)
            word_mask[i, : len(t)] = True
        return input_ids, attn, first_idx, tags, word_mask
    return collate


class BertCRF(nn.Module):
    def __init__(self, name, num_tags, dropout=0.1):
        super().__init__()
        self.bert = AutoModel.from_pretrained(name, add_pooling_layer=False)
        self.drop = nn.Dropout(dropout)
        self.emit = nn.Linear(self.bert.config.hidden_size, num_tags)
        self.crf = CRF(num_tags, batch_first=True)

    def _emissions(self, input_ids, attn, first_idx):
        h = self.bert(input_ids=input_ids, attention_mask=attn).last_hidden_state
        h = torch.gather(h, 1, first_idx.unsqueeze(-1).expand(-1, -1, h.size(-1)))
        return self.emit(self.drop(h))

    def forward(self, input_ids, attn, first_idx, tags, word_mask):
        em = self._emissions(input_ids, attn, first_idx)
        return -self.crf(em, tags, mask=word_mask, reduction="mean")

    @torch.no_grad()
    def decode(self, input_ids, attn, first_idx, word_mask):
        return self.crf.decode(self._emissions(input_ids, attn, first_idx), mask=word_mask)


def evaluate(model, loader, device):
    model.eval()
    gold, pred = [], []
    for input_ids, attn, first_idx, tags, word_mask in loader:
        paths = model.decode(input_ids.to(device), attn.to(device), first_idx.to(device), word_mask.to(device))
        for p, t, m in zip(paths, tags, word_mask):
            n = int(m.sum())
            gold.append([TAGS[x] for x in t[:n].tolist()])
            pred.append([TAGS[x] for x in p[:n]])
    return f1_score(gold, pred, mode="strict", scheme=IOB2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bert", default="emilyalsentzer/Bio_ClinicalBERT")
    ap.add_argument("--max_len", type=int, default=200)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--crf_lr", type=float, default=5e-3)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--neg_keep", type=float, default=0.3, help="fraction of all-O batches kept")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.bert)
    train = SentDataset(os.path.join(args.data, "train.jsonl"), tok, args.max_len)
    dev = SentDataset(os.path.join(args.data, "dev.jsonl"), tok, args.max_len)
    collate = make_collate(tok.pad_token_id)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True)
    dev_dl = DataLoader(dev, batch_size=64, shuffle=False, collate_fn=collate, num_workers=2)

    model = BertCRF(args.bert, len(TAGS)).to(device)
    model = DDP(model, device_ids=[local_rank])
    crf_params = [p for n, p in model.named_parameters() if ".crf." in n or ".emit." in n]
    bert_params = [p for n, p in model.named_parameters() if ".bert." in n]
    opt = torch.optim.AdamW([{"params": bert_params, "lr": args.lr},
                             {"params": crf_params, "lr": args.crf_lr}], weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.05 * total), total)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, seen, skipped = time.time(), 0, 0
        for input_ids, attn, first_idx, tags, word_mask in train_dl:
            if tags.sum() == 0 and random.random() > args.neg_keep:
                skipped += 1
                continue
            loss = model(input_ids.to(device, non_blocking=True), attn.to(device, non_blocking=True),
                         first_idx.to(device), tags.to(device), word_mask.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            seen += 1
            if rank == 0 and seen % 200 == 0:
                print(f"[ep {epoch}] step {seen} loss {loss.item():.3f}", flush=True)

        # dev set is small (~4k sentences): score it once on rank 0
        if rank == 0:
            f1 = evaluate(model.module, dev_dl, device)
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s, steps {seen}, skipped {skipped}, "
                  f"dev strict F1 {f1:.4f}", flush=True)
            if f1 > best:
                best = f1
                torch.save({"model": model.module.state_dict(), "tags": TAGS, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
