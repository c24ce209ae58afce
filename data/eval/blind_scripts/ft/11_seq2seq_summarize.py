"""Fine-tune T5 for abstractive summarisation with token-budget batching.

Articles range from 50 to 1024 tokens; grouping by source length and filling each batch up to
--max-source-tokens keeps padding low and memory roughly constant per step.

torchrun --nproc_per_node=8 11_seq2seq_summarize.py --train data/xsum_train.jsonl \
    --valid data/xsum_valid.jsonl --model t5-base --output_dir runs/t5_xsum
"""
import argparse
import json
import math
import os
import random
import time

import torch
import torch.distributed as dist
from rouge_score import rouge_scorer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, get_linear_schedule_with_warmup


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--model", default="t5-base")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_source_len", type=int, default=1024)
    p.add_argument("--max_target_len", type=int, default=64)
    p.add_argument("--max_source_tokens", type=int, default=12000)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup_steps", type=int, default=500)
    p.add_argument("--eval_max_examples", type=int, default=2000)
    p.add_argument("--num_beams", type=int, default=4)
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


class SummDataset(Dataset):
    def __init__(self, path, tok, max_src, max_tgt, limit=None, prefix="summarize: "):
        with open(path) as f:
            rows = [json.loads(l) for l in f]
        if limit:
            rows = rows[:limit]
        self.src = tok([prefix + r["document"] for r in rows], truncation=True, max_length=max_src)["input_ids"]
        self.tgt = tok([r["summary"] for r in rows], truncation=True, max_length=max_tgt)["input_ids"]
        self.refs = [r["summary"] for r in rows]
        self.lengths = [len(s) for s in self.src]

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return i, self.src[i], self.tgt[i]


class Collator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        idx, src, tgt = zip(*batch)
        S, T = max(map(len, src)), max(map(len, tgt))
        input_ids = torch.full((len(batch), S), self.pad_id)
        attn = torch.zeros((len(batch), S), dtype=torch.long)
        labels = torch.full((len(batch), T), -100)
        for i, (s, t) in enumerate(zip(src, tgt)):
            input_ids[i, : len(s)] = torch.tensor(s)
            attn[i, : len(s)] = 1
            labels[i, : len(t)] = torch.tensor(t)
        return torch.tensor(idx), input_ids, attn, labels


class DistributedSortedBatchSampler(Sampler):
    def __init__(self, lengths, max_tokens, num_replicas, rank, shuffle=True, seed=0, pad=True, pool=200):
        self.lengths, self.max_tokens = lengths, max_tokens
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.pad, self.pool = shuffle, seed, pad, pool
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _build(self):
        rnd = random.Random(self.seed + self.epoch)
        order = list(range(len(self.lengths)))
        if self.shuffle:
            rnd.shuffle(order)
        # sort inside pools of `pool` future batches' worth of examples
        pool_size = self.pool * max(1, self.max_tokens // 512)
        batches = []
        for s in range(0, len(order), pool_size):
            chunk = sorted(order[s:s + pool_size], key=lambda i: self.lengths[i], reverse=True)
            cur, width = [], 0
            for i in chunk:
                w = max(width, self.lengths[i])
                if cur and w * (len(cur) + 1) > self.max_tokens:
                    batches.append(cur)
                    cur, w = [], self.lengths[i]
                cur.append(i)
                width = w
            if cur:
                batches.append(cur)
        if self.shuffle:
            rnd.shuffle(batches)
        if self.pad and len(batches) % self.num_replicas:
            batches.extend(batches[: self.num_replicas - len(batches) % self.num_replicas])
        return batches[self.rank::self.num_replicas]

    def __iter__(self):
        return iter(self._build())

    def __len__(self):
        return len(self._build())


def evaluate(model, tok, loader, refs, args, device):
    model.eval()
    preds = {}
    with torch.no_grad():
        for idx, input_ids, attn, _ in loader:
            out = model.generate(input_ids=input_ids.to(device), attention_mask=attn.to(device),
                                 num_beams=args.num_beams, max_new_tokens=args.max_target_len)
            for i, text in zip(idx.tolist(), tok.batch_decode(out, skip_special_tokens=True)):
                preds[i] = text
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, preds)
    model.train()
    if dist.get_rank() != 0:
        return None
    merged = {}
    for part in gathered:
        merged.update(part)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for i, hyp in merged.items():
        s = scorer.score(refs[i], hyp)
        for k in totals:
            totals[k] += s[k].fmeasure
    return {k: 100 * v / len(merged) for k, v in totals.items()}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds = SummDataset(args.train, tok, args.max_source_len, args.max_target_len)
    valid_ds = SummDataset(args.valid, tok, args.max_source_len, args.max_target_len, limit=args.eval_max_examples)
    collator = Collator(tok.pad_token_id)
    train_sampler = DistributedSortedBatchSampler(train_ds.lengths, args.max_source_tokens, world, rank,
                                                  seed=args.seed)
    valid_sampler = DistributedSortedBatchSampler(valid_ds.lengths, args.max_source_tokens // 2, world, rank,
                                                  shuffle=False, pad=False)
    train_loader = DataLoader(train_ds, batch_sampler=train_sampler, collate_fn=collator, num_workers=4,
                              pin_memory=True)
    valid_loader = DataLoader(valid_ds, batch_sampler=valid_sampler, collate_fn=collator, num_workers=2)

    model = AutoModelForSeq2SeqLM.from_pretrained(args.model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total_steps = args.epochs * len(train_sampler)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)

    best_rl = -1.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for _, input_ids, attn, labels in train_loader:
            input_ids, attn, labels = input_ids.to(device), attn.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 100 == 0:
                elapsed = time.time() - t0
                print(f"epoch {epoch} step {step}/{total_steps} loss {loss.item():.4f} "
                      f"({elapsed / 100:.2f}s/step)", flush=True)
                t0 = time.time()

        scores = evaluate(model, tok, valid_loader, valid_ds.refs, args, device)
        if rank == 0:
            print(f"epoch {epoch} ROUGE: " + " ".join(f"{k}={v:.2f}" for k, v in scores.items()), flush=True)
            if scores["rougeL"] > best_rl:
                best_rl = scores["rougeL"]
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                tok.save_pretrained(os.path.join(args.output_dir, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
