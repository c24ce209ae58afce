#!/usr/bin/env python
"""
i2b2-2010 relation classification (TrIP, TrWP, TrCP, TrAP, TrNAP, TeRP, TeCP, PIP + None).

Started as a plain python script; one worker process per visible GPU is spawned:
    CUDA_VISIBLE_DEVICES=0,1,2,3 python 06_re_i2b2_spawn.py --data data/i2b2_2010_rel --out runs/rel_ddp

Batches are built with a token budget (sentences of similar length go together) from the whole training
set on every rank, with the same seed, then dealt out round-robin; the list is cut to a multiple of the
number of ranks so every rank runs the same number of steps.
"""
import argparse
import json
import os
import random

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

RELS = ["None", "TrIP", "TrWP", "TrCP", "TrAP", "TrNAP", "TeRP", "TeCP", "PIP"]
MARKERS = ["[E1]", "[/E1]", "[E2]", "[/E2]"]


def load_examples(path, tok, max_len):
    out = []
    with open(path) as f:
        for line in f:
            ex = json.loads(line)
            ids = tok(ex["text"], truncation=True, max_length=max_len)["input_ids"]
            e1 = tok.convert_tokens_to_ids("[E1]")
            e2 = tok.convert_tokens_to_ids("[E2]")
            if e1 not in ids or e2 not in ids:
                continue  # marker fell outside max_len; dropped identically on every rank
            out.append((ids, ids.index(e1), ids.index(e2), RELS.index(ex["label"])))
    return out


def token_budget_batches(examples, indices, max_tokens, shuffle, rng):
    indices = sorted(indices, key=lambda i: len(examples[i][0]))
    batches, cur, cur_max = [], [], 0
    for i in indices:
        n = len(examples[i][0])
        if cur and max(cur_max, n) * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    if shuffle:
        rng.shuffle(batches)
    return batches


def to_tensors(examples, batch, pad_id, device):
    L = max(len(examples[i][0]) for i in batch)
    ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
    for r, i in enumerate(batch):
        ids[r, : len(examples[i][0])] = torch.tensor(examples[i][0])
    e1 = torch.tensor([examples[i][1] for i in batch])
    e2 = torch.tensor([examples[i][2] for i in batch])
    y = torch.tensor([examples[i][3] for i in batch])
    return ids.to(device), (ids != pad_id).long().to(device), e1.to(device), e2.to(device), y.to(device)


class MarkerRE(nn.Module):
    def __init__(self, name, vocab_size, n_rel):
        super().__init__()
        self.enc = AutoModel.from_pretrained(name, add_pooling_layer=False)
        self.enc.resize_token_embeddings(vocab_size)
        h = self.enc.config.hidden_size
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(2 * h, n_rel))

    def forward(self, ids, mask, e1, e2):
        h = self.enc(input_ids=ids, attention_mask=mask).last_hidden_state
        r = torch.arange(h.size(0), device=h.device)
        return self.head(torch.cat([h[r, e1], h[r, e2]], -1))


@torch.no_grad()
def evaluate(model, examples, pad_id, device, rank, world, max_tokens):
    model.eval()
    shard = list(range(rank, len(examples), world))
    counts = torch.zeros(3, len(RELS), device=device)  # tp, fp, fn per relation
    for batch in token_budget_batches(examples, shard, max_tokens, False, None):
        ids, mask, e1, e2, y = to_tensors(examples, batch, pad_id, device)
        pred = model(ids, mask, e1, e2).argmax(-1)
        for c in range(1, len(RELS)):
            counts[0, c] += ((pred == c) & (y == c)).sum()
            counts[1, c] += ((pred == c) & (y != c)).sum()
            counts[2, c] += ((pred != c) & (y == c)).sum()
    dist.all_reduce(counts)
    tp, fp, fn = counts[0, 1:].sum(), counts[1, 1:].sum(), counts[2, 1:].sum()
    micro = (2 * tp / (2 * tp + fp + fn).clamp(min=1)).item()
    per_class = 2 * counts[0, 1:] / (2 * counts[0, 1:] + counts[1, 1:] + counts[2, 1:]).clamp(min=1)
    return micro, per_class.mean().item()


def worker(rank, world, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    train = load_examples(os.path.join(args.data, "train.jsonl"), tok, args.max_len)
    dev = load_examples(os.path.join(args.data, "dev.jsonl"), tok, args.max_len)

    model = MarkerRE(args.model, len(tok), len(RELS)).to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    n_batches = len(token_budget_batches(train, range(len(train)), args.max_tokens, False, None))
    approx_steps = n_batches // world * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * approx_steps), approx_steps)
    loss_fn = nn.CrossEntropyLoss()

    start_epoch, best = 0, 0.0
    ckpt_path = os.path.join(args.out, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]

    for epoch in range(start_epoch, args.epochs):
        model.train()
        rng = random.Random(args.seed + epoch)          # same batches, same order on every rank
        batches = token_budget_batches(train, range(len(train)), args.max_tokens, True, rng)
        batches = batches[: len(batches) - len(batches) % world]
        my_batches = batches[rank::world]
        for batch in my_batches:
            ids, mask, e1, e2, y = to_tensors(train, batch, tok.pad_token_id, device)
            loss = loss_fn(model(ids, mask, e1, e2), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()

        micro, macro = evaluate(model.module, dev, tok.pad_token_id, device, rank, world, args.max_tokens)
        if rank == 0:
            print(f"epoch {epoch}: {len(my_batches)} batches on rank0, dev micro-F1 {micro:.4f} "
                  f"macro-F1 {macro:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "epoch": epoch, "best": max(best, micro)}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if micro > best:
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        best = max(best, micro)
        dist.barrier()

    dist.destroy_process_group()


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="emilyalsentzer/Bio_ClinicalBERT")
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--max_tokens", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--port", default="29511")
    return ap.parse_args()


if __name__ == "__main__":
    args = parse_args()
    world = torch.cuda.device_count()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    mp.spawn(worker, args=(world, args), nprocs=world, join=True)
