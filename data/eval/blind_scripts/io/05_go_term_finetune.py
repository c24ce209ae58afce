"""Multi-label GO term prediction (molecular function) by fine-tuning ESM-2 from Hugging Face.

Training data is a directory of parquet shards (columns: accession, sequence, go_mf),
written by the annotation dump job. Each rank streams its own subset of shards.
Evaluation uses the protein-centric Fmax of CAFA.

    torchrun --nproc_per_node=8 05_go_term_finetune.py --train_dir data/go/train --val_file data/go/val.parquet
"""
import argparse
import collections
import glob
import math
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoTokenizer, EsmModel, get_cosine_schedule_with_warmup

THRESHOLDS = torch.linspace(0.01, 0.99, 99)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_dir", required=True)
    p.add_argument("--val_file", required=True)
    p.add_argument("--model_name", default="facebook/esm2_t30_150M_UR50D")
    p.add_argument("--min_term_count", type=int, default=25)
    p.add_argument("--max_len", type=int, default=1000)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--head_lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--steps_per_epoch", type=int, default=2000)
    p.add_argument("--output_dir", default="outputs/go_mf")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def load_records(files):
    frames = [pd.read_parquet(f, columns=["accession", "sequence", "go_mf"]) for f in files]
    df = pd.concat(frames, ignore_index=True)
    df = df[df["go_mf"].map(len) > 0]
    return list(zip(df["sequence"], df["go_mf"].map(list)))


def build_term_vocab(records, min_count):
    counts = collections.Counter(t for _, terms in records for t in terms)
    return sorted(t for t, c in counts.items() if c >= min_count)


def batch_iterator(records, batch_size, seed):
    rng = random.Random(seed)
    while True:
        order = list(range(len(records)))
        rng.shuffle(order)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield [records[j] for j in order[i:i + batch_size]]


class GOClassifier(nn.Module):
    def __init__(self, model_name, n_terms, dropout=0.1):
        super().__init__()
        self.esm = EsmModel.from_pretrained(model_name, add_pooling_layer=False)
        # the pretrained contact head is not part of this task
        self.esm.contact_head.requires_grad_(False)
        hidden = self.esm.config.hidden_size
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, n_terms))

    def forward(self, input_ids, attention_mask):
        h = self.esm(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1.0)
        return self.head(self.dropout(pooled))


def encode(tokenizer, batch, term_index, max_len, device):
    seqs = [s for s, _ in batch]
    enc = tokenizer(seqs, padding=True, truncation=True, max_length=max_len + 2, return_tensors="pt")
    y = torch.zeros(len(batch), len(term_index))
    for b, (_, terms) in enumerate(batch):
        for t in terms:
            j = term_index.get(t)
            if j is not None:
                y[b, j] = 1.0
    return enc["input_ids"].to(device), enc["attention_mask"].to(device), y.to(device)


@torch.no_grad()
def evaluate(model, tokenizer, val_records, term_index, args, device, rank, world):
    model.eval()
    shard = val_records[rank::world]
    thr = THRESHOLDS.to(device)
    # per threshold: sum of precisions, number of proteins with >=1 prediction, sum of recalls
    acc = torch.zeros(3, len(thr), device=device, dtype=torch.float64)
    n_prot = torch.zeros(1, device=device, dtype=torch.float64)
    for i in range(0, len(shard), args.batch_size):
        ids, mask, y = encode(tokenizer, shard[i:i + args.batch_size], term_index, args.max_len, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            probs = torch.sigmoid(model(ids, mask).float())
        pred = probs[None] >= thr[:, None, None]                  # T x B x C
        tp = (pred & (y[None] > 0)).sum(-1).double()
        n_pred = pred.sum(-1).double()
        n_true = y.sum(-1).double().clamp(min=1)
        has_pred = n_pred > 0
        acc[0] += torch.where(has_pred, tp / n_pred.clamp(min=1), torch.zeros_like(tp)).sum(-1)
        acc[1] += has_pred.sum(-1)
        acc[2] += (tp / n_true[None]).sum(-1)
        n_prot += y.shape[0]
    dist.all_reduce(acc)
    dist.all_reduce(n_prot)
    precision = acc[0] / acc[1].clamp(min=1)
    recall = acc[2] / n_prot
    f = 2 * precision * recall / (precision + recall).clamp(min=1e-8)
    best = int(f.argmax())
    model.train()
    return f[best].item(), thr[best].item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    shard_files = sorted(glob.glob(os.path.join(args.train_dir, "*.parquet")))
    my_files = shard_files[rank::world]
    train_records = load_records(my_files)
    terms = build_term_vocab(train_records, args.min_term_count)
    term_index = {t: i for i, t in enumerate(terms)}
    val_records = load_records([args.val_file])
    print(f"[rank {rank}] {len(my_files)} shards, {len(train_records)} proteins, {len(terms)} terms",
          flush=True)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    model = GOClassifier(args.model_name, len(terms)).to(device)
    model = DDP(model, device_ids=[local_rank])

    head_params = list(model.module.head.parameters())
    esm_params = [p for p in model.module.esm.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": esm_params, "lr": args.lr},
                                   {"params": head_params, "lr": args.head_lr}], weight_decay=0.01)
    total_steps = args.epochs * args.steps_per_epoch
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.05 * total_steps), total_steps)

    # label frequencies for the positive weights of the BCE loss
    pos = torch.zeros(len(terms))
    for _, ts in train_records:
        for t in ts:
            if t in term_index:
                pos[term_index[t]] += 1
    pos_weight = ((len(train_records) - pos) / pos.clamp(min=1)).clamp(max=50.0).to(device)

    batches = batch_iterator(train_records, args.batch_size, args.seed + rank)
    best_f = 0.0
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    for epoch in range(args.epochs):
        model.train()
        running = 0.0
        for step in range(args.steps_per_epoch):
            ids, mask, y = encode(tokenizer, next(batches), term_index, args.max_len, device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids, mask)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y, pos_weight=pos_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            running += loss.item()
            if rank == 0 and (step + 1) % 200 == 0:
                print(f"epoch {epoch} step {step + 1} loss {running / 200:.4f}", flush=True)
                running = 0.0

        fmax, thr = evaluate(model.module, tokenizer, val_records, term_index, args, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch}: Fmax {fmax:.4f} at t={thr:.2f}", flush=True)
            ckpt = {"model": model.module.state_dict(), "terms": terms, "epoch": epoch, "fmax": fmax}
            torch.save(ckpt, os.path.join(args.output_dir, "last.pt"))
            if fmax > best_f:
                best_f = fmax
                torch.save(ckpt, os.path.join(args.output_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
