"""CoNLL-2003 NER fine-tuning: DDP + torch.compile(dynamic seq len) + bucketed padding.

    torchrun --nproc_per_node=4 ner_compile_buckets.py --model roberta-large --out runs/ner_rl
"""
import argparse
import contextlib
import os

import numpy as np
import torch
import torch.distributed as dist
import torch._dynamo
from datasets import load_dataset
from seqeval.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForTokenClassification, AutoTokenizer, get_linear_schedule_with_warmup

BUCKETS = (32, 64, 128, 256)


@contextlib.contextmanager
def rank0_first(rank):
    if rank != 0:
        dist.barrier()
    yield
    if rank == 0:
        dist.barrier()


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="roberta-large")
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


def tokenize_and_align(examples, tokenizer):
    enc = tokenizer(examples["tokens"], is_split_into_words=True, truncation=True, max_length=BUCKETS[-1])
    all_labels = []
    for i, tags in enumerate(examples["ner_tags"]):
        prev, labels = None, []
        for w in enc.word_ids(batch_index=i):
            labels.append(-100 if w is None or w == prev else tags[w])
            prev = w
        all_labels.append(labels)
    enc["labels"] = all_labels
    return enc


def add_index(example, idx):
    return {"idx": idx}


class BucketCollator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, features):
        longest = max(len(f["input_ids"]) for f in features)
        L = next(b for b in BUCKETS if b >= longest)
        n = len(features)
        ids = torch.full((n, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, L), dtype=torch.long)
        labels = torch.full((n, L), -100, dtype=torch.long)
        for i, f in enumerate(features):
            k = len(f["input_ids"])
            ids[i, :k] = torch.tensor(f["input_ids"])
            mask[i, :k] = 1
            labels[i, :k] = torch.tensor(f["labels"])
        idx = torch.tensor([f["idx"] for f in features], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels, "idx": idx}


@torch.no_grad()
def evaluate(model, loader, id2label, device, rank, world):
    model.eval()
    all_idx, all_preds, all_labels = [], [], []
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        torch._dynamo.mark_dynamic(batch["input_ids"], 1)
        torch._dynamo.mark_dynamic(batch["attention_mask"], 1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        preds = logits.argmax(-1)
        labels = batch["labels"]
        gathered_i = [torch.empty_like(batch["idx"]) for _ in range(world)]
        dist.all_gather(gathered_i, batch["idx"])
        gathered_p = [torch.empty_like(preds) for _ in range(world)]
        gathered_l = [torch.empty_like(labels) for _ in range(world)]
        dist.all_gather(gathered_p, preds)
        dist.all_gather(gathered_l, labels)
        if rank == 0:
            all_idx.extend(i.cpu().numpy() for i in gathered_i)
            all_preds.extend(p.cpu().numpy() for p in gathered_p)
            all_labels.extend(l.cpu().numpy() for l in gathered_l)
    model.train()
    if rank != 0:
        return None
    # DistributedSampler repeats a few samples to even out the shards; count each once
    seen = {}
    for i_batch, p_batch, l_batch in zip(all_idx, all_preds, all_labels):
        for i, p_row, l_row in zip(i_batch, p_batch, l_batch):
            keep = l_row != -100
            seen[int(i)] = ([id2label[int(t)] for t in l_row[keep]], [id2label[int(t)] for t in p_row[keep]])
    y_true = [seen[i][0] for i in sorted(seen)]
    y_pred = [seen[i][1] for i in sorted(seen)]
    return f1_score(y_true, y_pred), classification_report(y_true, y_pred, digits=4)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model, add_prefix_space=True)
    with rank0_first(rank):
        raw = load_dataset("conll2003")
        label_names = raw["train"].features["ner_tags"].feature.names
        tokenized = raw.map(tokenize_and_align, batched=True, fn_kwargs={"tokenizer": tokenizer},
                            remove_columns=raw["train"].column_names)
        tokenized = tokenized.map(add_index, with_indices=True)
    id2label = dict(enumerate(label_names))

    collate = BucketCollator(tokenizer.pad_token_id)
    train_sampler = DistributedSampler(tokenized["train"], shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(tokenized["validation"], shuffle=False)
    train_dl = DataLoader(tokenized["train"], batch_size=args.batch_size, sampler=train_sampler,
                          collate_fn=collate, num_workers=2, drop_last=True)
    val_dl = DataLoader(tokenized["validation"], batch_size=64, sampler=val_sampler,
                        collate_fn=collate, num_workers=2)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model, num_labels=len(label_names), id2label=id2label,
        label2id={v: k for k, v in id2label.items()}).to(device)
    raw_model = model
    model = torch.compile(DDP(model, device_ids=[local_rank]))

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in raw_model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in raw_model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total = args.epochs * len(train_dl)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * total), total)

    best_f1 = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_dl):
            batch.pop("idx")
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            for k in ("input_ids", "attention_mask", "labels"):
                torch._dynamo.mark_dynamic(batch[k], 1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        result = evaluate(model, val_dl, id2label, device, rank, world)
        if rank == 0:
            f1, report = result
            print(f"epoch {epoch} val F1 {f1:.4f}\n{report}", flush=True)
            if f1 > best_f1:
                best_f1 = f1
                raw_model.save_pretrained(os.path.join(args.out, "best"))
                tokenizer.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
