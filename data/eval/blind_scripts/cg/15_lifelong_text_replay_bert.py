#!/usr/bin/env python
"""Lifelong text classification (d'Autume et al. 2019 setting): AGNews -> Yelp -> Amazon ->
DBPedia -> Yahoo, one BERT encoder and a shared 33-way label space, sparse experience replay
from an episodic memory filled by reservoir sampling.

    torchrun --nproc_per_node=4 15_lifelong_text_replay_bert.py --data_dir /data/lll_text \
        --output_dir out/bert_replay --replay_every 100
"""
import argparse
import logging
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)

TASKS = ["ag_news", "yelp", "amazon", "dbpedia", "yahoo"]
# offset of each task's labels in the shared label space (Yelp and Amazon share 5 sentiment labels)
OFFSETS = {"ag_news": 0, "yelp": 4, "amazon": 4, "dbpedia": 9, "yahoo": 23}
N_LABELS = 33


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--model_name", default="bert-base-uncased")
    p.add_argument("--max_len", type=int, default=128)
    p.add_argument("--train_per_task", type=int, default=115000)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--replay_every", type=int, default=100)
    p.add_argument("--replay_batch", type=int, default=32)
    p.add_argument("--memory_ratio", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


class TextTask(Dataset):
    def __init__(self, frame, tok, max_len, offset):
        self.text = frame["text"].tolist()
        self.label = (frame["label"].values + offset).tolist()
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.text)

    def __getitem__(self, i):
        return self.text[i], self.label[i]

    def collate(self, batch):
        texts, labels = zip(*batch)
        enc = self.tok(list(texts), truncation=True, max_length=self.max_len, padding=True,
                       return_tensors="pt")
        enc["labels"] = torch.tensor(labels)
        return enc


class ReservoirMemory:
    def __init__(self, capacity, seed):
        self.capacity, self.seen, self.items = capacity, 0, []
        self.rng = random.Random(seed)

    def add(self, texts, labels):
        for x, y in zip(texts, labels):
            if len(self.items) < self.capacity:
                self.items.append((x, y))
            else:
                j = self.rng.randint(0, self.seen)
                if j < self.capacity:
                    self.items[j] = (x, y)
            self.seen += 1

    def sample(self, n):
        return self.rng.sample(self.items, min(n, len(self.items)))


def load_split(data_dir, task, split, n=None, seed=0):
    df = pd.read_csv(os.path.join(data_dir, task, f"{split}.csv"))
    if n is not None and len(df) > n:
        df = df.sample(n=n, random_state=seed)
    return df.reset_index(drop=True)


@torch.no_grad()
def evaluate(model, tok, args, task, device, rank, world):
    ds = TextTask(load_split(args.data_dir, task, "test"), tok, args.max_len, OFFSETS[task])
    idx = list(range(rank, len(ds), world))
    dl = DataLoader(torch.utils.data.Subset(ds, idx), batch_size=64, collate_fn=ds.collate)
    model.eval()
    hit = torch.zeros(2, device=device)
    for batch in dl:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        hit[0] += (model(**batch).logits.argmax(-1) == labels).sum()
        hit[1] += labels.numel()
    dist.all_reduce(hit)
    model.train()
    return (hit[0] / hit[1]).item()


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARN)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model_name)
    model = AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=N_LABELS)
    model.to(device)
    ddp = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    memory = ReservoirMemory(int(args.memory_ratio * args.train_per_task * len(TASKS) / world),
                             seed=args.seed + rank)
    acc = np.zeros((len(TASKS), len(TASKS)))
    step = 0

    for t, task in enumerate(TASKS):
        ds = TextTask(load_split(args.data_dir, task, "train", args.train_per_task, args.seed),
                      tok, args.max_len, OFFSETS[task])
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
        dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, collate_fn=ds.collate,
                        num_workers=2, drop_last=True)
        opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
        sched = get_linear_schedule_with_warmup(opt, int(0.06 * len(dl)), len(dl))
        sampler.set_epoch(0)  # single pass over every task
        ddp.train()
        for i, batch in enumerate(dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = ddp(**batch).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            # store the raw examples of this batch in the episodic memory
            ids = batch["input_ids"].cpu()
            memory.add(tok.batch_decode(ids, skip_special_tokens=True), batch["labels"].tolist())

            if t > 0 and step % args.replay_every == 0:
                texts, labels = zip(*memory.sample(args.replay_batch))
                rb = tok(list(texts), truncation=True, max_length=args.max_len, padding=True,
                         return_tensors="pt").to(device)
                rloss = F.cross_entropy(ddp(**rb).logits, torch.tensor(labels, device=device))
                opt.zero_grad()
                rloss.backward()
                opt.step()

            if i % 500 == 0:
                logger.info("task %s it %d/%d loss %.4f", task, i, len(dl), loss.item())

        for j in range(t + 1):
            acc[t, j] = evaluate(model, tok, args, TASKS[j], device, rank, world)
        logger.info("after %s: %s  avg %.4f", task, np.round(acc[t, : t + 1], 4), acc[t, : t + 1].mean())
        if rank == 0:
            os.makedirs(args.output_dir, exist_ok=True)
            model.save_pretrained(os.path.join(args.output_dir, f"after_{task}"))
            tok.save_pretrained(os.path.join(args.output_dir, f"after_{task}"))
            np.save(os.path.join(args.output_dir, "acc.npy"), acc)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
