"""Contract clause extraction with Longformer token classification.

Contracts are split into 4096-token windows (stride 512) with global attention
on <s>. Span-level F1 is computed over the whole dev set after gathering the
window predictions from all ranks.

    torchrun --nproc_per_node=4 06_longformer_clause_extract.py \
        --train data/clauses/train.jsonl --dev data/clauses/dev.jsonl --out runs/lf_clauses
"""
import argparse
import json
import logging
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (
    AutoTokenizer,
    DataCollatorForTokenClassification,
    LongformerForTokenClassification,
    get_linear_schedule_with_warmup,
)

logger = logging.getLogger(__name__)

CLAUSE_TYPES = [
    "governing_law", "termination_for_convenience", "change_of_control", "anti_assignment",
    "non_compete", "exclusivity", "limitation_of_liability", "indemnification",
    "ip_ownership", "audit_rights", "insurance", "warranty_duration",
]
LABELS = ["O"] + [f"{p}-{c}" for c in CLAUSE_TYPES for p in ("B", "I")]
LABEL2ID = {l: i for i, l in enumerate(LABELS)}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="allenai/longformer-base-4096")
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--patience", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


class WindowDataset(Dataset):
    def __init__(self, path, tokenizer, window, stride):
        self.items = []
        with open(path) as f:
            for line in f:
                doc = json.loads(line)
                enc = tokenizer(doc["words"], is_split_into_words=True, truncation=True,
                                max_length=window, stride=stride, return_overflowing_tokens=True)
                for w in range(len(enc["input_ids"])):
                    word_ids = enc.word_ids(w)
                    labels, prev = [], None
                    for wid in word_ids:
                        labels.append(-100 if wid is None or wid == prev else LABEL2ID[doc["tags"][wid]])
                        prev = wid
                    self.items.append({
                        "key": (doc["doc_id"], w),
                        "word_ids": word_ids,
                        "input_ids": enc["input_ids"][w],
                        "attention_mask": enc["attention_mask"][w],
                        "labels": labels,
                    })

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        return {"input_ids": it["input_ids"], "attention_mask": it["attention_mask"],
                "labels": it["labels"], "index": i}


def add_global_attention(batch):
    g = torch.zeros_like(batch["input_ids"])
    g[:, 0] = 1
    batch["global_attention_mask"] = g
    return batch


def spans_from_word_tags(tags):
    spans, start, cur = set(), None, None
    for i, t in enumerate(tags + ["O"]):
        pre, _, typ = t.partition("-")
        if cur is not None and (pre != "I" or typ != cur):
            spans.add((start, i, cur))
            cur = None
        if pre == "B" or (pre == "I" and cur is None):
            start, cur = i, typ
    return spans


@torch.no_grad()
def evaluate(model, loader, dataset, device, world_size):
    model.eval()
    local = []
    for batch in loader:
        index = batch.pop("index")
        batch = add_global_attention({k: v.to(device) for k, v in batch.items()})
        pred = model(**batch).logits.argmax(-1).cpu()
        for row, i in zip(pred, index.tolist()):
            local.append((i, row.tolist()))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)

    tp = fp = fn = 0
    done = set()
    for part in gathered:
        for i, row in part:
            if i in done:          # padded duplicates from DistributedSampler
                continue
            done.add(i)
            item = dataset.items[i]
            p_tags, g_tags, prev = [], [], None
            for pos, wid in enumerate(item["word_ids"]):
                if wid is None or wid == prev:
                    prev = wid
                    continue
                p_tags.append(LABELS[row[pos]])
                g_tags.append(LABELS[item["labels"][pos]])
                prev = wid
            ps, gs = spans_from_word_tags(p_tags), spans_from_word_tags(g_tags)
            tp += len(ps & gs)
            fp += len(ps - gs)
            fn += len(gs - ps)
    p = tp / max(tp + fp, 1)
    r = tp / max(tp + fn, 1)
    model.train()
    return {"p": p, "r": r, "f1": 2 * p * r / max(p + r, 1e-9), "windows": len(done)}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model, add_prefix_space=True)
    train_ds = WindowDataset(args.train, tokenizer, args.window, args.stride)
    dev_ds = WindowDataset(args.dev, tokenizer, args.window, args.stride)
    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=512)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=2, pin_memory=True)
    dev_loader = DataLoader(dev_ds, batch_size=args.batch_size,
                            sampler=DistributedSampler(dev_ds, shuffle=False),
                            collate_fn=collator, num_workers=2)

    model = LongformerForTokenClassification.from_pretrained(
        args.model, num_labels=len(LABELS), id2label=dict(enumerate(LABELS)), label2id=LABEL2ID)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total), total)

    best_f1, stale = -1.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, batch in enumerate(train_loader):
            batch.pop("index")
            batch = add_global_attention({k: v.to(device, non_blocking=True) for k, v in batch.items()})
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 100 == 0:
                logger.info("ep %d step %d/%d loss %.4f (%.0fs)", epoch, step, len(train_loader),
                            loss.item(), time.time() - t0)

        metrics = evaluate(model.module, dev_loader, dev_ds, device, world_size)
        logger.info("epoch %d dev span %s", epoch, metrics)

        improved = metrics["f1"] > best_f1
        if improved:
            best_f1, stale = metrics["f1"], 0
            if rank == 0:
                model.module.save_pretrained(os.path.join(args.out, "best"))
                tokenizer.save_pretrained(os.path.join(args.out, "best"))
        else:
            stale += 1
        # rank 0 decides, so that a float rounding difference can never split the ranks
        stop = [stale >= args.patience]
        dist.broadcast_object_list(stop, src=0)
        dist.barrier()
        if stop[0]:
            logger.info("no improvement for %d epochs, stopping", args.patience)
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
