"""Text-to-SQL (Spider) with T5-large: question + serialized schema -> SQL.
Dev metric is normalized exact match over the full dev split.

    torchrun --nproc_per_node=4 15_text2sql_t5_exact_match.py \
        --spider_dir data/spider --output_dir runs/t5l_spider --bf16
"""
import argparse
import contextlib
import json
import logging
import os
import re
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, T5ForConditionalGeneration, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--spider_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--model_name", default="t5-large")
    parser.add_argument("--max_input_len", type=int, default=512)
    parser.add_argument("--max_output_len", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--grad_accum", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--eval_every_epochs", type=int, default=2)
    parser.add_argument("--num_beams", type=int, default=4)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def serialize_schema(db):
    parts = []
    for t_idx, table in enumerate(db["table_names_original"]):
        cols = [c for ti, c in db["column_names_original"] if ti == t_idx]
        parts.append(f"{table} : " + " , ".join(cols))
    return " | ".join(parts)


def normalize_sql(sql):
    sql = sql.strip().rstrip(";").lower()
    sql = re.sub(r"\s+", " ", sql)
    sql = re.sub(r"\s*([(),=<>])\s*", r" \1 ", sql)
    sql = sql.replace('"', "'")
    return " ".join(sql.split())


class SpiderDataset(Dataset):
    def __init__(self, path, schemas, tokenizer, args):
        with open(path) as f:
            rows = json.load(f)
        self.examples = []
        for r in rows:
            src = f"{r['question']} | {r['db_id']} | {serialize_schema(schemas[r['db_id']])}"
            self.examples.append({
                "input_ids": tokenizer(src, max_length=args.max_input_len, truncation=True)["input_ids"],
                "labels": tokenizer(text_target=r["query"], max_length=args.max_output_len, truncation=True)["input_ids"],
                "sql": r["query"],
            })

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


class Collator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        L = max(len(b["input_ids"]) for b in batch)
        T = max(len(b["labels"]) for b in batch)
        ids = torch.full((len(batch), L), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), T), -100, dtype=torch.long)
        for i, b in enumerate(batch):
            ids[i, :len(b["input_ids"])] = torch.tensor(b["input_ids"])
            labels[i, :len(b["labels"])] = torch.tensor(b["labels"])
        return {"input_ids": ids, "attention_mask": ids.ne(self.pad_id).long(), "labels": labels}


@torch.no_grad()
def exact_match(model, dataset, tokenizer, collate, args, device, rank, world_size):
    model.eval()
    idx = list(range(rank, len(dataset), world_size))
    hits = torch.zeros(2, device=device)
    for s in range(0, len(idx), 32):
        items = [dataset[i] for i in idx[s:s + 32]]
        batch = collate(items)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.bf16):
            out = model.generate(input_ids=batch["input_ids"].to(device),
                                 attention_mask=batch["attention_mask"].to(device),
                                 num_beams=args.num_beams, max_length=args.max_output_len)
        for pred, ex in zip(tokenizer.batch_decode(out, skip_special_tokens=True), items):
            hits[0] += float(normalize_sql(pred) == normalize_sql(ex["sql"]))
            hits[1] += 1
    dist.all_reduce(hits)
    model.train()
    return (hits[0] / hits[1]).item()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    # T5's sentencepiece vocab has no '<' or '{'; add the few SQL symbols it is missing
    tokenizer.add_tokens(["<", "<=", "{", "}"])
    with open(os.path.join(args.spider_dir, "tables.json")) as f:
        schemas = {db["db_id"]: db for db in json.load(f)}
    train_ds = SpiderDataset(os.path.join(args.spider_dir, "train_spider.json"), schemas, tokenizer, args)
    dev_ds = SpiderDataset(os.path.join(args.spider_dir, "dev.json"), schemas, tokenizer, args)
    collate = Collator(tokenizer.pad_token_id)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=4, pin_memory=True, drop_last=True)

    model = T5ForConditionalGeneration.from_pretrained(args.model_name)
    model.resize_token_embeddings(len(tokenizer))
    model.to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = len(loader) // args.grad_accum * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=int(0.03 * total), num_training_steps=total)

    logger.info("train=%d dev=%d world=%d total_updates=%d", len(train_ds), len(dev_ds), world_size, total)
    best_em = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for it, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            is_update = (it + 1) % args.grad_accum == 0
            with model.no_sync() if not is_update else contextlib.nullcontext():
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.bf16):
                    loss = model(**batch).loss / args.grad_accum
                loss.backward()
            if is_update:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            acc += torch.stack([loss.detach() * args.grad_accum, torch.ones((), device=device)])
        dist.all_reduce(acc)
        logger.info("epoch %d train loss %.4f (%.0fs)", epoch, (acc[0] / acc[1]).item(), time.time() - t0)

        if (epoch + 1) % args.eval_every_epochs == 0 or epoch + 1 == args.epochs:
            em = exact_match(model.module, dev_ds, tokenizer, collate, args, device, rank, world_size)
            logger.info("epoch %d dev EM %.2f", epoch, 100 * em)
            if rank == 0 and em > best_em:
                best_em = em
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))
            dist.barrier()

    logger.info("best dev EM %.2f", 100 * best_em)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
