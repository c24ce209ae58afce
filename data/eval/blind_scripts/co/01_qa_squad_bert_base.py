#!/usr/bin/env python
"""Fine-tune BERT on SQuAD v1.1 with a plain PyTorch DDP loop (no Trainer).

    torchrun --nproc_per_node=8 01_qa_squad_bert_base.py --output_dir runs/bert-base-squad
"""
import argparse
import collections
import logging
import os
import re
import string
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (
    AutoModelForQuestionAnswering,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_linear_schedule_with_warmup,
    set_seed,
)

logger = logging.getLogger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name_or_path", default="bert-base-uncased")
    p.add_argument("--dataset_name", default="squad")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_seq_length", type=int, default=384)
    p.add_argument("--doc_stride", type=int, default=128)
    p.add_argument("--per_device_train_batch_size", type=int, default=12)
    p.add_argument("--per_device_eval_batch_size", type=int, default=32)
    p.add_argument("--learning_rate", type=float, default=3e-5)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--num_train_epochs", type=int, default=2)
    p.add_argument("--warmup_ratio", type=float, default=0.1)
    p.add_argument("--n_best_size", type=int, default=20)
    p.add_argument("--max_answer_length", type=int, default=30)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log_every", type=int, default=50)
    return p.parse_args()


@contextmanager
def main_process_first(rank):
    if rank != 0:
        dist.barrier()
    yield
    if rank == 0:
        dist.barrier()


# ----------------------------------------------------------------------------- data

def prepare_train_features(examples, tokenizer, args):
    examples["question"] = [q.lstrip() for q in examples["question"]]
    enc = tokenizer(
        examples["question"],
        examples["context"],
        truncation="only_second",
        max_length=args.max_seq_length,
        stride=args.doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
    )
    sample_map = enc.pop("overflow_to_sample_mapping")
    offsets_all = enc.pop("offset_mapping")
    enc["start_positions"], enc["end_positions"] = [], []
    for i, offsets in enumerate(offsets_all):
        input_ids = enc["input_ids"][i]
        cls_index = input_ids.index(tokenizer.cls_token_id)
        seq_ids = enc.sequence_ids(i)
        answers = examples["answers"][sample_map[i]]
        start_char = answers["answer_start"][0]
        end_char = start_char + len(answers["text"][0])

        tok_start = 0
        while seq_ids[tok_start] != 1:
            tok_start += 1
        tok_end = len(input_ids) - 1
        while seq_ids[tok_end] != 1:
            tok_end -= 1

        if not (offsets[tok_start][0] <= start_char and offsets[tok_end][1] >= end_char):
            enc["start_positions"].append(cls_index)
            enc["end_positions"].append(cls_index)
            continue
        while tok_start < len(offsets) and offsets[tok_start][0] <= start_char:
            tok_start += 1
        enc["start_positions"].append(tok_start - 1)
        while offsets[tok_end][1] >= end_char:
            tok_end -= 1
        enc["end_positions"].append(tok_end + 1)
    return enc


def prepare_eval_features(examples, tokenizer, args):
    examples["question"] = [q.lstrip() for q in examples["question"]]
    enc = tokenizer(
        examples["question"],
        examples["context"],
        truncation="only_second",
        max_length=args.max_seq_length,
        stride=args.doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
    )
    sample_map = enc.pop("overflow_to_sample_mapping")
    enc["example_id"] = []
    for i in range(len(enc["input_ids"])):
        seq_ids = enc.sequence_ids(i)
        enc["example_id"].append(examples["id"][sample_map[i]])
        enc["offset_mapping"][i] = [
            o if seq_ids[k] == 1 else None for k, o in enumerate(enc["offset_mapping"][i])
        ]
    return enc


# ----------------------------------------------------------------------------- metrics

def normalize_answer(s):
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction, truth):
    pred_toks = normalize_answer(prediction).split()
    true_toks = normalize_answer(truth).split()
    common = collections.Counter(pred_toks) & collections.Counter(true_toks)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_toks)
    recall = num_same / len(true_toks)
    return 2 * precision * recall / (precision + recall)


def squad_metrics(predictions, examples):
    em = f1 = 0.0
    for ex in examples:
        pred = predictions[ex["id"]]
        golds = ex["answers"]["text"]
        em += max(float(normalize_answer(pred) == normalize_answer(g)) for g in golds)
        f1 += max(f1_score(pred, g) for g in golds)
    n = len(examples)
    return {"exact_match": 100.0 * em / n, "f1": 100.0 * f1 / n}


def postprocess(examples, features, start_logits, end_logits, n_best, max_answer_len):
    id_to_index = {k: i for i, k in enumerate(examples["id"])}
    feats_per_example = collections.defaultdict(list)
    for i, ex_id in enumerate(features["example_id"]):
        feats_per_example[id_to_index[ex_id]].append(i)

    predictions = {}
    for ex_index, ex in enumerate(examples):
        context = ex["context"]
        candidates = []
        for fi in feats_per_example[ex_index]:
            s_log, e_log = start_logits[fi], end_logits[fi]
            offsets = features[fi]["offset_mapping"]
            s_idx = np.argsort(s_log)[-1 : -n_best - 1 : -1].tolist()
            e_idx = np.argsort(e_log)[-1 : -n_best - 1 : -1].tolist()
            for s in s_idx:
                for e in e_idx:
                    if s >= len(offsets) or e >= len(offsets):
                        continue
                    if offsets[s] is None or offsets[e] is None:
                        continue
                    if e < s or e - s + 1 > max_answer_len:
                        continue
                    candidates.append((s_log[s] + e_log[e], context[offsets[s][0] : offsets[e][1]]))
        predictions[ex["id"]] = max(candidates)[1] if candidates else ""
    return predictions


# ----------------------------------------------------------------------------- eval

@torch.no_grad()
def evaluate(model, loader, device, world_size, num_features):
    model.eval()
    by_feature = {}
    for batch in loader:
        feature_idx = batch.pop("feature_idx").to(device)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        start = out.start_logits.float().contiguous()
        end = out.end_logits.float().contiguous()

        gathered_start = [torch.zeros_like(start) for _ in range(world_size)]
        gathered_end = [torch.zeros_like(end) for _ in range(world_size)]
        gathered_idx = [torch.zeros_like(feature_idx) for _ in range(world_size)]
        dist.all_gather(gathered_start, start)
        dist.all_gather(gathered_end, end)
        dist.all_gather(gathered_idx, feature_idx)

        for s, e, idx in zip(gathered_start, gathered_end, gathered_idx):
            for row_s, row_e, i in zip(s.cpu().numpy(), e.cpu().numpy(), idx.tolist()):
                by_feature[i] = (row_s, row_e)  # padded duplicates from the sampler collapse here
    model.train()
    starts = [by_feature[i][0] for i in range(num_features)]
    ends = [by_feature[i][1] for i in range(num_features)]
    return starts, ends


# ----------------------------------------------------------------------------- main

def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        level=logging.INFO if rank == 0 else logging.WARN,
    )
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, use_fast=True)
    raw = load_dataset(args.dataset_name)

    with main_process_first(rank):
        train_ds = raw["train"].map(
            prepare_train_features,
            fn_kwargs={"tokenizer": tokenizer, "args": args},
            batched=True,
            num_proc=8,
            remove_columns=raw["train"].column_names,
        )
        eval_examples = raw["validation"]
        eval_features = eval_examples.map(
            prepare_eval_features,
            fn_kwargs={"tokenizer": tokenizer, "args": args},
            batched=True,
            num_proc=8,
            remove_columns=eval_examples.column_names,
        )
    eval_ds = eval_features.remove_columns(["example_id", "offset_mapping"])
    eval_ds = eval_ds.add_column("feature_idx", list(range(len(eval_ds))))

    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(
        train_ds,
        batch_size=args.per_device_train_batch_size,
        sampler=train_sampler,
        collate_fn=collator,
        num_workers=args.num_workers,
        pin_memory=True,
    )
    eval_sampler = DistributedSampler(eval_ds, shuffle=False)
    eval_loader = DataLoader(
        eval_ds,
        batch_size=args.per_device_eval_batch_size,
        sampler=eval_sampler,
        collate_fn=collator,
        num_workers=args.num_workers,
    )

    model = AutoModelForQuestionAnswering.from_pretrained(args.model_name_or_path).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate)
    total_steps = len(train_loader) * args.num_train_epochs
    scheduler = get_linear_schedule_with_warmup(
        optimizer, int(args.warmup_ratio * total_steps), total_steps
    )

    logger.info("world_size=%d, train features=%d, steps/epoch=%d", world_size, len(train_ds), len(train_loader))

    step = 0
    for epoch in range(args.num_train_epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % args.log_every == 0:
                logger.info("epoch %d step %d loss %.4f lr %.2e", epoch, step, loss.item(), scheduler.get_last_lr()[0])

        starts, ends = evaluate(model, eval_loader, device, world_size, len(eval_features))
        if rank == 0:
            preds = postprocess(
                eval_examples, eval_features, starts, ends, args.n_best_size, args.max_answer_length
            )
            metrics = squad_metrics(preds, eval_examples)
            logger.info("epoch %d: EM %.2f F1 %.2f", epoch, metrics["exact_match"], metrics["f1"])

            out_dir = os.path.join(args.output_dir, f"epoch-{epoch}")
            model.module.save_pretrained(out_dir)
            tokenizer.save_pretrained(out_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
