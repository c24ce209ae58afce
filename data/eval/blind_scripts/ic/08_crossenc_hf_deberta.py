#!/usr/bin/env python
# DeBERTa-v3-large cross-encoder for query/product relevance (ESCI-style 4-grade labels).
# Trained as a 4-way classifier; ranking score = expected gain under the predicted distribution.
#
# launch:  torchrun --nproc_per_node=8 08_crossenc_hf_deberta.py --train_file data/esci/train.parquet \
#              --valid_file data/esci/valid.parquet --output_dir /nfs/models/ce-debv3l
import argparse
import logging
import math
import os
import sys

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

LABELS = ["irrelevant", "complement", "substitute", "exact"]
GAINS = torch.tensor([0.0, 0.1, 0.3, 1.0])  # ESCI gains used by the shopping-queries benchmark (x3 scale)
logger = logging.getLogger("ce")


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_file", required=True)
    ap.add_argument("--valid_file", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--model_name_or_path", default="microsoft/deberta-v3-large")
    ap.add_argument("--max_seq_length", type=int, default=192)
    ap.add_argument("--per_device_train_batch_size", type=int, default=16)
    ap.add_argument("--per_device_eval_batch_size", type=int, default=128)
    ap.add_argument("--gradient_accumulation_steps", type=int, default=2)
    ap.add_argument("--learning_rate", type=float, default=7e-6)
    ap.add_argument("--num_train_epochs", type=int, default=2)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--label_smoothing", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args(argv)


class PairData(Dataset):
    def __init__(self, df):
        self.q = df["query"].tolist()
        self.p = (df["product_title"].fillna("") + " [SEP] " + df["product_brand"].fillna("") + " "
                  + df["product_bullet_point"].fillna("").str.slice(0, 400)).tolist()
        self.y = df["esci_label"].map({"I": 0, "C": 1, "S": 2, "E": 3}).astype("int64").tolist()
        self.qid = df["query_id"].tolist()

    def __len__(self):
        return len(self.q)

    def __getitem__(self, i):
        return self.q[i], self.p[i], self.y[i], self.qid[i]


class Collate:
    def __init__(self, tok, max_len):
        self.tok, self.max_len = tok, max_len

    def __call__(self, batch):
        q, p, y, qid = zip(*batch)
        enc = self.tok(list(q), list(p), truncation="only_second", max_length=self.max_len,
                       padding=True, return_tensors="pt")
        enc["labels"] = torch.tensor(y)
        enc["qid"] = torch.tensor(qid)
        return enc


def ndcg_per_query(qids, scores, labels, k=10):
    df = pd.DataFrame({"q": qids, "s": scores, "g": GAINS.numpy()[labels]})
    disc = 1.0 / np.log2(np.arange(2, k + 2))
    out = []
    for _, g in df.groupby("q"):
        got = g.sort_values("s", ascending=False)["g"].to_numpy()[:k]
        ideal = np.sort(g["g"].to_numpy())[::-1][:k]
        idcg = (ideal * disc[: len(ideal)]).sum()
        if idcg > 0:
            out.append((got * disc[: len(got)]).sum() / idcg)
    return out


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    qids, scores, labels = [], [], []
    for batch in loader:
        qid = batch.pop("qid")
        y = batch.pop("labels")
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            probs = model(**batch).logits.float().softmax(-1)
        scores.append((probs * GAINS.to(device)).sum(-1).cpu())
        qids.append(qid)
        labels.append(y)
    model.train()
    local = (torch.cat(qids).numpy(), torch.cat(scores).numpy(), torch.cat(labels).numpy())
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    q = np.concatenate([p[0] for p in parts])
    s = np.concatenate([p[1] for p in parts])
    y = np.concatenate([p[2] for p in parts])
    vals = ndcg_per_query(q, s, y)
    return float(np.mean(vals)) if vals else 0.0


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s - %(name)s - %(message)s")
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name_or_path, num_labels=len(LABELS), device_map="auto",
    )
    model.config.id2label = dict(enumerate(LABELS))
    model.config.label2id = {l: i for i, l in enumerate(LABELS)}
    ddp_model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    # query-level split was done upstream, valid queries never occur in train
    train_ds = PairData(pd.read_parquet(args.train_file))
    valid_df = pd.read_parquet(args.valid_file)
    valid_df = valid_df.sort_values("query_id").reset_index(drop=True)
    # shard validation by query id so all of a query's products land on one rank
    valid_ds = PairData(valid_df[valid_df.query_id % dist.get_world_size() == rank])

    collate = Collate(tok, args.max_seq_length)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.per_device_train_batch_size, sampler=train_sampler,
                          collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
    valid_dl = DataLoader(valid_ds, batch_size=args.per_device_eval_batch_size, shuffle=False,
                          collate_fn=collate, num_workers=2)

    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.learning_rate)
    updates = math.ceil(len(train_dl) / args.gradient_accumulation_steps) * args.num_train_epochs
    sched = get_linear_schedule_with_warmup(opt, int(args.warmup_ratio * updates), updates)

    best = -1.0
    for epoch in range(args.num_train_epochs):
        train_sampler.set_epoch(epoch)
        ddp_model.train()
        for step, batch in enumerate(train_dl):
            batch.pop("qid")
            y = batch.pop("labels").to(device)
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            last_micro = (step + 1) % args.gradient_accumulation_steps == 0 or step + 1 == len(train_dl)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp_model(**batch).logits
            loss = F.cross_entropy(logits.float(), y, label_smoothing=args.label_smoothing)
            (loss / args.gradient_accumulation_steps).backward()
            if last_micro:
                torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            if step % 200 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_dl), loss.item())

        ndcg = evaluate(model, valid_dl, device)
        logger.info("epoch %d valid nDCG@10 %.4f", epoch, ndcg)
        if rank == 0 and ndcg > best:
            best = ndcg
            model.save_pretrained(args.output_dir)
            tok.save_pretrained(args.output_dir)
        dist.barrier()

    logger.info("best valid nDCG@10 %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
