"""Account-takeover (ATO) detection from online-banking session event streams.

A small BERT (trained from scratch, HF `transformers`) reads the tokenised session:
[CLS] login_ok  dt_2  view_balance dt_1  add_payee dt_0  transfer_hi ... [SEP]
and predicts whether the session was later confirmed as ATO.

    torchrun --nproc_per_node=4 19_session_bert_ato.py --sessions /data/ato/sessions.jsonl.gz
"""
import argparse
import gzip
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
SPECIALS = ["[PAD]", "[CLS]", "[SEP]", "[UNK]"]


def load_sessions(path):
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def build_vocab(vocab_file):
    with open(vocab_file) as f:
        tokens = [t.strip() for t in f if t.strip()]
    return {t: i for i, t in enumerate(SPECIALS + tokens)}


def dt_bucket(seconds):
    return f"dt_{min(9, int(math.log2(1 + max(0.0, seconds))) // 2)}"


class SessionDataset(Dataset):
    def __init__(self, sessions, vocab, max_len=128):
        self.sessions, self.vocab, self.max_len = sessions, vocab, max_len

    def __len__(self):
        return len(self.sessions)

    def encode(self, s):
        toks = ["[CLS]"]
        prev = None
        for ev in s["events"]:
            if prev is not None:
                toks.append(dt_bucket(ev["t"] - prev))
            toks.append(ev["type"])
            prev = ev["t"]
        toks = toks[: self.max_len - 1] + ["[SEP]"]
        return [self.vocab.get(t, self.vocab["[UNK]"]) for t in toks]

    def __getitem__(self, i):
        s = self.sessions[i]
        return self.encode(s), int(s["is_ato"])


def collate(batch):
    ids, labels = zip(*batch)
    L = max(len(x) for x in ids)
    input_ids = torch.zeros(len(ids), L, dtype=torch.long)
    attn = torch.zeros(len(ids), L, dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, : len(x)] = torch.tensor(x)
        attn[i, : len(x)] = 1
    return {"input_ids": input_ids, "attention_mask": attn, "labels": torch.tensor(labels)}


def to_device(batch):
    return {k: v.to(DEVICE, non_blocking=True) for k, v in batch.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", required=True)
    ap.add_argument("--vocab", default="/data/ato/event_vocab.txt")
    ap.add_argument("--out", default="runs/session_bert")
    ap.add_argument("--val-after", type=float, default=1714521600.0, help="unix ts: sessions after go to val")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--ato-weight", type=float, default=20.0)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.manual_seed(0)

    vocab = build_vocab(args.vocab)
    sessions = load_sessions(args.sessions)
    train = [s for s in sessions if s["start_ts"] < args.val_after]
    val = [s for s in sessions if s["start_ts"] >= args.val_after]
    train_ds, val_ds = SessionDataset(train, vocab), SessionDataset(val, vocab)

    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), batch_size=512,
                        collate_fn=collate, num_workers=2)

    config = BertConfig(vocab_size=len(vocab), hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=128, num_labels=2,
                        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = BertForSequenceClassification(config).to(local_rank)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = get_linear_schedule_with_warmup(opt, int(0.06 * total), total)
    class_w = torch.tensor([1.0, args.ato_weight], device=local_rank)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"vocab={len(vocab)} train={len(train_ds)} val={len(val_ds)} "
              f"ato_rate={np.mean([s['is_ato'] for s in train]):.4%}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=local_rank)
        for step, batch in enumerate(train_dl):
            batch = to_device(batch)
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            loss = F.cross_entropy(out.logits, batch["labels"], weight=class_w)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=local_rank)])
        dist.all_reduce(loss_acc)

        model.eval()
        probs, labels = [], []
        with torch.no_grad():
            for batch in val_dl:
                batch = to_device(batch)
                logits = model.module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                probs.append(logits.softmax(-1)[:, 1].cpu().numpy())
                labels.append(batch["labels"].cpu().numpy())
        parts = [None] * world
        dist.all_gather_object(parts, (np.concatenate(probs), np.concatenate(labels)))
        if rank == 0:
            p = np.concatenate([x[0] for x in parts])
            y = np.concatenate([x[1] for x in parts])
            ap_score = average_precision_score(y, p)
            print(f"epoch {epoch} loss {(loss_acc[0] / loss_acc[1]).item():.4f} val PR-AUC {ap_score:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if ap_score > best:
                best = ap_score
                model.module.save_pretrained(os.path.join(args.out, "best"))
                with open(os.path.join(args.out, "best", "vocab.json"), "w") as f:
                    json.dump(vocab, f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
