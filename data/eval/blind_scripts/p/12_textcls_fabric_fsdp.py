"""Legal-clause classification (100 clause types) with a 1.3B decoder as encoder.

Fabric + FSDP (full shard, transformer-block auto-wrap).  Last-token pooling head.

    python 12_textcls_fabric_fsdp.py --train data/clauses_train.jsonl --val data/clauses_val.jsonl --devices 4
"""
import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import FSDPStrategy
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModel, AutoTokenizer
from transformers.models.opt.modeling_opt import OPTDecoderLayer


class ClauseSet(Dataset):
    def __init__(self, path, label2id):
        self.rows = [json.loads(l) for l in open(path)]
        self.label2id = label2id

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return r["text"], self.label2id[r["label"]]


def make_collate(tok, max_len):
    def collate(batch):
        texts, labels = zip(*batch)
        enc = tok(list(texts), truncation=True, max_length=max_len, padding=True, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"], torch.tensor(labels)
    return collate


class ClauseClassifier(nn.Module):
    def __init__(self, name, n_labels):
        super().__init__()
        self.lm = AutoModel.from_pretrained(name, torch_dtype=torch.float32)
        self.score = nn.Linear(self.lm.config.word_embed_proj_dim, n_labels, bias=False)

    def forward(self, input_ids, attention_mask):
        h = self.lm(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = attention_mask.sum(1) - 1
        pooled = h[torch.arange(h.size(0), device=h.device), last]
        return self.score(pooled)


def cosine_lr(step, total, warmup, base):
    if step < warmup:
        return base * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1 + math.cos(math.pi * p))


@torch.no_grad()
def evaluate(fabric, model, loader):
    model.eval()
    correct = torch.zeros((), device=fabric.device)
    seen = torch.zeros((), device=fabric.device)
    for ids, mask, y in loader:
        pred = model(ids, mask).argmax(-1)
        correct += (pred == y).sum()
        seen += y.numel()
    correct = fabric.all_reduce(correct, reduce_op="sum")
    seen = fabric.all_reduce(seen, reduce_op="sum")
    model.train()
    return (correct / seen).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="facebook/opt-1.3b")
    ap.add_argument("--train", default="data/clauses_train.jsonl")
    ap.add_argument("--val", default="data/clauses_val.jsonl")
    ap.add_argument("--labels", default="data/clause_labels.json")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--out", default="out/clauses-opt1.3b")
    args = ap.parse_args()

    strategy = FSDPStrategy(auto_wrap_policy={OPTDecoderLayer}, sharding_strategy="FULL_SHARD",
                            activation_checkpointing_policy={OPTDecoderLayer})
    fabric = Fabric(accelerator="cuda", devices=args.devices, strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    fabric.seed_everything(3)

    label_list = json.load(open(args.labels))
    label2id = {l: i for i, l in enumerate(label_list)}
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "right"

    with fabric.init_module(empty_init=False):
        model = ClauseClassifier(args.model, len(label_list))
    model = fabric.setup_module(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    opt = fabric.setup_optimizers(opt)

    collate = make_collate(tok, args.max_len)
    train_dl = DataLoader(ClauseSet(args.train, label2id), batch_size=args.bs, shuffle=True,
                          collate_fn=collate, num_workers=2, drop_last=True)
    val_dl = DataLoader(ClauseSet(args.val, label2id), batch_size=args.bs * 2, collate_fn=collate, num_workers=2)
    train_dl, val_dl = fabric.setup_dataloaders(train_dl, val_dl)

    total = args.epochs * len(train_dl)
    warmup = int(0.05 * total)
    step = 0
    best = 0.0
    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        t0 = time.time()
        for ids, mask, y in train_dl:
            for g in opt.param_groups:
                g["lr"] = cosine_lr(step, total, warmup, args.lr)
            loss = F.cross_entropy(model(ids, mask), y)
            opt.zero_grad()
            fabric.backward(loss)
            fabric.clip_gradients(model, opt, max_norm=1.0)
            opt.step()
            step += 1
            if step % 50 == 0:
                fabric.print(f"ep {epoch} step {step}/{total} loss {loss.item():.4f}")

        acc = evaluate(fabric, model, val_dl)
        fabric.print(f"epoch {epoch}: val acc {acc:.4f} ({time.time() - t0:.0f}s)")
        if acc > best:
            best = acc
            if fabric.global_rank == 0:
                torch.save({"model": model.state_dict(), "labels": label_list, "acc": acc},
                           os.path.join(args.out, "best.pt"))
                print(f"saved best.pt (acc={acc:.4f})")
        fabric.barrier()


if __name__ == "__main__":
    main()
