"""Dialogue summarization (SAMSum) with flan-t5-base, token-budget batches, DDP.

torchrun --nproc_per_node=4 10_samsum_t5_tokcache.py --data_dir data/samsum --cache_dir cache/ --out_dir runs/samsum_t5
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from rouge_score import rouge_scorer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, get_cosine_schedule_with_warmup


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="google/flan-t5-base")
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--cache_dir", default="cache")
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--max_src", type=int, default=512)
    ap.add_argument("--max_tgt", type=int, default=96)
    ap.add_argument("--max_tokens", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def load_or_tokenize(tokenizer, args, split):
    cache_file = os.path.join(args.cache_dir, f"samsum_{split}_{os.path.basename(args.model)}_{args.max_src}_{args.max_tgt}.pt")
    if os.path.exists(cache_file):
        return torch.load(cache_file)
    with open(os.path.join(args.data_dir, f"{split}.json")) as f:
        rows = json.load(f)
    rows = [r for r in rows if r["dialogue"].strip() and r["summary"].strip()]
    src = tokenizer(["summarize: " + r["dialogue"] for r in rows], max_length=args.max_src, truncation=True)["input_ids"]
    tgt = tokenizer(text_target=[r["summary"] for r in rows], max_length=args.max_tgt, truncation=True)["input_ids"]
    data = {"src": src, "tgt": tgt, "ref": [r["summary"] for r in rows]}
    os.makedirs(args.cache_dir, exist_ok=True)
    torch.save(data, cache_file)
    return data


class Seq2SeqData(Dataset):
    def __init__(self, d):
        self.src, self.tgt = d["src"], d["tgt"]

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return i, self.src[i], self.tgt[i]


class DistributedTokenBatchSampler(Sampler):
    """Length-sorted buckets of up to max_tokens; same number of batches on every rank."""

    def __init__(self, lengths, max_tokens, rank, world, seed=0, shuffle=True):
        self.lengths, self.max_tokens = lengths, max_tokens
        self.rank, self.world, self.seed, self.shuffle = rank, world, seed, shuffle
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        order = sorted(range(len(self.lengths)), key=lambda i: self.lengths[i])
        out, cur, width = [], [], 0
        for i in order:
            w = max(width, self.lengths[i])
            if cur and w * (len(cur) + 1) > self.max_tokens:
                out.append(cur)
                cur, w = [], self.lengths[i]
            cur.append(i)
            width = w
        if cur:
            out.append(cur)
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(out)
        usable = len(out) - len(out) % self.world
        return out[:usable][self.rank::self.world]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


def make_collate(pad_id):
    def collate(batch):
        idx = [b[0] for b in batch]
        src = torch.nn.utils.rnn.pad_sequence([torch.tensor(b[1]) for b in batch], batch_first=True, padding_value=pad_id)
        tgt = torch.nn.utils.rnn.pad_sequence([torch.tensor(b[2]) for b in batch], batch_first=True, padding_value=-100)
        return idx, src, src.ne(pad_id).long(), tgt
    return collate


@torch.no_grad()
def rouge_eval(model, tokenizer, data, refs, collate, device, rank, world):
    model.eval()
    ids = list(range(rank, len(data), world))
    out = []
    for s in range(0, len(ids), 48):
        idx, src, attn, _ = collate([data[i] for i in ids[s:s + 48]])
        gen = model.generate(input_ids=src.to(device), attention_mask=attn.to(device), max_new_tokens=96,
                             num_beams=1, do_sample=False)
        out.extend(zip(idx, tokenizer.batch_decode(gen, skip_special_tokens=True)))
    parts = [None] * world
    dist.all_gather_object(parts, out)
    model.train()
    if rank != 0:
        return None
    preds = dict(p for part in parts for p in part)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    agg = {k: 0.0 for k in ("rouge1", "rouge2", "rougeL")}
    for i, ref in enumerate(refs):
        sc = scorer.score(ref, preds[i])
        for k in agg:
            agg[k] += sc[k].fmeasure
    return {k: round(100 * v / len(refs), 2) for k, v in agg.items()}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_raw = load_or_tokenize(tokenizer, args, "train")
    val_raw = load_or_tokenize(tokenizer, args, "validation")
    train_ds, val_ds = Seq2SeqData(train_raw), Seq2SeqData(val_raw)
    collate = make_collate(tokenizer.pad_token_id)

    lengths = [max(len(s), len(t)) for s, t in zip(train_raw["src"], train_raw["tgt"])]
    batch_sampler = DistributedTokenBatchSampler(lengths, args.max_tokens, rank, world, seed=args.seed)
    loader = DataLoader(train_ds, batch_sampler=batch_sampler, collate_fn=collate, num_workers=4, pin_memory=True)

    model = AutoModelForSeq2SeqLM.from_pretrained(args.model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = len(batch_sampler) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, total)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"train={len(train_ds)} val={len(val_ds)} batches/rank/epoch={len(batch_sampler)} world={world}")

    best = -1.0
    for epoch in range(args.epochs):
        batch_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for _, src, attn, labels in loader:
            src, attn, labels = src.to(device), attn.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=src, attention_mask=attn, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            stats += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(stats)

        scores = rouge_eval(model.module, tokenizer, val_ds, val_raw["ref"], collate, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} loss {(stats[0] / stats[1]).item():.4f} {scores} ({time.time() - t0:.0f}s)", flush=True)
            if scores["rouge2"] > best:
                best = scores["rouge2"]
                model.module.save_pretrained(os.path.join(args.out_dir, "best"))
                tokenizer.save_pretrained(os.path.join(args.out_dir, "best"))
                with open(os.path.join(args.out_dir, "best", "val_scores.json"), "w") as f:
                    json.dump({"epoch": epoch, **scores}, f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
