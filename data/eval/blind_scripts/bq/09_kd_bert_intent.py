"""Distil a fine-tuned BERT-large intent classifier into a 4-layer BERT student.

Input: one jsonl file of {"text": ..., "intent": ...}; 5% is held out for validation.
Loss: soft-target KL at temperature T plus CE on the gold intent.

    torchrun --nproc_per_node=4 09_kd_bert_intent.py --data data/intents_v7.jsonl \
        --teacher models/bert-large-intents-v7 --out models/bert-L4-intents-v7
"""
import argparse
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--student", default="google/bert_uncased_L-4_H-512_A-8")
    ap.add_argument("--out", required=True)
    ap.add_argument("--val-frac", type=float, default=0.05)
    ap.add_argument("--max-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--alpha", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class IntentDataset(Dataset):
    def __init__(self, records, label2id):
        self.texts = [r["text"] for r in records]
        self.labels = [label2id[r["intent"]] for r in records]

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return self.texts[i], self.labels[i]


def make_collate(tokenizer, max_len):
    def collate(batch):
        texts, labels = zip(*batch)
        enc = tokenizer(list(texts), padding=True, truncation=True, max_length=max_len, return_tensors="pt")
        enc["labels"] = torch.tensor(labels, dtype=torch.long)
        return enc
    return collate


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


@torch.no_grad()
def evaluate(student, teacher, loader, device):
    student.eval()
    s = torch.zeros(4, device=device)  # student correct, teacher correct, agreement, n
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        sp = student(**batch).logits.argmax(-1)
        tp = teacher(**batch).logits.argmax(-1)
        s += torch.stack([(sp == labels).sum(), (tp == labels).sum(), (sp == tp).sum(),
                          torch.tensor(labels.numel(), device=device)]).float()
    dist.all_reduce(s)
    return (s[:3] / s[3]).tolist()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different dropout masks / augmentation per rank
    seed_everything(args.seed + rank)

    with open(args.data) as f:
        records = [json.loads(l) for l in f if l.strip()]
    intents = sorted({r["intent"] for r in records})
    label2id = {name: i for i, name in enumerate(intents)}
    random.shuffle(records)
    n_val = int(len(records) * args.val_frac)
    val_records, train_records = records[:n_val], records[n_val:]

    tokenizer = AutoTokenizer.from_pretrained(args.student)
    teacher = AutoModelForSequenceClassification.from_pretrained(args.teacher).to(device).eval()
    teacher.requires_grad_(False)
    assert teacher.config.num_labels == len(intents), "teacher head does not match intent set"
    t2id = teacher.config.label2id
    if t2id and set(t2id) == set(label2id):
        label2id = {k: int(v) for k, v in t2id.items()}

    student = AutoModelForSequenceClassification.from_pretrained(
        args.student, num_labels=len(intents),
        id2label={i: n for n, i in label2id.items()}, label2id=label2id,
    ).to(device)
    student = DDP(student, device_ids=[local_rank])

    train_ds, val_ds = IntentDataset(train_records, label2id), IntentDataset(val_records, label2id)
    collate = make_collate(tokenizer, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=256, sampler=val_sampler, collate_fn=collate, num_workers=2)

    opt = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)
    T = args.temperature

    if rank == 0:
        print(f"{len(train_ds)} train / {len(val_ds)} val examples, {len(intents)} intents, world {world}")

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        student.train()
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            with torch.no_grad():
                t_logits = teacher(**batch).logits
            s_logits = student(**batch).logits
            kd = F.kl_div(F.log_softmax(s_logits / T, -1), F.softmax(t_logits / T, -1),
                          reduction="batchmean") * T * T
            ce = F.cross_entropy(s_logits, labels)
            loss = args.alpha * kd + (1 - args.alpha) * ce
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 200 == 0:
                print(f"ep {epoch} step {step} kd {kd.item():.4f} ce {ce.item():.4f}")

        s_acc, t_acc, agree = evaluate(student, teacher, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: student acc {s_acc:.4f} | teacher acc {t_acc:.4f} | agreement {agree:.4f}")
            if s_acc > best:
                best = s_acc
                student.module.save_pretrained(args.out)
                tokenizer.save_pretrained(args.out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
