"""Fine-tune t5-small for news summarization (jsonl with "article" / "highlights").

torchrun --nproc_per_node=4 train_summ.py --train data/cnndm/train.jsonl --valid data/cnndm/val.jsonl
"""
import argparse
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from rouge_score import rouge_scorer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, T5ForConditionalGeneration, get_linear_schedule_with_warmup


def get_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="t5-small")
    parser.add_argument("--train", required=True)
    parser.add_argument("--valid", required=True)
    parser.add_argument("--save_dir", default="ckpt/t5_cnndm")
    parser.add_argument("--max_source_len", type=int, default=512)
    parser.add_argument("--max_target_len", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--grad_accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--warmup_steps", type=int, default=500)
    parser.add_argument("--eval_samples", type=int, default=500)
    parser.add_argument("--num_beams", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1234)
    return parser


class SummDataset(Dataset):
    def __init__(self, path, tokenizer, max_src, max_tgt, limit=None):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        if limit:
            self.rows = self.rows[:limit]
        self.tok, self.max_src, self.max_tgt = tokenizer, max_src, max_tgt

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return "summarize: " + self.rows[i]["article"], self.rows[i]["highlights"]

    def collate(self, batch):
        src, tgt = zip(*batch)
        enc = self.tok(list(src), max_length=self.max_src, truncation=True, padding=True,
                       return_tensors="pt")
        labels = self.tok(list(tgt), max_length=self.max_tgt, truncation=True, padding=True,
                          return_tensors="pt").input_ids
        labels[labels == self.tok.pad_token_id] = -100
        enc["labels"] = labels
        return enc


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rouge_eval(model, tokenizer, dataset, device, args):
    """Runs on rank 0 only: beam-search summaries for the first eval_samples articles."""
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    loader = DataLoader(dataset, batch_size=32, collate_fn=dataset.collate)
    scores = {"rouge1": [], "rouge2": [], "rougeL": []}
    model.eval()
    with torch.no_grad():
        for batch in loader:
            out = model.generate(input_ids=batch["input_ids"].to(device),
                                 attention_mask=batch["attention_mask"].to(device),
                                 num_beams=args.num_beams, max_length=args.max_target_len,
                                 early_stopping=True)
            preds = tokenizer.batch_decode(out, skip_special_tokens=True)
            labels = batch["labels"].masked_fill(batch["labels"] == -100, tokenizer.pad_token_id)
            refs = tokenizer.batch_decode(labels, skip_special_tokens=True)
            for p, r in zip(preds, refs):
                s = scorer.score(r, p)
                for k in scores:
                    scores[k].append(s[k].fmeasure)
    model.train()
    return {k: 100 * float(np.mean(v)) for k, v in scores.items()}


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = T5ForConditionalGeneration.from_pretrained(args.model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    train_ds = SummDataset(args.train, tokenizer, args.max_source_len, args.max_target_len)
    valid_ds = SummDataset(args.valid, tokenizer, args.max_source_len, args.max_target_len,
                           limit=args.eval_samples)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              collate_fn=train_ds.collate, num_workers=4, pin_memory=True,
                              drop_last=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    updates_per_epoch = len(train_loader) // args.grad_accum
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps,
                                                updates_per_epoch * args.epochs)

    if rank == 0:
        print(f"{len(train_ds)} train examples, {world_size} GPUs, "
              f"global batch {args.batch_size * args.grad_accum * world_size}")

    best_r2 = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        acc = torch.zeros(2, device=device)
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            sync = (step + 1) % args.grad_accum == 0
            if sync:
                loss = model(**batch).loss / args.grad_accum
                loss.backward()
            else:
                with model.no_sync():
                    loss = model(**batch).loss / args.grad_accum
                    loss.backward()
            acc[0] += loss.detach() * args.grad_accum
            acc[1] += 1
            if sync:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item() * args.grad_accum:.4f}")
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} mean train loss {(acc[0] / acc[1]).item():.4f}")
            scores = rouge_eval(model, tokenizer, valid_ds, device, args)
            print(f"epoch {epoch} ROUGE-1 {scores['rouge1']:.2f} ROUGE-2 {scores['rouge2']:.2f} "
                  f"ROUGE-L {scores['rougeL']:.2f}")
            if scores["rouge2"] > best_r2:
                best_r2 = scores["rouge2"]
                model.module.save_pretrained(args.save_dir)
                tokenizer.save_pretrained(args.save_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
