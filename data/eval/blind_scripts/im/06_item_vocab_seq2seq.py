#!/usr/bin/env python3
"""
Seq2seq recommender on Amazon reviews (string ASINs) with frozen RQ-VAE semantic IDs.
Users are split into train / held-out users (inductive setting) so that we can
measure recall@k on users never seen in training.

torchrun --nnodes=1 --nproc_per_node=8 06_item_vocab_seq2seq.py \
    --reviews data/amazon/Toys.jsonl --sem_ids artifacts/toys/sem_ids.json
"""
import argparse
import json
import os
import random
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import T5Config, T5ForConditionalGeneration, get_linear_schedule_with_warmup

PAD_ID, EOS_ID = 0, 1
N_SPECIAL = 2


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def load_user_sequences(path, min_len=5):
    by_user = defaultdict(list)
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            by_user[r["reviewerID"]].append((r["unixReviewTime"], r["asin"]))
    seqs = {}
    for u, events in by_user.items():
        if len(events) >= min_len:
            seqs[u] = [a for _, a in sorted(events)]
    return seqs


def split_users(users, holdout_frac):
    users = sorted(users)
    random.shuffle(users)
    n_hold = int(len(users) * holdout_frac)
    return users[n_hold:], users[:n_hold]


class NextItemDataset(Dataset):
    def __init__(self, seqs, users, sem_ids, K, max_items, last_only):
        self.sem_ids, self.K = sem_ids, K
        self.examples = []
        for u in users:
            s = [a for a in seqs[u] if a in sem_ids]
            if len(s) < 2:
                continue
            if last_only:
                self.examples.append((s[-1 - max_items:-1], s[-1]))
            else:
                for t in range(1, len(s)):
                    self.examples.append((s[max(0, t - max_items):t], s[t]))

    def ids(self, asin):
        return [N_SPECIAL + lvl * self.K + c for lvl, c in enumerate(self.sem_ids[asin])]

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        hist, tgt = self.examples[i]
        src = [t for a in hist for t in self.ids(a)]
        return src, self.ids(tgt) + [EOS_ID]


def collate(batch):
    L = max(len(s) for s, _ in batch)
    src = torch.full((len(batch), L), PAD_ID)
    for i, (s, _) in enumerate(batch):
        src[i, :len(s)] = torch.tensor(s)
    tgt = torch.tensor([t for _, t in batch])
    return {"input_ids": src, "attention_mask": (src != PAD_ID).long(), "labels": tgt}


@torch.no_grad()
def recall_at_k(net, loader, device, n_levels, beams=20, ks=(5, 10, 20)):
    net.eval()
    hits = torch.zeros(len(ks) + 1, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = net.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           num_beams=beams, num_return_sequences=beams, max_new_tokens=n_levels + 1)
        B = batch["input_ids"].size(0)
        cand = out[:, 1:n_levels + 1].view(B, beams, n_levels)
        match = (cand == batch["labels"][:, None, :n_levels]).all(-1)
        for j, k in enumerate(ks):
            hits[j] += match[:, :k].any(-1).sum()
        hits[-1] += B
    dist.all_reduce(hits)
    net.train()
    return {f"recall@{k}": (hits[j] / hits[-1]).item() for j, k in enumerate(ks)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reviews", required=True)
    ap.add_argument("--sem_ids", required=True)
    ap.add_argument("--codebook_size", type=int, default=256)
    ap.add_argument("--holdout_frac", type=float, default=0.1)
    ap.add_argument("--max_items", type=int, default=20)
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--out", default="outputs/toys_seq2seq")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--wandb_project", default="genrec")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different dropout masks per rank
    set_seed(args.seed + rank)

    with open(args.sem_ids) as f:
        sem_ids = {k: tuple(v) for k, v in json.load(f).items()}
    n_levels = len(next(iter(sem_ids.values())))
    seqs = load_user_sequences(args.reviews)
    train_users, heldout_users = split_users(seqs.keys(), args.holdout_frac)

    train_ds = NextItemDataset(seqs, train_users, sem_ids, args.codebook_size, args.max_items, last_only=False)
    test_ds = NextItemDataset(seqs, heldout_users, sem_ids, args.codebook_size, args.max_items, last_only=True)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True)
    test_sub = torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world))
    test_dl = DataLoader(test_sub, batch_size=64, collate_fn=collate, num_workers=2)

    cfg = T5Config(vocab_size=N_SPECIAL + n_levels * args.codebook_size, d_model=256, d_ff=1024, d_kv=32,
                   num_layers=4, num_heads=8, dropout_rate=0.1, pad_token_id=PAD_ID,
                   eos_token_id=EOS_ID, decoder_start_token_id=PAD_ID)
    net = T5ForConditionalGeneration(cfg).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = get_linear_schedule_with_warmup(opt, args.warmup, args.epochs * len(train_dl))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project=args.wandb_project, config=vars(args), name=os.path.basename(args.out))
        print(f"train users {len(train_users)} heldout {len(heldout_users)} train examples {len(train_ds)}")

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        acc = torch.zeros(2, device=device)
        for it, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(acc)
        metrics = recall_at_k(net, test_dl, device, n_levels)
        if rank == 0:
            metrics["train_loss"] = (acc[0] / acc[1]).item()
            wandb.log(metrics, step=epoch)
            print(epoch, metrics, flush=True)
            if metrics["recall@10"] > best:
                best = metrics["recall@10"]
                net.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
